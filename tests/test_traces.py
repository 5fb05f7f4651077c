"""Traces: format round-trip, calibration of the skew against DESIGN.md §5, statistics on hand cases."""

import pytest
import torch

from lrmoe.traces import (Trace, generate_trace, gini, inclusion_probs, load_trace, max_over_mean, rank_loads,
                          sample_routing, sample_topk, zipf_popularity)


def test_trace_round_trips_and_never_overwrites(tmp_path):
    trace = generate_trace(3, 2, 4, 16, 2, 64, seed=3, model="qwen3-30b-a3b-debug")
    path = trace.save(tmp_path / "t.npz")
    back = load_trace(path)
    assert torch.equal(back.counts_SLNE, trace.counts_SLNE)
    assert back.meta["source"] == "synthetic" and back.meta["seed"] == 3 and back.meta["generator"]["skew"] == "zipf"
    with pytest.raises(FileExistsError):
        trace.save(path)


def test_counts_sum_to_tokens_times_k_in_both_modes():
    for exact in (False, True):
        trace = generate_trace(2, 2, 3, 16, 4, 50, exact=exact)
        assert (trace.counts_SLNE.sum(-1) == 200).all()
        if exact:  # without replacement: no expert gets more pairs than there are tokens
            assert trace.counts_SLNE.max() <= 50


def test_same_seed_same_trace():
    a = generate_trace(2, 3, 4, 32, 2, 100, seed=7, skew="dirichlet", skew_param=1.0)
    b = generate_trace(2, 3, 4, 32, 2, 100, seed=7, skew="dirichlet", skew_param=1.0)
    assert torch.equal(a.counts_SLNE, b.counts_SLNE)


def test_zipf_04_over_128_experts_calibrates_to_gini_023():
    trace = generate_trace(2, 8, 8, 128, 8, 4096, skew_param=0.4, drift_sigma=0.0, seed=1)
    assert trace.summary()["gini_mean"] == pytest.approx(0.23, abs=0.03)
    pop = zipf_popularity(128, 0.4, torch.Generator().manual_seed(0))
    assert float(gini(pop)) == pytest.approx(0.23, abs=0.01)
    assert float(max_over_mean(pop)) == pytest.approx(4.3, abs=0.1)


def test_fast_mode_matches_exact_gumbel_topk_means():
    pop = zipf_popularity(64, 0.8, torch.Generator().manual_seed(0))
    idx = sample_topk(torch.log(pop), 50_000, 4, torch.Generator().manual_seed(1))
    empirical = torch.bincount(idx.flatten(), minlength=64).double() / 50_000
    error = (inclusion_probs(pop, 4) - empirical).abs()
    assert error.max() < 0.02 and error.mean() < 0.004
    assert idx.unique(dim=1).shape == idx.shape  # k distinct experts per token


def test_statistics_on_hand_cases():
    assert float(gini(torch.tensor([1.0, 1.0, 1.0, 1.0]))) == pytest.approx(0.0)
    assert float(gini(torch.tensor([0.0, 0.0, 0.0, 4.0]))) == pytest.approx(0.75)  # (n-1)/n
    assert float(max_over_mean(torch.tensor([1.0, 3.0]))) == pytest.approx(1.5)
    # expert 0 has two replicas (rank 0 and rank 1): its 8 pairs split 4 + 4
    placement = torch.tensor([[0, 1], [0, 2]])
    assert rank_loads(torch.tensor([8, 2, 6]), placement).tolist() == [6.0, 10.0]
    with pytest.raises(ValueError, match=r"experts \[2\] have no slot"):
        rank_loads(torch.tensor([1, 1, 1]), torch.tensor([[0, 1]]))


def test_sample_routing_has_the_family_form():
    pop = zipf_popularity(16, 0.4, torch.Generator().manual_seed(0))
    out = sample_routing(pop, 32, 4, "softmax_topk", torch.Generator().manual_seed(0))
    assert out.weight_TK.sum(-1).allclose(torch.ones(32))
    out = sample_routing(pop, 32, 4, "sigmoid_bias", torch.Generator().manual_seed(0))
    assert out.idx_TK.shape == (32, 4)


def test_bad_trace_input_raises():
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        generate_trace(1, 1, 1, 8, 9, 10)
    with pytest.raises(ValueError, match="unknown skew"):
        generate_trace(1, 1, 1, 8, 2, 10, skew="pareto")
    with pytest.raises(ValueError, match="negative"):
        Trace(-torch.ones(1, 1, 1, 2, dtype=torch.long))
