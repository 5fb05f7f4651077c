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
import math
import random
import statistics

from typing import TYPE_CHECKING

# The parser needs only these light modules; the planner, torch, pandas and matplotlib load in the functions that
# time and draw.
from lrmoe.cli import fraction_arg, non_negative_float_arg, non_negative_int_arg
from lrmoe.cli import SYSTEMS_HELP, script_parser, system_arg
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from lrmoe.systems import SystemContext

POLICY_NAMES = ("lrmoe", "lrmoe-rho0.75", "lrmoe-tight", "symi-dropless", "symi-cf1", "online-greedy", "static-ep",
                "capacity-cf1")
TARGET_MS = 0.3  # critical path per layer and micro-batch at E = 256, N = 256, batched over 48 layers


def system_context(num_experts: int, num_ranks: int, args, total_pairs: int) -> SystemContext:
    """SYMI gets the same slot budget as LRMoE (E/N + ``--extra-slots``); no memory model. lrmoe-tight: no balance
    slack and a memory cap of 90 % of the mean load, so the backward routing and the quotas do work on every
    rank."""
    from lrmoe.systems import SystemContext

    return SystemContext(num_experts=num_experts, num_ranks=num_ranks, spare_slots=args.extra_slots, eps=args.eps,
                         gamma=args.gamma, pairs_per_rank=total_pairs / num_ranks)


