"""Online replication (lrmoe.planner.online): replicas planned from the current forward, weights pushed into spare
slots.

Pure: the spare slots only are filled, only inside the expert's home node, never lowering balance; the plan's push
names a home slot of the same expert; the push's byte model by hand. Distributed (gloo, 2 and 4 forked ranks,
float64): over several iterations whose skew changes direction, every plan is the online placement of *this*
forward's counts, the pushed slots hold their expert's current weights, the layer equals the reference forward and
backward (plain autograd and recalibrated), counted push bytes = modelled ones, and the step's redistribution
empties the spare slots again; trained over several steps it follows torch.optim.Adam; with the retention budget on
top it equals the reference on the retained pairs.
"""

import pytest
import torch
import torch.distributed as dist

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_layer, expected_step
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, flatten_experts, unflatten_experts
from lrmoe.runtime.layer import EPMoELayer, initial_placement
from lrmoe.planner.online import Online, home_placement, online_replicas, push_sources
from lrmoe.planner.plan import LayerPlan, no_flows
from lrmoe.planner.policies import StaticEP, Trimmed
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.bytemodel.sync_model import push_bytes, push_rows
from lrmoe.systems import SystemContext, get_system

D, F, E, K, T = 8, 5, 8, 2, 16
SPARE = 2
STEPS = 3
TIGHT = dict(rtol=1e-10, atol=1e-12)
SHARD = dict(rtol=1e-5, atol=1e-6)  # expert gradients pass through the fp32 optimizer shards


# -- pure ------------------------------------------------------------------------------------------------------
def _counts(n, e, seed, skew=1.5):
    g = torch.Generator().manual_seed(seed)
    pop = torch.rand(e, generator=g, dtype=torch.float64) ** (1 + 4 * skew)
    return torch.poisson((pop / pop.mean() * 20).expand(n, e).contiguous(), generator=g).long()


@pytest.mark.parametrize("n, e, spare, rpn", [(4, 8, 2, None), (4, 8, 2, 2), (8, 32, 1, 4), (8, 16, 3, None),
                                              (4, 8, 2, 1)])
