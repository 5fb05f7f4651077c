"""The planner benchmark's measurements (``experiments/bench_planner.py``): per policy, E and N, the old whole plan,
one placement (the overlapped part), ``plan_on`` per layer and the batched critical path, the previous
implementation's times (:mod:`lrmoe.planner.reference`), the back-to-back ratios, the LRMoE stages; then the run's
summary (growth with N·E, the target at E = N = 256) and its Markdown tables. torch, pandas and the planner load in
the functions that need them."""

from __future__ import annotations

import math
import random
import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from lrmoe.systems import SystemContext

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
    """Every policy on every (E, N) with N dividing E, one thread; each record passed to ``log`` as it is made."""
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


def summarise(frame: pd.DataFrame) -> dict:
    """The run's summary: per policy, the growth exponent of each time with N·E, and at E = N = 256 the critical
    path and whether it meets :data:`TARGET_MS`."""
    summary = {}
    for name, group in frame.groupby("policy", sort=False):
        for column in ("old_ms", "critical_path_ms", "overlapped_ms", "reference_ms",
                       "reference_critical_path_layer_ms"):
            summary[f"{name}/growth_exponent_{column}"] = growth_exponent(group, column)
    target = frame[(frame.E == 256) & (frame.N == 256)]
    for _, row in target.iterrows():
        summary[f"{row.policy}/E256_N256_critical_path_ms"] = float(row.critical_path_ms)
        summary[f"{row.policy}/meets_target"] = bool(row.critical_path_ms <= TARGET_MS)
    return {**summary, "target_ms": TARGET_MS}


def print_tables(frame: pd.DataFrame, summary: dict) -> None:
    """The per-policy times, the LRMoE stages (when timed) and the growth exponents, as Markdown on stdout."""
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
