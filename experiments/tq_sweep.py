"""The time-to-quality protocol's runs (docs/protocols/time_to_quality.md §11): the model pilot, the variance pilot, the
sweep; resumable; and its report.

Each run is experiments/train.py on the emulated engine with the protocol's arguments (lrmoe.analysis.tq_protocol:
the eleven runs of a seed, their step budgets, evaluation every 15 steps, the run's own trace), called in-process
through its command-line entry point. A finished run is collected as one line of the results file (its endpoint,
curve, routing shape and, at the full budget, its modelled paper-scale iteration time from its own trace,
lrmoe.sim.replay); a run already collected with the same identity is skipped, one collected with other settings is
an error, and an interrupted run resumes from its last checkpoint.

A slice (--stop-after MINUTES) starts no run that its measured cost says cannot finish in time: a run's cost is the
largest wall time collected for its arm (and budget) on this preset, in this results file or any other of the
protocol's beside it (lrmoe.analysis.tq_protocol.run_costs); each run's --timeout is a multiple of that cost.

    python experiments/tq_sweep.py --stage model-pilot                        # seeds 2100-2101, static EP
    python experiments/tq_sweep.py --stage model-pilot --preset qwen3-30b-a3b-routing-h128-f32-l2
    python experiments/tq_sweep.py --stage pilot                              # seeds 2000-2003, weak first
    python experiments/tq_sweep.py --stage sweep --seeds-count 12             # seeds 3000-3011
    python experiments/tq_sweep.py --stage pilot --report outputs/tq_pilot.md  # no training: the report
    python experiments/tq_sweep.py --stage pilot --max-runs 1                 # one more run, then stop
    python experiments/tq_sweep.py --stage pilot --stop-after 120             # a slice: only runs that fit 2 hours
    python experiments/tq_sweep.py --stage pilot --shard 0/2 & python experiments/tq_sweep.py --stage pilot --shard 1/2

The report (--report FILE.md, never over an existing file; a figure beside it) holds per regime the per-seed table,
the eight claims with their words (interim below the planned seeds), the six robustness checks of §11.4, power
after the fact, the controls and what §11.6 Record 3 adds (check 6 at every micro-batch count with each claim's
break-even count, the r* flags, the selection's price as a sensitivity, the replica-gradient mode); for the model
pilot, the rule of §11.1 per preset; with --time-axis, the time ratios from the runs' own traces beside a Zipf
matched on static EP's slowest rank.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

# The parser needs only these light modules (the protocol as data, lrmoe.cli): torch, pandas and train.py load in
# the functions that train, collect and report, so --help comes back at once (tests/test_cli.py).
from lrmoe.analysis import tq_protocol as P
from lrmoe.cli import positive_float_arg, positive_int_arg, run_entry, script_parser
from lrmoe.results import append_record, read_headers, read_records, read_results


def build_parser() -> argparse.ArgumentParser:
    """The command line (lrmoe.cli's formatter: every flag's default in its help; tests/test_cli.py)."""
    parser = script_parser(__doc__)
    parser.add_argument("--stage", choices=P.STAGES, required=True,
                        help="the protocol's stage: the model pilot, the variance pilot or the sweep "
                             "(docs/protocols/time_to_quality.md §11)")
    parser.add_argument("--preset", default=P.PRESET, choices=P.LADDER,
                        help=f"the model (default {P.PRESET}; the model pilot's record names the one chosen)")
    parser.add_argument("--regimes", nargs="+", default=list(P.REGIMES), choices=list(P.REGIMES),
                        help="the regimes whose runs are trained or reported, in this order")
    parser.add_argument("--seeds-count", type=positive_int_arg, default=None,
                        help=f"the sweep's seeds per regime (from the pilot's power calculation, at most "
                             f"{P.MAX_SEEDS}): {P.SWEEP_SEED0}, {P.SWEEP_SEED0 + 1}, ...")
    parser.add_argument("--work", default="outputs/tq_protocol", help="per-run files, traces, checkpoints")
    parser.add_argument("--out", default=None, help="the collected runs (default "
                                                     "paper_figures/results/tq_protocol_<stage>.jsonl)")
    parser.add_argument("--max-runs", type=positive_int_arg, default=None, help="train at most this many runs")
    parser.add_argument("--shard", default=None, metavar="K/N",
                        help="train only the stage's runs whose place in its order is K modulo N (N processes, "
                             "one per core, share one results file; each appends under its lock)")
    parser.add_argument("--stop-after", type=positive_float_arg, default=None, metavar="MINUTES",
                        help="a slice: start no run that its measured cost says cannot end within this many "
                             "minutes of the start, and return after collecting what finished")
    parser.add_argument("--report", default=None, help="train nothing; write the report to this Markdown file")
    parser.add_argument("--time-axis", action="store_true",
                        help="with --report: the runs' own time ratios beside the Zipf-matched ones")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.runs = P.stage_runs(args.stage, args.seeds_count, args.regimes, args.preset)
    except ValueError as exc:
        parser.error(str(exc))
    if args.shard is not None:
        try:
            k, n = (int(x) for x in args.shard.split("/"))
            if not 0 <= k < n:
                raise ValueError
        except ValueError:
            parser.error(f"--shard takes K/N with 0 <= K < N, got {args.shard!r}")
        args.shard_runs = [run for i, run in enumerate(args.runs) if i % n == k]
    else:
        args.shard_runs = args.runs
    args.out = Path(args.out or f"paper_figures/results/tq_protocol_{args.stage.replace('-', '_')}.jsonl")
    if args.report and Path(args.report).exists():
        parser.error(f"--report {args.report} exists; give a new name")
    if args.report and claims_figure(args).exists():
        parser.error(f"the report's figure {claims_figure(args)} exists; write the report into another folder")
    if args.time_axis and not args.report:
        parser.error("--time-axis goes with --report")
    return args


def finished(run: P.TQRun, work: Path) -> bool:
    path = run.results(work)
    return path.exists() and run.trace(work).exists() and any(r.get("step") == run.steps for r in read_results(path))


def differences(run: P.TQRun, work: Path) -> list[str]:
    """How the run's per-run results file (its stored configuration) differs from the protocol's arguments."""
    headers = read_headers(run.results(work)) if run.results(work).exists() else []
    if not headers:
        return []
    from lrmoe.analysis.runs import config_differences  # pandas: not for --help

    return config_differences(headers[-1].get("config") or {}, run.train_argv(work), ignore=P.NOT_IDENTITY)


def check(args) -> list[dict]:
    """Before anything trains: every collected line of this stage's runs has the protocol's identity, and every
    per-run file not yet collected holds the run the protocol asks for. SystemExit naming what differs."""
    try:
        rows = P.collected_rows(args.out)
    except ValueError as exc:
        raise SystemExit(f"tq_sweep.py: error: {exc}") from None
    for run in args.runs:
        if (row := P.clashing(rows, run)) is not None:
            raise SystemExit(f"tq_sweep.py: error: {args.out} holds {run.key} with other train.py arguments "
                             f"({row.get('argv')}): not this protocol's run; give another --out")
        if not any(P.same_run(r, run) for r in rows) and (diffs := differences(run, Path(args.work))):
            raise SystemExit(f"tq_sweep.py: error: {run.results(args.work)} holds a run of other settings "
                             f"({'; '.join(diffs)}): move it away, or give the sweep its own --work")
    return rows


def train(argv: list[str]) -> None:
    """experiments/train.py's command line, run in this process through its entry point (lrmoe.cli.run_entry; the
    import of a script by a script is named in the import contracts); a failed run is this script's error."""
    from lrmoe.experiments import train as train_script

    run_entry("tq_sweep.py", "train.py", train_script.cli, argv)


