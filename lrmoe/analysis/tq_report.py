"""The time-to-quality protocol's report over collected runs (docs/protocols/time_to_quality.md §11.3-11.5): per regime
the per-seed table, the family of eight claims with its words, the six robustness checks of §11.4, power after the fact,
the controls, and the time axis from the runs' own routing beside a Zipf matched on static EP's slowest rank.

    frames = regime_frames(rows, "weak")            # endpoints (seed, arm, budget) and times (seed, arm)
    table = tq_table(per_seed_table(*frames))       # lrmoe.analysis.time_to_quality
    checks = robustness(rows, "weak")               # claim x check -> word
    text = regime_report(rows, "weak", planned_seeds=4)
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from lrmoe.analysis import time_to_quality as tq
from lrmoe.analysis import tq_protocol as P
from lrmoe.analysis.robustness import sign_flip_p, wilcoxon_p
from lrmoe.analysis.stats import decide, holm, paired_test, power, seeds_needed

REGISTERED_MB = (8, 1, 32)  # check (6)'s micro-batch counts: the protocol's central 8 and the band's ends (§5.3)
CHECKS = ("protocol", "(1) last evaluation alone", "(2) reference SYMI-dropless alone", "(3) r* interpolated",
          "(4) sign-flip test", "(5) Wilcoxon test", "(6) least favourable band corner")
TRUE_Q = -5.0  # the power calculation's true q, % (docs/protocols/time_to_quality.md §11.5)
FULL_ARMS = ("static-ep", "symi-dropless", *P.LRMOE_ARMS, *P.CONTROLS)


def regime_rows(rows: list[dict], regime: str, stage: str | None = None) -> list[dict]:
    return [r for r in rows if r["regime"] == regime and r["stage"] != "model-pilot"
            and (stage is None or r["stage"] == stage)]


def regime_frames(rows: list[dict], regime: str, endpoint: str = "protocol",
                  corner: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(endpoints: seed, arm, budget, endpoint; times: seed, arm, time) of a regime's collected runs. ``endpoint``
    "last": the last evaluation alone (check 1); ``corner``: the times at that corner of the constants band."""
    mine = regime_rows(rows, regime)
    ends = [{"seed": r["seed"], "arm": r["arm"], "budget": r["budget"],
             "endpoint": r["val_loss"][-1] if endpoint == "last" else r["endpoint"]} for r in mine]
    times = [{"seed": r["seed"], "arm": r["arm"], "time": r["time_s"] if corner is None else r["time_corners"][corner]}
             for r in mine if r["budget"] == 1.0 and "time_s" in r]
    return (pd.DataFrame(ends, columns=["seed", "arm", "budget", "endpoint"]),
            pd.DataFrame(times, columns=["seed", "arm", "time"]))


def with_p(table: pd.DataFrame, per_seed: pd.DataFrame, p_of, delta: float = tq.DELTA) -> pd.DataFrame:
    """``table`` (:func:`tq.tq_table`) with each claim's p from ``p_of(values)`` instead of the t test's, Holm
    again over the family and the words again (the interval stays the t interval)."""
    out = table.copy()
    tested = out["seeds"].notna() if "seeds" in out else pd.Series(False, index=out.index)
    if not tested.any():
        return out
    cols = {c.name: c.column for c in tq.tq_family()}
    ps = [p_of(per_seed[cols[name]].to_numpy(dtype=float)) for name in out.loc[tested, "claim"]]
    out.loc[tested, "p"] = ps
    out.loc[tested, "p_holm"] = holm(ps)
    words = []
    for name, p_adj in zip(out.loc[tested, "claim"], out.loc[tested, "p_holm"]):
        test = paired_test(per_seed[cols[name]].to_numpy(dtype=float), "superior", -1)
        words.append(decide(test, float(p_adj), delta))
    out.loc[tested, "word"] = words
    return out


def sign_flip(values) -> float:
    """The sign-flip permutation p (mean < 0): exact up to 20 seeds, else 200,000 random sign patterns (fixed
    stream)."""
    d = np.asarray(values, dtype=float)
    if len(d) <= 20:
        return sign_flip_p(d, "superior", -1)
    signs = np.random.default_rng(0).choice((-1.0, 1.0), size=(200_000, len(d)))
    return float(np.mean(signs @ np.abs(d) / len(d) <= d.mean() + 1e-12 * max(1.0, np.abs(d).max())))


