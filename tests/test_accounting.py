"""The per-rank accountant: phases timed and counted by name from one vocabulary, and the check that compares what
a rank counted with the closed form of its plan (lrmoe.bytemodel.layout, lrmoe.bytemodel.sync_model)."""

import pytest
import torch

from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_layer
from lrmoe.bytemodel.layout import BYTE_PHASES
from lrmoe.planner.plan import LayerPlan, no_flows


def test_phases_accumulate_and_record_flat_keys():
    acc = Accountant()
    for _ in range(2):
        with acc.phase("dispatch_a2a"):
            pass
        acc.add_bytes("dispatch_a2a", 8, 16)
    acc.begin("expert_bwd")  # a phase whose ends lie in different places (autograd callbacks)
    assert acc.is_open("expert_bwd")
    acc.end("expert_bwd")
    acc.add("pairs_fwd", 3)
    rec = acc.record()
    assert rec["dispatch_a2a.sent_bytes"] == 16 and rec["dispatch_a2a.recv_bytes"] == 32
    assert rec["pairs_fwd"] == 3 and rec["expert_bwd.wall_ms"] >= 0.0
    assert "expert_bwd.sent_bytes" not in rec and "dispatch_a2a" in BYTE_PHASES  # bytes only for byte phases
    acc.reset()
    assert acc.record() == {}


def test_unknown_names_and_unmatched_ends_are_errors():
    acc = Accountant()
    with pytest.raises(ValueError, match="unknown phase"):
        acc.begin("dispatch")
    with pytest.raises(ValueError, match="unknown counter"):
        acc.add("pairs", 1)
    with pytest.raises(ValueError, match="without a begin"):
        acc.end("adam")


def test_check_counts_names_every_disagreement():
    plan = LayerPlan(placement_NS=torch.tensor([[0], [1]]), fwd_NG=torch.tensor([[1, 2], [0, 1]]),
                     dropped_NE=torch.zeros(2, 2, dtype=torch.long), keep_NG=torch.tensor([[1, 2], [0, 1]]),
                     bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(2, dtype=torch.long))
    want = expected_layer(plan, hidden=4, ffn=3, act_bytes=4)
    good = {key: int(value[0]) for key, value in want.items()}
    check_accounting(good, want, rank=0)
    bad = dict(good, **{"dispatch_a2a.sent_bytes": good["dispatch_a2a.sent_bytes"] + 1, "pairs_fwd": 7})
    with pytest.raises(RuntimeError, match="dispatch_a2a.sent_bytes: counted 33, formula 32.*pairs_fwd"):
        check_accounting(bad, want, rank=0)
