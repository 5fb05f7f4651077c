"""lrmoe.analysis.skew: the time axis's Zipf skew matched to the runs' static-EP slowest ÷ mean rank load."""

import pytest
import torch

from lrmoe.analysis import protocol
from lrmoe.analysis.skew import (Scale, check_matched, match_zipf, protocol_scale, regime_zipf, runs_imbalance,
                                 side_by_side, synthetic_imbalance, trace_imbalance)

SMALL = Scale(num_ranks=8, num_experts=64, top_k=4, tokens_per_rank=512, layers=3, steps=2)


def test_trace_imbalance_hand_counted():
    # 2 ranks, 4 experts (experts 0-1 on rank 0): expert loads 3, 1, 1, 1 -> ranks 4 and 2, slowest / mean 4/3;
    # hottest expert / mean 3 / 1.5 = 2
    counts_ILNE = torch.tensor([[[[2, 1, 0, 1], [1, 0, 1, 0]]]])
    stats = trace_imbalance(counts_ILNE)
    assert stats["rank_max_over_mean"] == pytest.approx(4 / 3)
    assert stats["expert_max_over_mean"] == pytest.approx(2.0)


def test_match_recovers_the_generating_skew():
    """The ratio a Zipf 0.4 trace produces maps back to s ≈ 0.4, and the match passes the axes' check."""
    target = synthetic_imbalance(0.4, SMALL)["rank_max_over_mean"]
    match = match_zipf(target, SMALL)
    assert match.zipf_s == pytest.approx(0.4, abs=0.03)
    check_matched({"rank_max_over_mean": target}, match.simulated)
    # more skew in the runs -> a larger s
    assert match_zipf(target * 1.1, SMALL).zipf_s > match.zipf_s + 0.05


def test_mismatched_axes_are_an_error():
    with pytest.raises(ValueError, match="different systems"):
        check_matched({"rank_max_over_mean": 1.12}, {"rank_max_over_mean": 2.15})
    with pytest.raises(ValueError, match="beyond Zipf"):
        match_zipf(50.0, SMALL)


def test_runs_imbalance_reads_the_static_ep_arm():
    rows = [{"arm": "static-ep", "load/rank_max_over_mean_mean": 1.1, "load/gini_mean": 0.1,
             "load/expert_max_over_mean_mean": 1.5},
            {"arm": "static-ep", "load/rank_max_over_mean_mean": 1.3, "load/gini_mean": 0.3,
             "load/expert_max_over_mean_mean": 2.5},
            {"arm": "lrmoe-rho0.75-unbiased", "load/rank_max_over_mean_mean": 9.0, "load/gini_mean": 0.9,
             "load/expert_max_over_mean_mean": 9.0}]
    runs = runs_imbalance(rows)
    assert runs == pytest.approx({"rank_max_over_mean": 1.2, "gini": 0.2, "expert_max_over_mean": 2.0, "runs": 2})
    assert [r["matched"] for r in side_by_side(runs, runs)] == [True, False, False]
    with pytest.raises(ValueError, match="no static-EP run"):
        runs_imbalance(rows[2:])


def test_a_regime_is_matched_on_its_own_static_ep_runs_at_the_time_axis_scale():
    """regime_zipf reads only the named regime's static-EP rows: two regimes whose runs route at different
    imbalance get their own s, the more skewed the larger, each matching its runs; an unknown regime is an error.
    The default scale is the protocol's time axis (Qwen3-30B-A3B's 128 experts, top-8, 16 ranks, 2,048 tokens)."""
    scale = protocol_scale()
    assert (scale.num_ranks, scale.num_experts, scale.top_k, scale.tokens_per_rank) == (
        protocol.SIM_NODES * 8, 128, 8, protocol.SIM_TOKENS_PER_RANK)

    def row(regime, arm, ratio):
        return {"regime": regime, "arm": arm, "load/rank_max_over_mean_mean": ratio, "load/gini_mean": 0.1,
                "load/expert_max_over_mean_mean": 1.5}

    low, high = (synthetic_imbalance(s, SMALL)["rank_max_over_mean"] for s in (0.2, 0.6))
    rows = [row("a", "static-ep", low), row("b", "static-ep", high), row("a", "lrmoe", 9.0)]
    a, b = regime_zipf(rows, "a", SMALL), regime_zipf(rows, "b", SMALL)
    assert a.zipf_s == pytest.approx(0.2, abs=0.03) and b.zipf_s == pytest.approx(0.6, abs=0.03)
    check_matched({"rank_max_over_mean": low}, a.simulated)
    with pytest.raises(ValueError, match="no run of regime 'c'"):
        regime_zipf(rows, "c", SMALL)
