"""LayerPlan: the derived per-rank and per-slot views follow the pair-level rule, and validate() names the first
broken invariant (including the next iteration's placement)."""

import dataclasses

import pytest
import torch

from lrmoe.planner.plan import LayerPlan, no_flows
from lrmoe.planner.policies import StaticEP


def hand_plan(**changes):
    # 2 ranks × 2 slots: slots 0, 1 on rank 0 host e0, e1; slots 2, 3 on rank 1 host e0 (a replica) and e2.
    # fwd_NG[src, g]: rank 0 sends 4 pairs of e0 to slot 0 and 2 to slot 2; rank 1 sends 3 of e0 to slot 2, etc.
    # Backward: source 0 keeps 3 of its 4 pairs on slot 0 and moves 1 of them to slot 2 (rank 1, not its own:
    # the input row is carried).
    fields = dict(placement_NS=torch.tensor([[0, 1], [0, 2]]),
                  fwd_NG=torch.tensor([[4, 1, 2, 0], [0, 2, 3, 5]]),
                  dropped_NE=torch.zeros(2, 3, dtype=torch.long),
                  keep_NG=torch.tensor([[3, 1, 2, 0], [0, 2, 3, 5]]),
                  bwd_flows_V4=torch.tensor([[0, 0, 2, 1]]),
                  floor_excess_N=torch.zeros(2, dtype=torch.long), policy="hand")
    fields.update(changes)
    return LayerPlan(**fields)


def test_derived_views_of_a_hand_plan():
    plan = hand_plan().validate(torch.tensor([[6, 1, 0], [3, 2, 5]]))
    assert (plan.num_ranks, plan.slots_per_rank, plan.num_slots, plan.num_experts) == (2, 2, 4, 3)
    assert plan.slot_rank_G.tolist() == [0, 0, 1, 1]
    assert plan.fwd_NE.tolist() == [[6, 1, 0], [3, 2, 5]]
    assert plan.fwd_load_N.tolist() == [(4 + 0) + (1 + 2), (2 + 3) + (0 + 5)]  # column sums of each rank's slots
    assert plan.moved_out_NG.tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert plan.moved_NG.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    assert plan.carry_NG.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]  # slot 2 is on rank 1, not source 0
    assert plan.bwd_NG.tolist() == [[2, 1, 3, 0], [0, 2, 3, 5]]
    assert plan.bwd_load_N.tolist() == [(2 + 0) + (1 + 2), (3 + 3) + (0 + 5)]
    assert plan.quota_NE.tolist() == [[5, 1, 0], [3, 2, 5]]
    stats = plan.stats()
    assert stats["moved_pairs"] == 1 and stats["carried_rows"] == 1 and stats["replica_slots"] == 4


def test_next_placement_defaults_to_the_current_one():
    plan = hand_plan()
    assert plan.next_placement_NS is plan.placement_NS
    moved = hand_plan(next_placement_NS=torch.tensor([[0, 2], [1, 0]])).validate()
    assert moved.next_placement_NS.tolist() == [[0, 2], [1, 0]]


def test_validate_catches_broken_plans():
    plan = StaticEP().plan(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="keep_NG"):
        dataclasses.replace(plan, keep_NG=plan.fwd_NG + 1).validate()
    with pytest.raises(ValueError, match="different experts"):
        dataclasses.replace(plan, bwd_flows_V4=torch.tensor([[0, 0, 1, 1]])).validate()
    with pytest.raises(ValueError, match="exactly once"):
        plan.validate(torch.tensor([[1, 2], [3, 5]]))
    with pytest.raises(ValueError, match="drop_by"):
        dataclasses.replace(plan, drop_by="random").validate()
    with pytest.raises(ValueError, match="fwd_NG"):
        dataclasses.replace(plan, fwd_NG=plan.fwd_NG[:, :1]).validate()
    with pytest.raises(ValueError, match="next_placement_NS"):
        dataclasses.replace(plan, next_placement_NS=torch.tensor([[0, 1]])).validate()
    with pytest.raises(ValueError, match="next_placement_NS"):
        dataclasses.replace(plan, next_placement_NS=torch.tensor([[0, 1], [1, 5]])).validate()
    with pytest.raises(ValueError, match="next_placement_NS"):
        dataclasses.replace(plan, next_placement_NS=plan.placement_NS.int()).validate()
    with pytest.raises(ValueError, match="from a slot to itself"):
        hand_plan(bwd_flows_V4=torch.tensor([[0, 0, 0, 1]])).validate()
    with pytest.raises(ValueError, match="moves more pairs"):
        hand_plan(bwd_flows_V4=torch.tensor([[1, 2, 0, 4]])).validate()
    assert no_flows().shape == (0, 4)


def test_forward_only_and_dropless_plans_keep_every_pair_where_it_ran():
    placement_NS = torch.tensor([[0, 1], [2, 1]])
    fwd_NG = torch.tensor([[3, 1, 0, 2], [0, 4, 5, 1]])
    plan = LayerPlan.dropless(placement_NS, fwd_NG, 3, policy="p")
    assert torch.equal(plan.keep_NG, fwd_NG) and plan.keep_NG is not fwd_NG and not plan.bwd_flows_V4.numel()
    assert plan.dropped_NE.shape == (2, 3) and not plan.dropped_NE.any() and plan.policy == "p"
    assert torch.equal(plan.next_placement_NS, placement_NS) and plan.floor_excess_N.tolist() == [0, 0]
    dropped_NE = torch.tensor([[0, 1, 0], [2, 0, 0]])
    capped = LayerPlan.forward_only(placement_NS, fwd_NG, dropped_NE, drop_by="gate",
                                    next_placement_NS=placement_NS.flip(0))
    assert torch.equal(capped.dropped_NE, dropped_NE) and capped.drop_by == "gate"
    assert torch.equal(capped.next_placement_NS, placement_NS.flip(0))

