"""What docs/protocols/time_to_quality.md §11.6 Record 3 adds to the time-to-quality report: the family re-decided at
every micro-batch count of the cost model's band with each claim's break-even count, the r* flags, the selection's price
as a named sensitivity, and the replica-gradient mode. None of it changes a claim, a word or the six robustness checks.

    rows = with_micro_batches(rows)                  # band counts 2, 4, 16 derived where a row lacks them (affine)
    words, breakeven = micro_batch_check(rows, "weak")
    flags, counts = r_star_flags(rows, "weak")
    sens = selection_sensitivity(rows, "weak")       # only over the runs that carry the selection's scaled times
    text = amendments_text(rows, "weak")
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lrmoe.analysis import time_to_quality as tq
from lrmoe.analysis import tq_protocol as P
from lrmoe.analysis import tq_report as R

MICRO_BATCH_COUNTS = (1, 2, 4, 8, 16, 32)  # the band's every count (lrmoe.sim.replay.MICRO_BATCH_COUNTS)
SELECTION_SCALES = (0.5, 1.0, 2.0, 4.0)  # lrmoe.sim.replay.SELECTION_SCALES
DENSE = 0.5  # the dense part's central efficiency (lrmoe.sim.replay.DENSE_EFFICIENCY)
CURVE_RANGE = (0.85, 1.0)  # the budgets the dropless curve is measured at: r* outside is extrapolated
AFFINE_RTOL = 1e-9  # a derived count is trusted only when mb = 32 is predicted to this relative error
FLAG_ARMS = (*tq.ARMS, *P.CONTROLS)


def mb_key(mb: int) -> str:
    """The band corner of ``mb`` micro-batches at the other constants central."""
    return f"base|mb={mb}|dense={DENSE:g}"


def with_micro_batches(rows: list[dict]) -> tuple[list[dict], dict]:
    """``rows`` with every full-budget row's central corner at each count of :data:`MICRO_BATCH_COUNTS`: a count the
    row lacks (rows priced before Record 3 carry 1, 8 and 32) is derived from its mb = 1 and mb = 8 corners as
    t(mb) = a · mb + b, which is exact in the simulator (:mod:`lrmoe.sim.replay`: a corner reuses the simulated
    per-micro-batch phase times, the sync phases once and the rest and the dense part mb times). Each derivation
    is checked against the row's mb = 32 corner (relative error below :data:`AFFINE_RTOL`; ValueError otherwise).
    Returns (rows, {"derived": rows derived, "max_rel_err": the largest error at mb = 32})."""
    out, derived, worst = [], 0, 0.0
    for row in rows:
        corners = row.get("time_corners") or {}
        if all(mb_key(mb) in corners for mb in MICRO_BATCH_COUNTS) or any(mb_key(mb) not in corners
                                                                          for mb in (1, 8, 32)):
            out.append(row)
            continue
        t1, t8, t32 = (corners[mb_key(mb)] for mb in (1, 8, 32))
        a = (t8 - t1) / 7.0
        b = t1 - a
        err = abs(a * 32 + b - t32) / t32
        if not err < AFFINE_RTOL:
            raise ValueError(f"seed {row['seed']} {row['arm']}: mb = 32 is {t32:.6g} s, the line through mb = 1 "
                             f"and 8 says {a * 32 + b:.6g} s: its corners are not affine in the micro-batch count")
        worst = max(worst, err)
        derived += 1
        out.append({**row, "time_corners": {**corners, **{mb_key(mb): a * mb + b for mb in MICRO_BATCH_COUNTS
                                                           if mb_key(mb) not in corners}}})
    return out, {"derived": derived, "max_rel_err": worst}


def micro_batch_check(rows: list[dict], regime: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The family re-decided at each micro-batch count (the other constants central). Returns (claim x count ->
    "mean q (word)"; per claim the break-even count, the smallest whose mean q is below 0, or None)."""
    tables = {}
    for mb in MICRO_BATCH_COUNTS:
        mine = [r for r in rows if r["budget"] < 1.0 or mb_key(mb) in r.get("time_corners", {})]
        per_seed = tq.per_seed_table(*R.regime_frames(mine, regime, corner=mb_key(mb)))
        if not per_seed.empty:
            tables[mb] = tq.tq_table(per_seed).set_index("claim")
    if not tables:
        return pd.DataFrame(), pd.DataFrame()
    claims = [c.name for c in tq.tq_family()]
    cells = pd.DataFrame({f"mb={mb}": [cell(t, c) for c in claims] for mb, t in tables.items()}, index=claims)
    breakeven = [next((mb for mb, t in tables.items() if t.loc[c, "estimate"] < 0), None) for c in claims]
    return (cells.rename_axis("claim").reset_index(),
            pd.DataFrame({"claim": claims, "break-even mb": pd.Series(breakeven, dtype=object)}))


