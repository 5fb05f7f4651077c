"""Policies and the plan they produce: every policy's plan is valid, accounts for every pair, and is deterministic."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.placement import MemoryModel, static_placement, symi_placement
from lrmoe.plan import LayerPlan, no_flows
from lrmoe.policies import LRMoE, Capacity, StaticEP, Symi


def skewed_counts(N, E, pairs_per_rank, hot=0, heat=8.0, seed=0):
    """Counts with expert `hot` about `heat` times as popular as the others."""
    gen = torch.Generator().manual_seed(seed)
    pop = torch.ones(E)
    pop[hot] = heat
    idx = torch.multinomial(pop.repeat(N, 1), pairs_per_rank, replacement=True, generator=gen)
    return torch.stack([torch.bincount(row, minlength=E) for row in idx])


POLICIES = [StaticEP(), Capacity(1.0), Capacity(1.25, "gate"), Symi(3), Symi(3, cf=1.0), LRMoE(),
            LRMoE(eps=0.0, gamma=0.5, extra_slots=2), LRMoE(quotas=False), LRMoE(backward_routing=False),
            LRMoE(forward="even", eps=0.0)]


def test_policy_names():
    assert [p.name for p in POLICIES[:6]] == ["static-ep", "capacity-cf1", "capacity-cf1.25-gate", "symi-dropless",
                                              "symi-cf1", "lrmoe"]


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
    assert int(plan.dropped_NE.sum()) == 0 and plan.bwd_flows_F4.shape == (0, 4)


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
    assert len(plan.bwd_flows_F4) and int(plan.moved_NG.sum()) == int(plan.bwd_flows_F4[:, 3].sum())
    assert bool((plan.carry_NG <= plan.moved_NG).all())
    assert bool((plan.bwd_load_N <= plan.bwd_cap_N).all())
    off = LRMoE(forward="even", eps=0.0, gamma=0.0, extra_slots=1, backward_routing=False,
                mem_cap_pairs_N=torch.tensor([90, 400, 400, 400])).plan(counts, counts.sum(0))
    assert off.bwd_flows_F4.shape == (0, 4)
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
    if isinstance(policy, Symi) and N * policy.slots_per_rank < E:
        return
    plan = policy.plan(counts, prev).validate(counts)
    if policy.name in ("static-ep", "symi-dropless", "lrmoe"):
        assert int(plan.dropped_NE.sum()) == 0
    if plan.bwd_cap_N is not None and getattr(policy, "quotas", False):
        assert torch.equal(plan.bwd_load_N, torch.minimum(plan.bwd_load_N, plan.bwd_cap_N + plan.floor_excess_N))


def test_validate_catches_broken_plans():
    plan = StaticEP().plan(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="keep_NG"):
        dataclasses.replace(plan, keep_NG=plan.fwd_NG + 1).validate()
    with pytest.raises(ValueError, match="different experts"):
        dataclasses.replace(plan, bwd_flows_F4=torch.tensor([[0, 0, 1, 1]])).validate()
    with pytest.raises(ValueError, match="exactly once"):
        plan.validate(torch.tensor([[1, 2], [3, 5]]))
    with pytest.raises(ValueError, match="drop_by"):
        dataclasses.replace(plan, drop_by="random").validate()
    with pytest.raises(ValueError, match="fwd_NG"):
        dataclasses.replace(plan, fwd_NG=plan.fwd_NG[:, :1]).validate()
    assert no_flows().shape == (0, 4)


@pytest.mark.parametrize("make, match", [
    (lambda: LRMoE(eps=-0.1), "eps"),
    (lambda: LRMoE(gamma=1.5), "gamma"),
    (lambda: LRMoE(extra_slots=-1), "extra_slots"),
    (lambda: LRMoE(forward="fast"), "forward"),
    (lambda: LRMoE(mem_cap_pairs_N=-5), "mem_cap_pairs_N"),
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
