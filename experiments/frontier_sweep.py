"""The frontier protocol's training runs (docs/protocols/frontier.md §10): the variance pilot, then the sweep,
resumable.

Runs experiments/convergence.py (its command line, in this process) once per (seed, regime) with the protocol's settings
(lrmoe.analysis.protocol: every arm of the regime on that seed, the larger evaluation sample), seed-major, so that
whatever has finished when a sitting stops is whole seeds, paired across arms. A run that finished is skipped; one
that was interrupted resumes from its last checkpoint (convergence.py and train.py --resume). Per-run files,
checkpoints and traces go to --work; each finished run's endpoint and curve are appended to the results file, one
line per run, never rewriting a line already there.

    python experiments/frontier_sweep.py --stage pilot                     # PILOT_SEEDS x PILOT_ARMS, both regimes
    python experiments/frontier_sweep.py --stage sweep --seeds-count 12    # seeds 1000..1011 x SWEEP_ARMS, both regimes
    python experiments/frontier_sweep.py --stage sweep --seeds-count 12 --collect-only
    python experiments/frontier_sweep.py --stage pilot --report-only     # the pilot's variance and seed count
    python experiments/frontier_sweep.py --stage sweep --jobs 2            # the two regimes side by side

``--jobs 2`` runs each regime's seeds in a process of its own, both appending to the one results file (a line per
run, written whole): a run's 4 ranks leave part of 2 cores idle while they wait on each other, so two runs side by
side finish about 1.7 x as many runs an hour as one at a time on a 2-core machine (each run takes about 1.2 x as
long). A process that fails stops the others, and the sweep exits non-zero.

Every invocation ends with the report of what has finished (per regime: both axes' routing imbalance, the claim
table over whole seeds, interim until the planned seeds are in; the pilot's: the power calculation), printed and,
with --report, written as Markdown (never over an existing file); the regime processes of --jobs end without it
(--no-report), their parent reports every regime.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

# The parser needs only these light modules; the analysis (pandas, SciPy, torch) loads where runs are compared and
# reported.
from lrmoe.analysis import protocol
from lrmoe.cli import positive_int_arg
from lrmoe.cli import SYSTEMS_HELP, run_entry, script_parser, system_arg
from lrmoe.results import append_record, read_headers, read_records, read_results


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__)
    parser.add_argument("--stage", choices=("pilot", "sweep"), required=True,
                        help="the protocol's stage (docs/protocols/frontier.md §10): the pilot's seeds and arms, "
                             "or the sweep's")
    parser.add_argument("--regimes", nargs="+", default=list(protocol.REGIMES), choices=list(protocol.REGIMES),
                        help="the regimes to run (lrmoe.analysis.protocol.REGIMES)")
    parser.add_argument("--seeds-count", type=int, default=protocol.SWEEP_SEEDS,
                        help="the sweep's seeds: 1000 .. 1000 + count - 1 (default: the power calculation's number, "
                             f"{protocol.SWEEP_SEEDS})")
    parser.add_argument("--arms", nargs="+", type=system_arg, default=None,
                        help="systems trained; default: the protocol's (the pilot's or the sweep's); " + SYSTEMS_HELP)
    parser.add_argument("--work", default="outputs/frontier_protocol", help="per-run files, checkpoints, traces")
    parser.add_argument("--out", default=None,
                        help="results file the finished runs are appended to (default "
                             "paper_figures/results/frontier_protocol_<stage>.jsonl)")
    parser.add_argument("--collect-only", action="store_true", help="train nothing; append finished runs")
    parser.add_argument("--report-only", action="store_true", help="train and collect nothing; report")
    parser.add_argument("--report", default=None, help="write the report to this Markdown file (must not exist)")
    parser.add_argument("--no-report", action="store_true",
                        help="end without the report (the regime processes of --jobs: the sweep that started them "
                             "reports every regime once they have finished)")
    parser.add_argument("--jobs", type=positive_int_arg, default=1,
                        help="regimes run side by side, each in its own process (default 1: one after the other)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_report and (args.report or args.report_only):
        parser.error("--no-report leaves nothing for --report or --report-only")
    if args.stage == "pilot":
        args.seeds = list(protocol.PILOT_SEEDS)
    else:
        try:
            args.seeds = protocol.sweep_seeds(args.seeds_count)
        except ValueError as exc:
            parser.error(str(exc))
    args.arms = args.arms or list(protocol.PILOT_ARMS if args.stage == "pilot" else protocol.SWEEP_ARMS)
    args.out = Path(args.out or f"paper_figures/results/frontier_protocol_{args.stage}.jsonl")
    return args


def units(args) -> list[tuple[int, str, Path]]:
    """(seed, regime, convergence results file), seed-major."""
    return [(seed, name, Path(args.work) / name / f"seed{seed}.jsonl") for seed in args.seeds for name in args.regimes]


def convergence_argv(regime: str, seed: int, arms: list[str], out: Path) -> list[str]:
    """convergence.py's arguments for these arms of one seed in one regime, at the protocol's settings."""
    return [*protocol.get_regime(regime).convergence_argv(arms, [seed], str(out)),
            "--eval-batches", str(protocol.EVAL_BATCHES), "--slim", *(["--resume"] if out.exists() else [])]


def run_file(out: Path, arm: str) -> Path:
    """Where convergence.py (one seed) keeps an arm's per-run results: beside its results file, in its own folder."""
    return out.with_suffix("") / f"{arm}.jsonl"