def corner_mb(key: str) -> int | None:
    """The micro-batch count of a band corner's key (``"...|mb=<k>|..."``), None for a key without one."""
    part = next((p for p in key.split("|") if p.startswith("mb=")), None)
    return None if part is None else int(part[3:])


def least_favourable(rows: list[dict], regime: str) -> pd.DataFrame:
    """Check (6): each claim's per-seed q at the band corner whose mean q is the largest (least favourable to X).
    The corners are the registered ones: the band's micro-batch ends and the central count (:data:`REGISTERED_MB`);
    the counts between them that rows priced since Record 3 carry are its own section (:func:`micro_batch_check`)."""
    full = [r for r in regime_rows(rows, regime) if r["budget"] == 1.0 and "time_corners" in r]
    keys = sorted(set.intersection(*(set(r["time_corners"]) for r in full))) if full else []
    keys = [k for k in keys if corner_mb(k) in (None, *REGISTERED_MB)]
    tables = {k: tq.per_seed_table(*regime_frames(rows, regime, corner=k)) for k in keys}
    base = tq.per_seed_table(*regime_frames(rows, regime))
    if base.empty or not tables:
        return base
    out = base[["seed"] + [c for c in base.columns if c.startswith("r_star/")]].copy()
    for c in tq.tq_family():
        worst = max(keys, key=lambda k: tables[k][c.column].mean())
        out[c.column] = tables[worst][c.column].to_numpy()
    return out


def robustness(rows: list[dict], regime: str) -> pd.DataFrame:
    """Claim x check -> word (docs/protocols/time_to_quality.md §11.4's six checks, each re-deciding the whole family),
    with "robust"."""
    base = tq.per_seed_table(*regime_frames(rows, regime))
    tables = {"protocol": tq.tq_table(base)}
    if base.empty:
        return pd.DataFrame()
    last = tq.per_seed_table(*regime_frames(rows, regime, endpoint="last"))
    tables[CHECKS[1]] = tq.tq_table(last)
    ends, times = regime_frames(rows, regime)
    symi = ends[(ends.arm == "symi-dropless") & (ends.budget == 1.0)].set_index("seed")["endpoint"]
    alone = ends.copy()
    at_ref = (alone.arm == "static-ep") & (alone.budget == 1.0)
    alone.loc[at_ref, "endpoint"] = alone.loc[at_ref, "seed"].map(symi).to_numpy()  # the mean of two equals SYMI's
    tables[CHECKS[2]] = tq.tq_table(tq.per_seed_table(alone, times))
    tables[CHECKS[3]] = tq.tq_table(tq.per_seed_table(ends, times, interpolate=True))
    tables[CHECKS[4]] = with_p(tables["protocol"], base, sign_flip)
    tables[CHECKS[5]] = with_p(tables["protocol"], base, lambda d: wilcoxon_p(d, "superior", -1))
    tables[CHECKS[6]] = tq.tq_table(least_favourable(rows, regime))
    out = pd.DataFrame({name: t.set_index("claim")["word"] for name, t in tables.items() if not t.empty})
    out["robust"] = (out == "holds").all(axis=1)
    return out.reset_index()


def power_after(table: pd.DataFrame, alpha: float = 0.05) -> pd.DataFrame:
    """Per claim: its per-seed sd, the power its seeds had for a true q of −5 % at α ÷ 8 (Holm's first step), and
    the seeds that power 0.8 would need (docs/protocols/time_to_quality.md §11.5; capped at 32)."""
    out = []
    for r in table.to_dict("records"):
        if not r.get("seeds") or not r.get("sd", 0) > 0:
            continue
        n = int(r["seeds"])
        try:
            need = seeds_needed(r["sd"], -TRUE_Q, "superior", alpha / 8)
        except ValueError:
            need = float("nan")
        out.append({"claim": r["claim"], "seeds": n, "sd": r["sd"],
                    "power": float(power(n, r["sd"], -TRUE_Q, "superior", alpha / 8)), "seeds_for_0.8": need,
                    "capped": need > P.MAX_SEEDS if need == need else True})
    return pd.DataFrame(out)


