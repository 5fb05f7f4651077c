"""The simulator's validation run (``experiments/validate_sim.py``): the CPU calibration it prices with, the per-phase
comparison of the cost model with a measured ``layer_bench.py`` run (its logged tables and printed report), and the
measured points of the frontier protocol (per regime: the ratio table, the phase groups and the Markdown report). The
statistics themselves are :mod:`lrmoe.harness.sim_validation`."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lrmoe.bytemodel.layout import PHASES as LAYER_PHASES
from lrmoe.harness.calibrate_cpu import CLOCKS, calibrate, spec_for_bench, write_calibration
from lrmoe.harness.sim_validation import (COVERED, EXCLUDED, PHASE_GROUPS, REFERENCE, SPANS, bench_shapes,
                                          check_replay, compare, in_order, measured_phase_ms, phase_group_ms,
                                          phase_table, plan_facts, predict, ratio_table, relative_error, replay_plans)
from lrmoe.sim.cost import PHASES as MODEL_PHASES

TARGET = 0.20  # median |error|: target 4 of DESIGN.md §5.8


def calibration_file(calibration: str | None, config: dict, path: Path, *, quick: bool, seed: int,
                     overwrite: bool) -> tuple[Path, dict]:
    """The CPU calibration for the bench of ``config``: the file ``calibration`` when given, else measured on as many
    ranks as the bench had, at its shapes, and written to ``path`` (with its provenance)."""
    if calibration:
        path = Path(calibration)
        if not path.is_file():
            raise ValueError(f"--calibration {str(path)!r} is not a file")
        return path, json.loads(path.read_text())
    model, n, base, _ = bench_shapes(config)
    spec = spec_for_bench(n, model.hidden, model.expert_ffn, model.num_experts, model.top_k,
                          int(config["tokens_per_rank"]), base + int(config["spare_slots"]), config["dtype"],
                          quick=quick, seed=seed)
    t0 = time.time()
    data = calibrate(spec)
    data["provenance"]["seconds"] = round(time.time() - t0, 1)
    data["provenance"]["for_bench"] = {k: config[k] for k in ("model", "hidden", "ffn", "tokens_per_rank", "dtype",
                                                              "world_size")}
    write_calibration(data, path, overwrite=overwrite)
    return path, data


def fmt(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    return df.to_markdown(index=False, floatfmt=floatfmt)


def constants_table(cal: dict) -> pd.DataFrame:
    """The calibrated constants of each clock, in readable units, with the fits' median relative errors."""
    import pandas as pd

    from lrmoe.harness.calibrate_cpu import CLOCKS

    rows = []
    for clock in CLOCKS:
        c = cal.get("clocks", {}).get(clock, cal if clock == cal.get("clock", "cpu") else None)
        if c is None:
            continue
        fits = c.get("fits", {})
        rows.append({"clock": clock, "GEMM GFLOP/s": c["peak_flops"] / 1e9, "m_half rows": c["gemm"]["m_half"],
                     "launch us": c["gemm"]["launch_s"] * 1e6, "a2a latency us": c["a2a_latency"] * 1e6,
                     "a2a GB/s": c["a2a_bw"] / 1e9, "mem copy GB/s": c["mem_bw"] / 1e9,
                     "GEMM fit err": fits.get("gemm", {}).get("median_rel_error", float("nan")),
                     "GEMM fwd err": fits.get("gemm", {}).get("median_rel_error_fwd", float("nan")),
                     "GEMM bwd err": fits.get("gemm", {}).get("median_rel_error_bwd", float("nan")),
                     "a2a fit err": fits.get("a2a", {}).get("median_rel_error", float("nan"))})
        sized = [m for m in c.get("measurements", {}).get("a2a", []) if m["bytes_sent"] > 0 and "p2p_seconds" in m]
        if sized:  # the diagnostic: the layer's point-to-point exchange against the all-to-all, same bytes
            rows[-1]["a2a ms (median)"] = statistics.median(m["seconds"] for m in sized) * 1e3
            rows[-1]["p2p ms (median, not used)"] = statistics.median(m["p2p_seconds"] for m in sized) * 1e3
    return pd.DataFrame(rows)