def layer_counts(num_ranks: int, num_experts: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts_LNE of the planned micro-batch, the previous iteration's global counts_LE), one per layer."""
    from lrmoe.traces.synthetic import generate_trace

    trace = generate_trace(2, args.layers, num_ranks, num_experts, args.top_k, args.tokens_per_rank, skew=args.skew,
                           skew_param=args.skew_param, seed=args.seed)
    return trace.counts_ILNE[1], trace.counts_ILNE[0].sum(1)


def stage_times(counts_NE, prev_E, args) -> dict[str, float]:
    """Median time of each stage of the LRMoE plan, called one by one through the public functions."""
    from lrmoe.harness.timing import time_ms
    from lrmoe.planner.placement import lrmoe_placement
    from lrmoe.planner.quotas import rank_caps, retention_quotas
    from lrmoe.planner.replica_routing import route_backward, route_forward

    N, E = counts_NE.shape
    base = E // N
    placement = lrmoe_placement(prev_E, N, base, args.extra_slots)
    fwd = route_forward(counts_NE, placement, "balanced")
    cap = rank_caps(fwd.sum(0).view(N, -1).sum(1), args.eps)
    flows = route_backward(fwd, placement, cap)
    stages = {
        "placement": lambda: lrmoe_placement(prev_E, N, base, args.extra_slots),
        "forward": lambda: route_forward(counts_NE, placement, "balanced"),
        "backward": lambda: route_backward(fwd, placement, rank_caps(fwd.sum(0).view(N, -1).sum(1), args.eps)),
        "quotas": lambda: retention_quotas(fwd, placement.reshape(-1), cap, args.gamma, flows),
    }
    return {f"{k}_ms": statistics.median(time_ms(f, args.repeats, args.warmup)) for k, f in stages.items()}


def growth_exponent(frame: pd.DataFrame, column: str = "critical_path_ms") -> float:
    """Least-squares slope of log(median time) against log(N·E)."""
    x = [math.log(v) for v in frame["NE"]]
    y = [math.log(v) for v in frame[column]]
    if len(set(x)) < 2:
        return float("nan")
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def paired_ratios(reference, others: dict, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median over ``repeats`` rounds of each function's time over the reference's in the same round: the calls of
    a round run back to back (a neighbour's load that changes slowly cancels out of the ratio), in an order shuffled
    per round (so that no call always finds the caches the one before it warmed)."""
    from lrmoe.harness.timing import time_once_ms

    ratios = {name: [] for name in others}
    calls = [("reference", reference), *others.items()]
    order = random.Random(seed)
    for _ in range(repeats):
        order.shuffle(calls)
        times = {name: time_once_ms(f) for name, f in calls}
        for name in others:
            ratios[name].append(times[name] / times["reference"])
    return {name: statistics.median(r) for name, r in ratios.items()}


def _median(f, repeats: int, warmup: int) -> tuple[float, float, float]:
    from lrmoe.harness.timing import time_ms

    times = time_ms(f, repeats, warmup)
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return statistics.median(times), q[0], q[-1]


def time_policy(name: str, counts_LNE: torch.Tensor, prev_LE: torch.Tensor, args) -> dict:
    """One record: the old plan, the overlapped placement and the critical path (per layer and batched) of one
    policy on layer 0's counts (per-layer timings) and on every layer's (the batched call), after checking that
    the batched plans are the per-layer ones."""
    import torch

    from lrmoe.planner import reference
    from lrmoe.planner.batched import plan_layers, vectorised
    from lrmoe.planner.policies import placement_popularity
    from lrmoe.systems import get_system

    L, N, E = counts_LNE.shape
    total = int(counts_LNE[0].sum())
    policies = [get_system(name).make_policy(system_context(E, N, args, total)) for _ in range(L)]
    policy, counts_NE, prev_E = policies[0], counts_LNE[0], prev_LE[0]
    placements = [p.placement(placement_popularity(prev_LE[i], E), N, int(counts_LNE[i].sum()))
                  for i, p in enumerate(policies)]
    plan = policy.plan(counts_NE, prev_E).validate(counts_NE)
    batched = plan_layers(policies, counts_LNE, placements)
    for i in (0, L - 1):
        if not torch.equal(batched[i].fwd_NG, policies[i].plan_on(counts_LNE[i], placements[i]).fwd_NG):
            raise AssertionError(f"{name}: the batched plan of layer {i} differs from its per-layer plan")
    if not torch.equal(reference.plan_on(policy, counts_NE, placements[0]).keep_NG,
                       policy.plan_on(counts_NE, placements[0]).keep_NG):
        raise AssertionError(f"{name}: plan_on differs from the previous implementation's")
    old = _median(lambda: policy.plan(counts_NE, prev_E), args.repeats, args.warmup)
    placed = _median(lambda: policy.placement(placement_popularity(prev_E, E), N, total), args.repeats, args.warmup)
    layer = _median(lambda: policy.plan_on(counts_NE, placements[0]), args.repeats, args.warmup)
    whole = _median(lambda: plan_layers(policies, counts_LNE, placements), args.batched_repeats, 1)
    paired = paired_ratios(lambda: policy.plan(counts_NE, prev_E), {
        "critical_path_layer_ratio": lambda: policy.plan_on(counts_NE, placements[0]),
        "overlapped_ratio": lambda: policy.placement(placement_popularity(prev_E, E), N, total)},
        args.paired_repeats, args.seed)
    ref_old = _median(lambda: reference.plan(policy, counts_NE, prev_E), args.repeats, args.warmup)
    ref_layer = _median(lambda: reference.plan_on(policy, counts_NE, placements[0]), args.repeats, args.warmup)
    paired_ref = paired_ratios(lambda: reference.plan_on(policy, counts_NE, placements[0]), {
        "critical_path_vs_reference_ratio": lambda: policy.plan_on(counts_NE, placements[0])},
        args.paired_repeats, args.seed)
    paired_ref.update(paired_ratios(lambda: reference.plan(policy, counts_NE, prev_E), {
        "old_vs_reference_ratio": lambda: policy.plan(counts_NE, prev_E)}, args.paired_repeats, args.seed))
    stats = plan.stats()
    row = {"policy": name, "E": E, "N": N, "NE": N * E, "layers": L, "slots_per_rank": plan.slots_per_rank,
           "vectorised": vectorised(policy),
           "old_ms": old[0], "old_p10_ms": old[1], "old_p90_ms": old[2],
           "overlapped_ms": placed[0], "overlapped_p10_ms": placed[1], "overlapped_p90_ms": placed[2],
           "critical_path_layer_ms": layer[0], "critical_path_layer_p10_ms": layer[1],
           "critical_path_layer_p90_ms": layer[2],
           "critical_path_ms": whole[0] / L, "critical_path_p10_ms": whole[1] / L, "critical_path_p90_ms": whole[2] / L,
           "batched_ms": whole[0], "speedup_vs_old": old[0] / (whole[0] / L), **paired,
           "reference_ms": ref_old[0], "reference_p10_ms": ref_old[1], "reference_p90_ms": ref_old[2],
           "reference_critical_path_layer_ms": ref_layer[0], "reference_critical_path_layer_p10_ms": ref_layer[1],
           "reference_critical_path_layer_p90_ms": ref_layer[2], **paired_ref,
           "fwd_imbalance": stats["fwd_imbalance"], "bwd_max_over_fwd_mean": stats["bwd_max_over_fwd_mean"],
           "retained_frac": stats["retained_frac"], "dropped_frac": stats["dropped_frac"],
           "moved_pairs": stats["moved_pairs"], "floor_excess": stats["floor_excess"]}
    if name == "lrmoe" and args.stages:
        row.update(stage_times(counts_NE, prev_E, args))
    return row


def run_benchmark(args, log=lambda record: None) -> pd.DataFrame:
    import pandas as pd
    import torch

    torch.set_num_threads(1)
    rows = []
    for E in args.experts:
        for N in args.ranks:
            if E % N:
                continue
            counts_LNE, prev_LE = layer_counts(N, E, args)
            for name in args.policies:
                row = time_policy(name, counts_LNE, prev_LE, args)
                log(row)
                rows.append(row)
    return pd.DataFrame(rows)


def check_args(args, parser: argparse.ArgumentParser) -> None:
    """One clear error for arguments that would fail mid-run: sizes, skew, and every system on every (E, N)."""
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
    from lrmoe.integrations.tracking import Tracker

    with Tracker("bench_planner", config=vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        frame = run_benchmark(args, log=run.log)
        summary = {}
        for name, group in frame.groupby("policy", sort=False):
            for column in ("old_ms", "critical_path_ms", "overlapped_ms", "reference_ms",
                           "reference_critical_path_layer_ms"):
                summary[f"{name}/growth_exponent_{column}"] = growth_exponent(group, column)
        target = frame[(frame.E == 256) & (frame.N == 256)]
        for _, row in target.iterrows():
            summary[f"{row.policy}/E256_N256_critical_path_ms"] = float(row.critical_path_ms)
            summary[f"{row.policy}/meets_target"] = bool(row.critical_path_ms <= TARGET_MS)
        run.log_summary({**summary, "target_ms": TARGET_MS})
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from lrmoe.paper_figures.run_figures import planner_time

        fig, _ = planner_time(run.results)
        figure = run.log_figure("planner_time", fig)
        plt.close(fig)
        cols = ["policy", "E", "N", "slots_per_rank", "vectorised", "reference_ms", "old_ms", "overlapped_ms",
                "reference_critical_path_layer_ms", "critical_path_layer_ms", "critical_path_ms",
                "critical_path_vs_reference_ratio", "speedup_vs_old"]
        print(frame[cols].to_markdown(index=False, floatfmt=".3f"))
        stage_cols = [c for c in ("placement_ms", "forward_ms", "backward_ms", "quotas_ms") if c in frame]
        if stage_cols:
            print("\nLRMoE stages (median ms, called one by one):")
            stages = frame[frame.policy == "lrmoe"][["E", "N"] + stage_cols].astype({"E": int, "N": int})
            print(stages.to_markdown(index=False, floatfmt=["g", "g"] + [".3f"] * len(stage_cols)))
        print("\ngrowth with N·E (exponent of a power-law fit): old plan / critical path / overlapped")
        for name in frame["policy"].unique():
            print(f"  {name}: " + " / ".join(f"{summary[f'{name}/growth_exponent_{c}']:.2f}"
                                           for c in ("old_ms", "critical_path_ms", "overlapped_ms")))
        print(f"results: {args.out}; figure: {figure[0]}")
    return frame


if __name__ == "__main__":
    main()
