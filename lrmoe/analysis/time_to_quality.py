"""Equal quality as equal time: the per-seed quantities and the claims of the time-to-quality protocol (DESIGN.md
§11.3-11.4).

Per seed, the dropless maths is trained at several step budgets r (fractions of the full steps), giving a dropless
curve d(r) of endpoints. An arm X that trims work reached loss L_X; the dropless maths would reach it at the step
fraction r*_X where the curve equals L_X. X beats a dropless system Y at equal quality when its modelled time per
iteration t_X is below r*_X · t_Y: the per-seed quantity is q = 100 · (t_X ÷ (r*_X · t_Y) − 1) %.

    fit = fit_curve(budgets_B, endpoints_B)          # log d(r) = a + b r, least squares
    r = r_star(loss_X, fit)                          # or r_star_interpolated(loss_X, budgets_B, endpoints_B)
    q = time_to_quality(t_X, t_Y, r)                 # % (negative: X reaches the loss sooner)
    table = tq_table(per_seed)                       # the eight claims of a regime, Holm, words (δ = 2 %)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lrmoe.analysis.stats import decide, holm, paired_test

BUDGETS = (0.85, 0.90, 0.95, 1.0)  # the dropless maths' step budgets (docs/protocols/time_to_quality.md §11.2)
DELTA = 2.0  # percent of time: the smallest saving of interest (a claim fails when none of it is left)
R_RANGE = (0.70, 1.15)  # r* outside it is an extrapolation too far to trust: reported, and clipped to the range
REFERENCES = ("symi-dropless", "static-ep")  # the dropless systems Y of the claims
ARMS = ("lrmoe-rho0.75-early-unbiased", "lrmoe-rho0.9-unbiased", "lrmoe-rho0.75-unbiased", "lrmoe")


@dataclass(frozen=True)
class CurveFit:
    """log d(r) = a + b · r over the budgets (b < 0: more steps, lower loss)."""

    a: float
    b: float

    def loss(self, r: float) -> float:
        return float(np.exp(self.a + self.b * r))


def fit_curve(budgets_B, endpoints_B) -> CurveFit:
    """The least-squares line of log endpoint against the budget fraction (at least two distinct budgets, every
    endpoint finite and positive). A fitted slope that is not negative is an error: more steps did not lower the
    loss, so no step fraction can be read off the curve."""
    r, d = np.asarray(budgets_B, dtype=float), np.asarray(endpoints_B, dtype=float)
    if r.shape != d.shape or len(np.unique(r)) < 2:
        raise ValueError(f"a dropless curve needs endpoints at two or more budgets, got {r.tolist()}")
    if not (np.isfinite(d).all() and (d > 0).all()):
        raise ValueError(f"dropless endpoints must be finite and positive, got {d.tolist()}")
    b, a = np.polyfit(r, np.log(d), 1)
    if not b < 0:
        raise ValueError(f"the dropless curve does not fall with more steps (slope {b:.4g} of log loss per unit of "
                         f"steps): r* is undefined")
    return CurveFit(float(a), float(b))


def r_star(loss: float, fit: CurveFit) -> float:
    """The step fraction at which the fitted dropless curve reaches ``loss``, clipped to :data:`R_RANGE`."""
    r = (np.log(loss) - fit.a) / fit.b
    return float(np.clip(r, *R_RANGE))


def r_star_interpolated(loss: float, budgets_B, endpoints_B) -> float:
    """Robustness check (3) of docs/protocols/time_to_quality.md §11.4: r* by piecewise-linear interpolation of the
    endpoints between the budgets, extended linearly beyond the end budgets from the two nearest, clipped to
    :data:`R_RANGE`. The curve is made monotone first (a running minimum from the smallest budget), so a noisy budget
    cannot make r* ambiguous."""
    order = np.argsort(np.asarray(budgets_B, dtype=float))
    r = np.asarray(budgets_B, dtype=float)[order]
    d = np.minimum.accumulate(np.asarray(endpoints_B, dtype=float)[order])
    if loss >= d[0]:
        i = 0
    elif loss <= d[-1]:
        i = len(r) - 2
    else:
        i = int(np.nonzero(d <= loss)[0][0]) - 1
    if d[i + 1] == d[i]:
        return float(np.clip(r[i + 1], *R_RANGE))
    x = r[i] + (d[i] - loss) / (d[i] - d[i + 1]) * (r[i + 1] - r[i])
    return float(np.clip(x, *R_RANGE))


def time_to_quality(t_x: float, t_y: float, r: float) -> float:
    """q = 100 · (t_X ÷ (r · t_Y) − 1) %: X's time to its loss against the time dropless Y needs to reach it."""
    if not (t_x > 0 and t_y > 0 and r > 0):
        raise ValueError(f"times and the step fraction must be positive, got t_X {t_x}, t_Y {t_y}, r* {r}")
    return 100.0 * (t_x / (r * t_y) - 1.0)


