"""How much a decided claim depends on the choices the protocol fixed: the endpoint, the reference, the test and the
family (docs/protocols/frontier.md §10.8). Each variant re-decides every claim of a regime from the same collected runs;
a claim whose word moves under a variant is fragile in that direction.

    table = robustness_table(rows, "production")     # one row per (variant, claim): p, Holm p, word
    worth = steps_per_loss_margin(rows, "production")  # per seed: the share of the steps that 1 % of loss is worth

Tests beside the protocol's paired t: the exact sign-flip permutation test of the per-seed mean (all 2^n sign
patterns for n <= 20) and the Wilcoxon signed-rank test (``scipy.stats.wilcoxon``), both on the same per-seed
quantity, one-sided in the claim's direction (two-sided for a two-sided claim; non-inferiority tests the quantity
minus the margin).
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from scipy import stats

from lrmoe.analysis import protocol
from lrmoe.analysis.claims import MARGIN, Claim, claim_table, early_family, family, gap_table, per_seed
from lrmoe.analysis.stats import decide, holm, paired_test

# the variants, each a change of one choice from the protocol's (docs/protocols/frontier.md §10.3-10.4)
VARIANTS = ("protocol", "endpoint step 300", "reference symi-dropless", "reference static-ep", "sign-flip test",
            "wilcoxon test", "one family of all claims")


def sign_flip_p(values, kind: str, direction: int = -1, margin: float = 0.0) -> float:
    """The exact sign-flip permutation p value of the mean of ``values`` (the claim's per-seed quantity): under H0
    the per-seed quantity (less the margin, for non-inferiority) is symmetric about 0, so every sign pattern is as
    likely; the p value is the share of patterns whose mean is at least as extreme as the one observed."""
    d = np.asarray(values, dtype=float) - (margin if kind == "noninferior" else 0.0)
    if len(d) > 20:
        raise ValueError(f"the exact sign-flip test enumerates 2^n patterns; n = {len(d)} is too many")
    signs_XS = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))
    means_X = signs_XS @ np.abs(d) / len(d)
    observed = d.mean()
    tol = 1e-12 * max(1.0, float(np.abs(d).max()))
    if kind == "two-sided":
        return float(np.mean(np.abs(means_X) >= abs(observed) - tol))
    side = -1.0 if kind == "noninferior" else float(direction)  # the claim's side: side * mean large is extreme
    return float(np.mean(side * means_X >= side * observed - tol))


def wilcoxon_p(values, kind: str, direction: int = -1, margin: float = 0.0) -> float:
    """The Wilcoxon signed-rank p value of the same hypotheses as :func:`sign_flip_p`."""
    d = np.asarray(values, dtype=float) - (margin if kind == "noninferior" else 0.0)
    if kind == "two-sided":
        alternative = "two-sided"
    elif kind == "noninferior":
        alternative = "less"  # the claim: the gap is below the margin
    else:
        alternative = "less" if direction < 0 else "greater"
    return float(stats.wilcoxon(d, alternative=alternative).pvalue)


def _decided(gaps: pd.DataFrame, claims: list[Claim], test: str) -> pd.DataFrame:
    """The claim table of ``claims`` on ``gaps`` with the p values of ``test`` ("t", "sign-flip" or "wilcoxon"),
    Holm-adjusted over ``claims``; the decision words of docs/protocols/frontier.md §10.4 on the adjusted p (the
    intervals stay the t intervals, which decide a claim's failure)."""
    if test == "t":
        return claim_table(gaps, claims)
    tests, p = {}, {}
    for claim in claims:
        values = per_seed(gaps, claim)
        if values is None or len(values) < 2:
            continue
        margin = MARGIN if claim.kind == "noninferior" else 0.0
        tests[claim.name] = paired_test(values, claim.kind, claim.direction, margin)
        fn = sign_flip_p if test == "sign-flip" else wilcoxon_p
        p[claim.name] = fn(values, claim.kind, claim.direction, margin)
    adjusted = dict(zip(p, holm(list(p.values()))))
    rows = []
    for claim in claims:
        if claim.name not in tests:
            continue
        t = tests[claim.name]
        rows.append({"claim": claim.name, "seeds": t.n, "estimate": t.estimate, "ci_low": t.ci_low,
                     "ci_high": t.ci_high, "bound_high": t.bound_high, "p": p[claim.name],
                     "p_holm": float(adjusted[claim.name]), "word": decide(t, float(adjusted[claim.name]))})
    return pd.DataFrame(rows)


def _at_last_eval(rows: list[dict]) -> list[dict]:
    """The runs with their endpoint replaced by the last evaluation alone (step 300)."""
    out = []
    for r in rows:
        pairs = sorted(zip(r["eval_steps"], r["val_loss"]))
        ok = pairs and pairs[-1][0] == protocol.STEPS
        out.append({**r, "endpoint": float(pairs[-1][1]) if ok else float("nan")})
    return out


def robustness_table(rows, regime: str) -> pd.DataFrame:
    """Every claim of ``regime`` (both families, docs/protocols/frontier.md §10.4 and §10.6) decided under each of
    :data:`VARIANTS`: one row per (variant, claim) with its estimate, p, Holm-adjusted p and word. ``rows``: the
    protocol's collected runs (the sweep's only count)."""
    rows = [r for r in rows if r.get("stage") == "sweep" and r.get("regime") == regime]
    if not rows:
        raise ValueError(f"no sweep run of regime {regime!r}")
    arms = [a for a in protocol.SWEEP_ARMS if any(r["arm"] == a for r in rows)]
    main_arms = [a for a in arms if a not in protocol.EARLY_ARMS]
    early_arms = [*protocol.REFERENCES, f"lrmoe-rho{protocol.CLAIM_RHO:g}-unbiased", *protocol.EARLY_ARMS]
    tables = []
    for variant in VARIANTS:
        runs, references, test = rows, protocol.REFERENCES, "t"
        if variant == "endpoint step 300":
            runs = _at_last_eval(rows)
        elif variant.startswith("reference "):
            references = (variant.split()[1],)
        elif variant == "sign-flip test":
            test = "sign-flip"
        elif variant == "wilcoxon test":
            test = "wilcoxon"
        if variant == "one family of all claims":
            gaps = gap_table(runs, sorted(set(main_arms) | set(early_arms)), references)
            table = _decided(gaps, family() + early_family(), test)
        else:
            main = _decided(gap_table(runs, main_arms, references), family(), test)
            parts = [main]
            if set(protocol.EARLY_ARMS) <= set(arms):
                parts.append(_decided(gap_table(runs, early_arms, references), early_family(), test))
            table = pd.concat(parts, ignore_index=True)
        tables.append(table.assign(variant=variant, regime=regime))
    cols = ["regime", "variant", "claim", "seeds", "estimate", "ci_low", "ci_high", "p", "p_holm", "word"]
    return pd.concat(tables, ignore_index=True)[cols]


def steps_per_loss_margin(rows, regime: str, margin_pct: float = MARGIN) -> pd.DataFrame:
    """Per seed of ``regime``: the step at which the reference curve (the mean of the references' validation curves)
    first reaches its endpoint × (1 + margin), linearly interpolated between evaluations, and the share of the
    training steps between it and the endpoint's centre (the mean step of its evaluations): what a loss margin of
    ``margin_pct`` % is worth in steps."""
    rows = [r for r in rows if r.get("stage") == "sweep" and r.get("regime") == regime
            and r["arm"] in protocol.REFERENCES]
    out = []
    for seed in sorted({r["seed"] for r in rows}):
        refs = [r for r in rows if r["seed"] == seed]
        if len(refs) != len(protocol.REFERENCES):
            continue
        steps = np.asarray(refs[0]["eval_steps"], dtype=float)
        curve = np.mean([np.asarray(r["val_loss"], dtype=float) for r in refs], axis=0)
        evals = protocol.ENDPOINT_EVALS
        target = curve[-evals:].mean() * (1 + margin_pct / 100)
        below = np.nonzero(curve <= target)[0]
        if not len(below) or below[0] == 0:
            continue
        i = int(below[0])
        x = steps[i - 1] + (curve[i - 1] - target) / (curve[i - 1] - curve[i]) * (steps[i] - steps[i - 1])
        centre = float(steps[-evals:].mean())
        out.append({"regime": regime, "seed": seed, "step_at_margin": float(x), "endpoint_centre": centre,
                    "steps_share": (centre - float(x)) / centre})
    return pd.DataFrame(out)