def finished(results: Path) -> bool:
    return results.exists() and any(r.get("step") == protocol.STEPS for r in read_results(results))


# convergence.py's flags that train.py's configuration does not hold with the same meaning, or that do not change
# what a run computes (a run's identity leaves them out)
NOT_IDENTITY = ("--out", "--quiet", "--no-wandb", "--resume", "--slim", "--ckpt-every", "--extra-slots")


def run_differences(out: Path, regime: str, seed: int, arm: str) -> list[str]:
    """How the per-run file of ``arm`` differs from the run the protocol asks for in this regime and seed (its
    stored configuration against the protocol's arguments; none where it has no run header)."""
    from lrmoe.analysis.runs import config_differences

    headers = read_headers(run_file(out, arm))
    if not headers:
        return []
    config = headers[-1].get("config") or {}
    diffs = config_differences(config, convergence_argv(regime, seed, [arm], out), ignore=NOT_IDENTITY)
    for key, want in (("policy", arm), ("seed", seed)):
        if key in config and config[key] != want:
            diffs.append(f"--{key}: was {config.get(key)}, now {want}")
    return diffs


def check_identities(args) -> None:
    """Before anything trains or is collected: every per-run file not yet collected holds the run the protocol asks
    for (a file of other settings would be resumed, or collected, as if it were one); else an error naming it."""
    done = protocol.collected_keys(args.out)
    for seed, regime, out in units(args):
        for arm in args.arms:
            if (regime, seed, arm) not in done and (diffs := run_differences(out, regime, seed, arm)):
                raise SystemExit(f"frontier_sweep.py: error: {run_file(out, arm)} holds a run of other settings "
                                 f"than the protocol's ({'; '.join(diffs)}): move it away, or give the sweep its "
                                 f"own --work")


