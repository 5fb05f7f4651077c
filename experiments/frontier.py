"""Time against quality: the retention budget's frontier.

With ``--regime`` (DESIGN.md §10), the protocol's frontier of one regime: loss from the protocol's training runs
(experiments/frontier_sweep.py: gaps to the mean of static EP and SYMI-dropless, seed by seed), time from the
simulator at paper scale with the regime's own settings (slots per home slot, eps, gamma; a system the memory model
gives other slots is an error) on synthetic traces whose Zipf skew is matched to the runs' static-EP slowest rank ÷
mean (both shown; a mismatch over 5 % is an error). Writes the frontier's points with 95 % intervals on both axes
(training seeds; trace seeds), the claim table (estimate, interval, Holm-adjusted p, holds / fails / undecided),
the time claim, and a figure and a Markdown report. ``--time-only``: the time axis alone.

Without it, the earlier frontier from two scales: loss from a convergence sweep, time from the simulator at a
chosen skew, joined by system name only (kept to read the earlier results; DESIGN.md §10 says why it cannot decide
a claim).

    python experiments/frontier.py --regime production --runs paper_figures/results/frontier_protocol_sweep.jsonl
    python experiments/frontier.py --regime weak --time-only --runs paper_figures/results/frontier_protocol_pilot.jsonl
    python experiments/frontier.py --convergence outputs/convergence.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

# The parser needs only these light modules; the simulator (torch), the analysis (pandas, SciPy) and matplotlib load
# in the functions that simulate, decide and draw.
from lrmoe.analysis import protocol
from lrmoe.cli import fraction_arg, non_negative_float_arg, positive_float_arg, positive_int_arg
from lrmoe.cli import script_parser
from lrmoe.config import cluster_preset, model_preset
from lrmoe.integrations.tracking import check_tracking_args
from lrmoe.results import read_records, read_results

if TYPE_CHECKING:
    import pandas as pd

    from lrmoe.integrations.tracking import Tracker

REFERENCE = "symi-dropless"  # the x axis' unit
CF1 = "symi-cf1"
MAX_GAP_PCT = 1.0  # the headline's quality bar: mean loss gap to dropless static EP over the seeds


def curves_from(paths: list[str | Path]) -> pd.DataFrame:
    """The convergence sweeps' per-step records (policy, seed, step, val_loss, time_s, ...), one per step (several
    files: e.g. seeds run apart; a (policy, seed) run in two files is read from the last)."""
    import pandas as pd

    from lrmoe.analysis.runs import last_per_step

    records = [r for path in paths for r in read_results(path)]
    frames = []
    for (policy, seed), recs in pd.DataFrame(records).groupby(["policy", "seed"], sort=False):
        frames.append(pd.DataFrame(last_per_step(recs.to_dict("records"))))
    if not frames:
        raise SystemExit(f"frontier.py: error: {', '.join(map(str, paths))} hold no convergence records")
    return pd.concat(frames, ignore_index=True)


def frontier_table(losses: pd.DataFrame, reach: pd.DataFrame, times_ms: dict[str, float],
                   reference: str = REFERENCE, cf1: str = CF1) -> pd.DataFrame:
    """Join the loss summary (convergence.summarise) and the equal-quality table (convergence.time_to_reach) with
    the modelled paper-scale time per iteration of each system: time ÷ ``reference`` and ÷ ``cf1``, and the
    equal-quality time (steps to reach the target × time per iteration) ÷ the reference's."""
    import pandas as pd

    from lrmoe.paper_figures.frontier_figures import describe

    table = losses.merge(reach[["policy", "seeds_reached", "step_to_reach"]], on="policy", how="left")
    table["iter_ms"] = table.policy.map(times_ms)
    table["time_vs_dropless"] = table.iter_ms / times_ms.get(reference, np.nan)
    table["time_vs_cf1"] = table.iter_ms / times_ms.get(cf1, np.nan)
    # equal quality: only where every seed reached the target (else the mean step would flatter the system)
    reached = table.seeds_reached == table.seeds
    table["time_to_reach_ms"] = np.where(reached, table.step_to_reach * table.iter_ms, np.nan)
    ref = table.loc[table.policy == reference, "time_to_reach_ms"]
    table["time_to_reach_vs_dropless"] = table.time_to_reach_ms / (ref.iloc[0] if len(ref) else np.nan)
    described = pd.DataFrame([describe(p) for p in table.policy])
    return pd.concat([table, described], axis=1)