# -- one measured bench: the prediction error per phase -----------------------------------------------------------
@dataclass
class PhaseValidation:
    """The cost model's per-phase predictions for a bench's replayed plans against its measured phase times."""
    mismatches: pd.DataFrame  # counted quantities where the replayed plans differ from the bench's
    clocks: list[str]
    cells: pd.DataFrame  # one row per (clock, trace, policy, phase)
    table: pd.DataFrame  # per covered phase, on the primary clock
    med: dict[str, float]  # median |error| over the cells, per clock
    med_slowest: dict[str, float]  # the same against the literal slowest rank of every phase
    totals: pd.DataFrame  # the covered phases' sums per (clock, trace, policy)
    consts: pd.DataFrame  # the calibration's constants

    @property
    def primary(self) -> str:
        return self.clocks[0]

    @property
    def mine(self) -> pd.DataFrame:
        return self.cells[self.cells["clock"] == self.primary]


def phase_validation(config: dict, raw: pd.DataFrame, cal_path: Path, cal: dict) -> PhaseValidation:
    """Replay the bench's plans, predict every covered phase on each calibrated clock and compare."""
    replay = replay_plans(config)
    mismatches = check_replay(raw, replay, config)
    clocks = [c for c in CLOCKS if c in cal.get("clocks", {})] or [cal.get("clock", "cpu")]
    primary = clocks[0]
    cells = pd.concat([compare(predict(replay, config, cal_path, c if "clocks" in cal else None).assign(clock=c),
                               measured_phase_ms(raw, c)) for c in clocks], ignore_index=True)
    table = phase_table(cells, primary)
    med = {c: float(cells.loc[cells["clock"] == c, "error"].abs().median()) for c in clocks}
    med_slowest = {c: float(cells.loc[cells["clock"] == c, "error_step_slowest"].abs().median()) for c in clocks}
    totals = cells.groupby(["clock", "trace", "policy"], sort=False)[["predicted_ms", "measured_ms"]].sum()
    totals = totals.reset_index()
    totals["error"] = relative_error(totals["predicted_ms"], totals["measured_ms"])
    return PhaseValidation(mismatches, clocks, cells, table, med, med_slowest, totals, constants_table(cal))


def log_phase_validation(run, v: PhaseValidation, config: dict, bench: Path, cal_path: Path) -> None:
    """The validation's tables and summary, into the run's results file."""
    model, n, _, _ = bench_shapes(config)
    primary = v.primary
    run.log_table("calibration", v.consts, calibration_file=str(cal_path))
    run.log_table("replay_mismatch", v.mismatches)
    run.log_table("cell", v.cells)
    run.log_table("covered_total", v.totals)
    run.log_table("phase", v.table, clock=primary)
    for phase, why in EXCLUDED.items():
        run.log({"table": "excluded", "phase": phase, "reason": why})
    run.log_summary({"clock": primary, "median_abs_error": v.med[primary],
                     "median_abs_error_by_clock": v.med, "median_abs_error_slowest_rank_by_clock": v.med_slowest,
                     "target": TARGET, "target_met": v.med[primary] <= TARGET,
                     "replay_mismatches": len(v.mismatches), "cells": len(v.mine), "bench": str(bench),
                     "calibration": str(cal_path),
                     "bench_shape": {"ranks": n, "model": model.name, "hidden": model.hidden,
                                     "ffn": model.expert_ffn, "tokens_per_rank": config["tokens_per_rank"]}})


