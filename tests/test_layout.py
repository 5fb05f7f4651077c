"""The plan's byte model (lrmoe.bytemodel.layout): the rows every all-to-all carries, hand-derived on a small plan that
trims,
moves and (padded) pads; the runtime lays its packets out by these rules; the accountant and the cost model count
them."""

import pytest
import torch

from lrmoe.bytemodel.layout import (A2A_PHASES, PHASES, backward_counts, layer_counts, layer_traffic, plan_selects,
                          receive_layout)
from lrmoe.planner.plan import LayerPlan


def test_receive_layout_compact_and_padded():
    # 2 ranks x 1 slot, expert 0 on both. Source 0: 3 forward pairs on slot 0, keeps 2, moves 1 to slot 1;
    # source 1: 2 pairs on slot 1, keeps both.
    plan = LayerPlan(placement_NS=torch.tensor([[0], [0]]), fwd_NG=torch.tensor([[3, 0], [0, 2]]),
                     dropped_NE=torch.zeros(2, 1, dtype=torch.long), keep_NG=torch.tensor([[2, 0], [0, 2]]),
                     bwd_flows_V4=torch.tensor([[0, 0, 1, 1]]), floor_excess_N=torch.zeros(2, dtype=torch.long))
    assert plan_selects(plan)
    kind, slot, src = receive_layout(plan, 1, compact=True)
    # from source 0: its moved gradient row, then its carried input row; from source 1: 2 staying rows
    assert kind.tolist() == [1, 2, 0, 0] and src.tolist() == [0, 0, 1, 1] and slot.tolist() == [0, 0, 0, 0]
    kind, _, src = receive_layout(plan, 1, compact=False)
    assert kind.tolist() == [1, 2, 0, 0]  # source 0 computed nothing on rank 1 in the forward
    kind, _, src = receive_layout(plan, 0, compact=False)
    assert kind.tolist() == [0, 0, 0] and src.tolist() == [0, 0, 0]  # padded: all 3 forward rows, one zero
    kind, _, _ = receive_layout(plan, 0, compact=True)
    assert kind.tolist() == [0]  # compact: the one staying row


def _plan():
    # 2 ranks x 1 slot, expert 0 on both. fwd: source 0 sends 1 pair to slot 0 and 2 to slot 1; source 1 sends 1 and
    # 1. Source 0 keeps 1 of its 2 pairs on slot 1; source 1 moves its slot-0 pair to slot 1.
    # moved_out = [[0, 0], [1, 0]], moved in = [[0, 0], [0, 1]], bwd = [[1, 1], [0, 2]], staying = [[1, 1], [0, 1]]
    return LayerPlan(placement_NS=torch.tensor([[0], [0]]), fwd_NG=torch.tensor([[1, 2], [1, 1]]),
                     dropped_NE=torch.zeros(2, 1, dtype=torch.long), keep_NG=torch.tensor([[1, 1], [1, 1]]),
                     bwd_flows_V4=torch.tensor([[1, 0, 1, 1]]), floor_excess_N=torch.zeros(2, dtype=torch.long))


def test_backward_counts_compact_and_padded():
    plan = _plan()
    send, ret, index = backward_counts(plan, compact=True)  # bwd + moved, bwd, staying
    assert send.tolist() == [[1, 1], [0, 3]] and ret.tolist() == [[1, 1], [0, 2]] and index.tolist() == [[1, 1], [0, 1]]
    send, ret, index = backward_counts(plan, compact=False)  # fwd + 2 moved, fwd + moved, none
    assert send.tolist() == [[1, 2], [1, 3]] and ret.tolist() == [[1, 2], [1, 2]] and not index.any()


@pytest.mark.parametrize("compact", [True, False])
def test_layer_counts_hand_derived(compact):
    # D = 4 elements of 2 bytes: rows of 8 bytes; metric columns: 1 (10-byte combine rows)
    out = layer_counts(_plan(), hidden=4, ffn=3, act_bytes=2, compact=compact, combine_cols=1)
    sent = {p: out[f"{p}.sent_bytes"].tolist() for p in A2A_PHASES}
    recv = {p: out[f"{p}.recv_bytes"].tolist() for p in A2A_PHASES}
    assert sent["dispatch_a2a"] == [16, 8] and recv["dispatch_a2a"] == [8, 16]  # c = [[1, 2], [1, 1]] off-diagonal
    assert sent["combine_a2a"] == [10, 20] and recv["combine_a2a"] == [20, 10]
    if compact:
        assert sent["combine_a2a_bwd"] == [8, 0] and sent["bwd_index_a2a"] == [4, 0]
        assert sent["dispatch_a2a_bwd"] == [0, 8] and recv["dispatch_a2a_bwd"] == [8, 0]
        assert out["pairs_bwd"].tolist() == [1, 3]
    else:
        assert sent["combine_a2a_bwd"] == [16, 8] and sent["bwd_index_a2a"] == [0, 0]
        assert sent["dispatch_a2a_bwd"] == [8, 16] and recv["dispatch_a2a_bwd"] == [16, 8]
        assert out["pairs_bwd"].tolist() == [2, 4]  # padded: every forward row plus the moved one
    assert out["pairs_retained"].tolist() == [1, 3] and out["pairs_recomputed"].tolist() == [0, 1]


def test_combine_columns_ride_only_when_the_plan_selects_and_no_input_gradient_travels_without_one():
    plan = _plan()
    keep_all = LayerPlan(placement_NS=plan.placement_NS, fwd_NG=plan.fwd_NG, dropped_NE=plan.dropped_NE,
                         keep_NG=plan.fwd_NG.clone(), bwd_flows_V4=torch.zeros(0, 4, dtype=torch.long),
                         floor_excess_N=plan.floor_excess_N)
    assert plan_selects(plan) and not plan_selects(keep_all)
    assert layer_traffic(keep_all, 4, 2, combine_cols=1)["combine_a2a"].row_bytes == 8
    assert layer_traffic(plan, 4, 2, combine_cols=1)["combine_a2a"].row_bytes == 10
    assert not layer_traffic(plan, 4, 2, input_grad=False)["dispatch_a2a_bwd"].bytes_NN.any()


def test_one_phase_vocabulary():
    assert len(set(PHASES)) == len(PHASES) and set(A2A_PHASES) <= set(PHASES)