def headline(table: pd.DataFrame, max_gap_pct: float = MAX_GAP_PCT, runs: pd.DataFrame | None = None) -> dict:
    """The issue's headline rule, on a frontier table:

    * the smallest modelled time ÷ SYMI-dropless among the LRMoE systems that use their metric whose mean loss
      gap to dropless static EP is <= ``max_gap_pct`` (over the seeds);
    * the smallest LRMoE time ÷ SYMI-cf1 among those whose mean gap is <= SYMI-cf1's (equal or better loss);
    * at the first one's rho: its mean gap against the random-trim controls (LRMoE's placement with random
      selection, and SYMI-dropless trimmed at random), and, given ``runs`` (convergence.per_run), on how many
      seeds it was lower."""
    lr = table[table.uses_metric & table.time_vs_dropless.notna()]
    out: dict = {"max_gap_pct": max_gap_pct}
    ok = lr[lr.gap_pct <= max_gap_pct]
    if ok.empty:
        out["best"] = None
    else:
        best = ok.sort_values(["time_vs_dropless", "gap_pct"]).iloc[0]
        out["best"] = {"policy": best.policy, "rho": best.rho, "time_vs_dropless": float(best.time_vs_dropless),
                       "gap_pct": float(best.gap_pct), "gap_pct_min": float(best.gap_pct_min),
                       "gap_pct_max": float(best.gap_pct_max), "seeds": int(best.seeds)}
        controls = {}
        for ctrl in (f"lrmoe-rho{best.rho:g}-random", f"symi-dropless-rho{best.rho:g}"):
            row = table[table.policy == ctrl]
            if row.empty:
                continue
            c = {"gap_pct": float(row.gap_pct.iloc[0]), "time_vs_dropless": float(row.time_vs_dropless.iloc[0]),
                 "metric_lower_mean": bool(best.gap_pct < row.gap_pct.iloc[0])}
            if runs is not None:
                mine = runs[runs.policy == best.policy].set_index("seed").gap_pct
                theirs = runs[runs.policy == ctrl].set_index("seed").gap_pct
                common = mine.index.intersection(theirs.index)
                c["seeds_metric_lower"] = int((mine[common] < theirs[common]).sum())
                c["seeds_compared"] = int(len(common))
            controls[ctrl] = c
        out["controls"] = controls
    cf1 = table[table.policy == CF1]
    if cf1.empty or lr.time_vs_cf1.isna().all():
        out["vs_cf1"] = None
    else:
        bar = float(cf1.gap_pct.iloc[0])
        ok = lr[lr.gap_pct <= bar]
        first = ok.sort_values(["time_vs_cf1", "gap_pct"]).iloc[0] if len(ok) else None
        out["vs_cf1"] = None if first is None else {
            "policy": first.policy, "time_vs_cf1": float(first.time_vs_cf1), "gap_pct": float(first.gap_pct),
            "cf1_gap_pct": bar}
    # "less work" without the metric: the fastest random-trim control within the same bar
    ctrl = table[~table.uses_metric & table.rho.notna() & table.time_vs_dropless.notna()
                 & (table.gap_pct <= max_gap_pct)]
    first = ctrl.sort_values(["time_vs_dropless", "gap_pct"]).iloc[0] if len(ctrl) else None
    out["best_control"] = None if first is None else {
        "policy": first.policy, "time_vs_dropless": float(first.time_vs_dropless), "gap_pct": float(first.gap_pct),
        "gap_pct_min": float(first.gap_pct_min), "gap_pct_max": float(first.gap_pct_max)}
    return out


