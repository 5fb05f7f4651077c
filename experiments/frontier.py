"""Time against quality: the retention budget's frontier.

With ``--regime`` (docs/protocols/frontier.md §10), the protocol's frontier of one regime: loss from the protocol's
training runs (experiments/frontier_sweep.py: gaps to the mean of static EP and SYMI-dropless, seed by seed), time from
the simulator at paper scale with the regime's own settings (slots per home slot, eps, gamma; a system the memory model
gives other slots is an error) on synthetic traces whose Zipf skew is matched to the runs' static-EP slowest rank ÷
mean (both shown; a mismatch over 5 % is an error). Writes the frontier's points with 95 % intervals on both axes
(training seeds; trace seeds), the claim table (estimate, interval, Holm-adjusted p, holds / fails / undecided),
the time claim, and a figure and a Markdown report. ``--time-only``: the time axis alone.

Without it, the earlier frontier from two scales: loss from a convergence sweep, time from the simulator at a
chosen skew, joined by system name only (kept to read the earlier results; docs/protocols/frontier.md §10 says why it
cannot decide a claim).

    python experiments/frontier.py --regime production --runs paper_figures/results/frontier_protocol_sweep.jsonl
    python experiments/frontier.py --regime weak --time-only --runs paper_figures/results/frontier_protocol_pilot.jsonl
    python experiments/frontier.py --convergence outputs/convergence.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules; the simulator (torch), the analysis (pandas, SciPy) and matplotlib load
# in the functions that simulate, decide and draw.
from lrmoe.analysis import protocol
from lrmoe.analysis.frontier import (MAX_GAP_PCT, FrontierError, curves_from, frontier_table, headline,
                                     headline_text, markdown_report, matched_times, modelled_times,
                                     protocol_report)
from lrmoe.cli import fraction_arg, non_negative_float_arg, positive_float_arg, positive_int_arg
from lrmoe.cli import script_parser
from lrmoe.integrations.tracking_args import check_tracking_args
from lrmoe.results import read_records, read_results

if TYPE_CHECKING:
    import pandas as pd

    from lrmoe.integrations.tracking import Tracker

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
                        help="the protocol's frontier of this regime (docs/protocols/frontier.md §10) from --runs, "
                             "instead of the two-scale frontier of --convergence")
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
    # the protocol's scale under --regime (docs/protocols/frontier.md §10.1), else the ablation's
    if args.tokens_per_rank is None:
        args.tokens_per_rank = (protocol.SIM_TOKENS_PER_RANK if args.regime and args.model == protocol.SIM_MODEL
                                else TOKENS.get(args.model, 2048))
    if args.sim_steps < 2:
        parser.error("--sim-steps must be at least 2 (the first is warm-up)")
    if args.sim_seeds < 2:
        parser.error("--sim-seeds must be at least 2 (the time axis's interval)")
    return args


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    try:
        return protocol_main(args) if args.regime is not None else two_scale_main(args)
    except FrontierError as exc:  # a frontier the inputs cannot give: one line naming why, as argparse's errors
        raise SystemExit(f"frontier.py: error: {exc}") from None


def two_scale_main(args) -> pd.DataFrame:
    """The earlier frontier from two scales (no --regime): loss from --convergence, time from the simulator."""
    from lrmoe.analysis.runs import BASELINE, per_run, summarise, time_to_reach
    from lrmoe.integrations.reports import write_report
    from lrmoe.integrations.tracking import Tracker

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
