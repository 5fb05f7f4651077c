"""The retention budget's frontier, time against quality (docs/protocols/frontier.md §10): the systems' modelled
paper-scale time per iteration (the simulator on a synthetic trace, as the ablation builds a cell's systems) joined with
the loss of their training runs, the headline rule read off that table, and the protocol's time axis of one regime at
the Zipf s matched to its runs. experiments/frontier.py is the command line around it (arguments, results file, figure).

Errors a caller can name to a user (a scale where a system runs out of memory, a regime whose slots the memory
model cuts, traces that miss the runs' skew) are :class:`FrontierError`.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lrmoe.config import cluster_preset, model_preset
from lrmoe.results import read_results

if TYPE_CHECKING:
    import pandas as pd

REFERENCE = "symi-dropless"  # the x axis' unit
CF1 = "symi-cf1"
MAX_GAP_PCT = 1.0  # the headline's quality bar: mean loss gap to dropless static EP over the seeds


class FrontierError(ValueError):
    """A frontier that cannot be drawn as asked: the message says why (a caller prefixes its own name)."""


def describe(policy: str) -> dict:
    """What a system name says about the budget: rho (NaN: none), the selection ("m2 top-k", "m2 unbiased",
    "random", or "none"), and whether it is an LRMoE variant that uses its metric."""
    from lrmoe.systems import get_system

    spec = get_system(policy)
    m = re.search(r"rho([0-9.]+)", policy)
    rho = float(m.group(1)) if m else np.nan
    if spec.family != "lrmoe":
        selection = "random" if m else "none"
    elif spec.backward.metric == "random":
        selection = "random"
    else:
        selection = f"{spec.backward.metric} {'unbiased' if spec.backward.mode == 'unbiased' else 'top-k'}"
    return {"family": spec.family, "rho": rho, "selection": selection,
            "uses_metric": spec.family == "lrmoe" and selection != "random", "label": spec.label}


def curves_from(paths: list[str | Path]) -> pd.DataFrame:
    """The convergence sweeps' per-step records (policy, seed, step, val_loss, time_s, ...), one per step (several
    files: e.g. seeds run apart; a (policy, seed) run in two files is read from the last)."""
    import pandas as pd

    from lrmoe.analysis.runs import last_per_step

    records = [r for path in paths for r in read_results(path) if "policy" in r and "seed" in r]
    frames = []
    for (policy, seed), recs in pd.DataFrame(records, columns=None if records else ["policy", "seed"]).groupby(
            ["policy", "seed"], sort=False):
        frames.append(pd.DataFrame(last_per_step(recs.to_dict("records"))))
    if not frames:
        raise FrontierError(f"{', '.join(map(str, paths))} hold no convergence records")
    return pd.concat(frames, ignore_index=True)


def frontier_table(losses: pd.DataFrame, reach: pd.DataFrame, times_ms: dict[str, float],
                   reference: str = REFERENCE, cf1: str = CF1) -> pd.DataFrame:
    """Join the loss summary (lrmoe.analysis.runs.summarise) and the equal-quality table (runs.time_to_reach) with
    the modelled paper-scale time per iteration of each system: time ÷ ``reference`` and ÷ ``cf1``, and the
    equal-quality time (steps to reach the target × time per iteration) ÷ the reference's."""
    import pandas as pd

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
      selection, and SYMI-dropless trimmed at random), and, given ``runs`` (lrmoe.analysis.runs.per_run), on how many
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
                raise FrontierError(f"{policy} cannot run at this scale: {skipped[policy]}")
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
        raise FrontierError(f"{', '.join(oom)} run out of memory at this scale ({m.name}, "
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


# -- the protocol's frontier (docs/protocols/frontier.md §10): one regime, both axes at its settings, the claims decided
# -----------
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
            raise FrontierError(f"regime {regime.name} gives every replicating system {slots} slots "
                             f"per rank; at this scale {wrong}: the two axes would describe different systems")
        times[seed] = t
        sims += [{**r, "regime": regime.name, "sim_seed": seed} for r in rows]
    return pd.DataFrame.from_dict(times, orient="index")[list(arms)], sims


def protocol_report(regime, claims: pd.DataFrame, c5: list[dict], points: pd.DataFrame, imbalance: list[dict],
                    zipf_s: float, seeds: int, planned: int, figure: str,
                    early_claims: pd.DataFrame | None = None) -> str:
    import pandas as pd

    label = "final" if seeds >= planned else f"interim: {seeds} of {planned} planned seeds"
    cols = ["claim", "text", "seeds", "estimate", "ci_low", "ci_high", "bound_high", "p", "p_holm", "word"]
    early = [] if early_claims is None else [
        "Early selection's claims (docs/protocols/frontier.md §10.6: their own Holm family, over their own whole "
        "seeds):", "",
        early_claims[[c for c in cols if c in early_claims.columns]].to_markdown(index=False, floatfmt=".3f"), ""]
    return "\n".join([
        f"# Frontier, regime {regime.name} ({label})", "", f"![frontier]({figure})", "",
        f"Protocol: docs/protocols/frontier.md §10. Regime: {regime.description}; both axes at "
        f"{regime.spare_per_home:g} spare slots "
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
    ``args.sim_seeds`` traces at it, and both axes' imbalance side by side (FrontierError when the simulated
    traces miss the runs' by more than the tolerance)."""
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
        raise FrontierError(str(exc)) from None
    return match, times, sims, side_by_side(runs_imb, simulated)
