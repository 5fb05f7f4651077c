"""CPU timing of the replica-gradient path (DESIGN.md §3.4): replica sync + gradient collection of one
:class:`~lrmoe.runtime.distributed.replica.ReplicaStore`, per mode, on forked gloo ranks.

Three variants, on the same placement and slot gradients:

* ``range``: the store's range mode (per expert, a reduce-scatter and an all-gather in its range group, summed in
  ascending host order so that it matches the shard mode bit for bit), then the point-to-point collection;
* ``shard``: the store's shard mode (one variable all-to-all for all experts, the owners add what they get);
* ``range-allreduce`` (reference): the path before the two modes, one backend ``all_reduce`` per expert in its
  range group, then the same collection. Its summation order is the backend's, so it is timed only.

A repetition's time is the slowest rank's (the phase group ends when the last rank is done), the result the
median over repetitions. Usage: ``time_replica_grad(placement_NS, num_experts, hidden, ffn)``, or
``python -m lrmoe.harness.replica_sync_timing`` for SYMI-like and LRMoE-like placements on 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import RangeGroups, ReplicaStore, sync_plan

VARIANTS = ("range", "shard", "range-allreduce")


def _allreduce_sync(store: ReplicaStore) -> None:
    """The pre-mode range sync: one backend all-reduce per expert over its range (order: the backend's)."""
    plan = sync_plan(store.placement_NS, store.num_experts)
    reduced = {}
    for e in range(store.num_experts):
        lo, hi = plan.span_E2[e].tolist()
        if not lo <= store.rank <= hi:
            continue
        buf = store._local_sum(e)
        if hi > lo:
            dist.all_reduce(buf, group=store.groups.get(lo, hi))
        reduced[e] = buf
    store._reduced = reduced


def _rank_times(rank: int, placement_NS: torch.Tensor, num_experts: int, hidden: int, ffn: int,
                variants: tuple[str, ...], repeats: int, warmup: int, seed: int) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    w = (torch.randn(num_experts, hidden, ffn), torch.randn(num_experts, hidden, ffn),
         torch.randn(num_experts, ffn, hidden))
    groups = RangeGroups(all_ranges=True)  # the backend all-reduce variant times the range groups
    grad_SW = torch.randn(placement_NS.shape[1], 3 * hidden * ffn, generator=torch.Generator().manual_seed(rank))
    out = {}
    for variant in variants:
        mode = "shard" if variant == "shard" else "range"
        store = ReplicaStore(*w, placement_NS, groups, replica_grad=mode)
        store.slots_SW.grad = grad_SW

        def once():
            if variant == "range-allreduce":
                _allreduce_sync(store)
            else:
                store.sync_replica_grads()
            store.collect_grad_shards()

        times = []
        for i in range(warmup + repeats):
            dist.barrier()
            t0 = time.perf_counter()
            once()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        out[variant] = times
    return out


def time_replica_grad(placement_NS: torch.Tensor, num_experts: int, hidden: int, ffn: int,
                      variants: tuple[str, ...] = VARIANTS, repeats: int = 15, warmup: int = 3, seed: int = 0,
                      timeout_s: float = 300.0) -> dict[str, dict]:
    """Median (and per-repetition) milliseconds of replica sync + gradient collection per variant, the slowest
    rank's per repetition, on ``placement_NS.shape[0]`` forked gloo ranks."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    per_rank = launch(_rank_times, placement_NS.shape[0], placement_NS, num_experts, hidden, ffn, tuple(variants),
                      repeats, warmup, seed, timeout_s=timeout_s)
    result = {}
    for variant in variants:
        slowest = [max(r[variant][i] for r in per_rank) for i in range(repeats)]
        result[variant] = {"median_ms": statistics.median(slowest), "ms": slowest}
    return result


def example_placements(num_ranks: int = 4, num_experts: int = 16, extra_slots: int = 1,
                       seed: int = 0) -> dict[str, torch.Tensor]:
    """SYMI's contiguous and LRMoE's scattered placements for one skewed popularity (Zipf-like, synthetic)."""
    from lrmoe.planner.placement import lrmoe_placement, symi_placement

    g = torch.Generator().manual_seed(seed)
    pop_E = (1.0 / torch.arange(1, num_experts + 1).double() ** 0.8)[torch.randperm(num_experts, generator=g)]
    counts_E = (pop_E / pop_E.sum() * 10_000).round().long().clamp(min=1)
    base = num_experts // num_ranks
    return {"symi": symi_placement(counts_E, num_ranks, base + extra_slots),
            "lrmoe": lrmoe_placement(counts_E, num_ranks, base, extra_slots)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--extra-slots", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    out = {}
    for name, placement in example_placements(args.ranks, args.experts, args.extra_slots).items():
        res = time_replica_grad(placement, args.experts, args.hidden, args.ffn, repeats=args.repeats)
        out[name] = {"placement": placement.tolist(), **{v: round(r["median_ms"], 3) for v, r in res.items()}}
        print(name, json.dumps(out[name]))
    return out


if __name__ == "__main__":
    main()
