"""The frontier's claims decided from the protocol's runs (docs/protocols/frontier.md §10.4): per-seed gaps to the
two-run reference, the family of claims of a regime, their tests with Holm's adjustment and decision words, and the seed
count a pilot's variance asks for.

    gaps = gap_table(rows)                  # seeds x arms, % above the reference, whole seeds only
    table = claim_table(gaps)               # one row per claim: estimate, 95 % interval, Holm p, word
    plan = seed_plan(pilot_gaps)            # per claim: the pilot's sd and the seeds it needs
    quality = arm_quality(rows, "weak")     # per arm with a gap claim (C4, E1): its word, estimate, final or not
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from lrmoe.analysis import protocol
from lrmoe.analysis.stats import decide, holm, paired_test, seeds_needed

DELTA = 0.5  # percentage points: the smallest difference of interest
MARGIN = 1.0  # percent: the non-inferiority margin of "LRMoE's loss gap is at most 1 %"
EFFECT = 1.0  # percentage points: the true difference (or distance from the margin) the seed count is powered for
POWER = 0.8
MAX_SEEDS = protocol.MAX_SEEDS


@dataclass(frozen=True)
class Claim:
    """One claim of the family. Its per-seed quantity is gap(arm) - gap(versus), or gap(arm) when ``versus`` is
    None; ``kind`` and ``direction`` as in :func:`lrmoe.analysis.stats.paired_test`."""

    name: str
    text: str
    kind: str
    arm: str
    versus: str | None = None
    direction: int = -1

    @property
    def arms(self) -> tuple[str, ...]:
        return (self.arm,) if self.versus is None else (self.arm, self.versus)


def family(rho: float = protocol.CLAIM_RHO, rhos=(0.9, 0.75, 0.5)) -> list[Claim]:
    """The claims of one regime (docs/protocols/frontier.md §10.4), in the protocol's order."""
    m2, rnd = f"lrmoe-rho{rho:g}-unbiased", f"lrmoe-rho{rho:g}-random-unbiased"
    return [
        Claim("C1", f"m2 unbiased beats random 1/p selection at ρ {rho:g}", "superior", m2, rnd),
        Claim("C2", f"LRMoE m2 unbiased beats SYMI-dropless's random trim at ρ {rho:g}", "superior", m2,
              f"symi-dropless-rho{rho:g}"),
        Claim("C3", f"1/p reweighting alone changes random selection's loss at ρ {rho:g}", "two-sided", rnd,
              f"lrmoe-rho{rho:g}-random"),
        *[Claim(f"C4 ρ{r:g}", f"LRMoE m2 unbiased at ρ {r:g}: loss gap ≤ {MARGIN:g} %", "noninferior",
                f"lrmoe-rho{r:g}-unbiased") for r in rhos],
        Claim("C4 cap", f"LRMoE cap mode: loss gap ≤ {MARGIN:g} %", "noninferior", "lrmoe"),
    ]


def early_family(rho: float = protocol.CLAIM_RHO) -> list[Claim]:
    """Early selection's claims (docs/protocols/frontier.md §10.6): a family of their own, Holm-adjusted between
    themselves."""
    early, late = f"lrmoe-rho{rho:g}-early-unbiased", f"lrmoe-rho{rho:g}-unbiased"
    return [
        Claim("E1", f"LRMoE early selection (gate, unbiased) at ρ {rho:g}: loss gap ≤ {MARGIN:g} %", "noninferior",
              early),
        Claim("E2", f"early selection (gate) changes the loss against late selection (m2) at ρ {rho:g}",
              "two-sided", early, late),
    ]


def early_arms(rho: float = protocol.CLAIM_RHO) -> list[str]:
    """The arms early selection's family reads: the references, late selection (m2 unbiased) and the early arm. Its
    gap table is taken over its own whole seeds, so that the arm added later (docs/protocols/frontier.md §10.6) never
    removes a seed from the main family's table."""
    return [*protocol.REFERENCES, f"lrmoe-rho{rho:g}-unbiased", *protocol.EARLY_ARMS]


def family_gaps(rows, arms) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The gap tables of a regime's two families (docs/protocols/frontier.md §10.6), each over its own whole seeds: the
    main family's over ``arms`` less the early arms, and early selection's over :func:`early_arms` when every early arm
    is among ``arms`` (else None)."""
    main = gap_table(rows, [a for a in arms if a not in protocol.EARLY_ARMS])
    early = gap_table(rows, early_arms()) if set(protocol.EARLY_ARMS) <= set(arms) else None
    return main, early


def gap_table(rows, arms=None, references=protocol.REFERENCES) -> pd.DataFrame:
    """Seeds x arms: each arm's endpoint as % above the seed's reference (the mean of the ``references``' endpoints,
    docs/protocols/frontier.md §10.3). Only whole seeds: those with a finite endpoint for every one of ``arms``
    (default: every arm present in ``rows``)."""
    frame = pd.DataFrame(list(rows))
    if frame.empty:
        raise ValueError("no runs")
    wide = frame.pivot_table(index="seed", columns="arm", values="endpoint", aggfunc="last")
    if arms is not None:
        wide = wide.reindex(columns=list(arms))
    missing = [r for r in references if r not in wide.columns]
    if missing:
        raise ValueError(f"no run of the reference arm(s) {missing}")
    wide = wide.dropna()  # a seed counts once every arm has finished
    reference = wide[list(references)].mean(axis=1)
    return 100 * (wide.div(reference, axis=0) - 1)


def per_seed(gaps: pd.DataFrame, claim: Claim) -> np.ndarray | None:
    """The claim's per-seed quantity, or None when an arm it needs is not in ``gaps``."""
    if any(a not in gaps.columns for a in claim.arms):
        return None
    values = gaps[claim.arm] if claim.versus is None else gaps[claim.arm] - gaps[claim.versus]
    return values.to_numpy(dtype=float)


