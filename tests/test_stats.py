"""lrmoe.analysis.stats: the claim statistics against scipy's own tests, a hand-worked Holm example, and simulations
with a known answer (a planted difference is found at the stated power; a null is rejected at the stated rate)."""

import numpy as np
import pytest
from scipy import stats as sps

from lrmoe.analysis.stats import decide, holm, paired_differences, paired_test, power, seeds_needed

REPS = 4000  # simulated sweeps per case: the rate's binomial sd is below 0.007


def many_tests(diff_RS, kind, **kw):
    return np.array([paired_test(d, kind, **kw).p for d in diff_RS])


def test_paired_test_matches_scipy_one_sample_tests():
    d = np.array([-1.2, 0.3, -2.0, -0.4, -0.9, 0.1])
    sup = paired_test(d, "superior", direction=-1)
    assert sup.p == pytest.approx(sps.ttest_1samp(d, 0.0, alternative="less").pvalue)
    two = paired_test(d, "two-sided")
    assert two.p == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue)
    ni = paired_test(d + 1.5, "noninferior", margin=1.0)
    assert ni.p == pytest.approx(sps.ttest_1samp(d + 1.5, 1.0, alternative="less").pvalue)
    lo, hi = sps.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=sps.sem(d))
    assert (two.ci_low, two.ci_high) == pytest.approx((lo, hi))
    # the one-sided upper bound is the 90 % two-sided interval's upper end
    assert ni.bound_high == pytest.approx(sps.t.interval(0.90, len(d) - 1, loc=d.mean() + 1.5, scale=sps.sem(d))[1])
    # non-inferiority at level alpha holds exactly when the one-sided bound is below the margin
    assert (ni.p < 0.05) == (ni.bound_high < 1.0)


def test_holm_hand_worked():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> monotone 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="p values"):
        holm([0.1, 1.5])


@pytest.mark.parametrize("kind, effect", [("superior", 1.0), ("two-sided", 1.0), ("noninferior", 1.0)])
def test_planted_difference_found_at_the_stated_power(kind, effect):
    """A true difference of 1 point with per-seed sd 1.4: the seeds the power calculation asks for reject at about
    0.8, with the family's alpha (0.05 / 7)."""
    sd, alpha = 1.4, 0.05 / 7
    n = seeds_needed(sd, effect, kind, alpha=alpha)
    rng = np.random.default_rng(0)
    true_mean = {"superior": -effect, "two-sided": effect, "noninferior": 1.0 - effect}[kind]
    diffs = rng.normal(true_mean, sd, size=(REPS, n))
    rate = (many_tests(diffs, kind, margin=1.0, alpha=alpha) < alpha).mean()
    assert float(power(n, sd, effect, kind, alpha)) >= 0.8 > float(power(n - 1, sd, effect, kind, alpha))
    assert rate == pytest.approx(0.8, abs=0.035), (kind, n, rate)


@pytest.mark.parametrize("kind", ["superior", "two-sided", "noninferior"])
def test_null_rejected_at_the_stated_rate(kind):
    """With no effect (superiority, two-sided) or a true gap exactly at the margin (non-inferiority), the test
    rejects at alpha."""
    rng = np.random.default_rng(1)
    null_mean = 1.0 if kind == "noninferior" else 0.0
    diffs = rng.normal(null_mean, 2.0, size=(REPS, 8))
    rate = (many_tests(diffs, kind, margin=1.0) < 0.05).mean()
    assert rate == pytest.approx(0.05, abs=0.012), (kind, rate)


def test_seeds_needed_matches_the_issue_arithmetic():
    # gap sd 1.4 points, true gap 0, margin 1 %, one-sided 5 %: about 14-16 seeds; at sd 3 far more
    n = seeds_needed(1.4, 1.0, "noninferior", alpha=0.05)
    assert 12 <= n <= 16
    assert seeds_needed(3.0, 1.0, "noninferior", alpha=0.05) > 4 * n
    with pytest.raises(ValueError, match="do not reach"):
        seeds_needed(3.0, 1.0, "noninferior", max_seeds=10)


def test_decision_words():
    fine = paired_test([0.1, -0.2, 0.0, 0.2, -0.1, 0.05], "noninferior", margin=1.0)
    assert decide(fine, fine.p) == "holds"
    bad = paired_test([3.1, 2.8, 3.3, 2.9, 3.0], "noninferior", margin=1.0)
    assert decide(bad, bad.p) == "fails"
    noisy = paired_test([3.0, -2.5, 1.0, -1.0], "noninferior", margin=1.0)
    assert decide(noisy, noisy.p) == "undecided"
    # superiority: a clear win holds; an interval that excludes any benefit of 0.5 points fails
    win = paired_test([-1.0, -1.2, -0.8, -1.1, -0.9], "superior", direction=-1)
    assert decide(win, win.p) == "holds"
    none = paired_test([0.02, -0.03, 0.01, 0.0, 0.02, -0.01], "superior", direction=-1)
    assert decide(none, none.p) == "fails"
    assert decide(win, 0.2) == "undecided"  # the same data, but the family's adjustment took the p above alpha
    tiny = paired_test([0.02, -0.03, 0.01, 0.0], "two-sided")
    assert decide(tiny, tiny.p) == "fails"


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least two"):
        paired_test([1.0], "superior")
    with pytest.raises(ValueError, match="kind"):
        paired_test([1.0, 2.0], "better")
    with pytest.raises(ValueError, match="non-finite"):
        paired_differences([1.0, np.nan], [1.0, 2.0])
    with pytest.raises(ValueError, match="equal length"):
        paired_differences([1.0, 2.0], [1.0])