def run_stage(args, trainer=train, clock=time.monotonic) -> int:
    """Train and collect what is missing, in the protocol's order; returns the runs trained. With
    ``args.stop_after`` (minutes) a run whose measured cost does not fit in the time left is not started (nor is
    any after it: the protocol's order is kept), and the stage returns."""
    work = Path(args.work)
    rows = check(args)
    costs = P.run_costs([*rows, *P.sibling_rows(args.out)], args.preset)
    deadline = None if args.stop_after is None else clock() + 60.0 * args.stop_after
    trained = 0
    for run in args.shard_runs:
        if any(P.same_run(r, run) for r in rows):
            continue
        wall = None
        if not finished(run, work):
            if args.max_runs is not None and trained >= args.max_runs:
                break
            cost = P.run_cost(costs, run)
            if deadline is not None and (cost is None or clock() + cost > deadline):
                left = (deadline - clock()) / 60.0
                print(f"{run.key}: not started: {left:.1f} min left of --stop-after, its measured cost is "
                      + ("unknown" if cost is None else f"{cost / 60.0:.1f} min"), flush=True)
                break
            resume = run.results(work).exists()
            print(f"{run.key}: {'resuming' if resume else 'training'}"
                  + ("" if cost is None else f" (measured cost {cost:.0f} s)"), flush=True)
            start = time.perf_counter()
            trainer(run.train_argv(work, resume=resume, timeout_s=P.run_timeout(cost)))
            wall = time.perf_counter() - start
            trained += 1
            if not finished(run, work):
                raise SystemExit(f"tq_sweep.py: error: train.py returned, but {run.results(work)} has not reached "
                                 f"step {run.steps} (or wrote no trace)")
        row = P.collect(run, work, wall_s=wall)
        append_record(args.out, row)  # one whole line, fsynced, under the file's lock
        rows.append(row)
        print(f"{run.key}: collected (endpoint {row['endpoint']:.4f}"
              + (f", {row['time_s']:.3f} s per paper-scale iteration" if "time_s" in row else "") + ")", flush=True)
    return trained