def headline_text(h: dict) -> str:
    lines = []
    b = h.get("best")
    if b is None:
        lines.append(f"No LRMoE system (with its metric and a modelled time) has a mean loss gap <= "
                     f"{h['max_gap_pct']:g} % to dropless.")
    else:
        lines.append(f"Smallest modelled LRMoE ÷ SYMI-dropless time with mean loss gap <= {h['max_gap_pct']:g} % "
                     f"over {b['seeds']} seeds: {b['time_vs_dropless']:.3f} ({b['policy']}, gap {b['gap_pct']:+.2f} % "
                     f"[{b['gap_pct_min']:+.2f}, {b['gap_pct_max']:+.2f}]).")
        if not h.get("controls"):
            lines.append("  (no random-trim control at this rho in the sweep)")
        for name, c in h.get("controls", {}).items():
            seeds = (f"; lower on {c['seeds_metric_lower']}/{c['seeds_compared']} seeds"
                     if "seeds_compared" in c else "")
            lines.append(f"  vs {name}: gap {c['gap_pct']:+.2f} %, time ÷ dropless {c['time_vs_dropless']:.3f}: "
                         f"the metric's mean gap is {'lower' if c['metric_lower_mean'] else 'NOT lower'}{seeds}.")
    c = h.get("best_control")
    if "best_control" in h:
        lines.append(f"No random-trim control has a mean loss gap <= {h['max_gap_pct']:g} %." if c is None else
                     f"Fastest random-trim control with mean gap <= {h['max_gap_pct']:g} %: {c['time_vs_dropless']:.3f}"
                     f" ({c['policy']}, gap {c['gap_pct']:+.2f} % [{c['gap_pct_min']:+.2f}, {c['gap_pct_max']:+.2f}]).")
    v = h.get("vs_cf1")
    lines.append("No LRMoE system (with its metric) matches SYMI-cf1's loss." if v is None else
                 f"Smallest LRMoE ÷ SYMI-cf1 time at equal or better loss (gap <= {v['cf1_gap_pct']:+.2f} %): "
                 f"{v['time_vs_cf1']:.3f} ({v['policy']}, gap {v['gap_pct']:+.2f} %).")
    return "\n".join(lines)


