"""One training run's whole iteration priced at paper scale from its own recorded routing
(docs/protocols/time_to_quality.md §11.3).

The run's trace (experiments/train.py ``--trace-out``) is replayed at the paper's tokens and layers
(:func:`lrmoe.traces.rescale.to_paper_scale`) and every step after the warm-up is planned and priced by the
simulator (:func:`lrmoe.sim.simulator.simulate`), with the system built as a sweep cell builds it
(:func:`lrmoe.sim.cells.build_systems`: the memory model, the planned-headroom rule, the regime's spare slots, eps
and gamma). The time of one iteration is the MoE layers' plus the dense part of the model (attention, router,
LM head), which is the same for every system (:func:`dense_seconds`).

    t = price_run(trace, "lrmoe-rho0.75-unbiased", model, cluster, tokens_per_rank=2048, micro_batches=8,
                  spare_slots=2, eps=0.1, gamma=0.1, warmup_steps=10)
    t.time_s, t.moe_s, t.dense_s, t.corners      # seconds per iteration; the constants band (§5.3)
    t.select_times                               # the selection's charge at 0.5, 1, 2, 4 x (§11.6 Record 3)

Paper layer l replays recorded layer ⌊l · L_run / L⌋, so every paper layer that replays the same recorded layer
sees the same counts and gets the same plans: each recorded layer is simulated once and weighted by the paper
layers that replay it (the same seconds as simulating all L paper layers; tests/test_tq_replay.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lrmoe.config import ClusterConfig, MoEConfig
from lrmoe.config import MICRO_BATCH_BAND, sensitivity_corners as corners
from lrmoe.sim.cells import Cell, CellRules, build_systems, cost_kwargs
from lrmoe.sim.simulator import SimResult, micro_batch_counts, simulate
from lrmoe.systems import get_system
from lrmoe.traces.rescale import layer_map, to_paper_scale
from lrmoe.traces.trace import Trace

# The dense part's matmuls at this fraction of the cluster's peak FLOP/s (ours, from a published figure):
# Megatron-LM trains GPT-3-sized dense transformers at 163 of 312 TFLOP/s per A100 (52 %; Narayanan et al.,
# "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21, Table 1), attention
# and all. Its band below spans a poorly and a very well tuned dense stack.
DENSE_EFFICIENCY = 0.5
DENSE_EFFICIENCY_BAND = (0.35, 0.65)
# The cost model's uncertain constants (DESIGN.md §5.3): GEMM efficiency, half-efficiency rows, link bandwidth as a
# fraction of the datasheet's; and micro-batches per iteration. The same ranges as experiments/ablate.py's band.
# Every micro-batch count of the band is priced, not only its ends (docs/protocols/time_to_quality.md §11.6 Record 3:
# check (6) at every count); and the recalibration selection's charge at these multiples of its measured value (a named
# sensitivity).
MICRO_BATCH_COUNTS = (1, 2, 4, 8, 16, 32)
SELECTION_SCALES = (0.5, 1.0, 2.0, 4.0)


def dense_flops_per_token(model: MoEConfig, seq_len: int) -> float:
    """Forward FLOPs of one token through the dense part of ``model`` (2 FLOPs per multiply-add): per MoE and dense
    layer the attention projections (q, k, v, o) and the causal attention itself (QKᵀ and AV over on average half
    of a ``seq_len`` context), per MoE layer the router, per dense layer its SwiGLU FFN, the shared experts, and
    the LM head once. Embedding lookups, norms and elementwise work are left out (memory-bound and small)."""
    d, hd = model.hidden, model.head_dim or model.hidden // model.num_heads
    q, kv = model.num_heads * hd, model.num_kv_heads * hd
    projections = d * q + 2 * d * kv + q * d
    attention = 2 * (seq_len / 2) * q  # QKᵀ and AV: each seq_len / 2 multiply-adds per query channel
    per_layer = 2 * (projections + attention)
    router = 2 * d * model.num_experts
    dense_ffn = 2 * 3 * d * model.dense_ffn
    shared = 2 * 3 * d * model.shared_ffn * model.num_shared_experts
    head = 2 * d * model.vocab_size
    return float(model.num_layers * per_layer + model.num_moe_layers * (router + shared)
                 + model.first_dense_layers * dense_ffn + head)


def dense_seconds(model: MoEConfig, cluster: ClusterConfig, tokens_per_rank: int, micro_batches: int,
                  efficiency: float = DENSE_EFFICIENCY, seq_len: int | None = None) -> float:
    """Seconds per iteration of the dense part on one rank: forward and backward (3 x the forward FLOPs) of
    ``micro_batches`` micro-batches of ``tokens_per_rank`` tokens, at ``efficiency`` of the cluster's peak. Every
    rank computes the same dense work (data parallel), so this is the same for every system. ``seq_len``: the
    attention's context (default: one micro-batch is one sequence, capped at the model's ``seq_len``). Its dense
    gradients' all-reduce and optimizer step are not priced (the same for every system, and overlapped with the
    backward in practice)."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"the dense part's efficiency must be in (0, 1], got {efficiency!r}")
    seq = min(tokens_per_rank, model.seq_len) if seq_len is None else seq_len
    flops = 3.0 * dense_flops_per_token(model, seq) * tokens_per_rank * micro_batches
    return flops / (efficiency * cluster.peak_flops)



