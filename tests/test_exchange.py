"""The recalibrated backward's pure parts: which slot runs each kept row's backward (the plan's pair-level rule for
flows), the return layout without the carried rows, and the configuration's checks. The exchange itself runs in
tests/test_layer_lrmoe.py (against the reference) and tests/test_dispatch.py (as the identity)."""

import pytest
import torch

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.runtime.exchange import flow_slots, rows_only
from lrmoe.kernels.compact import compact_plan, pack, unpack


def test_flow_slots_moves_the_lowest_scoring_kept_rows_first_row_first():
    # one group (slot 3) of kept rows scored .9 .1 .5 .3 and a dropped row; flows (3 -> 5, 1) and (3 -> 7, 2)
    slot = torch.tensor([3, 3, 3, 3, 3])
    keep = torch.tensor([True, True, True, True, False])
    scores = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.0])
    flows = torch.tensor([[3, 5, 1], [3, 7, 2]])
    assert flow_slots(slot, keep, scores, flows).tolist() == [3, 5, 7, 7, -1]
    # flows of another group leave this one alone; no flows: every kept row stays
    assert flow_slots(slot, keep, scores, torch.tensor([[2, 5, 1]])).tolist() == [3, 3, 3, 3, -1]
    assert flow_slots(slot, keep, scores, torch.zeros(0, 3, dtype=torch.long)).tolist() == [3, 3, 3, 3, -1]


def test_flow_slots_two_groups_and_ties():
    # groups 0 (rows 0, 2, 4) and 1 (rows 1, 3); equal scores rank by row index, so the later row is "lower"
    slot = torch.tensor([0, 1, 0, 1, 0])
    scores = torch.tensor([0.5, 0.2, 0.5, 0.4, 0.1])
    flows = torch.tensor([[0, 6, 2], [1, 4, 1]])
    assert flow_slots(slot, torch.ones(5, dtype=torch.bool), scores, flows).tolist() == [0, 4, 6, 1, 6]


def test_rows_only_drops_the_carry_blocks():
    # 4 pairs to 2 destinations; pairs 0 and 3 carry. Packed: dest0 [p0 p1 | c0], dest1 [p3 p2 | c3]
    dest = torch.tensor([0, 0, 1, 1])
    plan = compact_plan(dest, torch.zeros(4, dtype=torch.long), 2, 1, carry_P=torch.tensor([True, False, False, True]))
    assert plan.pos_P.tolist() == [0, 1, 4, 3]
    rows = rows_only(plan, dest)
    assert rows.pos_P.tolist() == [0, 1, 3, 2] and rows.num_packed == 4 and rows.num_carried == 0
    back = torch.arange(4.0)[:, None]  # what the destinations return, rows blocks only
    assert unpack(back, rows, per_token=False).flatten().tolist() == [0.0, 1.0, 3.0, 2.0]
    packed = pack(torch.arange(4.0)[:, None] * 10, plan, carry_YD=torch.arange(4.0)[:, None])
    assert packed.flatten().tolist() == [0.0, 10.0, 0.0, 30.0, 20.0, 3.0]


@pytest.mark.parametrize("field, value, message", [("metric", "m9", "metric"), ("mode", "all", "mode"),
                                                   ("compact", 1, "compact"), ("seed", -1, "seed"),
                                                   ("uniform_mix", -0.1, "uniform_mix")])
def test_backward_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        BackwardConfig(**{field: value})