def claim_table(gaps: pd.DataFrame, claims: list[Claim] | None = None, alpha: float = 0.05,
                delta: float = DELTA) -> pd.DataFrame:
    """One row per claim: seeds, estimate (points or %), sd, two-sided 95 % interval, one-sided bounds, p,
    Holm-adjusted p over the claims that could be tested, and the decision word (claims whose arms have not run
    are listed as "not run", those with fewer than two whole seeds as "too few seeds", without a test)."""
    claims = family() if claims is None else claims
    tests, rows = {}, []
    for claim in claims:
        values = per_seed(gaps, claim)
        if values is not None and len(values) >= 2:
            tests[claim.name] = paired_test(values, claim.kind, direction=claim.direction, margin=MARGIN
                                            if claim.kind == "noninferior" else 0.0, alpha=alpha)
    adjusted = dict(zip(tests, holm([t.p for t in tests.values()]))) if tests else {}
    for claim in claims:
        row = {"claim": claim.name, "text": claim.text, "kind": claim.kind, "arm": claim.arm,
               "versus": claim.versus or "reference"}
        test = tests.get(claim.name)
        if test is None:
            ran = per_seed(gaps, claim) is not None
            rows.append({**row, "seeds": int(len(gaps)) if ran else 0,
                         "word": "too few seeds" if ran else "not run"})
            continue
        rows.append({**row, "seeds": test.n, "estimate": test.estimate, "sd": test.sd, "ci_low": test.ci_low,
                     "ci_high": test.ci_high, "bound_low": test.bound_low, "bound_high": test.bound_high,
                     "p": test.p, "p_holm": float(adjusted[claim.name]),
                     "word": decide(test, float(adjusted[claim.name]), delta)})
    return pd.DataFrame(rows)


def decide_regime(rows, regime: str | None = None) -> dict:
    """Both families of one regime decided from collected runs, as frontier.py reports them: ``gaps`` and
    ``claims`` (the main family, over its whole seeds), ``early_gaps`` and ``early_claims`` (docs/protocols/frontier.md
    §10.6; None without two whole seeds of the early arms). ``rows``: the protocol's collected runs; only the sweep's
    count (the pilot's never enter a claim), and only ``regime``'s when given. ValueError without two whole seeds."""
    rows = [r for r in rows if r.get("stage") == "sweep" and (regime is None or r.get("regime") == regime)]
    if not rows:
        raise ValueError(f"no sweep run{'' if regime is None else f' of regime {regime!r}'}")
    arms = [a for a in protocol.SWEEP_ARMS if any(r["arm"] == a for r in rows)]
    gaps, early = family_gaps(rows, arms)
    if len(gaps) < 2:
        raise ValueError(f"{len(gaps)} whole seed(s){'' if regime is None else f' of regime {regime!r}'}: a claim "
                         "needs two")
    early = early if early is not None and len(early) >= 2 else None
    return {"gaps": gaps, "claims": claim_table(gaps), "early_gaps": early,
            "early_claims": None if early is None else claim_table(early, early_family())}


def arm_quality(rows, regime: str, planned: int = protocol.SWEEP_SEEDS) -> dict[str, dict]:
    """Per arm whose own gap to the reference has a non-inferiority claim in ``regime`` (C4 at each ρ, C4 cap, E1):
    that claim's row of :func:`decide_regime` (claim, word, estimate, interval, bound, Holm p, seeds) and ``final``,
    whether its seeds reached the ``planned`` count (before that the word is interim, docs/protocols/frontier.md §10.5).
    The references (static EP, SYMI-dropless: the same maths) map to ``{"word": "reference"}``. Empty when the runs
    hold no two whole seeds of the regime."""
    try:
        decided = decide_regime(rows, regime)
    except ValueError:
        return {}
    tables = [decided["claims"]] + ([decided["early_claims"]] if decided["early_claims"] is not None else [])
    out = {ref: {"word": "reference"} for ref in protocol.REFERENCES}
    for table in tables:
        for row in table.to_dict("records"):
            # a claim that was not tested ("not run": its arm is missing) has no estimate (NaN in the table's row)
            if row["kind"] == "noninferior" and row["versus"] == "reference" and pd.notna(row.get("estimate")):
                out[row["arm"]] = {**row, "final": row["seeds"] >= planned}
    return out