def cell(table: pd.DataFrame, claim: str) -> str:
    """"mean q (word)" of a claim in a decided family (the word alone where too few seeds)."""
    r = table.loc[claim]
    return r["word"] if pd.isna(r.get("estimate", np.nan)) else f"{r['estimate']:+.1f} ({r['word']})"


def r_star_flags(rows: list[dict], regime: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per seed and arm (the claims' and the controls'), r* as the protocol uses it, marked ``e`` when the line put
    it outside the measured budgets [0.85, 1] (extrapolated) and ``c`` when outside [0.70, 1.15] (clipped to that
    range); and per arm the seeds, and the extrapolated and clipped counts (a clipped r* is also extrapolated).
    Over the seeds of the per-seed table."""
    ends, times = R.regime_frames(rows, regime)
    seeds = set(tq.per_seed_table(ends, times)["seed"]) if not ends.empty else set()
    marks, counts = [], {arm: [0, 0, 0] for arm in FLAG_ARMS}
    for seed, g in ends[ends.seed.isin(seeds)].groupby("seed"):
        full = g[g.budget == 1.0].set_index("arm")["endpoint"]
        curve = g[(g.arm == "static-ep") & (g.budget < 1.0)].set_index("budget")["endpoint"]
        fit = tq.fit_curve([*curve.index, 1.0], [*curve.to_numpy(), np.mean([full[y] for y in tq.REFERENCES])])
        row = {"seed": seed}
        for arm in (a for a in FLAG_ARMS if a in full):
            raw = (np.log(full[arm]) - fit.a) / fit.b
            extrapolated = not CURVE_RANGE[0] <= raw <= CURVE_RANGE[1]
            clipped = not tq.R_RANGE[0] <= raw <= tq.R_RANGE[1]
            row[arm] = f"{tq.r_star(full[arm], fit):.3f}" + (" c" if clipped else " e" if extrapolated else "")
            counts[arm] = [counts[arm][0] + 1, counts[arm][1] + extrapolated, counts[arm][2] + clipped]
        marks.append(row)
    count = pd.DataFrame([{"arm": a, "seeds": n, "extrapolated": e, "clipped": c}
                          for a, (n, e, c) in counts.items() if n])
    return pd.DataFrame(marks), count


def selection_sensitivity(rows: list[dict], regime: str) -> tuple[pd.DataFrame, int]:
    """The family re-decided with the selection's modelled charge at each of :data:`SELECTION_SCALES` times its
    measured value (1 is the protocol), over the seeds whose full-budget runs all carry ``time_select``. Returns
    (claim x factor -> "mean q (word)", seeds); an empty table when no seed's runs carry it."""
    carry = [r for r in R.regime_rows(rows, regime) if r["budget"] < 1.0 or "time_select" in r]
    out, seeds = {}, 0
    for f in SELECTION_SCALES:
        key = f"select={f:g}"
        scaled = [{**r, "time_s": r["time_select"][key]} if r["budget"] == 1.0 else r for r in carry]
        per_seed = tq.per_seed_table(*R.regime_frames(scaled, regime))
        if per_seed.empty:
            return pd.DataFrame(), 0
        seeds = len(per_seed)
        table = tq.tq_table(per_seed).set_index("claim")
        out[f"x{f:g}"] = [cell(table, c.name) for c in tq.tq_family()]
    return pd.DataFrame(out, index=[c.name for c in tq.tq_family()]).rename_axis("claim").reset_index(), seeds


def replica_grad_modes(rows: list[dict], regime: str) -> pd.DataFrame:
    """Per arm, full-budget runs by the replica-gradient mode they trained in (``train_replica_grad``; rows collected
    before it was stored trained in train.py's default, ``range``: Record 3) and the mode their time is priced in
    (``replica_grad``: the faster of range and shard on the run's own routing)."""
    out = []
    for arm in R.FULL_ARMS:
        mine = [r for r in R.regime_rows(rows, regime) if r["arm"] == arm and r["budget"] == 1.0]
        if not mine:
            continue
        trained = pd.Series([r.get("train_replica_grad", "range") for r in mine]).value_counts()
        priced = pd.Series([r.get("replica_grad", "?") for r in mine]).value_counts()
        out.append({"arm": arm, "runs": len(mine), "trained in": ", ".join(f"{k} {v}" for k, v in trained.items()),
                    "priced in": ", ".join(f"{k} {v}" for k, v in priced.items())})
    return pd.DataFrame(out)


def amendments_text(rows: list[dict], regime: str, checks: pd.DataFrame | None = None) -> str:
    """Record 3's sections of one regime (Markdown). ``checks``: the regime's :func:`tq_report.robustness` table,
    whose check (6) word is shown beside the break-even counts (left out when not given)."""
    rows = R.regime_rows(rows, regime)
    lines = ["### Record 3's additions (reported; robustness is still the six checks above)", ""]
    try:
        full, derived = with_micro_batches(rows)
    except ValueError as exc:
        full, derived = None, str(exc)
    if full is None:
        lines += [f"Check (6) at every micro-batch count: not shown, {derived}. The counts 1, 8 and 32 are the "
                  f"registered corners above.", ""]
    else:
        words, breakeven = micro_batch_check(full, regime)
        if not words.empty:
            lf = checks.set_index("claim")[R.CHECKS[6]] if checks is not None and R.CHECKS[6] in checks else None
            if lf is not None:
                breakeven["(6) registered corner"] = breakeven["claim"].map(lf)
            how = ("every count priced by the simulator" if not derived["derived"] else
                   f"{derived['derived']} full-budget runs priced at 1, 8 and 32 micro-batches only: their 2, 4 and "
                   f"16 are derived as t(mb) = a · mb + b through their mb = 1 and 8 corners, exact in the simulator "
                   f"(a corner charges the sync phases once and every other phase and the dense part mb times); the "
                   f"line predicts each run's mb = 32 corner to {derived['max_rel_err']:.1e} relative")
            lines += [f"Check (6) at every micro-batch count of the band, the other constants central ({how}). "
                      f"Mean q (%) and the word at each count:", "", words.to_markdown(index=False), "",
                      "Break-even micro-batch count (the smallest whose mean q is below 0; none: not below 0 up to "
                      "32), beside the registered least-favourable corner's word:", "",
                      breakeven.fillna({"break-even mb": "none"}).to_markdown(index=False), ""]
    marks, counts = r_star_flags(rows, regime)
    if not marks.empty:
        marked = marks.set_index("seed").T.to_markdown(disable_numparse=True)  # "0.890", not 0.89
        lines += ["r* per seed and arm (e: extrapolated, outside the measured budgets [0.85, 1]; c: clipped to "
                  "[0.70, 1.15], and extrapolated):", "", marked, "",
                  counts.to_markdown(index=False), ""]
    sens, seeds = selection_sensitivity(rows, regime)
    if sens.empty:
        lines += ["The selection's price: no seed's runs carry the selection's scaled times (`time_select`, stored "
                  "since Record 3). They cannot be derived exactly from an older row: the selection is charged "
                  "inside the recalibrate phase, per rank with the compaction passes and the slowest rank's sum "
                  "taken, and whether a plan selects at a step depends on its routing, which the row does not "
                  "hold; so the sensitivity is reported for the runs that carry it.", ""]
    else:
        lines += [f"The selection's price (a named sensitivity, not a robustness check; {seeds} seeds whose runs "
                  f"carry it): mean q (%) and word with the selection's modelled charge at 0.5, 1, 2 and 4 × its "
                  f"measured value (x1 is the protocol):", "", sens.to_markdown(index=False), ""]
    modes = replica_grad_modes(rows, regime)
    if not modes.empty:
        lines += ["Replica-gradient mode (§3.4; range and shard are the same maths): the mode each full-budget run "
                  "trained in (rows without it: train.py's default, range) and the mode its time is priced in (the "
                  "faster of the two on its own routing):", "", modes.to_markdown(index=False), ""]
    return "\n".join(lines)