def modelled_times(policies: list[str], args, known: list[dict] = ()) -> tuple[dict[str, float], list[dict]]:
    """Modelled paper-scale MoE time per iteration (ms, all layers) of each system, on one synthetic trace, built as
    the ablation sweep builds a cell's systems (experiments/ablate.py: the memory model of the cost model's
    accounting, memory-sized slots, and the planned-headroom rule: each dropless system's buffers sized for its own
    planned peak on the trace's first iteration, which is not timed). ``known``: rows of an earlier run's
    "simulated" table; those at the same scale are reused instead of simulated again."""
    from tqdm import tqdm

    from lrmoe.sim.cells import Cell, CellRules, build_systems, cost_kwargs
    from lrmoe.sim.simulator import simulate
    from lrmoe.sim.simulated_systems import plan_twins
    from lrmoe.traces.synthetic import generate_trace

    m, c = model_preset(args.model), cluster_preset(args.cluster, args.nodes)
    layers = min(args.layers or m.num_moe_layers, m.num_moe_layers)
    mem_gb = args.mem_gb if args.mem_gb else c.mem_budget_bytes / 1e9
    scale = {"model": m.name, "cluster": c.name, "ranks": c.num_ranks, "nodes": c.num_nodes, "skew": args.skew,
             "tokens_per_rank": args.tokens_per_rank, "layers_simulated": layers, "sim_steps": args.sim_steps,
             "micro_batches": args.micro_batches, "mem_gb": mem_gb, "eps": args.eps, "gamma": args.gamma,
             "headroom_rule": "planned", "sim_seed": args.sim_seed, "max_extra": args.max_extra,
             "replica_grad": "best"}  # each system priced in range and shard mode, reported in its faster one
    reuse = {r["policy"]: r for r in known if all(r.get(k) == v for k, v in scale.items())}
    cell = Cell(m, c, ("zipf", args.skew), mem_gb, args.tokens_per_rank)
    sweep = CellRules(eps=args.eps, gamma=args.gamma, max_extra=args.max_extra)  # the ablation's rules, at this cell
    # one iteration more than timed: the first is the planners' reference (the planned-headroom rule)
    trace = generate_trace(args.sim_steps + 1, layers, c.num_ranks, m.num_experts, m.top_k, args.tokens_per_rank,
                           skew="zipf", skew_param=args.skew, seed=args.sim_seed, model=m.name)
    counts_ILNE = trace.counts_ILNE
    twins = plan_twins(policies)  # variants with the same plans (metric, selection) are simulated once
    times, rows = {}, []
    todo = [p for p in policies if p not in twins and p not in reuse]
    systems, skipped, notes, headrooms = (build_systems(cell, todo, sweep, (counts_ILNE[0], counts_ILNE[1]))
                                          if todo else ({}, {}, {}, {}))
    with tqdm(total=len(todo) * args.sim_steps * layers, desc="layer-steps", disable=None, mininterval=1.0) as bar:
        for policy in policies:
            if policy in twins:
                continue
            if policy in reuse:
                times[policy] = reuse[policy]["iter_ms"]
                rows.append({k: v for k, v in reuse[policy].items() if k not in ("kind", "run_id", "table", "step")})
                continue
            if policy in skipped:
                raise SystemExit(f"frontier.py: error: {policy} cannot run at this scale: {skipped[policy]}")
            res = simulate(counts_ILNE[1:], systems[policy], m, c, cost_kwargs=cost_kwargs(policy, cell, sweep),
                           micro_batches=args.micro_batches, progress=bar.update,
                           variants={"shard": {"replica_grad": "shard"}})
            s = res.summary()
            by_mode = {"range": s["time_s"], "shard": res.time_s("shard")}  # each system in its faster mode
            mode = min(by_mode, key=by_mode.get)
            times[policy] = 1e3 * by_mode[mode] * m.num_moe_layers / layers
            rows.append({"policy": policy, "iter_ms": times[policy], "oom": s["oom"], "drop_rate": s["drop_rate"],
                         "bwd_max_over_mean_fwd": s["rho"], "fwd_imbalance": s["fwd_imbalance"],
                         "slots_per_rank": s["slots_per_rank"], "replica_grad": mode, "note": notes.get(policy, ""),
                         **{f"planned_headroom_{k}": v for k, v in headrooms.items()}, **scale})
    oom = sorted(r["policy"] for r in rows if r.get("oom"))
    if oom:
        raise SystemExit(f"frontier.py: error: {', '.join(oom)} run out of memory at this scale ({m.name}, "
                         f"{c.num_ranks} ranks, {mem_gb:g} GB, {args.tokens_per_rank} tokens per rank): a time "
                         "there means nothing; give a larger --mem-gb or fewer --tokens-per-rank")
    for policy, twin in twins.items():
        if policy in policies:
            times[policy] = times[twin]
    return times, rows


def markdown_report(table: pd.DataFrame, h: dict, scale: dict, curves: pd.DataFrame, figure: str) -> str:
    """The table, the headline and both scales' conditions, as Markdown (written beside the results file)."""
    seeds = sorted(int(s) for s in curves.seed.unique())
    steps = int(curves.step.max())
    return "\n".join([
        "# Time against quality: the retention budget's frontier", "",
        f"![frontier]({figure})", "",
        "**Two scales.** Time: modelled MoE-layer time per iteration from the simulator at paper scale "
        f"({scale['model']}, {scale['cluster']}: {scale['ranks']} ranks on {scale['nodes']} nodes, "
        f"{scale['mem_gb']:.0f} GB MoE budget per rank, synthetic Zipf {scale['skew']:g} trace, "
        f"{scale['tokens_per_rank']} tokens per rank per micro-batch, {scale['micro_batches']} micro-batches, "
        f"{scale['layers_simulated']} layers simulated, {scale['sim_steps']} iterations, the first warm-up, after "
        "one that sizes each dropless system's buffers for its own planned peak, as in ablate.py). "
        f"Loss: validation loss of the debug model trained on 4 CPU ranks for {steps} steps, seeds {seeds}; the gap "
        "to dropless static EP is taken seed by seed (same data order), then averaged; min/max over seeds. "
        "Neither scale measures the other quantity: the two are joined by system name only.", "",
        table.sort_values("time_vs_dropless").to_markdown(index=False, floatfmt=".3f"), "",
        "**Headline** (mean gap over the seeds; `time_vs_*`: modelled time per iteration):", "",
        *[f"* {line.strip()}" for line in headline_text(h).splitlines()], "",
    ])