def print_phase_report(v: PhaseValidation, raw: pd.DataFrame, cal_path: Path, cal: dict, out: Path,
                       figure: Path) -> None:
    """The calibration, the replay's check, the excluded phases, the covered totals and the error per phase."""
    consts, mismatches, cells, totals = v.consts, v.mismatches, v.cells, v.totals
    med, med_slowest = v.med, v.med_slowest
    prov = cal.get("provenance", {})
    print(f"\nCPU calibration: {cal_path} ({prov.get('date', '?')}, {prov.get('device', '?')}, torch "
          f"{prov.get('torch', '?')}); fit errors are median relative errors over the micro-benchmark sizes")
    print(fmt(consts, ".3g"))
    print("(a2a / p2p ms: medians over the micro-benchmark's packet sizes of the layer's all-to-all and of its "
          "point-to-point exchange; the cost model charges gradient collection and redistribution, which run as "
          "point-to-point exchanges, as all-to-alls)")
    if len(mismatches):
        print(f"\nReplay: {len(mismatches)} counted quantities differ from the replayed plans (first ones below); "
              f"the predictions are for plans the benchmark did not run.")
        print(fmt(mismatches.head(10)))
    else:
        print(f"\nReplay: the replayed plans reproduce every pair and byte the benchmark counted "
              f"({raw.shape[0]} rank-steps).")
    print("\nExcluded phases (not covered by the cost model, or not timed by the layer):")
    for phase, why in EXCLUDED.items():
        print(f"* {phase}: {why}")
    print("\nSum of the covered phases per (trace, policy), medians over steps:")
    print(fmt(totals))
    steps = int(cells["steps"].max())
    for c in v.clocks:
        print(f"\nMedian |error| over the {int((cells['clock'] == c).sum())} (trace, policy, phase) cells, {c} "
              f"clock: {med[c]:.1%} (target <= {TARGET:.0%}: {'met' if med[c] <= TARGET else 'not met'}); against "
              f"the literal slowest rank of every phase: {med_slowest[c]:.1%}.")
    print(f"Times are medians over {steps} noisy steps on a shared CPU. results: {out}; figure: {figure}")
    print(f"\nPrediction error per covered phase, {v.primary} clock (medians over "
          f"{v.mine.groupby(['trace', 'policy']).ngroups} trace x policy cells):")
    print(fmt(v.table))


# -- the measured points of the frontier protocol -----------------------------------------------------------------
def regime_point(config: dict, raw: pd.DataFrame, calibration: Path, cal: dict) -> tuple[pd.DataFrame, dict]:
    """One regime's measured point: the replayed plans (checked against what the bench counted), the cost model's
    prediction of every phase for them on the CPU calibration, the ratio table with the plans' facts, and the
    per-phase error of the covered phases (CPU clock). SystemExit when the replay is not the run."""
    replay = replay_plans(config)
    mismatches = check_replay(raw, replay, config)
    if len(mismatches):
        raise SystemExit(f"validate_sim.py: error: the replayed plans of regime {config['regime']} differ from the "
                         f"bench's in {len(mismatches)} counted quantities:\n{fmt(mismatches.head(5))}")
    clock = "cpu" if "clocks" in cal else None
    predicted = predict(replay, config, calibration, clock, phases=MODEL_PHASES)
    measured = measured_phase_ms(raw, "cpu", phases=LAYER_PHASES)
    table = ratio_table(predicted, measured).merge(plan_facts(raw), on=["trace", "policy"], how="left")
    table = in_order(table, config["policies"], "span", SPANS)
    groups = in_order(phase_group_ms(predicted, measured), config["policies"], "group", PHASE_GROUPS)
    groups = groups.assign(regime=config["regime"])
    cells = compare(predicted[predicted["phase"].isin(COVERED)], measured[measured["phase"].isin(COVERED)])
    match = config["regime_match"]
    info = {"regime": config["regime"], "zipf_s": match["zipf_s"], "runs": match["runs"], "trace": match["trace"],
            "spare_slots": config["spare_slots"], "eps": config["eps"], "gamma": config["gamma"],
            "rhos": match["rhos"], "steps": int(config["steps"]), "rank_steps": len(raw),
            "covered_median_abs_error": float(cells["error"].abs().median())}
    return table.assign(regime=config["regime"]), groups, info


