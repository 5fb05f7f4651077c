"""Time the planner per policy on one CPU thread: the old whole plan, and its critical-path and overlapped parts.

A plan is placement + what needs this micro-batch's counts (forward routing over the replicas, capacities, caps,
backward routing, quotas). The runtime computes the placement from the previous iteration's counts while an
iteration runs (lrmoe.runtime.placement_ahead), so only the rest is on the critical path between the counts
all-gather and the dispatch (DESIGN.md §4). Per policy, E and N, in one run:

* ``old_ms``: ``policy.plan`` per layer (two placements and the rest: the reference);
* ``overlapped_ms``: one placement per layer (what the background thread does once per layer and iteration);
* ``critical_path_layer_ms``: ``policy.plan_on`` per layer;
* ``critical_path_ms``: :func:`lrmoe.planner.batched.plan_layers` over ``--layers`` layers of one micro-batch,
  divided by the layers (per layer and micro-batch; ``batched_ms`` is the whole call);
* ``critical_path_layer_ratio``, ``overlapped_ratio``: ``plan_on`` and one placement over the old plan, timed back
  to back in each round, in a shuffled order (median of the rounds' ratios): what the simulator scales its
  measured whole-plan times by (:mod:`lrmoe.sim.overheads`), since on a loaded machine ratios hold better than
  times;
* ``reference_ms``, ``reference_critical_path_layer_ms``: the whole plan and ``plan_on`` per layer made by the
  previous implementation of the critical path (:mod:`lrmoe.planner.reference`, the planner before its NumPy
  rewrite), timed in the same run; ``critical_path_vs_reference_ratio`` and ``old_vs_reference_ratio``: ``plan_on``
  over the previous ``plan_on`` and ``plan`` over the previous ``plan``, back to back in shuffled rounds (median of
  the rounds' ratios; the plans are checked equal first).

Counts come from a synthetic trace (Zipf skew, AR(1) drift): step 0 is the previous iteration (placement input),
step 1 the one planned, one trace layer per planned layer.

    python experiments/bench_planner.py --experts 128 256 384 --ranks 16 64 256 --out outputs/bench_planner.jsonl
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

# The parser needs only these light modules; the measurements (lrmoe.harness.planner_bench), the planner, torch,
# pandas and matplotlib load in the functions that time and draw.
from lrmoe.cli import fraction_arg, non_negative_float_arg, non_negative_int_arg
from lrmoe.cli import SYSTEMS_HELP, script_parser, system_arg
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd

POLICY_NAMES = ("lrmoe", "lrmoe-rho0.75", "lrmoe-tight", "symi-dropless", "symi-cf1", "online-greedy", "static-ep",
                "capacity-cf1")


def check_args(args, parser: argparse.ArgumentParser) -> None:
    """One clear error for arguments that would fail mid-run: sizes, skew, and every system on every (E, N)."""
    from lrmoe.harness.planner_bench import system_context
    from lrmoe.systems import check_systems

    for name in ("experts", "ranks"):
        if any(v < 1 for v in getattr(args, name)):
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("top_k", "tokens_per_rank", "repeats", "batched_repeats", "paired_repeats", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    valid = args.skew_param > 0 if args.skew == "dirichlet" else args.skew_param >= 0
    if not valid:
        parser.error(f"--skew-param {args.skew_param:g} is not a valid {args.skew} parameter")
    cells = [(E, N) for E in args.experts for N in args.ranks if E % N == 0]
    if not cells:
        parser.error(f"no --ranks {args.ranks} divides any --experts {args.experts}: nothing to time")
    for E, N in cells:
        if args.top_k > E:
            parser.error(f"--top-k {args.top_k} exceeds {E} experts")
        try:
            check_systems(args.policies, system_context(E, N, args, args.tokens_per_rank * args.top_k * N))
        except ValueError as exc:
            parser.error(f"E={E}, N={N}: {exc}")


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/bench_planner.jsonl")
    parser.add_argument("--experts", type=int, nargs="+", default=[128, 256, 384], help="expert counts E to time")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256],
                        help="rank counts N to time (each (E, N) with N dividing E)")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers planned by one batched call")
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), type=system_arg,
                        help=f"systems whose planners are timed; {SYSTEMS_HELP}")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token")
    parser.add_argument("--tokens-per-rank", type=int, default=4096, help="tokens per rank of the synthetic trace")
    parser.add_argument("--skew", default="zipf", choices=["zipf", "dirichlet"],
                        help="family of the synthetic expert popularity")
    parser.add_argument("--skew-param", type=float, default=0.6,
                        help="its parameter: Zipf exponent s (>= 0) or Dirichlet alpha (> 0)")
    parser.add_argument("--extra-slots", type=non_negative_int_arg, default=1,
                        help="LRMoE replica slots per rank (SYMI: same total)")
    parser.add_argument("--eps", type=non_negative_float_arg, default=0.1,
                        help="LRMoE balance slack (fraction of the mean load a rank may exceed)")
    parser.add_argument("--gamma", type=fraction_arg, default=0.1,
                        help="LRMoE per-expert floor (fraction of each expert's pairs always kept)")
    parser.add_argument("--repeats", type=int, default=200, help="timed repetitions of each per-layer call")
    parser.add_argument("--batched-repeats", type=int, default=10, help="timed repetitions of the batched call")
    parser.add_argument("--paired-repeats", type=int, default=100,
                        help="rounds of the back-to-back timing of plan, plan_on and one placement (the shares)")
    parser.add_argument("--warmup", type=non_negative_int_arg, default=10, help="untimed calls before each timing")
    parser.add_argument("--no-stages", dest="stages", action="store_false", help="skip the per-stage timing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces")
    return parser


def main(argv=None) -> pd.DataFrame:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "bench_planner")
    check_args(args, parser)
    from lrmoe.harness.planner_bench import print_tables, run_benchmark, summarise
    from lrmoe.integrations.tracking import Tracker

    with Tracker("bench_planner", config=vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        frame = run_benchmark(args, log=run.log)
        summary = summarise(frame)
        run.log_summary(summary)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from lrmoe.paper_figures.run_figures import planner_time

        fig, _ = planner_time(run.results)
        figure = run.log_figure("planner_time", fig)
        plt.close(fig)
        print_tables(frame, summary)
        print(f"results: {args.out}; figure: {figure[0]}")
    return frame


if __name__ == "__main__":
    main()
