"""Pair selection: exact quotas, the top-quota set, water-filled probabilities, unbiased sampling."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.recal.selection import group_order, select


# --- loop-per-group references (slow, obviously right) -------------------------------------------------------
def topk_reference(scores, groups, quotas):
    keep = torch.zeros(len(scores), dtype=torch.bool)
    for q in range(len(quotas)):
        members = [i for i in range(len(scores)) if groups[i] == q]
        members.sort(key=lambda i: (-float(scores[i]), i))
        for i in members[: int(quotas[q])]:
            keep[i] = True
    return keep


def probability_reference(scores, groups, quotas, mix):
    """Iterated water-filling: cap at 1 whatever c·s reaches 1, recompute c on the rest, until stable."""
    prob = torch.zeros(len(scores), dtype=torch.float64)
    for q in range(len(quotas)):
        members = [i for i in range(len(scores)) if groups[i] == q]
        if not members:
            continue
        s = {i: float(scores[i]) for i in members}
        mean = sum(s.values()) / len(members)
        s = {i: (1.0 if mean <= 0 else v + mix * mean) for i, v in s.items()}
        quota = min(int(quotas[q]), len(members))
        capped: set[int] = set()
        while True:
            rest = [i for i in members if i not in capped]
            c = (quota - len(capped)) / sum(s[i] for i in rest) if rest else 0.0
            new = {i for i in rest if c * s[i] >= 1.0}
            if not new:
                break
            capped |= new
        for i in members:
            prob[i] = 1.0 if i in capped else c * s[i]
    return prob


def random_problem(gen, num_pairs=200, num_groups=12, tie_levels=None):
    if tie_levels:
        scores = torch.randint(0, tie_levels, (num_pairs,), generator=gen).to(torch.float32)
    else:
        scores = torch.rand(num_pairs, generator=gen) ** 3  # skewed, like gradient norms
    groups = torch.randint(0, num_groups, (num_pairs,), generator=gen)
    sizes = torch.bincount(groups, minlength=num_groups)
    quotas = (torch.rand(num_groups, generator=gen) * (sizes + 2)).long()  # some above the size, some 0
    return scores, groups, quotas


def kept_per_group(sel, groups, num_groups):
    return torch.bincount(groups[sel.keep_P], minlength=num_groups)


# --- top-quota (biased) ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie_levels", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_keeps_exactly_the_top_quota_ties_to_lower_index(tie_levels, dtype):
    gen = torch.Generator().manual_seed(1)
    scores, groups, quotas = random_problem(gen, tie_levels=tie_levels)
    sel = select(scores.to(dtype), groups, quotas, "topk")
    assert torch.equal(sel.keep_P, topk_reference(scores, groups, quotas))
    sizes = torch.bincount(groups, minlength=len(quotas))
    assert torch.equal(kept_per_group(sel, groups, len(quotas)), torch.minimum(quotas, sizes))
    assert torch.equal(sel.scale_P, sel.keep_P.to(dtype))  # biased: no rescaling


def test_topk_hand_example():
    # group 0: pairs 0, 2, 4 with scores 0.5, 0.9, 0.5 (quota 2 → pair 2, then the tie 0 beats 4)
    # group 1: pairs 1, 3 with scores 0.1, 0.2 (quota 0 → nothing)
    scores = torch.tensor([0.5, 0.1, 0.9, 0.2, 0.5])
    groups = torch.tensor([0, 1, 0, 1, 0])
    sel = select(scores, groups, torch.tensor([2, 0]), "topk")
    assert sel.keep_P.tolist() == [True, False, True, False, False]


def test_group_order_float32_key_matches_two_sorts():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(500, generator=gen)  # negative scores and -0.0 / +0.0 too
    scores[:10] = 0.0
    scores[10:20] = -0.0
    scores[20:40] = scores[40:60]  # ties
    groups = torch.randint(0, 7, (500,), generator=gen)
    assert torch.equal(group_order(scores, groups), group_order(scores.double(), groups))


# --- unbiased ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie_levels", [None, 4])
def test_unbiased_probabilities_are_water_filled(tie_levels):
    gen = torch.Generator().manual_seed(3)
    scores, groups, quotas = random_problem(gen, tie_levels=tie_levels)
    scores[groups == 0] = 0.0  # an all-zero group becomes uniform
    sel = select(scores, groups, quotas, "unbiased", torch.Generator().manual_seed(0), uniform_mix=1e-2)
    expected = probability_reference(scores, groups, quotas, mix=1e-2)
    torch.testing.assert_close(sel.prob_P.double(), expected, rtol=1e-5, atol=1e-6)
    sizes = torch.bincount(groups, minlength=len(quotas))
    prob_sum = torch.zeros(len(quotas), dtype=torch.float64).index_add_(0, groups, sel.prob_P.double())
    torch.testing.assert_close(prob_sum, torch.minimum(quotas, sizes).double(), rtol=0, atol=1e-4)
    assert bool((sel.prob_P <= 1).all())
    assert bool((sel.prob_P[quotas[groups] > 0] > 0).all())  # the mix leaves no zero probability
    assert bool((sel.prob_P[quotas[groups] == 0] == 0).all())


def test_unbiased_keeps_exactly_the_quota_every_draw_and_scales_by_inverse_probability():
    gen = torch.Generator().manual_seed(4)
    scores, groups, quotas = random_problem(gen)
    sizes = torch.bincount(groups, minlength=len(quotas))
    draw_gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        sel = select(scores, groups, quotas, "unbiased", draw_gen)
        assert torch.equal(kept_per_group(sel, groups, len(quotas)), torch.minimum(quotas, sizes))
        kept = sel.keep_P
        torch.testing.assert_close(sel.scale_P[kept], 1.0 / sel.prob_P[kept])
        assert bool((sel.scale_P[~kept] == 0).all())
        assert bool(kept[sel.prob_P >= 1].all())  # probability 1: kept outright


def test_unbiased_inclusion_frequency_matches_probability():
    """Each pair is kept with probability p_i, so the quota holds in expectation pair by pair too."""
    gen = torch.Generator().manual_seed(5)
    scores = torch.rand(60, generator=gen) ** 2
    groups = torch.arange(60) % 3
    quotas = torch.tensor([5, 11, 19])
    draws, draw_gen = 3000, torch.Generator().manual_seed(1)
    freq = torch.zeros(60, dtype=torch.float64)
    for _ in range(draws):
        sel = select(scores, groups, quotas, "unbiased", draw_gen)
        freq += sel.keep_P.double()
    freq /= draws
    p = sel.prob_P.double()
    sigma = (p * (1 - p) / draws).sqrt().clamp_min(1e-3)
    assert float(((freq - p).abs() / sigma).max()) < 5.0


def test_unbiased_horvitz_thompson_sum_is_unbiased():
    """Σ keep·scale·x estimates Σ x per group: the mean over draws converges (error ~ 1/sqrt(draws))."""
    gen = torch.Generator().manual_seed(6)
    x = torch.rand(80, generator=gen, dtype=torch.float64) ** 2
    scores = (x + 0.1 * torch.rand(80, generator=gen, dtype=torch.float64)).float()  # noisy proxy of x
    groups = torch.arange(80) % 4
    quotas = torch.tensor([3, 6, 9, 12])
    truth = torch.zeros(4, dtype=torch.float64).index_add_(0, groups, x)
    draw_gen, draws = torch.Generator().manual_seed(2), 4000
    estimates = torch.stack([
        torch.zeros(4, dtype=torch.float64).index_add_(
            0, groups, select(scores, groups, quotas, "unbiased", draw_gen).scale_P.double() * x)
        for _ in range(draws)])
    mean, std = estimates.mean(0), estimates.std(0)
    assert float(((mean - truth).abs() / (std / math.sqrt(draws)).clamp_min(1e-9)).max()) < 5.0


def test_unbiased_is_seeded():
    gen = torch.Generator().manual_seed(7)
    scores, groups, quotas = random_problem(gen)
    a = select(scores, groups, quotas, "unbiased", torch.Generator().manual_seed(11))
    b = select(scores, groups, quotas, "unbiased", torch.Generator().manual_seed(11))
    c = select(scores, groups, quotas, "unbiased", torch.Generator().manual_seed(12))
    assert torch.equal(a.keep_P, b.keep_P) and torch.equal(a.scale_P, b.scale_P)
    assert not torch.equal(a.keep_P, c.keep_P)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 60), st.integers(1, 8), st.sampled_from([None, 2, 5]))
def test_selection_properties_hold_on_arbitrary_problems(seed, num_pairs, num_groups, tie_levels):
    gen = torch.Generator().manual_seed(seed)
    scores, groups, quotas = random_problem(gen, num_pairs, num_groups, tie_levels)
    sizes = torch.bincount(groups, minlength=num_groups)
    top = select(scores, groups, quotas, "topk")
    assert torch.equal(top.keep_P, topk_reference(scores, groups, quotas))
    unb = select(scores, groups, quotas, "unbiased", gen)
    assert torch.equal(kept_per_group(unb, groups, num_groups), torch.minimum(quotas, sizes))
    torch.testing.assert_close(unb.prob_P.double(), probability_reference(scores, groups, quotas, 1e-3),
                               rtol=1e-5, atol=1e-6)


def test_edge_cases_empty_input_zero_quota_and_oversized_quota():
    empty = select(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.tensor([3]), "unbiased")
    assert empty.keep_P.numel() == 0
    scores, groups = torch.tensor([0.3, 0.2, 0.1]), torch.tensor([0, 0, 2])
    for mode in ("topk", "unbiased"):
        sel = select(scores, groups, torch.tensor([0, 4, 9]), mode, torch.Generator().manual_seed(0))
        assert sel.keep_P.tolist() == [False, False, True]
        assert sel.scale_P.tolist() == [0.0, 0.0, 1.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="greedy"), "mode"),
    (dict(quota_Q=torch.tensor([1, -1])), "non-negative"),
    (dict(group_P=torch.tensor([0, 2, 1])), "group_P values"),
    (dict(group_P=torch.tensor([0, 1])), "group_P must"),
    (dict(scores_P=torch.tensor([0.1, float("nan"), 0.3])), "NaN"),
    (dict(scores_P=torch.tensor([0.1, float("inf"), 0.3])), "inf"),
    (dict(scores_P=torch.tensor([0.1, -0.2, 0.3]), mode="unbiased"), "non-negative"),
    (dict(quota_Q=torch.tensor([1.0, 1.0])), "quota_Q"),
    (dict(uniform_mix=-1.0, mode="unbiased"), "uniform_mix"),
])
def test_bad_input_raises_value_error_naming_it(kwargs, message):
    args = dict(scores_P=torch.tensor([0.1, 0.2, 0.3]), group_P=torch.tensor([0, 1, 1]),
                quota_Q=torch.tensor([1, 1]), mode="topk")
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        select(**args)