# -- the protocol's frontier (DESIGN.md §10): one regime, both axes at its settings, the claims decided -----------
def regime_times(arms: list[str], regime, zipf_s: float, args) -> tuple[pd.DataFrame, list[dict]]:
    """Modelled paper-scale time per iteration of each arm (ms; rows: trace seed, columns: arms) at the regime's
    settings (its slots per home slot, eps, gamma) and the matched Zipf s, on ``args.sim_seeds`` trace seeds. Every
    replicating system must get the regime's slots: one the memory model leaves with fewer is an error (the two axes
    would describe different systems)."""
    import pandas as pd

    from lrmoe.systems import get_system

    m, c = model_preset(args.model), cluster_preset(args.cluster, args.nodes)
    spare = regime.spare_slots(m.num_experts, c.num_ranks)
    slots = m.num_experts // c.num_ranks + spare
    times, sims = {}, []
    for seed in range(args.sim_seeds):
        at = argparse.Namespace(**{**vars(args), "skew": zipf_s, "sim_seed": seed, "eps": regime.eps,
                                   "gamma": regime.gamma, "max_extra": spare})
        t, rows = modelled_times(arms, at)
        wrong = {r["policy"]: r["slots_per_rank"] for r in rows
                 if get_system(r["policy"]).family != "static-ep" and r["slots_per_rank"] != slots}
        if wrong:
            raise SystemExit(f"frontier.py: error: regime {regime.name} gives every replicating system {slots} slots "
                             f"per rank; at this scale {wrong}: the two axes would describe different systems")
        times[seed] = t
        sims += [{**r, "regime": regime.name, "sim_seed": seed} for r in rows]
    return pd.DataFrame.from_dict(times, orient="index")[list(arms)], sims