@dataclass
class RunTime:
    """One run's modelled iteration at paper scale: seconds (whole, MoE layers, dense part), the replica-gradient
    mode it is priced in (the faster of range and shard), the steps priced, and the whole iteration's seconds at
    every corner of the constants band (``"<cost corner or base>|mb=<k>|dense=<eff>"``, ``k`` micro-batches, every
    count of :data:`MICRO_BATCH_COUNTS`), and at the central constants with the selection's charge scaled
    (``"select=<f>"`` for each ``f`` of :data:`SELECTION_SCALES`, in the same replica-gradient mode; 1 is ``time_s``).
    A corner's seconds reuse the simulated per-micro-batch phase times: the sync phases once, the rest ``k`` times,
    and the dense part ``k`` times, so at fixed other constants a corner is exactly affine in ``k``."""

    system: str
    time_s: float
    moe_s: float
    dense_s: float
    replica_grad: str
    steps_priced: int
    layer_weights: list[int]
    corners: dict[str, float] = field(default_factory=dict)
    select_times: dict[str, float] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)  # the simulator's summary (drops, imbalance, memory, slots)


def weighted_seconds(res: SimResult, weights_L: np.ndarray, variant: str | None = None,
                     micro_batches: int | None = None) -> float:
    """Mean seconds per iteration after the warm-up of ``res``'s layers, layer l counted ``weights_L[l]`` times."""
    phase_ILH = res.phase_ILH if variant is None else res.variant_ILH[variant]
    timed_ILH = phase_ILH[res.warmup:] if phase_ILH.shape[0] > res.warmup else phase_ILH
    w_L = timed_ILH.new_tensor(np.asarray(weights_L, dtype=np.float64))
    per_layer_LH = timed_ILH.mean(dim=0)
    return float(((per_layer_LH * w_L[:, None]).sum(0) * res.weights_H(micro_batches)).sum())


def check_top_k(trace: Trace, top_k: int) -> None:
    """A recorded trace routes the paper's top-k: its metadata's ``top_k``, or (train.py's traces) every row's pairs
    over its ``tokens_per_rank`` x ``micro_batches`` tokens, must be ``top_k``; ValueError otherwise."""
    k = trace.meta.get("top_k")
    tokens = trace.meta.get("tokens_per_rank")
    if k is None and tokens:
        per_row = trace.counts_array().sum(-1) / (tokens * (trace.meta.get("micro_batches") or 1))
        k = float(per_row.flat[0]) if np.all(per_row == per_row.flat[0]) else None
    if k is None:
        raise ValueError("the trace says neither its top_k nor its tokens per rank: its pairs per token are unknown")
    if k != top_k:
        raise ValueError(f"the trace routes {k:g} experts per token, the paper's model {top_k}: a recorded trace is "
                         f"replayed at its own routing shape (docs/protocols/time_to_quality.md §11.1)")


