"""The statistics that decide a frontier claim (docs/protocols/frontier.md §10.4): paired t intervals, non-inferiority
bounds, Holm's adjustment, the decision word, and the number of seeds a claim needs (noncentral t power).

Every claim is a one-sample test on per-seed differences (paired design): superiority ("the mean is below 0"),
two-sided ("the mean is not 0") or non-inferiority ("the mean is below the margin"). Distributions come from
``scipy.stats``.

    test = paired_test(diff_S, kind="superior", direction=-1)           # mean of the per-seed differences < 0
    test = paired_test(gap_S, kind="noninferior", margin=1.0)            # mean gap < 1 (percentage points)
    adjusted = holm([t.p for t in tests])
    decide(test, adjusted_p, delta=0.5)                                   # "holds" | "fails" | "undecided"
    seeds_needed(sd=1.4, effect=1.0, kind="noninferior", alpha=0.05 / 7)  # the sweep's seed count
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

KINDS = ("superior", "two-sided", "noninferior")
WORDS = ("holds", "fails", "undecided")


@dataclass(frozen=True)
class PairedTest:
    """A one-sample t test on per-seed differences.

    kind        "superior" (the claim: the mean lies on the ``direction`` side of 0), "two-sided" (the mean is
                not 0) or "noninferior" (the mean is below ``margin``).
    estimate    the mean of the differences; ``sd`` their standard deviation (ddof 1); ``n`` the seeds.
    ci_low, ci_high   the two-sided (1 - alpha) t interval of the mean.
    bound_low, bound_high  the one-sided (1 - alpha) bounds: the mean is above ``bound_low``, below
                ``bound_high`` (non-inferiority holds at level alpha when ``bound_high`` < ``margin``).
    p           the test's p value (unadjusted): one-sided in the claimed direction (superior), two-sided, or the
                one-sided p of H0 "mean >= margin" (noninferior).
    """

    kind: str
    n: int
    estimate: float
    sd: float
    ci_low: float
    ci_high: float
    bound_low: float
    bound_high: float
    p: float
    direction: int = -1
    margin: float = 0.0
    alpha: float = 0.05

    def as_dict(self) -> dict:
        return asdict(self)


def paired_differences(a, b) -> np.ndarray:
    """a - b element by element (seed by seed); both must be finite and of the same length."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired samples must be 1-D and of equal length, got shapes {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("paired samples hold a non-finite value (an unfinished run?)")
    return a - b


def paired_test(diff, kind: str, direction: int = -1, margin: float = 0.0, alpha: float = 0.05) -> PairedTest:
    """The t test of ``kind`` on the per-seed differences ``diff`` (module doc). Needs at least two finite values;
    an sd of exactly 0 gives p 0 or 1 (the test is degenerate, not an error)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    if direction not in (-1, 1):
        raise ValueError(f"direction must be -1 (claim: mean < 0) or +1 (mean > 0), got {direction!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    d = np.asarray(diff, dtype=float)
    if d.ndim != 1 or len(d) < 2 or not np.isfinite(d).all():
        raise ValueError(f"a paired test needs at least two finite per-seed differences, got {d.tolist()}")
    n, mean, sd = len(d), float(d.mean()), float(d.std(ddof=1))
    se, df = sd / np.sqrt(n), n - 1
    half = float(stats.t.ppf(1 - alpha / 2, df)) * se
    one = float(stats.t.ppf(1 - alpha, df)) * se
    if kind == "superior":
        p = _t_sf(direction * mean, se, df)  # P(T >= t) for the claimed side
    elif kind == "two-sided":
        p = min(1.0, 2 * _t_sf(abs(mean), se, df))
    else:
        p = _t_sf(margin - mean, se, df)  # H0: mean >= margin, rejected for small means
    return PairedTest(kind=kind, n=n, estimate=mean, sd=sd, ci_low=mean - half, ci_high=mean + half,
                      bound_low=mean - one, bound_high=mean + one, p=p, direction=direction, margin=margin,
                      alpha=alpha)


def _t_sf(x: float, se: float, df: int) -> float:
    """P(T_df >= x / se), with se = 0 read as an exact result."""
    if se == 0:
        return 0.0 if x > 0 else 1.0
    return float(stats.t.sf(x / se, df))


def holm(p_values) -> np.ndarray:
    """Holm's step-down adjusted p values (family-wise error), in the input order: the i-th smallest p times
    (m - i), made monotone, capped at 1."""
    p = np.asarray(p_values, dtype=float)
    if p.ndim != 1 or ((p < 0) | (p > 1) | ~np.isfinite(p)).any():
        raise ValueError(f"p values must be a 1-D array in [0, 1], got {p.tolist()}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
    out = np.empty(m)
    out[order] = adjusted
    return out


def decide(test: PairedTest, adjusted_p: float, delta: float = 0.5) -> str:
    """The decision word of docs/protocols/frontier.md §10.4 for one claim, given its Holm-adjusted p and the smallest
    difference of interest ``delta`` (superiority and two-sided claims)."""
    if adjusted_p < test.alpha:
        return "holds"
    if test.kind == "superior":
        # the interval's end on the claimed side: no benefit of delta or more is left in it
        best = -test.ci_low if test.direction < 0 else test.ci_high
        return "fails" if best < delta else "undecided"
    if test.kind == "two-sided":
        return "fails" if -delta < test.ci_low and test.ci_high < delta else "undecided"
    return "fails" if test.bound_low > test.margin else "undecided"


def power(n, sd: float, effect: float, kind: str, alpha: float = 0.05):
    """The probability that the test of ``kind`` at level ``alpha`` rejects with ``n`` seeds when the per-seed
    differences have standard deviation ``sd`` and the claim is true by ``effect``: the true mean's distance from
    the null on the claimed side (superior: |mean|; two-sided: |mean|; noninferior: margin - mean). Noncentral t.
    ``n`` may be an array."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {KINDS}")
    if not sd > 0:
        raise ValueError(f"sd must be positive, got {sd!r}")
    n = np.asarray(n, dtype=float)
    if (n < 2).any():
        raise ValueError("power needs at least two seeds")
    df, nc = n - 1, effect * np.sqrt(n) / sd
    if kind == "two-sided":
        crit = stats.t.ppf(1 - alpha / 2, df)
        return stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)
    return stats.nct.sf(stats.t.ppf(1 - alpha, df), df, nc)


def seeds_needed(sd: float, effect: float, kind: str, alpha: float = 0.05, target: float = 0.8,
                 max_seeds: int = 1000) -> int:
    """The smallest number of seeds whose :func:`power` reaches ``target``; ValueError past ``max_seeds``."""
    n = np.arange(2, max_seeds + 1)
    reached = np.flatnonzero(power(n, sd, effect, kind, alpha) >= target)
    if not len(reached):
        raise ValueError(f"{max_seeds} seeds do not reach power {target} (sd {sd}, effect {effect}, {kind})")
    return int(n[reached[0]])