def log_frontier(run: Tracker) -> list[Path]:
    """The frontier figure, drawn from the results file written so far (lrmoe.paper_figures.frontier_figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lrmoe.paper_figures import frontier_figures

    fig, _ = frontier_figures.frontier(run.results)
    paths = run.log_figure("frontier", fig)
    plt.close(fig)
    return paths


def protocol_report(regime, claims: pd.DataFrame, c5: list[dict], points: pd.DataFrame, imbalance: list[dict],
                    zipf_s: float, seeds: int, planned: int, figure: str,
                    early_claims: pd.DataFrame | None = None) -> str:
    import pandas as pd

    label = "final" if seeds >= planned else f"interim: {seeds} of {planned} planned seeds"
    cols = ["claim", "text", "seeds", "estimate", "ci_low", "ci_high", "bound_high", "p", "p_holm", "word"]
    early = [] if early_claims is None else [
        "Early selection's claims (DESIGN.md §10.6: their own Holm family, over their own whole seeds):", "",
        early_claims[[c for c in cols if c in early_claims.columns]].to_markdown(index=False, floatfmt=".3f"), ""]
    return "\n".join([
        f"# Frontier, regime {regime.name} ({label})", "", f"![frontier]({figure})", "",
        f"Protocol: DESIGN.md §10. Regime: {regime.description}; both axes at {regime.spare_per_home:g} spare slots "
        f"per home slot, ε {regime.eps:g}, γ {regime.gamma:g}. Loss: the debug model on 4 CPU ranks, {seeds} whole "
        f"seeds. Time: the simulator at paper scale, Zipf s {zipf_s:.3f}, matched to the runs' static-EP slowest "
        "rank ÷ mean.", "",
        "Routing imbalance of both axes (static EP):", "",
        pd.DataFrame(imbalance).to_markdown(index=False, floatfmt=".3f"), "",
        "Claims (estimates in percentage points; 95 % intervals unadjusted; p Holm-adjusted over the family):", "",
        claims[[c for c in cols if c in claims.columns]].to_markdown(index=False, floatfmt=".3f"), "",
        "Time claim (C5, a model output: outside the Holm family):", "",
        pd.DataFrame(c5).to_markdown(index=False, floatfmt=".3f") if c5 else "no arm to price", "", *early,
        "Frontier points:", "", points.to_markdown(index=False, floatfmt=".3f"), ""])


def matched_times(rows: list[dict], regime, arms: list[str], args):
    """The time axis of a regime: the Zipf s matched to the runs' static-EP slowest ÷ mean, the arms' times on
    ``args.sim_seeds`` traces at it, and both axes' imbalance side by side (SystemExit when the simulated traces
    miss the runs' by more than the tolerance)."""
    from lrmoe.analysis.skew import Scale, check_matched, match_zipf, runs_imbalance, side_by_side

    m, c = model_preset(args.model), cluster_preset(args.cluster, args.nodes)
    runs_imb = runs_imbalance(rows)
    match = match_zipf(runs_imb["rank_max_over_mean"], Scale(c.num_ranks, m.num_experts, m.top_k,
                                                              args.tokens_per_rank))
    times, sims = regime_times(arms, regime, match.zipf_s, args)
    # the simulated traces themselves: static EP's forward imbalance in the simulator, beside the runs'
    simulated = {**match.simulated, "rank_max_over_mean": float(np.mean(
        [r["fwd_imbalance"] for r in sims if r["policy"] == "static-ep"]))}
    try:
        check_matched(runs_imb, simulated)
    except ValueError as exc:
        raise SystemExit(f"frontier.py: error: {exc}") from None
    return match, times, sims, side_by_side(runs_imb, simulated)


