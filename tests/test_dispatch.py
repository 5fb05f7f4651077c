"""The token dispatcher: the pair-level rule, the receive permutation, and the one data path (pack → all-to-all →
slot-major → experts → all-to-all back → un-permute) as the identity, forward and backward, with identity experts:
plain and recalibrated (trimmed, compact and padded) exchanges, on 2 and 4 gloo ranks."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.runtime.dispatch import assign_pairs, make_dispatch, source_to_slot_major
from lrmoe.runtime.distributed.comm import all_gather_rows
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import RangeGroups
from lrmoe.runtime.expert_compute import Activations
from lrmoe.runtime.layer import EPMoELayer, initial_placement
from lrmoe.planner.policies import StaticEP
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.runtime.routing import RouterOutput, route

from test_layer import FixedPlacement, random_placement, replica_slots

D, F, E, K, T = 8, 5, 8, 2, 8


# -- pure bookkeeping ------------------------------------------------------------------------------------------
# 4 tokens, top-2, 3 experts; pairs p = t*2 + j:  p0 e0 | p1 e1 | p2 e1 | p3 e0 | p4 e0 | p5 e2 | p6 e1 | p7 e0
IDX_TK = torch.tensor([[0, 1], [1, 0], [0, 2], [1, 0]])
GATE_TK = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
SLOT_EXPERT_G = torch.tensor([0, 1, 0, 2])  # 2 ranks x 2 slots: expert 0 on slots 0 and 2


def test_assign_pairs_dropless_fills_replicas_in_slot_order():
    # e0's pairs p0 p3 p4 p7 (token order): 2 to slot 0, then 2 to slot 2
    slot_P = assign_pairs(IDX_TK, GATE_TK, torch.tensor([2, 3, 2, 1]), torch.tensor([0, 0, 0]), SLOT_EXPERT_G)
    assert slot_P.tolist() == [0, 1, 1, 0, 2, 3, 1, 2]


def test_assign_pairs_drops_the_last_pairs_by_position():
    slot_P = assign_pairs(IDX_TK, GATE_TK, torch.tensor([2, 2, 1, 1]), torch.tensor([1, 1, 0]), SLOT_EXPERT_G)
    assert slot_P.tolist() == [0, 1, 1, 0, 2, 3, -1, -1]  # p7 (e0) and p6 (e1) are the last of their experts


def test_assign_pairs_drops_the_lowest_gates():
    # e0 gates p0 .6, p3 .3, p4 .5, p7 .1: drop p7, p3; e1 gates p1 .4, p2 .7, p6 .9: drop p1
    slot_P = assign_pairs(IDX_TK, GATE_TK, torch.tensor([1, 2, 1, 1]), torch.tensor([2, 1, 0]), SLOT_EXPERT_G,
                          drop_by="gate")
    assert slot_P.tolist() == [0, -1, 1, -1, 2, 3, 1, -1]
    # equal gates: the later token is dropped
    tie = assign_pairs(torch.zeros(3, 1, dtype=torch.long), torch.full((3, 1), 0.5), torch.tensor([2, 0, 0, 0]),
                       torch.tensor([1, 0, 0]), SLOT_EXPERT_G, drop_by="gate")
    assert tie.tolist() == [0, 0, -1]


def test_assign_pairs_rejects_a_plan_that_misses_pairs():
    with pytest.raises(ValueError, match="does not account"):
        assign_pairs(IDX_TK, GATE_TK, torch.tensor([2, 3, 2, 0]), torch.tensor([0, 0, 0]), SLOT_EXPERT_G)
    with pytest.raises(ValueError, match="empty slot"):
        assign_pairs(IDX_TK, GATE_TK, torch.tensor([2, 3, 2, 1]), torch.tensor([0, 0, 0]),
                     torch.tensor([0, 1, -1, 2]))
    with pytest.raises(ValueError, match="drop_by"):
        assign_pairs(IDX_TK, GATE_TK, torch.tensor([2, 3, 2, 1]), torch.tensor([0, 0, 0]), SLOT_EXPERT_G, "random")


def test_source_to_slot_major():
    # received: s0j0 | s0j1 s0j1 | s1j0 s1j0 s1j0 -> slot-major: slot 0 from s0 then s1, slot 1 from s0
    assert source_to_slot_major(torch.tensor([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]
    assert source_to_slot_major(torch.zeros(3, 2, dtype=torch.long)).tolist() == []
    assert source_to_slot_major(torch.tensor([[2]])).tolist() == [0, 1]


# -- the data path as the identity ---------------------------------------------------------------------------------
class IdentityExperts:
    """Experts that return their input (and pass gradients straight back): the exchange then moves rows only."""

    def forward(self, x_MD, slots_SW, offs_S):
        empty = x_MD.new_empty(x_MD.shape[0], 0)
        return x_MD.clone(), Activations(x_MD, empty, empty, empty)

    def backward(self, act, dy_MD, slots_SW, offs_S, input_grad=True):
        return (dy_MD.clone() if input_grad else None), torch.zeros_like(slots_SW)


class Trimmed:
    """A policy's plan with each (source, slot) group keeping half its pairs for the backward (quotas, in effect)."""

    def __init__(self, base):
        self.base, self.name = base, "trimmed"

    def plan(self, counts_NE, prev_counts_E=None):
        plan = self.base.plan(counts_NE, prev_counts_E)
        return dataclasses.replace(plan, keep_NG=plan.fwd_NG // 2, policy=self.name)


def _identity_case(rank, placement_kind, backward):
    """Unit gates and identity experts: every kept pair brings x_t back, so y = K·x in the forward, and the
    input gradient is dy times the number of the token's pairs the backward kept (all K without trimming), exactly;
    the rows that reach each slot are exactly the tokens the plan sends there."""
    world = dist.get_world_size()
    ref = ReferenceMoE(D, F, E, K, "softmax_topk", dtype=torch.float64, seed=3)
    if placement_kind == "static":
        placement = initial_placement(StaticEP(), world, E)
    else:
        placement = random_placement(world, replica_slots(world), 7)
    policy = FixedPlacement(placement)
    if backward is not None:
        policy = Trimmed(policy)
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", policy, placement, RangeGroups(), backward=backward)
    layer.experts = IdentityExperts()
    g = torch.Generator().manual_seed(9)
    x = torch.randn(world * T, D, generator=g, dtype=torch.float64)
    dy = torch.randn(world * T, D, generator=g, dtype=torch.float64)
    mine = slice(rank * T, (rank + 1) * T)
    idx_TK = route(x[mine] @ ref.w_router_ED.T, "softmax_topk", K).idx_TK
    unit = RouterOutput(idx_TK, torch.ones(T, K, dtype=x.dtype), None)

    # the dispatcher alone: what arrives at each local slot
    counts_NE = all_gather_rows(torch.bincount(idx_TK.reshape(-1), minlength=E))
    d = make_dispatch(idx_TK, unit.weight_TK, policy.plan(counts_NE), counts_NE, rank, x.device)
    x_slot, _ = layer.dispatcher.dispatch(x[mine], d)
    slots_all = all_gather_rows(d.slot_P)  # [N, T*K] global slot of every pair of every rank
    S = layer.slots_per_rank
    expected = [x[src * T + (slots_all[src] == rank * S + j).nonzero().flatten() // K]
                for j in range(S) for src in range(world)]
    assert torch.equal(x_slot, torch.cat(expected))

    # the whole exchange through the layer, forward and backward
    x_local = x[mine].clone().requires_grad_(True)
    y, info = layer(x_local, routing=unit)
    assert torch.equal(y, K * x[mine])
    y.backward(dy[mine])
    kept = torch.full((T,), float(K), dtype=x.dtype) if backward is None else info.record.keep_TK.sum(1).to(x.dtype)
    if backward is not None:
        assert int(info.record.keep_TK.sum()) < T * K  # the trim took something
    assert torch.equal(x_local.grad, kept[:, None] * dy[mine])
    return True


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backward", [None, BackwardConfig(metric="random", seed=1),
                                      BackwardConfig(metric="random", seed=1, compact=False)],
                         ids=["plain", "trimmed-compact", "trimmed-padded"])
def test_permute_all_to_all_unpermute_is_the_identity(world_size, backward):
    for kind in ("static", "random"):
        assert launch(_identity_case, world_size, kind, backward) == [True] * world_size