def controls(rows: list[dict], regime: str) -> pd.DataFrame:
    """The controls beside the claims (not tested): per control, mean over seeds of its r*, q against each dropless
    system, and its loss gap to the reference (%, the mean of static EP's and SYMI-dropless's endpoints)."""
    ends, times = regime_frames(rows, regime)
    out = []
    for arm in P.CONTROLS:
        per = []
        for seed, g in ends.groupby("seed"):
            full = g[g.budget == 1.0].set_index("arm")["endpoint"]
            curve = g[(g.arm == "static-ep") & (g.budget < 1.0)].set_index("budget")["endpoint"]
            t = times[times.seed == seed].set_index("arm")["time"]
            if arm not in full or arm not in t or not set(tq.REFERENCES) <= set(full.index) or len(curve) < 3:
                continue
            ref = float(np.mean([full[y] for y in tq.REFERENCES]))
            r = tq.r_star(full[arm], tq.fit_curve([*curve.index, 1.0], [*curve.to_numpy(), ref]))
            per.append({"r_star": r, "gap_pct": 100 * (full[arm] / ref - 1),
                        **{f"q/{y}": tq.time_to_quality(t[arm], t[y], r) for y in tq.REFERENCES}})
        if per:
            out.append({"arm": arm, "seeds": len(per), **pd.DataFrame(per).mean().to_dict()})
    return pd.DataFrame(out)


def own_ratios(rows: list[dict], regime: str) -> pd.DataFrame:
    """Each full-budget arm's modelled time ÷ static EP's and ÷ SYMI-dropless's, seed by seed, from the runs' own
    routing: mean and 95 % t interval over seeds (one value per seed: no interval with one)."""
    _, times = regime_frames(rows, regime)
    wide = times.pivot(index="seed", columns="arm", values="time")
    out = []
    for arm in [a for a in FULL_ARMS if a in wide]:
        rec = {"arm": arm}
        for y in ("static-ep", "symi-dropless"):
            if y not in wide:
                continue
            x = (wide[arm] / wide[y]).dropna().to_numpy()
            rec[f"/{y}"] = float(x.mean()) if len(x) else float("nan")
            if len(x) >= 2:
                t = paired_test(x - 1.0, "two-sided")
                rec[f"/{y} ci"] = f"[{1 + t.ci_low:.3f}, {1 + t.ci_high:.3f}]"
        out.append(rec)
    return pd.DataFrame(out)


def runs_shape(rows: list[dict], regime: str) -> dict:
    """The mean routing-shape statistics of a regime's full-budget static-EP runs' own traces."""
    mine = [r["shape"] for r in regime_rows(rows, regime) if r["arm"] == "static-ep" and r["budget"] == 1.0]
    if not mine:
        raise ValueError(f"no full-budget static-EP run of regime {regime!r}")
    return {k: float(np.mean([m[k] for m in mine])) for k in mine[0]} | {"runs": len(mine)}


def zipf_matched(rows: list[dict], regime: str, trace_seeds: int = 5, steps: int = 4, layers: int = 8,
                 arms=FULL_ARMS) -> tuple[dict, pd.DataFrame]:
    """§10's time axis for comparison: the Zipf s whose synthetic trace at paper scale gives static EP the runs'
    slowest rank ÷ mean, and each arm's time ÷ static EP's and ÷ SYMI-dropless's on ``trace_seeds`` such traces
    (``steps`` priced, ``layers`` simulated), priced as the runs are (:func:`tq_protocol.price`, central
    constants). Returns ({zipf_s, the synthetic traces' shape statistics}, ratio table)."""
    from lrmoe.analysis.skew import match_zipf, protocol_scale
    from lrmoe.traces.synthetic import generate_trace

    target = runs_shape(rows, regime)["rank_max_over_mean"]
    scale = protocol_scale()
    match = match_zipf(target, scale)
    times, shapes = {}, []
    for seed in range(trace_seeds):
        trace = generate_trace(steps + 2, layers, scale.num_ranks, scale.num_experts, scale.top_k,
                               scale.tokens_per_rank, skew="zipf", skew_param=match.zipf_s, seed=seed)
        trace.meta |= {"top_k": scale.top_k, "tokens_per_rank": scale.tokens_per_rank, "micro_batches": 1}
        shapes.append(P.shape_stats(trace, warmup=2))
        at = {}
        for arm in arms:
            run = P.TQRun("zipf", regime, seed, arm, 1.0)
            at[arm] = P.price(trace, run, band=False, warmup_steps=2).time_s
        times[seed] = at
    wide = pd.DataFrame.from_dict(times, orient="index")
    out = []
    for arm in arms:
        rec = {"arm": arm}
        for y in ("static-ep", "symi-dropless"):
            x = (wide[arm] / wide[y]).to_numpy()
            t = paired_test(x - 1.0, "two-sided")
            rec[f"/{y}"] = float(x.mean())
            rec[f"/{y} ci"] = f"[{1 + t.ci_low:.3f}, {1 + t.ci_high:.3f}]"
        out.append(rec)
    shape = {k: float(np.mean([s[k] for s in shapes])) for k in shapes[0]}
    return {"zipf_s": match.zipf_s, **shape}, pd.DataFrame(out)


