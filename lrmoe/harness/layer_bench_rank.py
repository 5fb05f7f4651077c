"""One rank of the layer benchmark (experiments/layer_bench.py): every trace and policy on the real
expert-parallel layer, the policies taking turns inside each step in an order that rotates from step to step, one
record per (trace, policy, measured step) with the accountant's counters.

One iteration = forward, backward of a random linear loss, data-parallel sync of the router, the experts' optimizer
step with redistribution into the next placement. Before each timed iteration an untimed one computes the full
gradient at the same weights and inputs (:mod:`lrmoe.harness.gradient_error`), unless ``no_grad_error``; the counted
bytes and pairs are checked against the formulas of :mod:`lrmoe.runtime.distributed.accounting` every iteration.

``run_rank`` reads the benchmark's arguments (an argparse namespace): those of
:mod:`lrmoe.harness.layer_bench_setup`, and ``model``, ``hidden``, ``ffn``, ``policies``, ``replica_grad``,
``dtype``, ``no_grad_error``. ``run_ranks`` runs it on every rank (torchrun's, or the fork launcher's) and hands
the records to the script's report.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from tqdm import tqdm

from lrmoe.bytemodel.layout import BACKWARD_PHASES, FORWARD_PHASES, STEP_PHASES
from lrmoe.config import model_preset
from lrmoe.harness.gradient_error import full_gradient, gradient_errors
from lrmoe.harness.layer_bench_setup import buffer_load, make_policy, make_traces, memory_model, system_context
from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_layer, expected_step
from lrmoe.runtime.distributed.replica import RangeGroups
from lrmoe.runtime.layer import EPMoELayer, initial_placement
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.runtime.routing import RouterOutput

T = TypeVar("T")


def tokens_from_counts(counts_E: torch.Tensor, num_tokens: int, top_k: int, gen: torch.Generator):
    """Per-token choices with exactly these per-expert pair counts (each ≤ num_tokens, summing to T·k) and random
    gate weights. Pairs sorted by expert are dealt round-robin to tokens, so a token's k pairs are num_tokens
    apart in that order and (as each expert's run is at most num_tokens long) always distinct experts."""
    counts_E = counts_E.long()
    if int(counts_E.sum()) != num_tokens * top_k or int(counts_E.max()) > num_tokens:
        raise ValueError(f"counts_E must sum to tokens·k = {num_tokens * top_k} with each ≤ {num_tokens}, "
                         f"got sum {int(counts_E.sum())}, max {int(counts_E.max())}")
    experts = torch.repeat_interleave(torch.arange(counts_E.numel()), counts_E)
    idx_TK = experts.view(top_k, num_tokens).T.contiguous()
    w_TK = torch.rand(num_tokens, top_k, generator=gen, dtype=torch.float64) + 0.1
    return RouterOutput(idx_TK, (w_TK / w_TK.sum(1, keepdim=True)).float(), None)


def phase_sum(record: dict, phases, unit: str) -> float:
    """The sum of ``unit`` (e.g. ``wall_ms``) over ``phases`` in one accountant record (0 for a phase not run)."""
    return sum(record.get(f"{p}.{unit}", 0.0) for p in phases)


def run_rank(rank: int, args, device: torch.device) -> list[dict]:
    """Every trace and policy on this rank: one record per (trace, policy, measured step) with its counters."""
    N = dist.get_world_size()
    cfg = model_preset(args.model)
    cfg = replace(cfg, hidden=args.hidden or cfg.hidden, expert_ffn=args.ffn or cfg.expert_ffn)
    E, D, F, K = cfg.num_experts, cfg.hidden, cfg.expert_ffn, cfg.top_k
    if E % N:
        raise ValueError(f"num_experts={E} of --model {args.model} is not divisible by {N} ranks")
    dtype = getattr(torch, args.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    base = E // N
    ref = ReferenceMoE(D, F, E, K, cfg.router, seed=args.seed, dtype=torch.float32)
    groups = RangeGroups()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    records = []
    for label, counts_INE, T in make_traces(args, N, E, K, cfg.name):
        memory = memory_model(base, args.spare_slots, T, K, D, F, elem, buffer_load(args))
        ctx = system_context(args, N, E, memory, T, K)
        layers = {}
        modes = list(dict.fromkeys(args.replica_grad))
        for name in args.policies:
            for mode in modes:
                policy, backward = make_policy(name, ctx)
                acc = Accountant(sync=sync)
                layer = EPMoELayer(ref.export_weights(), K, cfg.router, policy,
                                   initial_placement(policy, N, E, T * K), groups, routed_scaling=cfg.routed_scaling,
                                   dtype=dtype, device=device, accountant=acc, backward=backward, replica_grad=mode)
                layers[name if len(modes) == 1 else f"{name} ({mode})"] = (policy, backward, acc, layer, mode)
        # a progress bar on rank 0 (the ranks run in step): every policy per step
        for step in tqdm(range(args.warmup + args.steps), desc=label, unit="step", disable=rank != 0):
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
            routing = tokens_from_counts(counts_INE[step, rank], T, K, gen)
            x_TD = torch.randn(T, D, generator=gen).to(device, dtype)
            dy_TD = torch.randn(T, D, generator=gen).to(device, dtype)
            names = list(layers)
            shift = step % len(names)
            for name in names[shift:] + names[:shift]:  # the policies take turns, the first one rotating
                policy, backward, acc, layer, mode = layers[name]
                errors = {}
                if not args.no_grad_error:
                    full_shards, full_dx = full_gradient(layer, policy, routing, x_TD, dy_TD, 1.0 / N)
                acc.reset()
                x = x_TD.clone().requires_grad_(True)
                y_TD, info = layer(x, routing=routing)
                (y_TD * dy_TD).sum().backward()
                layer.sync_dense_grads(1.0 / N)
                before = layer.placement_NS.clone()
                after = layer.expert_step(grad_scale=1.0 / N)
                plan = info.dispatch.plan
                want = expected_layer(plan, D, F, elem, backward.metric, backward.compact)
                want.update(expected_step(before, after, E, D, F, elem, replica_grad=mode))
                record = acc.record()
                check_accounting(record, want, rank)  # raises if any counted byte or pair differs from the formula
                if not args.no_grad_error:
                    errors = gradient_errors(layer.store.grad_shards_EW, full_shards, x.grad, full_dx)
                for p in layer.dense_parameters():
                    p.grad = None
                if step < args.warmup:
                    continue
                slots = int((before >= 0).sum())
                records.append({
                    "trace": label, "policy": name, "replica_grad": mode, "step": step - args.warmup, "rank": rank,
                    "replica_slots": slots, "slots_per_rank": layer.slots_per_rank,
                    "fwd_wall_ms": phase_sum(record, FORWARD_PHASES, "wall_ms"),
                    "bwd_wall_ms": phase_sum(record, BACKWARD_PHASES, "wall_ms"),
                    "fwd_cpu_ms": phase_sum(record, FORWARD_PHASES, "cpu_ms"),
                    "bwd_cpu_ms": phase_sum(record, BACKWARD_PHASES, "cpu_ms"),
                    "step_wall_ms": phase_sum(record, STEP_PHASES, "wall_ms"),
                    "memory_bytes": layer.slots_per_rank * memory.slot_bytes + record.get("token_buffer_bytes", 0)
                    + record.get("bwd_buffer_bytes", 0),
                    "budget_bytes": memory.budget_bytes, "floor_excess": int(plan.floor_excess_N[rank]),
                    **errors, **record})
    return records


def fork_rank(rank: int, args) -> list[dict]:
    """One rank of the fork launcher: gloo on the CPU."""
    return run_rank(rank, args, torch.device("cpu"))


def run_ranks(args, report: Callable[[list[dict], int], T]) -> T | None:
    """Every rank's records, then ``report(records, world_size)``: as one of torchrun's ranks (the records gathered
    on rank 0, which reports; the others return None), or on the fork launcher's ``args.ranks`` gloo ranks."""
    import os

    from lrmoe.runtime.distributed.comm import init_process_group_from_env
    from lrmoe.runtime.distributed.launch import launch
    from lrmoe.runtime.distributed.torchrun import torchrun_env

    if torchrun_env() is not None:  # one of torchrun's ranks
        info = init_process_group_from_env()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.world_size))
        records = run_rank(info.rank, args, info.device)
        gathered = [None] * info.world_size if info.rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
        out = report([r for part in gathered for r in part], info.world_size) if info.rank == 0 else None
        dist.barrier()
        dist.destroy_process_group()
        return out
    parts = launch(fork_rank, args.ranks, args, timeout_s=args.timeout)
    return report([r for part in parts for r in part], args.ranks)