def price_run(trace: Trace, system: str, model: MoEConfig, cluster: ClusterConfig, tokens_per_rank: int,
              micro_batches: int, spare_slots: int, eps: float, gamma: float, warmup_steps: int,
              band: bool = True, dense_efficiency: float = DENSE_EFFICIENCY) -> RunTime:
    """``system``'s iteration at paper scale (``model`` on ``cluster``, ``micro_batches`` of ``tokens_per_rank``)
    replaying ``trace``'s steps from index ``warmup_steps`` on (module doc). The two steps before them plan the
    headroom rule's reference and the first priced step's placement, so ``warmup_steps`` must be at least 2.

    Errors (ValueError): a trace of other experts or ranks than the paper's, a system the cell cannot build, a
    replicating system left with fewer than the regime's slots, a plan over the memory budget."""
    if warmup_steps < 2 or warmup_steps >= trace.num_steps:
        raise ValueError(f"warmup_steps must be in [2, {trace.num_steps}) for a trace of {trace.num_steps} steps, "
                         f"got {warmup_steps}")
    recorded_layers = trace.num_layers
    check_top_k(trace, model.top_k)
    weights_L = np.bincount(layer_map(recorded_layers, model.num_moe_layers), minlength=recorded_layers)
    paper = to_paper_scale(trace, num_layers=recorded_layers, tokens_per_rank=tokens_per_rank,
                           micro_batches=micro_batches, top_k=model.top_k, num_experts=model.num_experts,
                           num_ranks=cluster.num_ranks, steps=slice(warmup_steps - 2, None))
    one_mb_ILNE, _ = micro_batch_counts(paper)
    cell = Cell(model, cluster, ("recorded", 0.0), cluster.mem_budget_bytes / 1e9, tokens_per_rank)
    rules = CellRules(eps=eps, gamma=gamma, max_extra=spare_slots)
    systems, skipped, _, _ = build_systems(cell, [system], rules, (one_mb_ILNE[0], one_mb_ILNE[1]))
    if system in skipped:
        raise ValueError(f"{system} cannot run at this scale: {skipped[system]}")
    replayed = Trace(paper.counts_ILNE[1:], paper.meta)
    variants = {"shard": {"replica_grad": "shard"}}
    if band:
        scaled = {f"select={f:g}": {"selection_scale": f} for f in SELECTION_SCALES if f != 1.0}
        variants |= {**corners(), **scaled,
                     **{f"{k}|shard": {**v, "replica_grad": "shard"} for k, v in {**corners(), **scaled}.items()}}
    res = simulate(replayed, systems[system], model, cluster, cost_kwargs=cost_kwargs(system, cell, rules),
                   warmup=1, variants=variants)
    s = res.summary()
    if s["oom"]:
        raise ValueError(f"{system}'s plans need {s['peak_mem_bytes'] / 1e9:.1f} GB per rank, over the "
                         f"{s['mem_budget_bytes'] / 1e9:.1f} GB budget: a time there means nothing")
    slots = model.num_experts // cluster.num_ranks + spare_slots
    most = int(res.slots_used_IL.max()) / cluster.num_ranks  # a slot may stay empty at a step; none may be missing
    if get_system(system).family != "static-ep" and most != slots:
        raise ValueError(f"{system} fills at most {most:g} slots per rank, the regime gives {slots}: the two axes "
                         f"would describe different systems")
    by_mode = {"range": weighted_seconds(res, weights_L), "shard": weighted_seconds(res, weights_L, "shard")}
    mode = min(by_mode, key=by_mode.get)
    suffix = "|shard" if mode == "shard" else ""
    dense = dense_seconds(model, cluster, tokens_per_rank, micro_batches, dense_efficiency)
    out = RunTime(system, by_mode[mode] + dense, by_mode[mode], dense, mode, int(replayed.num_steps - 1),
                  weights_L.tolist(), summary=s)
    if band:
        for corner in [None, *corners()]:
            priced = corner + suffix if corner else (suffix[1:] or None)
            for mb in dict.fromkeys((micro_batches, *MICRO_BATCH_BAND, *MICRO_BATCH_COUNTS)):
                moe = weighted_seconds(res, weights_L, priced, mb)
                for eff in (dense_efficiency, *DENSE_EFFICIENCY_BAND):
                    key = f"{corner or 'base'}|mb={mb}|dense={eff:g}"
                    out.corners[key] = moe + dense_seconds(model, cluster, tokens_per_rank, mb, eff)
        for f in SELECTION_SCALES:
            scaled = None if f == 1.0 else f"select={f:g}" + suffix
            moe = by_mode[mode] if f == 1.0 else weighted_seconds(res, weights_L, scaled)
            out.select_times[f"select={f:g}"] = moe + dense
    return out