def claims_figure(args) -> Path:
    """Where the report's figure goes: beside the report, named as make figures names it (<results stem>_claims)."""
    return Path(args.report).parent / f"{args.out.stem}_claims.png"


def report(args) -> str:
    from lrmoe.analysis import tq_report as R
    from lrmoe.analysis import time_to_quality as tq

    try:
        rows = [r for r in P.collected_rows(args.out) if any(P.same_run(r, run) for run in args.runs)]
    except ValueError as exc:
        raise SystemExit(f"tq_sweep.py: error: {exc}") from None
    lines = [f"# Time-to-quality protocol (docs/protocols/time_to_quality.md §11), stage {args.stage}: "
             f"{len(rows)} of {len(args.runs)} runs collected in {args.out.name}", ""]
    if args.stage == "model-pilot":
        if rows:
            v = P.model_pilot_verdict(rows)
            lines += [f"Model {v['preset']}, {v['seeds']} seeds: validation loss falls {100 * v['loss_drop']:.1f} % "
                      f"from step 25 to 300 (rule: ≥ {100 * P.MODEL_PILOT_LOSS_DROP:g} %), per-expert Gini moves "
                      f"{v['gini_move']:.3f} (rule: ≥ {P.MODEL_PILOT_GINI_MOVE}): "
                      f"{'learns to route' if v['learns_to_route'] else 'does not pass'}.", ""]
        return "\n".join(lines)
    planned = len({r.seed for r in args.runs})
    lines += [P.progress_table(rows, args.runs), ""]
    tables = {}
    for regime in args.regimes:
        lines.append(R.regime_report(rows, regime, planned, args.stage))
        per_seed = tq.per_seed_table(*R.regime_frames(R.regime_rows(rows, regime), regime))
        if not per_seed.empty:
            tables[regime] = tq.tq_table(per_seed)
        if args.time_axis:
            try:
                lines += ["### The time axis: own routing against a matched Zipf", "",
                          R.time_axis_text(rows, regime)]
            except ValueError as exc:
                lines += [f"No time axis yet: {exc}.", ""]
    if tables:  # the figure make figures draws of the same file: every regime with a whole seed
        from lrmoe.paper_figures import style, tq_figures

        fig, _ = tq_figures.claims(args.out)
        figure = style.save(fig, claims_figure(args).parent, claims_figure(args).stem, dpi=120)[0]
        lines += [f"![claims]({figure.name})", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        text = report(args)
        Path(args.report).write_text(text + "\n")
        print(text)
        return
    trained = run_stage(args)
    print(f"{trained} runs trained; {len(read_records(args.out))} lines in {args.out}")


if __name__ == "__main__":
    main()