def test_online_replicas_fill_spare_slots_inside_the_home_node(n, e, spare, rpn):
    base = e // n
    for seed in range(6):
        counts_E = _counts(n, e, seed).sum(0)
        p = online_replicas(counts_E, n, spare, rpn)
        assert torch.equal(p[:, :base], home_placement(e, n, spare)[:, :base])  # the home slots never move
        node = (torch.arange(n) // (rpn or n))[:, None]
        filled = p[:, base:] >= 0
        home_node = (p[:, base:].clamp(min=0) // base) // (rpn or n)
        assert bool((home_node == node)[filled].all())  # a replica stays in its expert's home node
        for row in p.tolist():  # never two slots of one expert on one rank
            hosted = [x for x in row if x >= 0]
            assert len(hosted) == len(set(hosted))
        # filled slots come first in each rank's spare columns
        assert bool((filled[:, 1:] <= filled[:, :-1]).all()) if spare > 1 else True
        # even-split load estimate: the most loaded rank is never worse than static EP's
        r_E = torch.bincount(p[p >= 0], minlength=e).double()

        def loads(pl, r):
            share = counts_E.double() / r
            return torch.stack([share[[x for x in row if x >= 0]].sum() for row in pl.tolist()])

        assert float(loads(p, r_E).max()) <= float(loads(home_placement(e, n, spare), torch.ones(e)).max())
        if rpn == 1:
            assert not filled.any()  # one rank per node: nowhere to push
    assert torch.equal(online_replicas(counts_E, n, spare, rpn), p)  # deterministic


def test_online_plan_relieves_the_hot_rank_from_the_current_counts():
    counts_NE = torch.tensor([[10, 1, 1, 1, 30, 1, 1, 1], [8, 2, 1, 1, 25, 1, 1, 1],
                              [9, 1, 1, 2, 30, 1, 1, 1], [7, 1, 1, 1, 20, 1, 1, 1]])
    static = StaticEP().plan(counts_NE)
    plan = Online(spare_slots=2).plan(counts_NE, prev_counts_E=torch.ones(8))  # previous counts are not used
    plan.validate(counts_NE)
    assert int(plan.fwd_load_N.max()) < int(static.fwd_load_N.max())
    assert torch.equal(plan.next_placement_NS, home_placement(8, 4, 2))
    assert torch.equal(plan.resident_NS, home_placement(8, 4, 2))
    assert torch.equal(plan.keep_NG, plan.fwd_NG) and plan.bwd_flows_V4.numel() == 0
    S = plan.slots_per_rank
    for g in plan.pushed_G.nonzero().flatten().tolist():  # each pushed slot copies its expert's home slot
        e = int(plan.slot_expert_G[g])
        assert int(plan.push_src_G[g]) == (e // 2) * S + e % 2
    assert plan.pushed_G.any()
    # inside nodes of two ranks the hot expert 4 (rank 2) can only be copied to rank 3
    node = Online(spare_slots=2, ranks_per_node=2).plan(counts_NE)
    assert set(node.placement_NS[:, 2:].flatten().tolist()) - {-1} <= {4, 5, 6, 7}
    assert 4 in node.placement_NS[3].tolist()


def _pushes(placement_NS: torch.Tensor, base: int) -> int:
    return int((placement_NS[:, base:] >= 0).sum())


def test_cost_aware_rule_pushes_a_copy_only_where_it_saves_more_than_its_cost():
    # 2 ranks, 2 home + 1 spare slot each. Rank 0 hosts experts 0 (100 pairs) and 1 (3 pairs), rank 1 experts 2
    # and 3 (5 each). A copy of 0 on rank 1: loads (50 + 3, 10 + 50) -> saving 103 - 60 = 43 pairs. Then a copy of
    # 2 on rank 0 would save 60 - 57.5 = 2.5 pairs: the greedy rule pushes it too.
    counts = torch.tensor([100, 3, 5, 5])
    assert online_replicas(counts, 2, 1).tolist() == [[0, 1, 2], [2, 3, 0]]
    assert online_replicas(counts, 2, 1, push_cost_rows=2.4).tolist() == [[0, 1, 2], [2, 3, 0]]
    assert online_replicas(counts, 2, 1, push_cost_rows=2.5).tolist() == [[0, 1, -1], [2, 3, 0]]
    assert online_replicas(counts, 2, 1, push_cost_rows=42.9).tolist() == [[0, 1, -1], [2, 3, 0]]
    assert _pushes(online_replicas(counts, 2, 1, push_cost_rows=43.0), 2) == 0  # not worth it: stays home
    # an expert with one routed pair is never worth a push: the greedy rule pushes it if it relieves anything
    small = torch.tensor([1, 1, 0, 0])
    assert _pushes(online_replicas(small, 2, 1), 2) == 1
    assert _pushes(online_replicas(small, 2, 1, push_cost_rows=1.0), 2) == 0
    with pytest.raises(ValueError, match="push_cost_rows"):
        Online(spare_slots=1, push_cost_rows=-1.0)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "glm-4.5-air"])
def test_cost_aware_rule_pushes_fewer_copies_than_the_greedy_one_on_a_skewed_trace(model):
    """On a Zipf 0.8 trace at paper scale (2 nodes x 8 A100s, the cost model's push cost), the cost-aware rule
    pushes fewer copies than the greedy one, and each rank's load stays within the threshold of the greedy's."""
    from lrmoe.config import cluster_preset, model_preset
    from lrmoe.traces.synthetic import generate_trace
    from lrmoe.sim.cost import CostModel

    m, c = model_preset(model), cluster_preset("a100-40gb-x8").with_nodes(2)
    threshold = CostModel(m, c).push_cost_rows()
    assert 10 < threshold < 1000  # a push is worth tens to hundreds of pairs, not one
    trace = generate_trace(4, 3, c.num_ranks, m.num_experts, m.top_k, 1024, skew="zipf", skew_param=0.8, seed=0)
    base = m.num_experts // c.num_ranks
    greedy_n = aware_n = 0
    for counts_NE in trace.counts_ILNE.flatten(0, 1):
        greedy = Online(spare_slots=4, ranks_per_node=8).plan(counts_NE)
        aware = Online(spare_slots=4, ranks_per_node=8, push_cost_rows=threshold).plan(counts_NE)
        greedy_n, aware_n = greedy_n + _pushes(greedy.placement_NS, base), aware_n + _pushes(aware.placement_NS, base)
        assert int(aware.fwd_load_N.max()) <= int(StaticEP().plan(counts_NE).fwd_load_N.max())
    assert aware_n < greedy_n


def test_push_bytes_by_hand():
    # 2 ranks, 2 home + 2 spare slots: rank 1 takes expert 0 from rank 0 (remote) and expert 3 from itself (local);
    # rank 0 takes expert 2 from rank 1 twice (two slots: one message)
    placement = torch.tensor([[0, 1, 2, 2], [2, 3, 0, 3]])
    src = torch.tensor([-1, -1, 4, 4, -1, -1, 0, 5])
    plan = LayerPlan(placement_NS=placement, fwd_NG=torch.zeros(2, 8, dtype=torch.long),
                     dropped_NE=torch.zeros(2, 4, dtype=torch.long), keep_NG=torch.zeros(2, 8, dtype=torch.long),
                     bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(2, dtype=torch.long), push_src_G=src)
    plan.validate()
    assert torch.equal(plan.resident_NS, torch.tensor([[0, 1, -1, -1], [2, 3, -1, -1]]))
    assert push_rows(placement, src).tolist() == [[0, 1, 0], [1, 0, 2]]
    P = 3 * 4 * 3
    assert push_bytes(placement, src, P, 2).tolist() == [[0, P * 2], [P * 2, 0]]
    want = expected_layer(plan, hidden=4, ffn=3, act_bytes=2)
    assert want["weight_push.sent_bytes"].tolist() == [P * 2, P * 2]
    assert "weight_push.sent_bytes" not in expected_layer(StaticEP().plan(torch.ones(2, 4, dtype=torch.long)), 4,
                                                          3, 2)
    assert torch.equal(push_sources(placement, plan.resident_NS), src)  # each from the expert's home slot


@pytest.mark.parametrize("src, match", [([-1, -1, 2, -1, -1, -1, -1, -1], "itself pushed"),
                                        ([-1, -1, 1, -1, -1, -1, -1, -1], "another expert"),
                                        ([-1, -1, 9, -1, -1, -1, -1, -1], "outside"),
                                        ([-1, -1, 0], "shape")])
def test_plan_rejects_a_bad_push(src, match):
    placement = torch.tensor([[0, 1, 0, -1], [2, 3, -1, -1]])
    plan = LayerPlan(placement_NS=placement, fwd_NG=torch.zeros(2, 8, dtype=torch.long),
                     dropped_NE=torch.zeros(2, 4, dtype=torch.long), keep_NG=torch.zeros(2, 8, dtype=torch.long),
                     bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(2, dtype=torch.long),
                     push_src_G=torch.tensor(src))
    with pytest.raises(ValueError, match=match):
        plan.validate()


def test_registry_entries():
    with pytest.raises(ValueError, match="push_cost_rows"):  # the cost-aware rule is priced, or not built
        get_system("online").make_policy(SystemContext(num_experts=8, num_ranks=4, spare_slots=2))
    assert get_system("online-greedy").make_policy(SystemContext(8, 4, spare_slots=2)).push_cost_rows == 0.0
    ctx = SystemContext(num_experts=8, num_ranks=4, spare_slots=2, push_cost_rows=1.0)
    online = get_system("online").make_policy(ctx)
    budget = get_system("online-rho0.75").make_policy(ctx)
    assert isinstance(online, Online) and isinstance(budget, Trimmed) and budget.name == "online-rho0.75"
    assert get_system("online-rho0.75").recalibrated and get_system("online-rho0.75").backward.metric == "m2"
    counts = _counts(4, 8, 0)
    full, trimmed = online.plan(counts), budget.plan(counts)
    assert torch.equal(full.placement_NS, trimmed.placement_NS) and torch.equal(full.push_src_G, trimmed.push_src_G)
    assert int(trimmed.keep_NG.sum()) < int(full.keep_NG.sum())


# -- distributed -----------------------------------------------------------------------------------------------
def skewed_base(dtype=torch.float64, skew=True, experts=E):
    base = ReferenceMoE(D, F, experts, K, "softmax_topk", seed=3, dtype=dtype)
    if skew:
        with torch.no_grad():
            base.w_router_ED[:, 0] = torch.linspace(2.0, -1.0, experts)
    return base


def batch(world, step, dtype=torch.float64, skew=1.5):
    """Skew towards low expert ids on even steps, high ids on odd ones (router feature 0)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world * T, D, generator=g, dtype=torch.float64)
    x[:, 0] += skew if step % 2 == 0 else -skew
    return x.to(dtype), torch.randn(world * T, D, generator=g, dtype=torch.float64).to(dtype)


def reference_like(layer, base, initial):
    ref = ReferenceMoE(D, F, layer.num_experts, K, base.router, seed=base.seed, dtype=torch.float64)
    w = base.export_weights()
    if not initial:
        gate, up, down = unflatten_experts(layer.store.full_master().double(), D, F)
        w.update(w_gate_EDF=gate, w_up_EDF=up, w_down_EFD=down)
    ref.load_weights(w)
    return ref


def _online_steps(rank, ranks_per_node, backward, replica_grad, push_cost_rows=0.0, experts=E):
    world = dist.get_world_size()
    policy = Online(spare_slots=SPARE, ranks_per_node=ranks_per_node, push_cost_rows=push_cost_rows)
    base = skewed_base(experts=experts)
    acc = Accountant()
    home = initial_placement(policy, world, experts)
    layer = EPMoELayer(base.export_weights(), K, "softmax_topk", policy, home, RangeGroups(), adam=AdamConfig(lr=1e-2),
                       accountant=acc, backward=backward, replica_grad=replica_grad)
    mine = slice(rank * T, (rank + 1) * T)
    pushed = remote = fewer = 0
    for step in range(STEPS):
        acc.reset()
        # between iterations the slots hold the home placement; the spare slots are empty
        assert torch.equal(layer.placement_NS, home)
        assert not layer.store.slots_SW.detach()[experts // world:].any()
        initial = step == 0
        ref = reference_like(layer, base, initial)
        held = (flatten_experts(base.w_gate_EDF, base.w_up_EDF, base.w_down_EFD).detach() if initial
                else layer.store.full_master().to(layer.store.dtype))
        x, w = batch(world, step)
        x_local = x[mine].clone().requires_grad_(True)
        y, info = layer(x_local)
        plan = info.dispatch.plan
        # the plan is the online placement of this forward's counts; the slots now hold it, pushed ones included
        assert torch.equal(plan.placement_NS, online_replicas(info.counts_E, world, SPARE, ranks_per_node,
                                                              push_cost_rows))
        assert torch.equal(layer.placement_NS, plan.placement_NS)
        for j, e in enumerate(plan.placement_NS[rank].tolist()):
            if e >= 0:
                assert torch.equal(layer.store.slots_SW[j].detach(), held[e])
        (y * w[mine]).sum().backward()
        x_ref = x.clone().requires_grad_(True)
        y_ref, _ = ref(x_ref)
        (y_ref * w).sum().backward()
        torch.testing.assert_close(y, y_ref[mine], **TIGHT)
        torch.testing.assert_close(x_local.grad, x_ref.grad[mine], **TIGHT)
        layer.sync_dense_grads(1.0)
        torch.testing.assert_close(layer.w_router_ED.grad, ref.w_router_ED.grad, **TIGHT)
        layer.w_router_ED.grad = None
        layer.store.sync_replica_grads()
        got = unflatten_experts(layer.store.gather_full(layer.store.collect_grad_shards()), D, F)
        for g, r in zip(got, (ref.w_gate_EDF.grad, ref.w_up_EDF.grad, ref.w_down_EFD.grad)):
            torch.testing.assert_close(g.double(), r, **SHARD)
        elem = torch.tensor([], dtype=torch.float64).element_size()
        before = layer.placement_NS.clone()
        after = layer.expert_step(grad_scale=1.0)
        assert torch.equal(after, home)
        want = expected_layer(plan, D, F, elem, *((backward.metric, backward.compact) if backward else ()))
        want.update(expected_step(before, after, experts, D, F, elem, replica_grad=replica_grad))
        for key in ("replica_sync", "grad_collect"):  # run twice here (the test's own sync above)
            want.pop(f"{key}.sent_bytes")
            want.pop(f"{key}.recv_bytes")
        record = acc.record()
        check_accounting(record, want, rank)
        pushed += int(plan.pushed_G.sum())
        remote += record.get("weight_push.recv_bytes", 0)
        greedy = online_replicas(info.counts_E, world, SPARE, ranks_per_node)
        fewer += int((greedy >= 0).sum() - (plan.placement_NS >= 0).sum())
    return pushed, remote, fewer


@pytest.mark.parametrize("world_size, ranks_per_node, backward, replica_grad", [
    (2, None, None, "range"),
    (2, None, BackwardConfig(), "shard"),
    (4, None, None, "shard"),
    (4, 2, BackwardConfig(compact=False), "range"),
], ids=["2r-autograd-range", "2r-recal-shard", "4r-autograd-shard", "4r-2pernode-recal-padded-range"])
def test_online_layer_equals_the_reference_and_counts_its_push(world_size, ranks_per_node, backward, replica_grad):
    out = launch(_online_steps, world_size, ranks_per_node, backward, replica_grad, timeout_s=120)
    assert out[0][0] > 0  # something was pushed
    assert sum(r for _, r, _ in out) > 0  # ... and some of it crossed ranks


@pytest.mark.parametrize("backward", [None, BackwardConfig()], ids=["autograd", "recal"])
def test_cost_aware_online_layer_on_three_ranks_equals_the_reference(backward):
    """The cost-aware rule (a copy only where it relieves the busiest rank by more than 3 pairs) in the real layer on
    3 ranks and 9 experts: pushes happen, and forward, backward and counted bytes are exact as the greedy rule's."""
    out = launch(_online_steps, 3, None, backward, "range", 3.0, 9, timeout_s=120)
    pushed, _, fewer = out[0]
    assert pushed > 0 and sum(r for _, r, _ in out) > 0  # pushes happened, some across ranks
    assert fewer > 0  # ... and the threshold held back some copies the greedy rule would have pushed


def _training_steps(rank, steps, replica_grad):
    """Online replication over several steps in fp32 against the reference trained by torch.optim.Adam. The
    routing is not skewed by hand here: Adam's first steps move every weight by about lr whatever the size of its
    gradient, so a near-zero gradient summed in another order flips its update (SYMI's test does the same); the
    random routing of 16 tokens per rank is uneven enough to replicate."""
    world = dist.get_world_size()
    policy = Online(spare_slots=SPARE)
    ref = skewed_base(torch.float32, skew=False)
    acc = Accountant()
    cfg = AdamConfig(lr=1e-2)
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", policy, initial_placement(policy, world, E),
                       RangeGroups(), adam=cfg, accountant=acc, replica_grad=replica_grad)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=cfg.lr, foreach=False)
    dense_opt = torch.optim.Adam(layer.dense_parameters(), lr=cfg.lr, foreach=False)
    mine = slice(rank * T, (rank + 1) * T)
    placements = []
    for step in range(steps):
        acc.reset()
        x, w = batch(world, step, torch.float32, skew=0.0)
        y, info = layer(x[mine].clone().requires_grad_(True))
        (y * w[mine]).sum().backward()
        y_ref, _ = ref(x)
        (y_ref * w).sum().backward()
        torch.testing.assert_close(y, y_ref[mine].detach(), rtol=1e-5, atol=1e-5)
        layer.sync_dense_grads(1.0)
        dense_opt.step()
        dense_opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        plan = info.dispatch.plan
        placements.append(plan.placement_NS.clone())
        before = layer.placement_NS.clone()
        after = layer.expert_step(grad_scale=1.0)
        want = expected_layer(plan, D, F, 4)
        want.update(expected_step(before, after, E, D, F, 4, replica_grad=replica_grad))
        check_accounting(acc.record(), want, rank)
    master = layer.store.full_master()
    want = flatten_experts(ref.w_gate_EDF.detach(), ref.w_up_EDF.detach(), ref.w_down_EFD.detach())
    torch.testing.assert_close(master, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.w_router_ED.detach(), ref.w_router_ED.detach(), rtol=1e-4, atol=1e-5)
    return placements


