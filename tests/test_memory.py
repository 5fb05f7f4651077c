"""The one memory model (lrmoe.bytemodel.memory): its terms by hand, and the property that ties the planner to the
simulator:
on random plans of every policy, "the planner says it fits" if and only if "the simulator reports no OOM"; the
planner's slot count is exactly the simulator's boundary; and the headroom rule is the same for every system."""

import dataclasses
import random

import pytest
import torch

from lrmoe.config import ClusterConfig, MoEConfig, cluster_preset, model_preset
from lrmoe.bytemodel.memory import Footprint, LayerLoads, footprint, layer_memory, model_peak, plan_loads, slot_capacity
from lrmoe.planner.placement import MemoryModel, static_placement
from lrmoe.planner.plan import LayerPlan, no_flows
from lrmoe.planner.policies import LRMoE, Capacity, StaticEP, Symi, Trimmed
from lrmoe.planner.replica_routing import route_forward
from lrmoe.sim.cost import CostModel, GemmCurve
from lrmoe.sim.simulator import System, simulate

CURVE = GemmCurve(eff_max=0.5, m_half=2.0, launch_s=0.0)


def _cluster(n: int, per_node: int) -> ClusterConfig:
    return ClusterConfig(name="toy", num_ranks=n, ranks_per_node=per_node, mem_budget_bytes=1e9, intra_bw=1e9,
                         inter_bw=1e8, intra_latency=1e-6, inter_latency=2e-6, peak_flops=1e12, hbm_bw=1e11)


def _model(d: int, f: int, e: int, k: int, layers: int, dtype: str) -> MoEConfig:
    return MoEConfig(name="toy", hidden=d, expert_ffn=f, num_experts=e, top_k=k, router="softmax_topk",
                     num_layers=layers, num_heads=1, num_kv_heads=1, dtype=dtype)


# -- the terms, by hand --------------------------------------------------------------------------------------------
def test_footprint_terms_of_qwen3():
    fp = footprint(2048, 768, 2, combine_cols=1)
    assert fp.slot == 3 * 2048 * 768 * 4  # bf16 weights + bf16 gradients
    assert fp.row == 4096 and fp.combine_extra == 2
    assert fp.expert_act == 3 * 768 * 2 and fp.bwd_act == 2 * 768 * 2 and fp.recompute == 3 * 768 * 2
    assert fp.expert_pair == 4096 + 4608  # the received row is the saved input: counted once
    assert fp.home_pair == 4098
    assert fp.index == 4


def test_layer_memory_hand_case():
    """Two ranks, one slot each; rank 0's tokens: 3 pairs to slot 0, 1 to slot 1; rank 1's: 2 and 5."""
    fwd_NG = torch.tensor([[3, 1], [2, 5]])
    plan = LayerPlan(placement_NS=torch.tensor([[0], [1]]), fwd_NG=fwd_NG, dropped_NE=torch.zeros(2, 2).long(),
                     keep_NG=fwd_NG.clone(), bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(2).long())
    fp = Footprint(slot=100.0, row=10.0, expert_act=6.0, bwd_act=4.0, index=1.0)
    loads = plan_loads(plan)
    assert loads.expert_N.tolist() == [5.0, 6.0] and loads.home_N.tolist() == [4.0, 7.0]
    mem = layer_memory(fp, loads)
    assert mem.slot_N.tolist() == [100.0, 100.0]
    assert mem.saved_N.tolist() == [5 * 16 + 4 * 10, 6 * 16 + 7 * 10]  # expert pairs x (row + act) + home rows
    assert mem.fwd_N.tolist() == [(4 + 5) * 10, (7 + 6) * 10]  # packed send + expert output
    assert mem.bwd_N.tolist() == [2 * (4 + 5) * 10 + 5 * 4, 2 * (7 + 6) * 10 + 6 * 4]
    # three layers like it: resident three times, in flight once
    resident_LN = mem.resident_N.expand(3, -1)
    inflight_LN = mem.inflight_N.expand(3, -1)
    assert model_peak(resident_LN, inflight_LN).tolist() == [3 * 220 + 200, 3 * 266 + 284]
    # a fixed-size capacity of 8 rows per slot: the expert side holds and multiplies 8 rows however many arrive
    padded = plan_loads(plan, slot_capacity_rows=8)
    assert padded.expert_N.tolist() == [8.0, 8.0] and padded.bwd_gemm_N.tolist() == [8.0, 8.0]
    assert padded.home_N.tolist() == [4.0, 7.0]
    assert slot_capacity(plan, 1.0) == 6  # ceil(11 pairs / 2 slots)


