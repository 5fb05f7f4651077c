"""Time one MoE layer's plan per policy on one CPU thread, and how it grows with N·E.

The full LRMoE plan is placement + dropless forward routing + caps + backward replica routing + quotas (one call
to ``LRMoE.plan``); the target (DESIGN.md §5.8) is <= 1 ms per layer at E = 128, N = 64, so that planning all 48
layers of Qwen3-30B-A3B stays a small fraction of an iteration. Counts come from a synthetic trace (Zipf skew, AR(1)
drift): step 0 is the previous iteration (placement input), step 1 the one planned.

    python experiments/bench_planner.py --ranks 8 16 64 --out outputs/bench_planner.jsonl
"""

from __future__ import annotations

import argparse
import math
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import torch

from lrmoe.harness.timing import time_ms
from lrmoe.planner.placement import lrmoe_placement
from lrmoe.planner.quotas import rank_caps, retention_quotas
from lrmoe.planner.replica_routing import route_backward, route_forward
from lrmoe.systems import SystemContext, check_systems, get_system, system_arg, system_names_help
from lrmoe.integrations.tracking import Tracker, add_tracking_args, check_tracking_args
from lrmoe.traces.synthetic import generate_trace

POLICY_NAMES = ("lrmoe", "lrmoe-tight", "symi-dropless", "symi-cf1", "static-ep", "capacity-cf1")
TARGET_MS = 1.0


def system_context(num_experts: int, num_ranks: int, args, total_pairs: int) -> SystemContext:
    """SYMI gets the same slot budget as LRMoE (E/N + ``--extra-slots``); no memory model. lrmoe-tight: no balance
    slack and a memory cap of 90 % of the mean load, so the backward routing and the quotas do work on every
    rank."""
    return SystemContext(num_experts=num_experts, num_ranks=num_ranks, spare_slots=args.extra_slots, eps=args.eps,
                         gamma=args.gamma, pairs_per_rank=total_pairs / num_ranks)