def per_seed_table(endpoints: pd.DataFrame, times: pd.DataFrame, interpolate: bool = False) -> pd.DataFrame:
    """Seeds x (arm, reference) q values, with each arm's r*.

    ``endpoints``: one row per (seed, arm, budget) with ``endpoint``; the dropless curve is static EP's at budgets
    < 1 and, at 1, the mean of static EP's and SYMI-dropless's endpoints (docs/protocols/time_to_quality.md §11.3).
    ``times``: one row per (seed, arm) with ``time`` (the modelled iteration time from the run's own routing, at the
    full budget). Returns one row per seed with columns ``r_star/<arm>`` and ``q/<arm>/<reference>``; only seeds whose
    every arm, budget and time is there."""
    rows = []
    for seed, group in endpoints.groupby("seed"):
        full = group[group.budget == 1.0].set_index("arm")["endpoint"]
        curve = group[(group.arm == "static-ep") & (group.budget < 1.0)].set_index("budget")["endpoint"]
        t = times[times.seed == seed].set_index("arm")["time"]
        need = set(ARMS) | set(REFERENCES)
        if not need <= set(full.index) or not need <= set(t.index) or len(curve) < len(BUDGETS) - 1:
            continue
        budgets = [*curve.index, 1.0]
        values = [*curve.to_numpy(), float(np.mean([full[ref] for ref in REFERENCES]))]
        fit = None if interpolate else fit_curve(budgets, values)
        row = {"seed": seed}
        for arm in ARMS:
            r = r_star_interpolated(full[arm], budgets, values) if interpolate else r_star(full[arm], fit)
            row[f"r_star/{arm}"] = r
            for ref in REFERENCES:
                row[f"q/{arm}/{ref}"] = time_to_quality(float(t[arm]), float(t[ref]), r)
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class TQClaim:
    name: str
    arm: str
    reference: str

    @property
    def column(self) -> str:
        return f"q/{self.arm}/{self.reference}"


def tq_family() -> list[TQClaim]:
    """The eight claims of a regime (docs/protocols/time_to_quality.md §11.4): T1 against SYMI-dropless, T2 against
    static EP."""
    return [TQClaim(f"T{1 + REFERENCES.index(ref)} {arm}", arm, ref) for ref in REFERENCES for arm in ARMS]


def tq_table(per_seed: pd.DataFrame, alpha: float = 0.05, delta: float = DELTA) -> pd.DataFrame:
    """The family decided: per claim the seeds, mean q with its 95 % t interval, one-sided p (superiority: mean < 0),
    Holm-adjusted p over the claims tested, and the word (holds: adjusted p < alpha; fails: the interval's lower end
    is above −delta; undecided otherwise)."""
    claims = [c for c in tq_family() if c.column in per_seed.columns]
    tests = {c.name: paired_test(per_seed[c.column].to_numpy(dtype=float), "superior", -1, alpha=alpha)
             for c in claims if per_seed[c.column].notna().sum() >= 2}
    adjusted = dict(zip(tests, holm([t.p for t in tests.values()]))) if tests else {}
    rows = []
    for c in claims:
        t = tests.get(c.name)
        if t is None:
            rows.append({"claim": c.name, "arm": c.arm, "reference": c.reference, "word": "too few seeds"})
            continue
        rows.append({"claim": c.name, "arm": c.arm, "reference": c.reference, "seeds": t.n, "estimate": t.estimate,
                     "sd": t.sd, "ci_low": t.ci_low, "ci_high": t.ci_high, "p": t.p,
                     "p_holm": float(adjusted[c.name]), "word": decide(t, float(adjusted[c.name]), delta)})
    return pd.DataFrame(rows)