def test_a_memory_model_of_two_numbers_is_slot_and_pair_bytes():
    m = MemoryModel(budget_bytes=100, slot_bytes=10, pair_bytes=2)
    assert m.footprint == Footprint.slot_and_pair(10, 2)
    assert m.extra_slots(30, 2, 10) == 2  # 100 - 2·10 - 30·2 = 20 bytes: two more slots
    assert m.pair_cap(3) == 35  # (100 - 3·10) / 2
    with pytest.raises(ValueError, match="cannot hold"):
        m.extra_slots(45, 2, 10)
    with pytest.raises(ValueError, match="disagree"):
        MemoryModel(100, 10, 2, footprint=Footprint(slot=11.0, row=2.0))


# -- random plans --------------------------------------------------------------------------------------------------
def _random_plan(rng: random.Random):
    n = rng.choice([2, 4, 8])
    e = n * rng.choice([1, 2, 4])
    k = rng.choice([1, 2, 4])
    tokens = rng.randint(0, 60)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pop = torch.rand(e, generator=g) ** rng.choice([1, 3, 6]) + 1e-3
    counts = torch.zeros(n, e, dtype=torch.long)
    for src in range(n):
        if tokens:
            idx = torch.multinomial(pop.expand(tokens, -1), min(k, e), replacement=False, generator=g)
            counts[src] = torch.bincount(idx.reshape(-1), minlength=e)
    prev = counts.sum(0) + torch.randint(0, 5, (e,), generator=g)
    base = e // n
    kind = rng.choice(["static", "capacity", "symi", "symi-cf", "lrmoe", "lrmoe-budget", "trimmed"])
    cf = None
    if kind == "static":
        policy = StaticEP()
    elif kind == "capacity":
        cf = rng.choice([1.0, 1.25])
        policy = Capacity(cf)
    elif kind == "symi":
        policy = Symi(base + rng.randint(0, 2))
    elif kind == "symi-cf":
        cf = rng.choice([1.0, 1.25])
        policy = Symi(base + rng.randint(0, 2), cf)
    elif kind == "lrmoe":
        policy = LRMoE(eps=rng.choice([0.0, 0.1]), extra_slots=rng.randint(0, 2), gamma=rng.choice([0.0, 0.1]),
                       forward=rng.choice(["balanced", "even"]), mem_cap_pairs_N=rng.choice([None, tokens * k // 2]))
    elif kind == "lrmoe-budget":
        policy = LRMoE(rho=rng.choice([0.5, 0.75, 1.0]), extra_slots=rng.randint(0, 2),
                       backward_routing=rng.choice([False, True]), forward=rng.choice(["balanced", "even"]))
    else:
        policy = Trimmed(Symi(base + rng.randint(0, 1)), rng.choice([0.5, 0.9]))
    return policy.plan(counts, prev), cf


def _cost_model(rng: random.Random, plan, cf):
    n, e = plan.num_ranks, plan.num_experts
    model = _model(d=rng.choice([4, 8, 16]), f=rng.choice([2, 6, 12]), e=e, k=1, layers=rng.randint(1, 3),
                   dtype=rng.choice(["float32", "bfloat16"]))
    return CostModel(model, _cluster(n, rng.choice([1, 2, n])), gemm=CURVE, compaction=rng.choice([True, False]),
                     combine_cols=rng.choice([0, 1]), optimizer_in_budget=rng.choice([False, True]),
                     sharded_optimizer=not (plan.policy.startswith(("static", "capacity")) and rng.random() < 0.5),
                     capacity_cf=cf,
                     overheads=rng.choice([("capacity_buffers",), ()]))


class _Fixed:
    """A policy that returns one plan whatever it is asked: L identical layers for the simulator."""

    def __init__(self, plan):
        self._plan = plan

    def plan(self, counts_NE, prev_counts_E=None):
        return self._plan


def test_planner_fits_iff_simulator_reports_no_oom_on_500_random_plans():
    """The planner's check (MemoryModel.plan_peak_bytes, from CostModel.memory_model) against the simulator's
    accounting of the whole model (simulate() over L identical layers), at budgets on both sides of the peak."""
    rng = random.Random(15)
    outcomes = {True: 0, False: 0}
    for _ in range(500):
        plan, cf = _random_plan(rng)
        cm0 = _cost_model(rng, plan, cf)
        cap = cm0.slot_capacity_rows(plan)
        peak = float(cm0.memory_model().plan_peak_bytes(plan, cm0.compaction, cap).max())
        n_l = cm0.model.num_moe_layers
        # a budget at the peak, just under it, or a random factor around it
        budget = rng.choice([peak, peak * (1 - 1e-9), peak * rng.uniform(0.7, 1.3)])
        cm = dataclasses.replace(cm0, mem_budget_bytes=budget / n_l)
        mm = cm.memory_model()
        planner_fits = bool((mm.plan_peak_bytes(plan, cm.compaction, cap) <= mm.budget_bytes).all())
        system = System("fixed", lambda: _Fixed(plan), compaction=cm.compaction,
                        sharded_optimizer=cm.sharded_optimizer)
        trace = torch.zeros(1, n_l, plan.num_ranks, plan.num_experts, dtype=torch.long)
        kw = {f.name: getattr(cm, f.name) for f in dataclasses.fields(cm)
              if f.name not in ("model", "cluster", "compaction", "sharded_optimizer")}
        res = simulate(trace, system, cm.model, cm.cluster, cost_kwargs=kw, warmup=0)
        layer_fits = not bool(res.layer_oom_IL[0, 0])  # the cost model's verdict on one layer (PhaseTimes.oom)
        assert planner_fits == layer_fits, (plan.policy, peak, budget)
        # the simulator sums the layers where the planner multiplies: equal up to rounding, so exactly at the
        # boundary only the peaks are compared
        torch.testing.assert_close(res.peak_IN[0], mm.plan_peak_bytes(plan, cm.compaction, cap), rtol=1e-12, atol=0)
        if abs(budget / peak - 1) > 1e-12:
            assert planner_fits == (not res.oom), (plan.policy, peak, budget)
        outcomes[planner_fits] += 1
    assert min(outcomes.values()) >= 100, outcomes  # both sides of the boundary are exercised


def _padded_static(counts_NE, slots: int) -> LayerPlan:
    """Static EP's plan on ``slots`` allocated slots per rank (the extra ones empty)."""
    n, e = counts_NE.shape
    home = static_placement(e, n)
    placement = torch.cat([home, torch.full((n, slots - home.shape[1]), -1, dtype=torch.long)], 1)
    fwd_NG = route_forward(counts_NE, placement, "even")
    return LayerPlan(placement_NS=placement, fwd_NG=fwd_NG, dropped_NE=torch.zeros_like(counts_NE),
                     keep_NG=fwd_NG.clone(), bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(n).long(),
                     policy="static-ep")


def test_the_planners_slot_count_is_the_simulators_boundary():
    """With every rank routing the same pairs, MemoryModel.extra_slots at the plan's peak load gives exactly the
    most slots with which the cost model reports no OOM: one slot more runs out of memory."""
    rng = random.Random(7)
    model = model_preset("qwen3-30b-a3b")
    checked = 0
    for _ in range(24):
        n = rng.choice([8, 16])
        cluster = cluster_preset("a100-40gb-x8").with_nodes(n // 8)
        tokens = rng.choice([1024, 2048, 4096])
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        pop = torch.rand(128, generator=g) ** 3 + 1e-3
        # every rank routes tokens · 8 pairs (counts drawn with replacement: only the counts matter here)
        counts = torch.stack([torch.bincount(torch.multinomial(pop, tokens * 8, replacement=True, generator=g),
                                             minlength=128) for _ in range(n)])
        base = 128 // n
        cm = CostModel(model, cluster, mem_budget_bytes=rng.uniform(20e9, 60e9) / 48)
        mm = cm.memory_model()
        plan = _padded_static(counts, base)
        try:
            extra = mm.extra_slots(plan.fwd_load_N.max(), base, 2 * base, tokens * 8)
        except ValueError:
            assert cm.cost(plan).oom
            continue
        assert not cm.cost(_padded_static(counts, base + extra)).oom
        if extra < 2 * base:
            assert cm.cost(_padded_static(counts, base + extra + 1)).oom
        checked += 1
    assert checked >= 12


def test_headroom_rule_is_each_systems_own_plan():
    """spare_slots_for: the spare slots returned fit with the system's own plan, one more does not; SYMI's
    headroom is its own planned peak (above LRMoE's balanced one), and a capacity bounds SYMI-cf1's."""
    model, cluster = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8")
    g = torch.Generator().manual_seed(0)
    pop = torch.arange(1, 129, dtype=torch.float64) ** -0.8
    counts = torch.stack([torch.bincount(torch.multinomial(pop.expand(4096, -1), 8, generator=g).reshape(-1),
                                         minlength=128) for _ in range(8)])
    cm = CostModel(model, cluster, mem_budget_bytes=50e9 / 48)  # 50 GB: room for some spare slots
    mm = cm.memory_model()
    ref = lambda policy: policy.plan(counts, counts.sum(0))  # noqa: E731
    s_spare, s_h = mm.spare_slots_for(lambda sp: ref(Symi(16 + sp)), 16, 16)
    l_spare, l_h = mm.spare_slots_for(lambda sp: ref(LRMoE(extra_slots=sp)), 16, 16)
    c_spare, c_h = mm.spare_slots_for(lambda sp: ref(Symi(16 + sp, 1.0)), 16, 16, capacity_cf=1.0)
    assert 1.0 <= l_h < s_h and c_h <= 1.0 + 1e-9
    for spare, make in ((s_spare, lambda sp: Symi(16 + sp)), (l_spare, lambda sp: LRMoE(extra_slots=sp))):
        assert not bool((mm.plan_peak_bytes(ref(make(spare))) > mm.budget_bytes).any())
        if spare < 16:
            assert bool((mm.plan_peak_bytes(ref(make(spare + 1))) > mm.budget_bytes).any())
    # a margin only ever takes slots away
    assert mm.spare_slots_for(lambda sp: ref(Symi(16 + sp)), 16, 16, load_margin=0.2)[0] <= s_spare


def test_planned_view_is_the_plan_view_of_a_uniform_rank():
    fp = footprint(64, 32, 2, combine_cols=1)
    planned = layer_memory(fp, LayerLoads.planned(5, 100, 80))
    assert planned.slot_N.item() == 5 * fp.slot
    assert planned.saved_N.item() == 100 * fp.expert_pair + 80 * fp.home_pair
    assert planned.bwd_N.item() == (2 * 80 + 2 * 100) * fp.row + 100 * fp.bwd_act


# -- early selection: the forward saves activations for the kept pairs alone ------------------------------------
def test_early_selection_saves_the_kept_pairs_activations_alone():
    """The hand case above with rank 0's slot keeping 2 of its 5 pairs and rank 1's 4 of 6: the expert side saves
    2 and 4 pairs' rows and activations, the 3 and 2 others are in flight during the forward only; the home side
    still saves every output row; a plan that moves pairs cannot select early."""
    fwd_NG = torch.tensor([[3, 1], [2, 5]])
    keep_NG = torch.tensor([[1, 1], [1, 3]])
    plan = LayerPlan(placement_NS=torch.tensor([[0], [1]]), fwd_NG=fwd_NG, dropped_NE=torch.zeros(2, 2).long(),
                     keep_NG=keep_NG, bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(2).long())
    fp = Footprint(slot=100.0, row=10.0, expert_act=6.0, bwd_act=4.0, index=1.0)
    late, early = layer_memory(fp, plan_loads(plan)), layer_memory(fp, plan_loads(plan, early=True))
    assert plan_loads(plan, early=True).saved_expert_N.tolist() == [2.0, 4.0]
    assert early.saved_N.tolist() == [2 * 16 + 4 * 10, 4 * 16 + 7 * 10]
    assert (late.saved_N - early.saved_N).tolist() == [3 * 16, 2 * 16]
    assert (early.fwd_N - late.fwd_N).tolist() == [3 * 16, 2 * 16]  # transient while the forward runs
    assert torch.equal(early.bwd_N, late.bwd_N) and torch.equal(early.slot_N, late.slot_N)
    moved = dataclasses.replace(plan, bwd_flows_V4=torch.tensor([[0, 0, 1, 1]]))
    with pytest.raises(ValueError, match="early selection"):
        plan_loads(moved, early=True)


def test_early_selection_frees_slots_in_the_planner_and_the_simulator_alike():
    """Qwen3 on 16 GPUs at a tight budget: memory-aware placement with early selection at rho = 0.75 holds more
    replica slots than without; the budget plan it makes fits in the simulator's accounting (the one memory model),
    and the same plan without early selection's saving would not."""
    model, cluster = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8").with_nodes(2)
    cm = CostModel(model, cluster, mem_budget_bytes=31e9 / model.num_moe_layers)
    late = cm.memory_model()
    early = dataclasses.replace(late, early_rho=0.75)
    pairs = 4096 * 8
    planned = int(1.1 * pairs)
    n_late, n_early = late.extra_slots(planned, 8, 8, pairs), early.extra_slots(planned, 8, 8, pairs)
    assert n_early >= n_late + 3
    g = torch.Generator().manual_seed(0)
    pop = torch.arange(1, 129, dtype=torch.float64) ** -0.6
    counts = torch.stack([torch.bincount(torch.multinomial(pop.expand(4096, -1), 8, generator=g).reshape(-1),
                                         minlength=128) for _ in range(16)])
    policy = LRMoE(rho=0.75, memory=early, extra_slots=n_early, eps=0.1)
    plan = policy.plan(counts, counts.sum(0))
    assert plan.slots_per_rank == 8 + n_early
    sim_early = dataclasses.replace(cm, early_selection=True).cost(plan)
    assert not sim_early.oom and torch.allclose(sim_early.peak_bytes_N, early.plan_peak_bytes(plan))
    assert cm.cost(plan).oom  # the same replicas without the saving: out of memory
    with pytest.raises(ValueError, match="early selection"):
        LRMoE(rho=0.5, memory=early)  # the memory model's rho is the quotas' rho