def layer_counts(num_ranks: int, num_experts: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts_NE of the planned iteration, previous iteration's global counts_E) from a synthetic trace."""
    trace = generate_trace(2, 1, num_ranks, num_experts, args.top_k, args.tokens_per_rank, skew=args.skew,
                           skew_param=args.skew_param, seed=args.seed)
    return trace.counts_ILNE[1, 0], trace.counts_ILNE[0, 0].sum(0)


def stage_times(counts_NE, prev_E, args) -> dict[str, float]:
    """Median time of each stage of the LRMoE plan, called one by one through the public functions."""
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


def growth_exponent(frame: pd.DataFrame) -> float:
    """Least-squares slope of log(median time) against log(N·E)."""
    x = [math.log(v) for v in frame["NE"]]
    y = [math.log(v) for v in frame["median_ms"]]
    if len(set(x)) < 2:
        return float("nan")
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def run_benchmark(args, log=lambda record: None) -> pd.DataFrame:
    torch.set_num_threads(1)
    rows = []
    for E in args.experts:
        for N in args.ranks:
            if E % N:
                continue
            counts_NE, prev_E = layer_counts(N, E, args)
            total = int(counts_NE.sum())
            for name in args.policies:
                policy = get_system(name).make_policy(system_context(E, N, args, total))
                plan = policy.plan(counts_NE, prev_E).validate(counts_NE)
                times = time_ms(lambda: policy.plan(counts_NE, prev_E), args.repeats, args.warmup)
                q = statistics.quantiles(times, n=10)
                stats = plan.stats()
                row = {"policy": name, "E": E, "N": N, "NE": N * E, "slots_per_rank": plan.slots_per_rank,
                       "median_ms": statistics.median(times), "p10_ms": q[0], "p90_ms": q[-1],
                       "layers48_ms": 48 * statistics.median(times),
                       "fwd_imbalance": stats["fwd_imbalance"], "bwd_max_over_fwd_mean": stats["bwd_max_over_fwd_mean"],
                       "retained_frac": stats["retained_frac"], "dropped_frac": stats["dropped_frac"],
                       "moved_pairs": stats["moved_pairs"], "floor_excess": stats["floor_excess"]}
                if name == "lrmoe" and args.stages:
                    row.update(stage_times(counts_NE, prev_E, args))
                log(row)
                rows.append(row)
    return pd.DataFrame(rows)


def plot(frame: pd.DataFrame):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    styles = dict(zip(sorted(frame["E"].unique()), ["-", "--", ":", "-."]))
    colors = {name: f"C{i}" for i, name in enumerate(frame["policy"].unique())}
    for (name, E), group in frame.groupby(["policy", "E"], sort=False):
        group = group.sort_values("NE")
        ax.errorbar(group["NE"], group["median_ms"], yerr=[group["median_ms"] - group["p10_ms"],
                                                         group["p90_ms"] - group["median_ms"]],
                    marker="o", ms=4, capsize=2, color=colors[name], ls=styles.get(E, "-"), label=f"{name}, E={E}")
    ax.axhline(TARGET_MS, color="k", ls="--", lw=1, label="target (1 ms)")
    ax.set(xscale="log", yscale="log", xlabel="N · E (ranks × experts)", ylabel="plan time per layer (ms)",
           title="Planner time, one CPU thread (median, p10–p90)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def check_args(args, parser: argparse.ArgumentParser) -> None:
    """One clear error for arguments that would fail mid-run: sizes, skew, and every system on every (E, N)."""
    for name in ("experts", "ranks"):
        if any(v < 1 for v in getattr(args, name)):
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("top_k", "tokens_per_rank", "repeats"):
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


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[128])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), type=system_arg,
                        help=system_names_help())
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--skew", default="zipf", choices=["zipf", "dirichlet"])
    parser.add_argument("--skew-param", type=float, default=0.6)
    parser.add_argument("--extra-slots", type=int, default=1, help="LRMoE replica slots per rank (SYMI: same total)")
    parser.add_argument("--eps", type=float, default=0.1)
    parser.add_argument("--gamma", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--no-stages", dest="stages", action="store_false", help="skip the per-stage timing")
    parser.add_argument("--seed", type=int, default=0)
    add_tracking_args(parser, "outputs/bench_planner.jsonl")
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "bench_planner")
    check_args(args, parser)
    with Tracker("bench_planner", config=vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        frame = run_benchmark(args, log=run.log)
        summary = {}
        for name, group in frame.groupby("policy", sort=False):
            summary[f"{name}/growth_exponent"] = growth_exponent(group)
        target = frame[(frame.policy == "lrmoe") & (frame.E == 128) & (frame.N == 64)]
        if len(target):
            summary["lrmoe/E128_N64_median_ms"] = float(target["median_ms"].iloc[0])
            summary["lrmoe/meets_1ms_target"] = bool(target["median_ms"].iloc[0] <= TARGET_MS)
        run.log_summary(summary)
        figure = run.log_figure("planner_time", plot(frame))
        cols = ["policy", "E", "N", "slots_per_rank", "median_ms", "p10_ms", "p90_ms", "layers48_ms",
                "fwd_imbalance", "bwd_max_over_fwd_mean", "retained_frac", "dropped_frac"]
        print(frame[cols].to_markdown(index=False, floatfmt=".3f"))
        stage_cols = [c for c in ("placement_ms", "forward_ms", "backward_ms", "quotas_ms") if c in frame]
        if stage_cols:
            print("\nLRMoE stages (median ms, called one by one):")
            stages = frame[frame.policy == "lrmoe"][["E", "N"] + stage_cols].astype({"E": int, "N": int})
            print(stages.to_markdown(index=False, floatfmt=["g", "g"] + [".3f"] * len(stage_cols)))
        print("\ngrowth of the median time with N·E (exponent of a power-law fit):")
        print("\n".join(f"  {k.split('/')[0]}: {v:.2f}" for k, v in summary.items() if k.endswith("growth_exponent")))
        print(f"results: {args.out}; figure: {figure[0]}")
    return frame


if __name__ == "__main__":
    main()
