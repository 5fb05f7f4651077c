"""Policies and the plan they produce: every policy's plan is valid, accounts for every pair, and is deterministic;
the plan carries the next iteration's placement; LRMoE's budget mode keeps min(L_n, ceil(rho · mean)) per rank."""

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.planner.placement import MemoryModel, static_placement, symi_placement
from lrmoe.planner.plan import LayerPlan
from lrmoe.planner.policies import LRMoE, Capacity, StaticEP, Symi, Trimmed, initial_placement


def skewed_counts(N, E, pairs_per_rank, hot=0, heat=8.0, seed=0):
    """Counts with expert `hot` about `heat` times as popular as the others."""
    gen = torch.Generator().manual_seed(seed)
    pop = torch.ones(E)
    pop[hot] = heat
    idx = torch.multinomial(pop.repeat(N, 1), pairs_per_rank, replacement=True, generator=gen)
    return torch.stack([torch.bincount(row, minlength=E) for row in idx])


POLICIES = [StaticEP(), Capacity(1.0), Capacity(1.25, "gate"), Symi(3), Symi(3, cf=1.0), LRMoE(eps=0.1),
            LRMoE(), LRMoE(rho=0.75), Trimmed(Symi(3), 0.75), Trimmed(StaticEP(), 0.5, gamma=0.2),
            LRMoE(eps=0.0, gamma=0.5, extra_slots=2), LRMoE(eps=0.1, quotas=False),
            LRMoE(eps=0.1, backward_routing=False), LRMoE(forward="even", eps=0.0),
            LRMoE(rho=0.5, forward="even", backward_routing=True)]


def test_policy_names():
    assert [p.name for p in POLICIES[:10]] == ["static-ep", "capacity-cf1", "capacity-cf1.25-gate", "symi-dropless",
                                               "symi-cf1", "lrmoe", "lrmoe-rho1", "lrmoe-rho0.75",
                                               "symi-dropless-rho0.75", "static-ep-rho0.5"]


