"""The one memory model of an MoE layer: which buffers a rank holds, for how long, and how many bytes each takes.

Read by the planner (:class:`lrmoe.planner.placement.MemoryModel`: LRMoE's replica slots and memory cap, SYMI's slot
count), by the cost model and the simulator (:mod:`lrmoe.sim.cost`, :mod:`lrmoe.sim.simulator`: peak memory and
out-of-memory), by the layer benchmark and the notebooks. Pure: no ``torch.distributed``. DESIGN.md §5.4 states
the rules; this module is them, term by term.

Bytes per unit (:class:`Footprint`, from the model shape by :func:`footprint`; D hidden width, F expert FFN width,
a the activation dtype's bytes, g the gradient dtype's):

==================  =========================  ===============================================================
term                bytes                      what
==================  =========================  ===============================================================
``slot``            3DF · (a + g)              one replica slot: the expert's weights and their gradient
``row``             D · a                      one token row in an all-to-all buffer
``combine_extra``   c · a                      the recalibration metric's extra combine columns (m2's ‖h‖: c=1)
``expert_act``      3F · a                     a computed pair's gate and up projections and their product h,
                                               saved for the SwiGLU backward
``bwd_act``         2F · a                     a backward row's gate and up gradients (h's gradient is formed
                                               in place)
``recompute``       3F · a                     a moved pair's gate, up and h, recomputed on its new replica
``index``           4                          one int32 index entry of the compact backward
==================  =========================  ===============================================================

What a rank holds (:func:`layer_memory`), each buffer counted once:

* **Resident**, from the layer's forward to its backward, so every MoE layer's at once: the slots (allocated
  slots times ``slot``, empty or not); for every pair the rank computes, its received input row, which *is* the
  saved GEMM input, plus ``expert_act``; for every pair of the rank's own tokens that was computed, the output row
  the combine brought home (plus ``combine_extra``), saved for the router's gradient ⟨δ, o⟩.
* **In flight**, only while the layer runs, so one layer's at a time: forward, the home's packed send rows and the
  expert's output rows (the combine's send buffer); backward, the rows the rank sends and receives on both sides of
  both exchanges (output gradients and carried input rows out, input gradients back, the compact layout's index),
  ``bwd_act`` per backward GEMM row and ``recompute`` per moved pair. The larger of the two is the layer's peak.
* **Fixed**: the optimizer shard (fp32 master weights and two Adam moments of E/N experts' worth), when it counts
  against the budget.

* **Early selection** (DESIGN.md §4): when the forward already knows which pairs the backward keeps (a metric of
  the forward, the gate), the expert side saves the input row and ``expert_act`` of those pairs alone
  (``LayerLoads.saved_expert_N``); the others' are in flight during the forward only. The home side still saves
  every computed pair's output row (the router's gradient is exact for every pair).

A model of L MoE layers peaks, on rank n, at Σ_l (slots + resident)_l + max_l (in flight)_l + fixed
(:func:`model_peak`). With fixed-size capacity buffers (SYMI-cf1, capacity systems) every slot's expert-side
buffers hold its capacity, however many rows arrive (:func:`plan_loads` with ``slot_capacity``).

Not counted (small, or the same for every system): routing indices and gate weights (a few bytes per pair), the
router's and shared expert's own activations, the allocator's fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from lrmoe.bytemodel.layout import backward_counts, plan_selects

INDEX_BYTES = 4  # one int32 per staying row of the compact backward (lrmoe.bytemodel.layout)
STATE_BYTES_PER_PARAM = 12.0  # fp32 master weights + two fp32 Adam moments


@dataclass(frozen=True)
class Footprint:
    """Bytes per unit of each buffer kind (the module doc's table). All non-negative."""

    slot: float
    row: float = 0.0
    combine_extra: float = 0.0
    expert_act: float = 0.0
    bwd_act: float = 0.0
    recompute: float = 0.0
    index: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Footprint.{f.name} must be a finite non-negative number, got {value!r}")

    @classmethod
    def slot_and_pair(cls, slot_bytes: float, pair_bytes: float) -> "Footprint":
        """A two-number model: ``slot_bytes`` per slot and ``pair_bytes`` per retained pair's backward buffers,
        nothing else (small hand-made cases: a :class:`~lrmoe.planner.placement.MemoryModel` built from the two
        numbers)."""
        return cls(slot=float(slot_bytes), bwd_act=float(pair_bytes))

    @property
    def expert_pair(self) -> float:
        """Resident bytes per pair a rank computes: the received (= saved) input row and the saved activations."""
        return self.row + self.expert_act

    @property
    def home_pair(self) -> float:
        """Resident bytes per computed pair of a rank's own tokens: the combine's output row kept at home."""
        return self.row + self.combine_extra


def footprint(hidden: int, ffn: int, act_bytes: int, grad_bytes: int | None = None,
              combine_cols: int = 0) -> Footprint:
    """The footprint of a SwiGLU expert layer of width ``hidden`` and FFN width ``ffn`` (the module doc's table)."""
    a = float(act_bytes)
    g = a if grad_bytes is None else float(grad_bytes)
    return Footprint(slot=3.0 * hidden * ffn * (a + g), row=hidden * a, combine_extra=combine_cols * a,
                     expert_act=3.0 * ffn * a, bwd_act=2.0 * ffn * a, recompute=3.0 * ffn * a, index=INDEX_BYTES)


def optimizer_shard_bytes(num_experts: int, expert_params: int, num_ranks: int, sharded: bool = True,
                          hosted_experts_N: Tensor | None = None) -> Tensor:
    """float64 [N] optimizer state per rank: E/N experts' worth when sharded (SYMI's static shards), else the
    state of the experts each rank hosts (``hosted_experts_N``, static expert parallelism)."""
    if sharded or hosted_experts_N is None:
        return torch.full((num_ranks,), num_experts * expert_params / num_ranks * STATE_BYTES_PER_PARAM,
                          dtype=torch.float64)
    return hosted_experts_N.double() * expert_params * STATE_BYTES_PER_PARAM


# -- the rows a layer-iteration puts in each buffer, per rank ----------------------------------------------------
@dataclass(frozen=True)
class LayerLoads:
    """Rows per rank [N] (float64) in each buffer of one layer-iteration; see :func:`plan_loads`."""

    slots_N: Tensor  # allocated slots
    expert_N: Tensor  # pairs computed on the rank (padded to capacity with fixed-size buffers)
    home_N: Tensor  # computed pairs of the rank's own tokens (their outputs come home)
    bwd_home_send_N: Tensor  # backward rows the home sends (output gradients, carried input rows)
    bwd_home_recv_N: Tensor  # input-gradient rows it receives
    bwd_expert_recv_N: Tensor  # rows the expert side receives
    bwd_expert_send_N: Tensor  # input-gradient rows it sends back
    bwd_gemm_N: Tensor  # backward GEMM rows
    index_N: Tensor  # index entries sent plus received (compact backward)
    moved_N: Tensor  # moved pairs recomputed on the rank
    saved_expert_N: Tensor | None = None  # early selection: computed pairs whose activations are saved (None: all)

    @classmethod
    def planned(cls, slots, expert_rows, home_rows, num_ranks: int | None = None,
                early_rho: float | None = None) -> "LayerLoads":
        """The planner's view of a rank: ``slots`` allocated slots, ``expert_rows`` pairs computed there,
        ``home_rows`` pairs of its tokens, every computed pair retained for the backward where it ran (the forward
        layout: no index, no moves). Scalars or [N] tensors. ``early_rho``: early selection at the retention
        budget rho, the backward keeps (and the forward saves) min(expert_rows, ceil(rho · home_rows)) pairs,
        ``home_rows`` standing for the mean load."""
        t = [torch.as_tensor(x, dtype=torch.float64) for x in (slots, expert_rows, home_rows)]
        if num_ranks is not None:
            t = [x.expand(num_ranks) for x in t]
        slots_N, expert_N, home_N = torch.broadcast_tensors(*t)
        zero = torch.zeros_like(expert_N)
        if early_rho is None:
            return cls(slots_N, expert_N, home_N, home_N, home_N, expert_N, expert_N, expert_N, zero, zero)
        level_N = torch.ceil(early_rho * home_N - 1e-9)
        kept_N, sent_N = torch.minimum(expert_N, level_N), torch.minimum(home_N, level_N)
        return cls(slots_N, expert_N, home_N, sent_N, sent_N, kept_N, kept_N, kept_N, zero, zero, kept_N)

    def scaled(self, factor: float) -> "LayerLoads":
        """The same buffers with ``factor`` times the rows (slots unchanged): a margin on a planned load."""
        if factor == 1.0:
            return self
        return LayerLoads(self.slots_N, *(None if getattr(self, f.name) is None else getattr(self, f.name) * factor
                                          for f in fields(self)[1:]))


def _per_rank(x_G: Tensor, num_ranks: int) -> Tensor:
    return x_G.reshape(num_ranks, -1).sum(1)


def slot_capacity(plan, cf: float) -> int:
    """Rows of each slot's fixed-size buffer under a capacity factor: ceil(cf · routed pairs / (N · S)), the
    capacity SYMI gives a slot (and GShard an expert, S = E/N); lrmoe.planner.replica_routing."""
    routed = int(plan.fwd_NG.sum()) + int(plan.dropped_NE.sum())
    return math.ceil(cf * routed / plan.num_slots - 1e-9)


def plan_loads(plan, compact: bool = True, slot_capacity_rows: int | None = None,
               input_grad: bool = True, early: bool = False) -> LayerLoads:
    """The rows of every buffer of one layer-iteration executing ``plan`` (the layout of :mod:`lrmoe.bytemodel.layout`).

    ``compact``: the backward's compaction switch. ``slot_capacity_rows``: fixed-size capacity buffers; each
    non-empty slot's expert-side buffers (forward and backward) hold that many rows. ``input_grad=False``: no
    input gradients travel back. ``early``: early selection, the expert side saves the activations of the pairs
    the plan keeps (``keep_NG``) alone; a plan that moves pairs between replicas cannot select early.
    """
    if early and plan.bwd_flows_V4.numel():
        raise ValueError("early selection keeps each retained pair where its forward ran: the plan moves pairs "
                         "between replicas (bwd_flows_V4), switch its backward routing off")
    N, S = plan.num_ranks, plan.slots_per_rank
    send_NG, gemm_NG, index_NG = backward_counts(plan, compact)  # the GEMM's rows are the rows returned
    ret_NG = gemm_NG * int(input_grad)
    dtype = torch.float64
    expert_N = _per_rank(plan.fwd_NG.sum(0), N).to(dtype)
    exp_recv_N = _per_rank(send_NG.sum(0), N).to(dtype)
    gemm_N = _per_rank(gemm_NG.sum(0), N).to(dtype)
    exp_send_N = _per_rank(ret_NG.sum(0), N).to(dtype)
    if slot_capacity_rows is not None:
        padded_N = (plan.placement_NS >= 0).sum(1).to(dtype) * float(slot_capacity_rows)
        expert_N = torch.maximum(expert_N, padded_N)
        exp_recv_N = torch.maximum(exp_recv_N, padded_N)
        gemm_N = torch.maximum(gemm_N, padded_N)
        exp_send_N = torch.maximum(exp_send_N, padded_N * int(input_grad))
    index_N = (index_NG.sum(1) + _per_rank(index_NG.sum(0), N)).to(dtype)
    moved_N = _per_rank(plan.moved_NG.sum(0), N).to(dtype) if plan.bwd_flows_V4.numel() else torch.zeros(N, dtype=dtype)
    return LayerLoads(slots_N=torch.full((N,), float(S), dtype=dtype), expert_N=expert_N,
                      home_N=plan.fwd_NG.sum(1).to(dtype), bwd_home_send_N=send_NG.sum(1).to(dtype),
                      bwd_home_recv_N=ret_NG.sum(1).to(dtype), bwd_expert_recv_N=exp_recv_N,
                      bwd_expert_send_N=exp_send_N, bwd_gemm_N=gemm_N, index_N=index_N, moved_N=moved_N,
                      saved_expert_N=_per_rank(plan.keep_NG.sum(0), N).to(dtype) if early else None)


# -- bytes ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerMemory:
    """Bytes per rank [N] (float64) of one layer-iteration: what it keeps and what it holds while it runs."""

    slot_N: Tensor  # weights + gradients of the allocated slots
    saved_N: Tensor  # activations kept from the forward to the backward
    fwd_N: Tensor  # forward in-flight buffers
    bwd_N: Tensor  # backward in-flight buffers

    @property
    def resident_N(self) -> Tensor:
        """What the layer holds while the other layers run: slots and saved activations."""
        return self.slot_N + self.saved_N

    @property
    def inflight_N(self) -> Tensor:
        """The larger of the forward's and the backward's in-flight buffers."""
        return torch.maximum(self.fwd_N, self.bwd_N)


def layer_memory(fp: Footprint, loads: LayerLoads, combine: bool = True) -> LayerMemory:
    """Bytes of one layer-iteration per rank (the module doc's rules). ``combine=False``: the plan does not
    select, so no metric columns ride on the combine rows."""
    combine_row = fp.row + (fp.combine_extra if combine else 0.0)
    kept_N = loads.expert_N if loads.saved_expert_N is None else loads.saved_expert_N
    saved_N = kept_N * fp.expert_pair + loads.home_N * combine_row
    # early selection: the activations of the pairs not kept live only while the forward runs
    fwd_N = loads.home_N * fp.row + loads.expert_N * combine_row + (loads.expert_N - kept_N) * fp.expert_pair
    rows_N = loads.bwd_home_send_N + loads.bwd_home_recv_N + loads.bwd_expert_recv_N + loads.bwd_expert_send_N
    bwd_N = (rows_N * fp.row + loads.index_N * fp.index + loads.bwd_gemm_N * fp.bwd_act
             + loads.moved_N * fp.recompute)
    return LayerMemory(slot_N=loads.slots_N * fp.slot, saved_N=saved_N, fwd_N=fwd_N, bwd_N=bwd_N)


def plan_memory(fp: Footprint, plan, compact: bool = True, slot_capacity_rows: int | None = None,
                early: bool = False) -> LayerMemory:
    """:func:`layer_memory` of a plan (metric columns ride on the combine only when the plan selects)."""
    return layer_memory(fp, plan_loads(plan, compact, slot_capacity_rows, early=early), combine=plan_selects(plan))


def model_peak(resident_LN: Tensor, inflight_LN: Tensor, fixed_N: Tensor | float = 0.0,
               num_layers: int | None = None) -> Tensor:
    """float64 [N]: a model's peak per rank, Σ_l resident + max_l in flight + fixed.

    ``resident_LN`` / ``inflight_LN`` [L, N] are the layers' bytes; ``num_layers`` > L scales the resident sum by
    num_layers / L (the mean layer stands for the ones not simulated).
    """
    n_l = resident_LN.shape[0]
    scale = 1.0 if num_layers is None else num_layers / n_l
    return resident_LN.sum(0) * scale + inflight_LN.max(0).values + fixed_N


def uniform_peak(memory: LayerMemory, num_layers: int, fixed_N: Tensor | float = 0.0) -> Tensor:
    """float64 [N]: the peak of ``num_layers`` layers that all look like this one (the planner's view)."""
    return num_layers * memory.resident_N + memory.inflight_N + fixed_N