def protocol_main(args) -> pd.DataFrame:
    import pandas as pd

    from lrmoe.analysis.claims import arm_gaps, decide_regime, time_claim, time_ratios
    from lrmoe.integrations.tracking import Tracker

    regime = protocol.get_regime(args.regime)
    try:  # a bad line is named by file and line
        rows = [row for path in args.runs for row in read_records(path)]
    except ValueError as exc:
        raise SystemExit(f"frontier.py: error: --runs: {exc}") from None
    # the claims read the sweep's runs only; the time axis alone (--time-only) may match the pilot's routing
    rows = [r for r in rows if r["regime"] == regime.name and (args.time_only or r.get("stage") == "sweep")]
    arms = list(protocol.SWEEP_ARMS) if args.time_only else [a for a in protocol.SWEEP_ARMS
                                                              if any(r["arm"] == a for r in rows)]
    if not rows:
        raise SystemExit(f"frontier.py: error: {args.runs} hold no {'' if args.time_only else 'sweep '}run of regime "
                         f"{regime.name}")
    if not args.time_only:
        try:
            decided = decide_regime(rows, regime.name)
        except ValueError as exc:
            raise SystemExit(f"frontier.py: error: {exc}") from None
        gaps, early = decided["gaps"], decided["early_gaps"]
    match, times, sims, imbalance = matched_times(rows, regime, arms, args)
    ratios = time_ratios(times)
    with Tracker("frontier", vars(args), results=args.out, seed=0, overwrite=args.overwrite, resume=args.resume,
                 wandb=not args.no_wandb) as run:
        run.log_table("simulated", sims)
        summary = {"regime": regime.name, "zipf_s": match.zipf_s, "imbalance": imbalance,
                   "runs_matched": len([r for r in rows if r["arm"] == "static-ep"])}
        if args.time_only:
            for rec in ratios.to_dict("records"):
                run.log({k: v for k, v in rec.items() if v == v}, step=None)
            run.log_summary(summary)
            text = "\n".join([
                f"# Time axis, regime {regime.name} (no loss axis: --time-only)", "",
                f"Zipf s {match.zipf_s:.3f}, matched to the static-EP runs' slowest rank ÷ mean; both axes:", "",
                pd.DataFrame(imbalance).to_markdown(index=False, floatfmt=".3f"), "",
                f"Modelled time ÷ SYMI-dropless, mean and 95 % interval over {args.sim_seeds} trace seeds:", "",
                ratios.to_markdown(index=False, floatfmt=".3f"), ""])
            print(text)
            Path(args.out).with_suffix(".md").write_text(text)
            return ratios
        claims, early_claims = decided["claims"], decided["early_claims"]
        by_arm = arm_gaps(gaps)
        if early is not None:
            by_arm = pd.concat([by_arm, arm_gaps(early[list(protocol.EARLY_ARMS)])], ignore_index=True)
        points = by_arm.merge(ratios, on="arm")
        c5 = time_claim(claims, ratios)
        for rec in points.to_dict("records"):
            run.log({k: v for k, v in rec.items() if v == v}, step=None)
        run.log_table("claims", claims.to_dict("records"))
        if early_claims is not None:
            run.log_table("early_claims", early_claims.to_dict("records"))
        run.log_table("gaps", gaps.reset_index().to_dict("records"))
        run.log_summary({**summary, "time_claim": c5, "seeds": int(len(gaps)), "planned_seeds": args.planned_seeds})
        figure = log_frontier(run)
        text = protocol_report(regime, claims, c5, points, imbalance, match.zipf_s, len(gaps), args.planned_seeds,
                               figure[0].name, early_claims)
        print(text)
        report = Path(args.out).with_suffix(".md")
        report.write_text(text)
        print(f"results: {args.out}; figure: {figure[0]}; report: {report}")
    return claims


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/frontier.jsonl")
    parser.add_argument("--convergence", nargs="+", default=["outputs/convergence.jsonl"],
                        help="the convergence results file(s)")
    parser.add_argument("--target-step", type=positive_int_arg, default=None,
                        help="equal-quality step T (default: the last)")
    parser.add_argument("--max-gap-pct", type=positive_float_arg, default=MAX_GAP_PCT,
                        help="the headline's quality bar: mean loss gap to dropless static EP over the seeds, %%")
    parser.add_argument("--model", default=protocol.SIM_MODEL, help="model preset of the simulated time axis")
    parser.add_argument("--cluster", default=protocol.SIM_CLUSTER, help="cluster preset of the simulated time axis")
    parser.add_argument("--nodes", type=positive_int_arg, default=protocol.SIM_NODES, help="nodes of that cluster")
    parser.add_argument("--skew", type=non_negative_float_arg, default=0.8, help="Zipf s of the synthetic trace")
    parser.add_argument("--tokens-per-rank", type=positive_int_arg, default=None,
                        help="tokens per rank per micro-batch (default: the ablation's for the model)")
    parser.add_argument("--mem-gb", type=positive_float_arg, default=None,
                        help="per-rank MoE budget, GB (default: the device)")
    parser.add_argument("--sim-steps", type=positive_int_arg, default=3,
                        help="simulated iterations (the first is warm-up)")
    parser.add_argument("--layers", type=positive_int_arg, default=None, help="simulated MoE layers (default all)")
    parser.add_argument("--micro-batches", type=positive_int_arg, default=protocol.SIM_MICRO_BATCHES,
                        help="micro-batches per simulated iteration")
    parser.add_argument("--eps", type=non_negative_float_arg, default=0.1,
                        help="LRMoE balance slack (fraction of the mean load a rank may exceed)")
    parser.add_argument("--gamma", type=fraction_arg, default=0.1,
                        help="LRMoE per-expert floor (fraction of each expert's pairs always kept)")
    parser.add_argument("--sim-seed", type=int, default=0, help="seed of the synthetic trace")
    parser.add_argument("--sim-from", default=None,
                        help="an earlier frontier results file: reuse its simulated times at the same scale")
    parser.add_argument("--max-extra", type=int, default=None, help="the most spare slots per rank (default E/N)")
    parser.add_argument("--quick", action="store_true", help="4 simulated layers, 2 iterations")
    parser.add_argument("--regime", choices=list(protocol.REGIMES), default=None,
                        help="the protocol's frontier of this regime (DESIGN.md §10) from --runs, instead of the "
                             "two-scale frontier of --convergence")
    parser.add_argument("--runs", nargs="+", default=["paper_figures/results/frontier_protocol_sweep.jsonl"],
                        help="--regime: the protocol's collected runs (experiments/frontier_sweep.py)")
    parser.add_argument("--sim-seeds", type=int, default=protocol.SIM_SEEDS,
                        help="--regime: trace seeds of the time axis")
    parser.add_argument("--time-only", action="store_true",
                        help="--regime: the time axis alone (every arm; the skew matched to any of the regime's "
                             "runs, the pilot's too), no claims")
    parser.add_argument("--planned-seeds", type=int, default=protocol.SWEEP_SEEDS,
                        help="--regime: the sweep's planned seeds (the table is interim below them)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from lrmoe.sim.cells import TOKENS

    check_tracking_args(parser, args, "frontier", report=True)  # its report beside it: never an unrelated file
    if args.quick:
        args.layers, args.sim_steps = args.layers or 4, 2
    if args.tokens_per_rank is None:  # the protocol's scale under --regime (DESIGN.md §10.1), else the ablation's
        args.tokens_per_rank = (protocol.SIM_TOKENS_PER_RANK if args.regime and args.model == protocol.SIM_MODEL
                                else TOKENS.get(args.model, 2048))
    if args.sim_steps < 2:
        parser.error("--sim-steps must be at least 2 (the first is warm-up)")
    if args.sim_seeds < 2:
        parser.error("--sim-seeds must be at least 2 (the time axis's interval)")
    return args


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    from lrmoe.analysis.runs import BASELINE, per_run, summarise, time_to_reach
    from lrmoe.integrations.tracking import Tracker, write_report

    if args.regime is not None:
        return protocol_main(args)
    curves = curves_from(args.convergence)
    if BASELINE not in set(curves.policy):
        raise SystemExit(f"frontier.py: error: {args.convergence} have no {BASELINE} run (the loss reference)")
    policies = list(dict.fromkeys(curves.policy))
    with Tracker("frontier", vars(args), results=args.out, seed=args.sim_seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        known = [r for r in read_results(args.sim_from) if r.get("table") == "simulated"] if args.sim_from else []
        times, sim_rows = modelled_times(policies, args, known)
        runs = per_run(curves)
        table = frontier_table(summarise(curves), time_to_reach(curves, args.target_step), times)
        h = headline(table, args.max_gap_pct, runs)
        for rec in table.to_dict("records"):
            run.log({k: v for k, v in rec.items() if v == v}, step=None)
        run.log_table("simulated", sim_rows)
        run.log_table("per_run", runs.to_dict("records"))
        val = curves.dropna(subset=["val_loss"])[["policy", "seed", "step", "val_loss", "time_s"]]
        run.log_table("val_curves", val.to_dict("records"))
        run.log_summary({"headline": h, "headline_text": headline_text(h),
                         "scales": "time: paper-scale simulator; loss: CPU training of the debug model",
                         "simulated": sim_rows[0] if sim_rows else {}})
        figure = log_frontier(run)
        cols = ["policy", "rho", "selection", "seeds", "val_loss", "val_loss_std", "gap_pct", "gap_pct_min",
                "gap_pct_max", "last20_drop_pct", "hot_rank_bwd_cut_pct", "dropped_pct", "iter_ms", "time_vs_dropless",
                "time_vs_cf1", "seeds_reached", "step_to_reach", "time_to_reach_vs_dropless"]
        print("Time (paper-scale simulator) against loss (CPU training of the debug model): two scales\n")
        print(table[cols].sort_values("time_vs_dropless").to_markdown(index=False, floatfmt=".3f"))
        print()
        print(headline_text(h))
        report = write_report(args.out, markdown_report(table[cols], h, sim_rows[0], curves, figure[0].name))
        print(f"results: {args.out}; figure: {figure[0]}; report: {report}")
    return table


if __name__ == "__main__":
    main()
