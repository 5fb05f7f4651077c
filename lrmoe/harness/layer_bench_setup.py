"""The layer benchmark's set-up, shared by experiments/layer_bench.py (which runs it on the real layer) and
experiments/validate_sim.py (which replays the same plans through the cost model): each system's policy and
backward as the benchmark runs it, the per-rank memory budget every policy gets, and the routing traces.

Functions of the benchmark's arguments (an argparse namespace or the run config of a results file, as a namespace):
``spare_slots``, ``eps``, ``gamma``, ``buffer_load``, and for the traces ``warmup``, ``steps``, ``skew``,
``skew_param``, ``tokens_per_rank``, ``seed``, ``trace``, ``trace_layer``.
"""

from __future__ import annotations

import math
from pathlib import Path

from lrmoe.bytemodel.memory import footprint
from lrmoe.planner.placement import MemoryModel
from lrmoe.systems import SystemContext, get_system
from lrmoe.traces.synthetic import generate_trace
from lrmoe.traces.trace import load_trace
from lrmoe.sim.simulator import micro_batch_counts


def system_context(args, num_ranks: int, num_experts: int, memory: MemoryModel, tokens: int,
                   top_k: int) -> SystemContext:
    """What every system is built from: ``--spare-slots`` replica slots per rank beyond E/N (SYMI uses them,
    LRMoE derives its replica slots and memory cap from ``memory``), LRMoE's eps and gamma, and the push cost of
    cost-aware online replication (``--push-cost-rows``; runs recorded before it had none)."""
    return SystemContext(num_experts=num_experts, num_ranks=num_ranks, spare_slots=args.spare_slots, eps=args.eps,
                         gamma=args.gamma, memory=memory, pairs_per_rank=tokens * top_k,
                         push_cost_rows=getattr(args, "push_cost_rows", None))


def make_policy(name: str, ctx: SystemContext):
    """(policy, backward config) of a system of :mod:`lrmoe.systems`, as this benchmark runs it: every system
    through the layer's hand-written backward (plans that keep every pair take its autograd-equivalent path)."""
    system = get_system(name)
    return system.make_policy(ctx), system.layer_backward(always=True)


def memory_model(base: int, spare: int, tokens: int, top_k: int, hidden: int, ffn: int, elem: int,
                 buffer_load: float) -> MemoryModel:
    """The per-rank budget every policy gets, in the one memory model (lrmoe.bytemodel.memory, the simulator's too):
    base +
    spare slots (weights and gradients) beside the buffers of a rank computing ceil(buffer_load · mean) pairs and
    sending its own mean load (saved activations, and the larger of the forward and backward in-flight buffers)."""
    fp = footprint(hidden, ffn, elem)
    planned = math.ceil(buffer_load * tokens * top_k - 1e-9)
    budget = float(MemoryModel.for_model(fp, 1.0).peak_bytes(base + spare, planned, tokens * top_k))
    return MemoryModel.for_model(fp, budget)


def buffer_load(args) -> float:
    """The memory budget's token buffers hold this many times the mean load."""
    return 1.0 + args.eps if args.buffer_load is None else args.buffer_load


def make_traces(args, num_ranks: int, num_experts: int, top_k: int, model: str):
    """[(label, counts_INE [steps, N, E], tokens per rank)]: the synthetic traces, then the recorded one (one
    micro-batch of each step where the trace records several per step)."""
    steps = args.warmup + args.steps
    out = []
    for s in args.skew_param:
        trace = generate_trace(steps, 1, num_ranks, num_experts, top_k, args.tokens_per_rank, skew=args.skew,
                               skew_param=s, seed=args.seed, exact=True, model=model)
        out.append((f"synthetic {args.skew} {s:g}", trace.counts_ILNE[:, 0], args.tokens_per_rank))
    if args.trace:
        trace = load_trace(args.trace)
        # a step of a trace that sums k micro-batches (its meta's micro_batches) is replayed as one of them: the
        # layer runs a micro-batch per forward and backward, as the simulator prices it
        counts_ILNE, k = micro_batch_counts(trace)
        if not 0 <= args.trace_layer < counts_ILNE.shape[1]:
            raise ValueError(f"--trace-layer {args.trace_layer}: --trace {args.trace} has layers 0 to "
                             f"{counts_ILNE.shape[1] - 1}")
        counts = counts_ILNE[:, args.trace_layer]
        if counts.shape[1:] != (num_ranks, num_experts) or counts.shape[0] < steps:
            raise ValueError(f"--trace {args.trace}: needs at least {steps} steps of [{num_ranks} ranks, "
                             f"{num_experts} experts], got {tuple(counts.shape)}")
        per_rank = counts[0].sum(1)
        if bool((per_rank != per_rank[0]).any()) or int(per_rank[0]) % top_k:
            raise ValueError(f"--trace {args.trace}: every rank must route the same number of tokens·k")
        empty = (counts[:steps].sum(-1) == 0).any(-1).nonzero().flatten()  # steps where a rank routes nothing
        if len(empty):
            raise ValueError(f"--trace {args.trace}: layer {args.trace_layer} routes no token on some rank in "
                             f"{len(empty)} of its first {steps} steps (first: step {int(empty[0])}); a trace of "
                             f"zero counts has no load to replay")
        label = f"recorded {Path(args.trace).stem}" + (f" (one of {k} micro-batches)" if k > 1 else "")
        out.append((label, counts[:steps], int(per_rank[0]) // top_k))
    return out