def test_quota_mode_follows_the_knobs():
    # budget is the default; eps alone (cap mode's knob, as every earlier caller passes it) keeps cap mode
    assert (LRMoE().quota_mode, LRMoE().rho, LRMoE().eps) == ("budget", 1.0, 0.1)
    assert (LRMoE(eps=0.0).quota_mode, LRMoE(eps=0.0).rho) == ("cap", None)
    assert LRMoE(rho=0.6).quota_mode == "budget" and LRMoE(eps=0.2, rho=0.6).quota_mode == "budget"
    assert LRMoE(quota_mode="cap").eps == 0.1 and LRMoE(quota_mode="budget", eps=0.3).rho == 1.0
    # backward routing: on in cap mode, off in budget mode unless asked for
    assert LRMoE(eps=0.0).backward_routing and not LRMoE(rho=0.5).backward_routing
    assert LRMoE(rho=0.5, backward_routing=True).backward_routing


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_plan_is_valid_and_deterministic(policy):
    counts = skewed_counts(4, 8, 200)
    prev = skewed_counts(4, 8, 200, seed=1).sum(0)
    before = counts.clone()
    plan = policy.plan(counts, prev)
    plan.validate(counts)  # every routed pair computed or dropped exactly once
    assert torch.equal(counts, before)
    assert plan.policy == policy.name
    again = policy.plan(counts, prev)
    for field in dataclasses.fields(LayerPlan):
        a, b = getattr(plan, field.name), getattr(again, field.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_static_ep_hand_case():
    # 2 ranks, 4 experts: rank 0 hosts e0, e1; rank 1 hosts e2, e3; everything computed and retained
    counts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    plan = StaticEP().plan(counts)
    assert plan.placement_NS.tolist() == [[0, 1], [2, 3]]
    assert plan.fwd_NG.tolist() == counts.tolist()  # slot g hosts expert g
    assert plan.fwd_load_N.tolist() == [14, 22] and torch.equal(plan.bwd_NG, plan.fwd_NG)
    assert int(plan.dropped_NE.sum()) == 0 and plan.bwd_flows_V4.shape == (0, 4)


def test_capacity_drops_overflow():
    # 40 pairs, E=4: capacity 10 per expert; expert 0 has 24 (12 per source) -> 14 dropped, 7 per source
    counts = torch.tensor([[12, 2, 3, 3], [12, 4, 2, 2]])
    plan = Capacity(1.0).plan(counts)
    assert plan.dropped_NE.tolist() == [[7, 0, 0, 0], [7, 0, 0, 0]]
    assert plan.fwd_NE[:, 0].tolist() == [5, 5] and plan.drop_by == "position"
    assert Capacity(1.0, "gate").plan(counts).drop_by == "gate"


def test_symi_uses_previous_counts_and_uniform_without():
    counts = torch.tensor([[10, 1, 1, 1], [10, 1, 1, 1]])
    prev = torch.tensor([60, 10, 10, 20])
    assert torch.equal(Symi(3).plan(counts, prev).placement_NS, symi_placement(prev, 2, 3))
    assert torch.equal(Symi(3).plan(counts).placement_NS, symi_placement(torch.ones(4), 2, 3))


def test_symi_cf1_drops_above_replica_capacity():
    # placement from prev [3, 1, 1, 1] over 2 × 3 slots: expert 0 gets 3 slots; 24 pairs / 6 slots -> 4 per slot
    counts = torch.tensor([[10, 4, 0, 0], [10, 0, 0, 0]])
    plan = Symi(3, cf=1.0).plan(counts, torch.tensor([3, 1, 1, 1]))
    cap = 4 * torch.bincount(plan.placement_NS.flatten(), minlength=4)
    assert torch.equal(plan.dropped_NE.sum(0), (counts.sum(0) - cap).clamp(min=0))


def test_lrmoe_balances_trims_and_reports():
    counts = skewed_counts(4, 8, 400, heat=12.0)
    plan = LRMoE(eps=0.0, gamma=0.0, extra_slots=1).plan(counts, counts.sum(0))
    static = StaticEP().plan(counts)
    assert int(plan.dropped_NE.sum()) == 0  # dropless forward
    assert int(plan.fwd_load_N.max()) < int(static.fwd_load_N.max())
    assert bool((plan.bwd_load_N <= plan.bwd_cap_N).all())  # gamma 0: no rank above its cap
    assert bool((plan.quota_NE <= counts).all())


def test_lrmoe_floor_excess_is_reported():
    # one expert everyone wants, no spare replicas: the floor forces pairs above the cap and the plan says so
    counts = torch.zeros(2, 2, dtype=torch.long)
    counts[:, 0] = 50
    plan = LRMoE(eps=0.0, gamma=0.9, extra_slots=0).plan(counts)
    assert plan.bwd_cap_N.tolist() == [50, 50]
    assert plan.bwd_load_N.tolist() == [90, 0] and plan.floor_excess_N.tolist() == [40, 0]


def test_lrmoe_backward_routing_moves_what_can_move():
    # even forward with a hot expert replicated everywhere, tight cap: moves happen, rows carried where needed
    counts = skewed_counts(4, 8, 400, heat=12.0)
    plan = LRMoE(forward="even", eps=0.0, gamma=0.0, extra_slots=1, mem_cap_pairs_N=torch.tensor([90, 400, 400, 400])
                 ).plan(counts, counts.sum(0))
    plan.validate(counts)
    assert len(plan.bwd_flows_V4) and int(plan.moved_NG.sum()) == int(plan.bwd_flows_V4[:, 3].sum())
    assert bool((plan.carry_NG <= plan.moved_NG).all())
    assert bool((plan.bwd_load_N <= plan.bwd_cap_N).all())
    off = LRMoE(forward="even", eps=0.0, gamma=0.0, extra_slots=1, backward_routing=False,
                mem_cap_pairs_N=torch.tensor([90, 400, 400, 400])).plan(counts, counts.sum(0))
    assert off.bwd_flows_V4.shape == (0, 4)
    assert int(off.bwd_load_N.sum()) <= int(plan.bwd_load_N.sum())  # moving saves pairs from the trim


def test_lrmoe_knobs_off():
    counts = skewed_counts(4, 8, 300)
    plan = LRMoE(quotas=False, backward_routing=False).plan(counts)
    assert torch.equal(plan.keep_NG, plan.fwd_NG) and plan.bwd_cap_N is None
    assert torch.equal(LRMoE(extra_slots=0).plan(counts).placement_NS, static_placement(8, 4))


def test_lrmoe_memory_aware_slots():
    # 4 ranks × 300 pairs, eps 0.1: planned 330 pairs of 1 KB; slots of 10 KB, 2 home slots per rank.
    # budget 380 KB leaves 380 - 20 - 330 = 30 KB -> 3 extra slots (capped at extra_slots=2); the memory cap is
    # (380 - 40) KB / 1 KB = 340 pairs. With 350 KB: 0 KB left -> no extra slot.
    counts = skewed_counts(4, 8, 300)
    kb = 1024
    plan = LRMoE(extra_slots=2, memory=MemoryModel(380 * kb, 10 * kb, kb)).plan(counts)
    assert plan.slots_per_rank == 4 and int(plan.bwd_cap_N.max()) <= 340
    assert LRMoE(extra_slots=2, memory=MemoryModel(350 * kb, 10 * kb, kb)).plan(counts).slots_per_rank == 2


@st.composite
def policy_inputs(draw):
    N = draw(st.sampled_from([1, 2, 4]))
    E = N * draw(st.integers(1, 3))
    counts = torch.tensor(draw(st.lists(st.integers(0, 30), min_size=N * E, max_size=N * E))).view(N, E)
    prev = torch.tensor(draw(st.lists(st.integers(0, 30), min_size=E, max_size=E)))
    return counts, prev


@settings(max_examples=60, deadline=None)
@given(policy_inputs(), st.sampled_from(POLICIES))
def test_every_policy_accounts_for_every_pair(inputs, policy):
    counts, prev = inputs
    N, E = counts.shape
    base = getattr(policy, "policy", policy)  # Trimmed wraps another policy
    if isinstance(base, Symi) and N * base.slots_per_rank < E:
        return
    plan = policy.plan(counts, prev).validate(counts)
    if policy.name.startswith(("static-ep", "symi-dropless", "lrmoe")):
        assert int(plan.dropped_NE.sum()) == 0
    if plan.bwd_cap_N is not None and getattr(policy, "quotas", False):
        assert torch.equal(plan.bwd_load_N, torch.minimum(plan.bwd_load_N, plan.bwd_cap_N + plan.floor_excess_N))


@pytest.mark.parametrize("make, match", [
    (lambda: LRMoE(eps=-0.1), "eps"),
    (lambda: LRMoE(gamma=1.5), "gamma"),
    (lambda: LRMoE(extra_slots=-1), "extra_slots"),
    (lambda: LRMoE(forward="fast"), "forward"),
    (lambda: LRMoE(mem_cap_pairs_N=-5), "mem_cap_pairs_N"),
    (lambda: LRMoE(quota_mode="trim"), "quota_mode"),
    (lambda: LRMoE(quota_mode="cap", rho=0.5), "rho"),
    (lambda: LRMoE(rho=0.0), "rho"),
    (lambda: LRMoE(rho=1.5), "rho"),
    (lambda: Trimmed(Symi(2), rho=-0.5), "rho"),
    (lambda: Trimmed(Symi(2), rho=0.5, gamma=2.0), "gamma"),
    (lambda: Capacity(cf=0), "cf"),
    (lambda: Capacity(drop_by="random"), "drop_by"),
    (lambda: Symi(0), "slots_per_rank"),
    (lambda: Symi(2, cf=-1.0), "cf"),
])
def test_policy_knobs_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_plan_rejects_bad_counts():
    with pytest.raises(ValueError, match="non-negative"):
        LRMoE().plan(torch.tensor([[1, -2], [3, 4]]))
    with pytest.raises(ValueError, match="prev_counts_E"):
        Symi(2).plan(torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="divisible"):
        LRMoE().plan(torch.tensor([[1, 2, 3], [3, 4, 5]]))
    with pytest.raises(ValueError, match="fewer than num_experts"):
        Symi(1).plan(torch.tensor([[1, 2, 3], [3, 4, 5]]))


# --- the next iteration's placement, from the same plan ----------------------------------------------------------

def counts_sequence(N, E, pairs_per_rank, steps, seed=0):
    """Counts of consecutive iterations with the same pairs per rank and a hot expert that wanders."""
    return [skewed_counts(N, E, pairs_per_rank, hot=(3 * t) % E, heat=6.0 + t, seed=seed + t) for t in range(steps)]


PLACING = [StaticEP(), Capacity(1.0), Symi(3), Symi(3, cf=1.0), LRMoE(), LRMoE(eps=0.0, extra_slots=2),
           LRMoE(rho=0.6, extra_slots=2, memory=MemoryModel(400 * 1024, 10 * 1024, 1024)), Trimmed(Symi(3), 0.75)]


@pytest.mark.parametrize("policy", PLACING, ids=lambda p: p.name)
def test_next_placement_is_what_the_next_plan_places(policy):
    # plan t+1 places from iteration t's global counts: exactly plan t's next_placement_NS (same pairs routed)
    steps = counts_sequence(4, 8, 250, 4)
    prev = None
    plans = []
    for counts in steps:
        plans.append(policy.plan(counts, prev).validate(counts))
        prev = counts.sum(0)
    for now, nxt in zip(plans, plans[1:]):
        assert torch.equal(now.next_placement_NS, nxt.placement_NS)
    # and it is what planning again with this iteration's counts as history would place (the old way)
    for counts, plan in zip(steps, plans):
        assert torch.equal(plan.next_placement_NS, policy.plan(counts, counts.sum(0)).placement_NS)


def test_a_plan_places_twice_and_plans_once():
    calls = []

    class Counting(Symi):
        def placement(self, popularity_E, num_ranks, total_pairs):
            calls.append("placement")
            return super().placement(popularity_E, num_ranks, total_pairs)

    plan = Counting(3).plan(skewed_counts(4, 8, 100), torch.arange(8))
    assert calls == ["placement", "placement"]  # this iteration's and the next one's, nothing else
    assert torch.equal(plan.placement_NS, symi_placement(torch.arange(8), 4, 3))


@pytest.mark.parametrize("policy", PLACING, ids=lambda p: p.name)
def test_initial_placement_is_the_uniform_plan(policy):
    # no history: the placement a plan of evenly spread counts makes (pairs_per_rank sizes memory-aware slots)
    for pairs in (None, 250, 7):
        per = 8 if pairs is None else pairs
        counts_E = torch.full((8,), per // 8, dtype=torch.long)
        counts_E[:per % 8] += 1
        planned = policy.plan(counts_E.expand(4, -1).contiguous()).placement_NS
        assert torch.equal(initial_placement(policy, 4, 8, pairs), planned)


def test_initial_placement_of_a_plan_only_policy():
    class PlanOnly:
        name = "plan-only"

        def plan(self, counts_NE, prev_counts_E=None):
            return Symi(3).plan(counts_NE, prev_counts_E)

    assert torch.equal(initial_placement(PlanOnly(), 4, 8), symi_placement(torch.ones(8), 4, 3))
    with pytest.raises(ValueError, match="pairs_per_rank"):
        initial_placement(StaticEP(), 4, 8, -1)


# --- budget mode: every rank keeps min(L_n, ceil(rho · mean)) -------------------------------------------------------

def budget(load_N, rho):
    """ceil(rho · mean load) with rho read as its decimal, exactly."""
    return math.ceil(Fraction(repr(rho)) * int(load_N.sum()) / load_N.numel())


@st.composite
def budget_inputs(draw):
    N = draw(st.sampled_from([1, 2, 3, 4, 8]))
    E = N * draw(st.integers(1, 4))
    hot = draw(st.integers(0, E - 1))
    cells = draw(st.lists(st.integers(0, 40), min_size=N * E, max_size=N * E))
    counts = torch.tensor(cells).view(N, E)
    counts[:, hot] *= draw(st.integers(1, 6))  # skew
    prev = torch.tensor(draw(st.lists(st.integers(0, 40), min_size=E, max_size=E)))
    rho = draw(st.sampled_from([0.5, 0.6, 0.75, 0.9, 1.0]) | st.floats(0.05, 1.0))
    gamma = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
    mem = draw(st.none() | st.lists(st.integers(0, 400), min_size=N, max_size=N))
    knobs = dict(extra_slots=draw(st.integers(0, 2)), forward=draw(st.sampled_from(["balanced", "even"])))
    return counts, prev, rho, gamma, mem, knobs


@settings(max_examples=250, deadline=None)
@given(budget_inputs())
def test_budget_keeps_min_of_load_and_budget_exactly(inputs):
    counts, prev, rho, gamma, mem, knobs = inputs
    mem_N = None if mem is None else torch.tensor(mem)
    plan = LRMoE(rho=rho, gamma=gamma, mem_cap_pairs_N=mem_N, **knobs).plan(counts, prev).validate(counts)
    L = plan.fwd_load_N
    cap = torch.full_like(L, budget(L, rho))
    if mem_N is not None:
        cap = torch.minimum(cap, mem_N)
    assert torch.equal(plan.bwd_cap_N, cap)
    assert plan.bwd_flows_V4.shape == (0, 4)  # budget mode moves nothing
    # every rank keeps exactly min(L_n, B_n) of its own pairs, plus what the floor forced (reported)
    assert torch.equal(plan.bwd_load_N, torch.minimum(L, cap) + plan.floor_excess_N)
    assert bool((plan.floor_excess_N <= L - torch.minimum(L, cap)).all())
    if gamma == 0:
        assert int(plan.floor_excess_N.sum()) == 0
    # the floor holds: every expert keeps ceil(gamma · C_e) of its computed pairs
    need_E = torch.ceil(plan.fwd_NE.sum(0) * gamma - 1e-9).long()
    assert bool((plan.quota_NE.sum(0) >= need_E).all())


@settings(max_examples=60, deadline=None)
@given(budget_inputs())
def test_budget_with_backward_routing_stays_under_the_budget(inputs):
    # the ablation: pairs may move into ranks whose whole load is under the budget; no rank ends above its cap
    # except by the floor, and moving only ever saves pairs from the trim
    counts, prev, rho, _, mem, knobs = inputs
    mem_N = None if mem is None else torch.tensor(mem)
    moving = LRMoE(rho=rho, gamma=0.0, mem_cap_pairs_N=mem_N, backward_routing=True, **knobs).plan(counts, prev)
    still = LRMoE(rho=rho, gamma=0.0, mem_cap_pairs_N=mem_N, **knobs).plan(counts, prev)
    moving.validate(counts)
    assert bool((moving.bwd_load_N <= moving.bwd_cap_N).all())
    assert int(moving.bwd_load_N.sum()) >= int(still.bwd_load_N.sum())


def test_budget_hand_case():
    # 2 ranks, 4 experts, static placement (no extra slots): rank 0 hosts e0, e1 (load 30), rank 1 e2, e3 (8);
    # mean 19, rho 0.75 -> budget ceil(14.25) = 15. Rank 0 cuts 15 over its groups (slot, source) = 10, 10, 5, 5
    # by cumulative rounding: 5, 5, 2, 3; rank 1 keeps its 8
    counts = torch.tensor([[10, 5, 2, 3], [10, 5, 3, 0]])
    plan = LRMoE(rho=0.75, gamma=0.0, extra_slots=0).plan(counts)
    assert plan.fwd_load_N.tolist() == [30, 8]
    assert plan.bwd_cap_N.tolist() == [15, 15]
    assert plan.bwd_load_N.tolist() == [15, 8]
    assert plan.keep_NG.tolist() == [[5, 3, 2, 3], [5, 2, 3, 0]]


def test_trimmed_control_keeps_the_base_placement_and_the_budget():
    steps = counts_sequence(4, 8, 300, 3, seed=5)
    base, trimmed = Symi(3), Trimmed(Symi(3), 0.6)
    prev = None
    for counts in steps:
        a, b = base.plan(counts, prev), trimmed.plan(counts, prev).validate(counts)
        prev = counts.sum(0)
        assert torch.equal(a.placement_NS, b.placement_NS) and torch.equal(a.fwd_NG, b.fwd_NG)
        assert torch.equal(a.next_placement_NS, b.next_placement_NS)
        L = a.fwd_load_N
        assert torch.equal(b.bwd_load_N, torch.minimum(L, torch.full_like(L, budget(L, 0.6))))
        assert b.bwd_flows_V4.shape == (0, 4) and int(b.floor_excess_N.sum()) == 0
    # the same budget as LRMoE's at the same rho, for the same loads
    counts = steps[0]
    lr = LRMoE(rho=0.6, gamma=0.0, extra_slots=0).plan(counts)
    assert torch.equal(Trimmed(StaticEP(), 0.6).plan(counts).bwd_cap_N, lr.bwd_cap_N)
    with pytest.raises(ValueError, match="already trims"):
        Trimmed(LRMoE(rho=0.5), 0.6).plan(counts)