@pytest.mark.parametrize("replica_grad", ["range", "shard"])
def test_online_training_steps_follow_torch_adam(replica_grad):
    placements = launch(_training_steps, 2, 4, replica_grad)[0]
    assert len({tuple(p.flatten().tolist()) for p in placements}) > 1  # the replicas followed the counts


def _budget_case(rank):
    from test_layer_lrmoe import run_case  # one iteration against the reference on the retained pairs

    groups = RangeGroups()
    ctx = SystemContext(num_experts=E, num_ranks=dist.get_world_size(), spare_slots=SPARE, push_cost_rows=1.0)
    spec = get_system("online-rho0.75")
    out = run_case(rank, groups, spec.make_policy(ctx), spec.layer_backward(seed=0))
    return out["trimmed"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_online_with_the_retention_budget_equals_the_reference_on_the_retained_pairs(world_size):
    assert launch(_budget_case, world_size, timeout_s=120)[0] > 0


# -- the cost model ----------------------------------------------------------------------------------------------
def test_cost_model_prices_the_push_the_layer_counts_on_intra_node_links():
    """Modelled push bytes = the accountant's closed form; the push runs on NVLink (intra-node) only; the pushed
    copies carry no optimizer state (static-EP state, as the home placement's)."""
    from lrmoe.config import cluster_preset, model_preset
    from lrmoe.sim.cost import PHASES, CostModel

    model = model_preset("qwen3-30b-a3b")
    cluster = cluster_preset("h200x8").with_nodes(2)  # 16 ranks, 8 per node
    cm = CostModel(model, cluster, sharded_optimizer=False)
    counts = _counts(16, model.num_experts, 0) * 40
    plan = Online(spare_slots=1, ranks_per_node=cluster.ranks_per_node).plan(counts)
    assert plan.pushed_G.any()
    t = cm.cost(plan)
    want = expected_layer(plan, model.hidden, model.expert_ffn, model.dtype_bytes)["weight_push.sent_bytes"]
    i = PHASES.index("weight_push")
    assert t.bytes_NH[:, i].tolist() == want.double().tolist()
    busy = want > 0
    intra_s = want.double() / cluster.intra_bw + cluster.intra_latency
    torch.testing.assert_close(t.time_NH[busy, i].max(), intra_s.max())  # slowest pusher on NVLink
    home = StaticEP().plan(counts)
    torch.testing.assert_close(t.state_bytes_N, cm.cost(home).state_bytes_N)
    torch.testing.assert_close(t.time_NH[:, PHASES.index("adam")], cm.cost(home).time_NH[:, PHASES.index("adam")])