def time_axis_text(rows: list[dict], regime: str, **zipf_kw) -> str:
    """The time ratios from the runs' own traces beside the Zipf-matched ones, with both sides' shape statistics."""
    runs = runs_shape(rows, regime)
    matched, zipf = zipf_matched(rows, regime, **zipf_kw)
    shape = pd.DataFrame([{"statistic": k, "runs' own traces": runs[k], "Zipf-matched": matched[k],
                           "matched": k == "rank_max_over_mean"} for k in ("rank_max_over_mean", "gini",
                                                                            "expert_max_over_mean")])
    own = own_ratios(rows, regime).rename(columns=lambda c: c if c == "arm" else f"own {c}")
    both = own.merge(zipf.rename(columns=lambda c: c if c == "arm" else f"zipf {c}"), on="arm", how="outer")
    return "\n".join([
        f"Routing shape (static EP, paper scale; {runs['runs']} runs' own traces after the warm-up, against Zipf s "
        f"{matched['zipf_s']:.3f} matched on slowest rank ÷ mean):", "", shape.to_markdown(index=False, floatfmt=".3f"),
        "", "Modelled iteration time (MoE layers + dense part) ÷ static EP and ÷ SYMI-dropless: the runs' own "
            "routing (mean, 95 % interval over seeds) beside the Zipf-matched traces (over trace seeds):", "",
        both.to_markdown(index=False, floatfmt=".3f"), ""])


def regime_report(rows: list[dict], regime: str, planned_seeds: int, stage: str) -> str:
    """One regime's section (Markdown): the per-seed table, the claims (interim below the planned seeds), the
    robustness checks, power after the fact, the controls, and what docs/protocols/time_to_quality.md §11.6 Record 3
    adds (:mod:`lrmoe.analysis.tq_amendments`)."""
    mine = regime_rows(rows, regime, stage)
    lines = [f"## Regime {regime} ({stage}): {len(mine)} collected runs", ""]
    per_seed = tq.per_seed_table(*regime_frames(mine, regime))
    if per_seed.empty:
        return "\n".join([*lines, "No whole seed yet (every run of a seed, each full-budget one priced).", ""])
    table = tq.tq_table(per_seed)
    if len(per_seed) < planned_seeds:
        label = f"interim, {len(per_seed)} of {planned_seeds} seeds"
    elif stage != "sweep":  # the variance pilot estimates the sds; only the sweep decides (§11.5)
        label = f"{stage}, not confirmatory: the words describe these seeds and decide nothing"
    else:
        label = "final"
    lines += ["Per seed: r* and q (%):", "", per_seed.set_index("seed").T.to_markdown(floatfmt=".3f"), "",
              f"Claims ({label}; Holm over the eight, δ = {tq.DELTA:g} %):", "",
              table.to_markdown(index=False, floatfmt=".4g"), ""]
    checks = robustness(mine, regime) if len(per_seed) >= 2 else None
    if checks is not None:
        lines += ["Robustness (each check re-decides the family):", "",
                  checks.to_markdown(index=False), "",
                  f"Power after the fact (true q {TRUE_Q:g} %, α 0.05 ÷ 8):", "",
                  power_after(table).to_markdown(index=False, floatfmt=".3f"), ""]
    ctrl = controls(mine, regime)
    if not ctrl.empty:
        lines += ["Controls (reported, not tested):", "", ctrl.to_markdown(index=False, floatfmt=".3f"), ""]
    from lrmoe.analysis.tq_amendments import amendments_text  # it builds on this module

    lines.append(amendments_text(mine, regime, checks))
    return "\n".join(lines)