def quality_text(quality: dict | None) -> str:
    """One arm's :func:`arm_quality` entry in words, e.g. ``C4 ρ0.75 undecided (+0.22 % [-0.64, +1.09], 16 seeds,
    final)``; None (no claim on this arm) reads as unmeasured."""
    if quality is None:
        return "no gap claim under the frontier protocol: unmeasured"
    if quality["word"] == "reference":
        return "the reference (dropless)"
    state = "final" if quality["final"] else "interim"
    return (f"{quality['claim']} {quality['word']} ({quality['estimate']:+.2f} % [{quality['ci_low']:+.2f}, "
            f"{quality['ci_high']:+.2f}], {quality['seeds']} seeds, {state})")


def seed_plan(pilot_gaps: pd.DataFrame, claims: list[Claim] | None = None, alpha: float | None = None,
              effect: float = EFFECT, target: float = POWER, max_seeds: int = MAX_SEEDS) -> pd.DataFrame:
    """The power calculation of docs/protocols/frontier.md §10.4: per claim, the pilot's sd of its per-seed quantity (a
    claim whose arms the pilot did not run takes the largest sd measured), and the seeds whose power reaches ``target``
    at ``alpha`` (default 0.05 ÷ the family's size, Holm's first step) for a true difference of ``effect`` points
    (non-inferiority: a true gap of margin - effect). ``capped``: the sweep's cap leaves the claim underpowered."""
    claims = family() if claims is None else claims
    alpha = 0.05 / len(claims) if alpha is None else alpha
    measured = {c.name: float(np.std(v, ddof=1)) for c in claims
                if (v := per_seed(pilot_gaps, c)) is not None and len(v) >= 2}
    if not measured:
        raise ValueError("the pilot measured no claim's per-seed quantity on two seeds or more")
    fallback = max(measured.values())
    rows = []
    for c in claims:
        sd = measured.get(c.name, fallback)
        needed = seeds_needed(sd, effect, c.kind, alpha=alpha, target=target)
        rows.append({"claim": c.name, "sd": sd, "sd_from": "pilot" if c.name in measured else "largest pilot sd",
                     "pilot_seeds": int(len(pilot_gaps)), "alpha": alpha, "effect": effect, "seeds_needed": needed,
                     "capped": needed > max_seeds})
    return pd.DataFrame(rows)


def interval(values, alpha: float = 0.05) -> dict:
    """Mean and two-sided (1 - alpha) t interval of independent values (NaN bounds for fewer than two)."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        mean = float(v.mean()) if len(v) else np.nan
        return {"mean": mean, "ci_low": np.nan, "ci_high": np.nan, "n": int(len(v))}
    t = paired_test(v, "two-sided", alpha=alpha)
    return {"mean": t.estimate, "ci_low": t.ci_low, "ci_high": t.ci_high, "n": t.n}


def arm_gaps(gaps: pd.DataFrame) -> pd.DataFrame:
    """Per arm: its mean gap to the reference (%) over the whole seeds, with the 95 % t interval (the frontier's
    y axis)."""
    return pd.DataFrame([{"arm": arm, **{f"gap_{k}": v for k, v in interval(gaps[arm]).items()}}
                         for arm in gaps.columns])


def time_ratios(times_ms: pd.DataFrame, reference: str = "symi-dropless") -> pd.DataFrame:
    """Per arm: modelled time ÷ ``reference``'s, taken trace seed by trace seed (``times_ms``: rows sim_seed,
    columns arms), mean and 95 % t interval over the trace seeds (the frontier's x axis)."""
    if reference not in times_ms.columns:
        raise ValueError(f"no simulated time of the reference {reference!r}")
    ratio = times_ms.div(times_ms[reference], axis=0)
    return pd.DataFrame([{"arm": arm, **{f"time_{k}": v for k, v in interval(ratio[arm]).items()}}
                         for arm in ratio.columns])


def time_claim(claims: pd.DataFrame, ratios: pd.DataFrame) -> list[dict]:
    """C5 of docs/protocols/frontier.md §10.4: LRMoE ÷ SYMI-dropless time at the deepest ρ whose non-inferiority holds,
    or at every ρ when none does (each row says which)."""
    ni = claims[claims.claim.str.startswith("C4 ρ")].copy()
    ni["rho"] = ni.claim.str.removeprefix("C4 ρ").astype(float)
    held = ni[ni.word == "holds"]
    chosen = held.nsmallest(1, "rho") if len(held) else ni
    by_arm = ratios.set_index("arm")
    rows = []
    for _, c in chosen.iterrows():
        if c.arm not in by_arm.index:
            continue
        t = by_arm.loc[c.arm]
        rows.append({"claim": "C5", "arm": c.arm, "rho": c.rho, "quality": c.word,
                     "basis": "deepest ρ whose gap ≤ 1 % holds" if len(held) else "no ρ holds: every ρ shown",
                     "time_vs_dropless": t.time_mean, "ci_low": t.time_ci_low, "ci_high": t.time_ci_high,
                     "trace_seeds": int(t.time_n)})
    return rows