def report(args) -> str:
    """What the finished runs can say, per regime (Markdown)."""
    from lrmoe.analysis.claims import claim_table, early_family, family_gaps, seed_plan
    from lrmoe.analysis.skew import runs_imbalance

    rows = read_records(args.out)
    lines = [f"# Frontier protocol ({args.stage}): {len(rows)} finished runs in {args.out.name}", ""]
    for regime in args.regimes:
        mine = [r for r in rows if r["regime"] == regime and r["arm"] in args.arms]
        lines += [f"## Regime {regime}: {protocol.get_regime(regime).description}", ""]
        try:
            gaps, early = family_gaps(mine, args.arms)
        except ValueError as exc:
            lines += [f"No table yet: {exc}.", ""]
            continue
        imb = runs_imbalance(mine)
        lines += [f"Routing of the static-EP runs ({imb['runs']} runs): slowest rank ÷ mean "
                  f"{imb['rank_max_over_mean']:.3f}, per-expert Gini {imb['gini']:.3f}, hottest expert ÷ mean "
                  f"{imb['expert_max_over_mean']:.3f}.", "",
                  f"Gaps to the reference (mean of static EP and SYMI-dropless), %, {len(gaps)} whole seeds:", "",
                  gaps.round(3).to_markdown(), ""]
        if args.stage == "pilot":
            try:
                lines += ["Power calculation (docs/protocols/frontier.md §10.4):", "",
                          seed_plan(gaps).to_markdown(index=False), ""]
            except ValueError as exc:
                lines += [f"No power calculation yet: {exc}.", ""]
        else:
            planned = len(args.seeds)
            label = "final" if len(gaps) >= planned else f"interim, {len(gaps)} of {planned} seeds"
            lines += [f"Claims ({label}):", "", claim_table(gaps).to_markdown(index=False, floatfmt=".3f"), ""]
            if early is not None:
                label = "final" if len(early) >= planned else f"interim, {len(early)} of {planned} seeds"
                lines += [f"Early selection's claims (docs/protocols/frontier.md §10.6, a Holm family of their own; "
                          f"{label}):", "",
                          claim_table(early, early_family()).to_markdown(index=False, floatfmt=".3f"), ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report and Path(args.report).exists():
        raise SystemExit(f"frontier_sweep.py: error: {args.report} exists; give a new name")
    try:
        if not args.report_only:
            check_identities(args)
        read_records(args.out)  # a bad collected line is named (file and line) before anything trains
    except ValueError as exc:
        raise SystemExit(f"frontier_sweep.py: error: {exc}") from None
    if args.jobs > 1 and len(args.regimes) > 1 and not args.report_only:
        run_side_by_side(args)
    elif not args.report_only:
        train_and_collect(args)
    if args.no_report:
        return
    text = report(args)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")


def regime_argv(args, regime: str) -> list[str]:
    """This invocation's arguments for one regime alone (no report, no jobs)."""
    return ["--stage", args.stage, "--regimes", regime, "--seeds-count", str(len(args.seeds)), "--arms", *args.arms,
            "--work", str(args.work), "--out", str(args.out), *(["--collect-only"] if args.collect_only else []),
            "--no-report"]


def run_side_by_side(args, command=None) -> None:
    """Each regime in a process of its own (``command(regime)``, default: this script, by its module name, on that
    regime alone), at most ``args.jobs`` at a time; the first that fails stops the others (their runs resume from
    their checkpoints next time) and exits non-zero."""
    command = command or (lambda regime: [sys.executable, "-m", "lrmoe.experiments.frontier_sweep",
                                          *regime_argv(args, regime)])
    pending, running = list(args.regimes), {}
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                regime = pending.pop(0)
                running[regime] = subprocess.Popen(command(regime))
            time.sleep(0.2)
            for regime, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[regime]
                if proc.returncode:
                    raise SystemExit(f"frontier_sweep.py: error: the {regime} regime's sweep exited with "
                                     f"{proc.returncode}; the others were stopped")
    finally:
        for proc in running.values():
            proc.terminate()
        for proc in running.values():
            proc.wait()


def train_and_collect(args) -> None:
    """Train what is missing, seed-major, and collect every finished run once."""
    from tqdm import tqdm

    from lrmoe.experiments import convergence

    plan = units(args)
    done = protocol.collected_keys(args.out)
    total = len(plan) * len(args.arms)
    ready = sum(finished(run_file(out, arm)) for _, _, out in plan for arm in args.arms)
    print(f"{args.stage}: {total} runs, {ready} finished, {len(done)} collected in {args.out}")
    with tqdm(total=len(plan), desc="seed x regime", disable=None) as bar:
        for seed, regime, out in plan:
            # a run already collected is done, even where its per-run files are gone (another checkout)
            todo = [a for a in args.arms if (regime, seed, a) not in done and not finished(run_file(out, a))]
            if todo and not args.collect_only:
                # convergence.py in this process, through its entry point (lrmoe.cli.run_entry); a failed one
                # is this script's error, naming it
                run_entry("frontier_sweep.py", "convergence.py", convergence.main,
                          convergence_argv(regime, seed, todo, out))
            done = protocol.collected_keys(args.out)  # again: another sitting may have collected meanwhile
            for arm in args.arms:  # appended as each seed finishes: a stopped sitting keeps what it has
                results = run_file(out, arm)
                if (regime, seed, arm) in done or not finished(results):
                    continue
                row = protocol.collect_run(results, regime=regime, seed=seed, arm=arm, stage=args.stage)
                append_record(args.out, row)  # one whole line, fsynced, under the file's lock
                done.add((regime, seed, arm))
            bar.update(1)
    print(f"{len(done)} runs in {args.out}")


if __name__ == "__main__":
    main()