def regime_report(table: pd.DataFrame, groups: pd.DataFrame, infos: dict, cal_path: Path, config: dict,
                  figure: str, descriptions: dict[str, str]) -> str:
    """The Markdown report of the measured points: per regime (``descriptions``: each one's line of the protocol),
    its settings, the layer's ratios measured beside modelled, and where the time goes."""
    model, n, base, _ = bench_shapes(config)
    lines = [f"# Measured points of the frontier protocol: the real layer on {n} gloo ranks (CPU)", "",
             f"![measured vs modelled]({figure})", "",
             f"The layer of `experiments/layer_bench.py --regime R` ({model.name}, E = {model.num_experts}, "
             f"k = {model.top_k}, D = {model.hidden}, F = {model.expert_ffn}, {config['tokens_per_rank']} tokens per "
             f"rank, {config['dtype']}), every arm of the regime in turn inside each step on the same tokens; the "
             f"cost model priced with this machine's CPU calibration (`{cal_path.name}`) on the same plans (replayed "
             "and checked against every pair and byte the bench counted). Times are CPU times of a 2-core machine "
             "shared with other work: ratios, never GPU results.", "",
             "Statistic: per step, the slowest rank's CPU time summed over the layer's forward and backward phases "
             "(the bench's headline), median over steps, ÷ SYMI-dropless's; the model's the same on its predicted "
             "per-rank phase times. `q25`–`q75`: quartiles of the per-step measured ratio. `stragglers`: the "
             "simulator's statistic (the sum over phases of each phase's slowest rank) of the model. `difference`: "
             "modelled − measured ratio.", ""]
    for regime, info in infos.items():
        df = table[table["regime"] == regime]
        runs, trace = info["runs"], info["trace"]
        lines += [f"## Regime {regime}", "",
                  f"{descriptions[regime]}. Settings: {info['spare_slots']} spare slot(s) per rank beside "
                  f"{base} home slots, ε {info['eps']:g}, γ {info['gamma']:g}, ρ ∈ {info['rhos']}; Zipf s "
                  f"{info['zipf_s']:.4f}, matched to the runs' static-EP slowest rank ÷ mean "
                  f"{runs['rank_max_over_mean']:.3f} ({runs['runs']} runs) at the bench's own trace: the replayed "
                  f"trace has {trace['rank_max_over_mean']:.3f} "
                  f"(per-expert Gini {trace['gini']:.3f} against the runs' {runs['gini']:.3f}; hottest ÷ mean "
                  f"{trace['expert_max_over_mean']:.2f} against {runs['expert_max_over_mean']:.2f}, not matched). "
                  f"{info['steps']} measured steps per arm. Median |error| of the model over the covered phases' "
                  f"cells: {info['covered_median_abs_error']:.1%}.", ""]
        layer = df[df["span"] == "layer"]
        cols = ["policy", "slots_per_rank", "retained_pct", "measured_ms", "measured_ratio", "measured_ratio_q25",
                "measured_ratio_q75", "modelled_ratio", "difference", "stragglers_ratio"]
        lines += ["Layer (forward + backward), slowest rank:", "", fmt(layer[cols]), ""]
        wide = df.pivot_table(index="policy", columns="span", values=["measured_ratio", "modelled_ratio"],
                              sort=False)
        wide.columns = [f"{span} {side.replace('_ratio', '')}" for side, span in wide.columns]
        order = [f"{span} {side}" for span in ("covered", "iteration") for side in ("measured", "modelled")]
        lines += ["The covered phases only (both sides the same phases) and the iteration (with the optimizer "
                  "step), ÷ SYMI-dropless's:", "", wide[order].reset_index().to_markdown(index=False, floatfmt=".3f"),
                  ""]
        g = groups[groups["regime"] == regime]
        cells = g.assign(ms=[f"{a:.2f} / {b:.2f}" for a, b in zip(g["measured_ms"], g["modelled_ms"])])
        cells = cells.pivot_table(index="policy", columns="group", values="ms", aggfunc="first", sort=False)
        lines += ["Where the time goes: slowest rank's ms per step in each group of phases, median over steps, "
                  "measured / modelled:", "", cells[list(PHASE_GROUPS)].reset_index().to_markdown(index=False), ""]
    return "\n".join(lines)



def regime_points(benches: dict, cal_path: Path, cal: dict) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """Every regime's measured point (``benches``: regime -> (config, raw)), their tables concatenated."""
    tables, groups, infos = [], [], {}
    for regime, (config, raw) in benches.items():
        table, group, infos[regime] = regime_point(config, raw, cal_path, cal)
        tables.append(table)
        groups.append(group)
    return pd.concat(tables, ignore_index=True), pd.concat(groups, ignore_index=True), infos


def log_regime_points(run, table: pd.DataFrame, groups: pd.DataFrame, infos: dict, cal: dict, cal_path: Path) -> None:
    """The measured points' tables and summary, into the run's results file."""
    run.log_table("calibration", constants_table(cal), calibration_file=str(cal_path))
    run.log_table("regime_ratio", table)
    run.log_table("regime_phase_group", groups)
    run.log_summary({"regimes": infos, "reference": REFERENCE, "calibration": str(cal_path),
                     **{f"{r['regime']}/{r['policy']}/{r['span']}/{side}": r[f"{side}_ratio"]
                        for r in table.to_dict("records") for side in ("measured", "modelled")}})
