"""The step benchmark: one training step split into its phases (plan, forward exchange, expert compute, backward
exchange, replica gradients, optimizer and redistribution, records, evaluation, the rest, and the emulated engine's
hand-offs between ranks), for every system of the time-to-quality protocol on the emulated engine at its shape, on the
distributed engine's gloo ranks, and the dense single-process reference of the same model on the same tokens (the
arithmetic floor); medians over the steps after the warm-up (lrmoe.harness.step_bench).

With --baseline-python (the interpreter of another checkout, e.g. a worktree of an earlier revision set up with
make setup), each run is repeated by that checkout's code, the two alternating, and the losses are compared bit for
bit.

    python experiments/bench_step.py --out outputs/bench_step.jsonl
    python experiments/bench_step.py --baseline-python ../old/.venv/bin/python --out outputs/bench_step.jsonl
    python experiments/bench_step.py --quick --out outputs/bench_step_quick.jsonl        # two systems, few steps
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lrmoe.cli import positive_int_arg, script_parser, system_arg
from lrmoe.integrations.tracking_args import check_tracking_args

ENGINES = ("emulated", "distributed")


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/bench_step.jsonl")
    parser.add_argument("--systems", nargs="+", type=system_arg, default=None,
                        help="systems to run (default: the time-to-quality protocol's, each once)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="engines to run")
    parser.add_argument("--steps", type=positive_int_arg, default=16,
                        help="training steps per run (evaluation at step 15 and the last, as the protocol's rate)")
    parser.add_argument("--warmup", type=positive_int_arg, default=3, help="steps left out of the medians")
    parser.add_argument("--dist-ranks", type=positive_int_arg, default=4, help="gloo ranks of the distributed engine")
    parser.add_argument("--baseline-python", default=None,
                        help="another checkout's interpreter: every run repeated by its code, side by side")
    parser.add_argument("--run-timeout", type=positive_int_arg, default=1800, help="seconds one run may take")
    parser.add_argument("--quick", action="store_true", help="two systems, 6 steps, warm-up 2 (tests)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "bench_step")
    if args.quick:
        args.steps, args.warmup = 6, 2
        args.systems = args.systems or ["static-ep", "lrmoe-rho0.75-unbiased"]
    if args.systems is None:
        from lrmoe.analysis import tq_protocol as P

        args.systems = list(dict.fromkeys(arm for arm, _ in P.SEED_RUNS))
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.baseline_python and not Path(args.baseline_python).is_file():
        parser.error(f"--baseline-python {args.baseline_python}: no such interpreter")
    return args


def runs(args) -> list[tuple[str, str, list[str]]]:
    """(engine, system, train.py arguments) of every run: a time-to-quality run of the system (its identity,
    docs/protocols/time_to_quality.md §11.1, production regime) cut to --steps, evaluation every 15 steps as there;
    on the distributed engine the same on --dist-ranks gloo ranks with that world's spare slots."""
    from lrmoe.analysis import protocol
    from lrmoe.analysis import tq_protocol as P
    from lrmoe.config import model_preset
    from lrmoe.harness.step_bench import with_values

    regime = protocol.get_regime("production")
    spare = regime.spare_slots(model_preset(P.PRESET).num_experts, args.dist_ranks)
    out = []
    for engine in args.engines:
        for system in args.systems:
            argv = with_values(P.TQRun("pilot", "production", 2000, system, 1.0).identity_argv(),
                               {"--steps": str(args.steps), "--warmup": str(min(P.WARMUP, args.steps - 1))})
            if engine == "distributed":
                argv = with_values(argv, {"--engine": "distributed", "--ranks": str(args.dist_ranks),
                                          "--extra-slots": str(spare)})
            out.append((engine, system, argv))
    return out


def main(argv=None):
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lrmoe.analysis import tq_protocol as P
    from lrmoe.harness import step_bench
    from lrmoe.integrations.tracking import Tracker
    from lrmoe.paper_figures.run_figures import step_phases

    with Tracker("bench_step", vars(args), results=args.out, seed=0, overwrite=args.overwrite, resume=args.resume,
                 wandb=not args.no_wandb) as run:
        rows = step_bench.bench(runs(args), args.steps, args.warmup,
                                {"preset": P.PRESET, "ranks": P.RANKS, "batch": P.BATCH, "seq_len": P.SEQ_LEN},
                                args.baseline_python, args.run_timeout)
        for row in rows:
            run.log(row)
        run.log_summary(step_bench.summary(rows))
        fig, _ = step_phases(run.results)
        figs = run.log_figure("phases", fig)
        plt.close(fig)
        print(step_bench.table(rows))
        print(f"results: {args.out}; figure: {figs[0]}")
    return rows


if __name__ == "__main__":
    main()
