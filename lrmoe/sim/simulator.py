"""Trace-driven simulator: the planner code of the real layer, run over every MoE layer and iteration of a
trace, each plan costed by :class:`~lrmoe.sim.cost.CostModel`.

A :class:`System` is a policy constructor plus how its layer executes (compaction, optimizer sharding). The
simulator calls ``policy.plan(counts_NE, prev_counts_E)`` exactly as the distributed layer does — one policy
object per MoE layer, fed that layer's counts of this iteration and its global counts of the previous one — so
the plans are the same objects the layer would execute (tested in ``tests/test_simulator.py``).

Micro-batches: an iteration of ``micro_batches`` micro-batches runs the all-to-all and GEMM phases once per
micro-batch and the sync phases (replica sync, gradient collection, Adam, redistribution) once, after the last
one: gradients accumulate locally in between and the placement is fixed for the whole iteration. Every micro-batch
of an iteration is priced on the same counts, one micro-batch's (ours: micro-batches of one step route alike). A
bare counts tensor holds one micro-batch per step (the synthetic generator's traces); a recorded trace whose
metadata says it sums k micro-batches per step (``micro_batches``: ``experiments/train.py``, Megatron-Core imports)
is split into k first, and is priced at k micro-batches unless told otherwise (:func:`micro_batch_counts`); its
placement plans from the previous step's sum over the micro-batches, as the layer's does (DESIGN.md §3.9).

Whole-model memory per rank (:mod:`lrmoe.bytemodel.memory`, the planner's model too): every MoE layer's slots and saved
activations are alive at the end of the forward, and one layer's in-flight buffers at a time on top of them,
plus the optimizer shard when it counts: Σ_l resident + max_l in flight + fixed
(:func:`lrmoe.bytemodel.memory.model_peak`).
When a trace holds fewer layers than the model, the simulated layers' mean stands for the missing ones
(:attr:`SimResult.peak_IN`; headlines simulate every layer). The budget is the cost model's per-layer budget times
the model's MoE layers (by default the cluster's whole budget).

Sensitivity: ``variants`` names other values of the cost model's uncertain constants
(:meth:`~lrmoe.sim.cost.CostModel.variant`: GEMM efficiency, half-efficiency rows, link bandwidth); every plan is
priced under each of them too, from the same counted work, and the number of micro-batches can be changed after
the fact (:meth:`SimResult.summary`), since it only weights the phases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from lrmoe.config import ClusterConfig, MoEConfig
from lrmoe.bytemodel.memory import model_peak
from lrmoe.planner.plan import LayerPlan, Policy
from lrmoe.sim.cost import CATEGORIES, PHASES, CostModel, PhaseTimes
from lrmoe.traces.trace import Trace


@dataclass(frozen=True)
class System:
    """A system to simulate: ``make_policy()`` returns a fresh :class:`~lrmoe.planner.plan.Policy`."""

    name: str
    make_policy: Callable[[], Policy]
    compaction: bool = True  # False: backward packets padded to forward sizes
    sharded_optimizer: bool = True  # False: static EP keeps optimizer state with each expert's one host
    description: str = ""
    # keyword arguments of CostModel this system sets (lrmoe.sim.simulated_systems.cost_options: its planner benchmark,
    # metric and selection mode, sync groups, capacity buffers); a caller's cost_kwargs come on top
    costs: dict = field(default_factory=dict, compare=False)


def iter_plans(trace_counts_ILNE: torch.Tensor, make_policy: Callable[[], Policy],
               layers: list[int] | None = None,
               step_counts_ILNE: torch.Tensor | None = None) -> Iterator[tuple[int, int, LayerPlan]]:
    """Yield ``(step, layer, plan)`` in execution order (step-major), one policy object per layer.

    ``prev_counts_E`` is the layer's global counts of the previous step (None at the first step), which is
    what the layer's one small all-reduce in the forward provides to SYMI / LRMoE placement. ``step_counts_ILNE``:
    each step's counts summed over its micro-batches where ``trace_counts_ILNE`` is one micro-batch of each step
    (DESIGN.md §3.9: every micro-batch plans from the previous iteration's sum); default the counts themselves.
    """
    if trace_counts_ILNE.dim() != 4:
        raise ValueError(f"trace counts must be [steps, layers, ranks, experts], got {tuple(trace_counts_ILNE.shape)}")
    if step_counts_ILNE is not None and step_counts_ILNE.shape != trace_counts_ILNE.shape:
        raise ValueError(f"the steps' counts {tuple(step_counts_ILNE.shape)} must have the micro-batch's shape "
                         f"{tuple(trace_counts_ILNE.shape)}")
    layers = list(range(trace_counts_ILNE.shape[1])) if layers is None else list(layers)
    policies = {layer: make_policy() for layer in layers}
    global_ILE = (trace_counts_ILNE if step_counts_ILNE is None else step_counts_ILNE).sum(dim=2)
    for step in range(trace_counts_ILNE.shape[0]):
        for layer in layers:
            prev = global_ILE[step - 1, layer] if step else None
            yield step, layer, policies[layer].plan(trace_counts_ILNE[step, layer], prev)


@dataclass
class SimResult:
    """Per-step, per-layer outcome of one system on one trace and cluster."""

    system: str
    model: str
    cluster: str
    phase_ILH: torch.Tensor  # float64 [I, L, H] straggler seconds of each phase
    bytes_ILH: torch.Tensor  # float64 [I, L, H] bytes sent by all ranks in each phase
    dropped_IL: torch.Tensor  # long [I, L] forward pairs dropped
    routed_IL: torch.Tensor  # long [I, L] pairs routed
    fwd_imbalance_IL: torch.Tensor  # float64 [I, L] slowest rank's forward rows / mean
    bwd_ratio_IL: torch.Tensor  # float64 [I, L] slowest rank's backward rows / mean forward rows (rho)
    peak_IN: torch.Tensor  # float64 [I, N] whole-model MoE memory per rank
    layer_oom_IL: torch.Tensor  # bool [I, L] a layer over its share of the budget
    slots_used_IL: torch.Tensor  # long [I, L] non-empty slots over all ranks
    mem_budget_bytes: float  # whole-model MoE budget per rank
    warmup: int = 1  # leading steps left out of the summary (no previous counts yet)
    micro_batches: int = 1  # all-to-all and GEMM phases run this many times per iteration, sync phases once
    phases: tuple[str, ...] = field(default=PHASES)
    variant_ILH: dict = field(default_factory=dict)  # {variant name: float64 [I, L, H] straggler seconds}
    placement_s: float = 0.0  # host seconds of one layer's placement, off the critical path once per iteration

    @property
    def placement_headroom_s(self) -> torch.Tensor:
        """float64 [I]: each iteration's time minus its simulated layers' placements (negative: they did not fit,
        and the excess is in the first layer's ``plan`` phase)."""
        return self.iteration_s - self.phase_ILH.shape[1] * self.placement_s

    def weights_H(self, micro_batches: int | None = None) -> torch.Tensor:
        """float64 [H]: how many times each phase runs per iteration (default: this run's micro-batches)."""
        mb = float(self.micro_batches if micro_batches is None else micro_batches)
        sync = set(CATEGORIES["sync"])
        return torch.tensor([1.0 if p in sync else mb for p in self.phases], dtype=torch.float64)

    @property
    def weight_H(self) -> torch.Tensor:
        """float64 [H]: how many times each phase runs per iteration."""
        return self.weights_H()

    @property
    def iteration_s(self) -> torch.Tensor:
        """float64 [I]: seconds per iteration of the simulated MoE layers (all phases, all micro-batches)."""
        return (self.phase_ILH * self.weight_H).sum(dim=(1, 2))

    def time_s(self, variant: str | None = None, micro_batches: int | None = None) -> float:
        """Mean seconds per iteration after warm-up, under a sensitivity ``variant`` (None: the base constants)
        and a number of ``micro_batches`` (None: this run's)."""
        s = slice(self.warmup, None) if self.phase_ILH.shape[0] > self.warmup else slice(None)
        phase_ILH = self.phase_ILH if variant is None else self.variant_ILH[variant]
        return float((phase_ILH[s].sum(dim=1).mean(dim=0) * self.weights_H(micro_batches)).sum())

    def category_s(self, variant: str | None = None) -> dict[str, float]:
        """Mean seconds per iteration after warm-up by category (forward, backward, communication, sync, ...),
        under a ``variant`` (None: the base constants)."""
        s = slice(self.warmup, None) if self.phase_ILH.shape[0] > self.warmup else slice(None)
        phase_ILH = self.phase_ILH if variant is None else self.variant_ILH[variant]
        per_step_H = phase_ILH[s].sum(dim=1).mean(dim=0) * self.weight_H
        return {cat: float(sum(per_step_H[self.phases.index(p)] for p in names)) for cat, names in CATEGORIES.items()}

    @property
    def oom(self) -> bool:
        """Whether the whole model's MoE memory exceeds the budget on some rank at some step after warm-up.
        (A layer over its per-layer share is reported as ``layer_over_share``: memory is pooled over layers.)"""
        return bool((self.peak_IN[self.warmup:] > self.mem_budget_bytes).any())

    def summary(self) -> dict:
        """Means over the steps after warm-up: seconds per iteration by category, bytes, memory, drops."""
        s = slice(self.warmup, None) if self.phase_ILH.shape[0] > self.warmup else slice(None)
        w_H = self.weight_H
        per_step_H = self.phase_ILH[s].sum(dim=1).mean(dim=0) * w_H  # [H] seconds per iteration, all layers
        out = {"system": self.system, "model": self.model, "cluster": self.cluster,
               "time_s": float(per_step_H.sum())}
        for cat, names in CATEGORIES.items():
            out[f"{cat}_s"] = float(sum(per_step_H[self.phases.index(p)] for p in names))
        bytes_H = self.bytes_ILH[s].sum(dim=1).mean(dim=0) * w_H
        out["a2a_bytes"] = float(sum(bytes_H[self.phases.index(p)] for p in CATEGORIES["communication"]))
        out["sync_bytes"] = float(sum(bytes_H[self.phases.index(p)] for p in CATEGORIES["sync"]))
        out["peak_mem_bytes"] = float(self.peak_IN[s].max())
        out["mem_budget_bytes"] = self.mem_budget_bytes
        out["oom"] = self.oom
        out["layer_over_share"] = float(self.layer_oom_IL[s].double().mean())
        out["drop_rate"] = float(self.dropped_IL[s].sum() / self.routed_IL[s].sum().clamp(min=1))
        out["fwd_imbalance"] = float(self.fwd_imbalance_IL[s].mean())
        out["rho"] = float(self.bwd_ratio_IL[s].mean())
        out["slots_per_rank"] = float(self.slots_used_IL[s].double().mean() / self.peak_IN.shape[1])
        return out


def split_micro_batches(counts_ILNE: torch.Tensor, k: int) -> torch.Tensor:
    """One micro-batch's counts from counts that sum ``k`` micro-batches per step: each (step, layer, source rank)
    row divided by k, in whole pairs that add up to the row's total // k (exactly its k-th when k divides it, as
    every recorded row does: each micro-batch of a rank routes as many tokens). Each count becomes ⌊c / k⌋ or
    ⌈c / k⌉; the counts with the largest remainders (the lower expert on ties) get the ⌈ ⌉."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"micro-batches per step must be a positive int, got {k!r}")
    if k == 1:
        return counts_ILNE
    floor_ILNE, rest_ILNE = torch.div(counts_ILNE, k, rounding_mode="floor"), counts_ILNE % k
    short_ILN1 = counts_ILNE.sum(-1, keepdim=True) // k - floor_ILNE.sum(-1, keepdim=True)  # pairs to hand out, < E
    order_ILNE = torch.sort(rest_ILNE, dim=-1, descending=True, stable=True).indices
    place_ILNE = order_ILNE.argsort(dim=-1)  # each count's place in its row, largest remainder first
    return floor_ILNE + (place_ILNE < short_ILN1).long()


def micro_batch_counts(trace: Trace | torch.Tensor) -> tuple[torch.Tensor, int]:
    """(one micro-batch's counts [I, L, N, E], the micro-batches each step of the trace sums) of what
    :func:`simulate` is given: a counts tensor is one micro-batch per step; a :class:`~lrmoe.traces.trace.Trace`
    sums ``meta["micro_batches"]`` of them (1 when absent), split by :func:`split_micro_batches`."""
    if torch.is_tensor(trace):
        return trace, 1
    if not isinstance(trace, Trace):
        raise TypeError(f"simulate takes a Trace or a counts tensor [I, L, N, E], got {type(trace).__name__}")
    k = trace.meta.get("micro_batches") or 1
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"the trace's meta says micro_batches={k!r}: not a positive int")
    return split_micro_batches(trace.counts_ILNE, k), k


def _charge_placement_excess(phase_ILH: torch.Tensor, host_s: float, micro_batches: int) -> None:
    """In place: the layers' placements (``host_s`` per iteration, on the background thread) run while the iteration
    runs; what does not fit under an iteration's time is charged to its first layer's ``plan`` phase."""
    if host_s <= 0:
        return
    weight_H = torch.tensor([1.0 if p in CATEGORIES["sync"] else float(micro_batches) for p in PHASES],
                            dtype=torch.float64)
    over_I = (host_s - (phase_ILH * weight_H).sum(dim=(1, 2))).clamp(min=0)
    phase_ILH[:, 0, PHASES.index("plan")] += over_I / micro_batches


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Runs its body on one intra-op torch thread, then restores the count (also a decorator).

    The planner and the cost model work on tensors of a few thousand elements at most, where a second thread only
    adds wake-ups: measured on 2 cores, a [16, 9] ``max(dim=0)`` took 40 us on two threads and 5 us on one, and a
    quick-mode ablation cell 3x longer with a busy neighbour process. The results do not change (no reduction here
    is large enough to be split)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@one_intra_op_thread()
def simulate(trace: Trace | torch.Tensor, system: System, model: MoEConfig, cluster: ClusterConfig,
             cost_kwargs: dict | None = None, layers: list[int] | None = None, warmup: int = 1,
             micro_batches: int | None = None, progress: Callable[[int], None] | None = None,
             variants: dict[str, dict] | None = None) -> SimResult:
    """Plan and cost every (step, layer) of a trace for one system. ``progress(1)`` is called per layer-step.

    ``trace``: a :class:`~lrmoe.traces.trace.Trace`, or its ``counts_ILNE`` as one micro-batch of
    every step; a trace that records k micro-batches per step (its meta's ``micro_batches``) is priced on one k-th
    of each step (:func:`micro_batch_counts`). Its rank and expert dimensions must match the cluster and the model.
    ``micro_batches``: the micro-batches of an iteration, each priced on those counts (default: the trace's k, 1
    for a tensor). ``cost_kwargs`` go to :class:`CostModel` (e.g. ``gemm``, ``mem_budget_bytes``, ``overheads``).
    ``variants``: {name: keyword arguments of :meth:`CostModel.variant`}, each priced from the same work.
    """
    trace_counts_ILNE, recorded = micro_batch_counts(trace)
    micro_batches = recorded if micro_batches is None else micro_batches
    num_steps, num_layers, n, e = trace_counts_ILNE.shape
    if n != cluster.num_ranks:
        raise ValueError(f"trace has {n} ranks but cluster {cluster.name!r} has num_ranks={cluster.num_ranks}")
    if e != model.num_experts:
        raise ValueError(f"trace has {e} experts but model {model.name!r} has num_experts={model.num_experts}")
    if not 0 <= warmup < num_steps:
        raise ValueError(f"warmup={warmup} must be in [0, steps={num_steps})")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
    layers = list(range(num_layers)) if layers is None else list(layers)
    cm = CostModel(model, cluster, compaction=system.compaction, sharded_optimizer=system.sharded_optimizer,
                   **{**system.costs, **(cost_kwargs or {})})
    priced = {name: cm.variant(**kw) for name, kw in (variants or {}).items()}
    num_l, p = len(layers), len(PHASES)
    phase_ILH = torch.zeros(num_steps, num_l, p, dtype=torch.float64)
    bytes_ILH = torch.zeros_like(phase_ILH)
    dropped_IL = torch.zeros(num_steps, num_l, dtype=torch.long)
    routed_IL = torch.zeros_like(dropped_IL)
    slots_IL = torch.zeros_like(dropped_IL)
    imb_IL = torch.zeros(num_steps, num_l, dtype=torch.float64)
    rho_IL = torch.zeros_like(imb_IL)
    oom_IL = torch.zeros(num_steps, num_l, dtype=torch.bool)
    resident_ILN = torch.zeros(num_steps, num_l, n, dtype=torch.float64)
    buffer_ILN = torch.zeros_like(resident_ILN)
    variant_ILH = {name: torch.zeros_like(phase_ILH) for name in priced}
    fixed_N = torch.zeros(n, dtype=torch.float64)
    where = {layer: i for i, layer in enumerate(layers)}
    summed_ILNE = None if recorded == 1 else trace.counts_ILNE  # the placement plans from the iteration's sum
    for step, layer, plan in iter_plans(trace_counts_ILNE, system.make_policy, layers, summed_ILNE):
        li = where[layer]
        work = cm.work(plan)
        t: PhaseTimes = cm.price(work)
        for name, vcm in priced.items():
            variant_ILH[name][step, li] = vcm.price(work).straggler_H
        phase_ILH[step, li] = t.straggler_H
        fixed_N = t.fixed_bytes_N
        bytes_ILH[step, li] = t.bytes_H
        dropped_IL[step, li] = t.dropped_pairs
        routed_IL[step, li] = t.routed_pairs
        slots_IL[step, li] = int((plan.placement_NS >= 0).sum())
        mean_fwd = t.fwd_rows_N.double().mean().clamp(min=1e-12)
        imb_IL[step, li] = t.fwd_rows_N.max() / mean_fwd
        rho_IL[step, li] = t.bwd_rows_N.max() / mean_fwd
        oom_IL[step, li] = t.oom
        resident_ILN[step, li] = t.resident_bytes_N
        buffer_ILN[step, li] = t.buffer_bytes_N
        if progress is not None:
            progress(1)
    peak_IN = torch.stack([model_peak(resident_ILN[st], buffer_ILN[st], fixed_N, model.num_moe_layers)
                           for st in range(num_steps)])
    placement_s = cm.placement_s()
    for phases in (phase_ILH, *variant_ILH.values()):
        _charge_placement_excess(phases, num_l * placement_s, micro_batches)
    return SimResult(system=system.name, model=model.name, cluster=cluster.name, phase_ILH=phase_ILH,
                     bytes_ILH=bytes_ILH, dropped_IL=dropped_IL, routed_IL=routed_IL, fwd_imbalance_IL=imb_IL,
                     bwd_ratio_IL=rho_IL, peak_IN=peak_IN, layer_oom_IL=oom_IL, slots_used_IL=slots_IL,
                     mem_budget_bytes=float(cm.mem_budget_bytes) * model.num_moe_layers, warmup=warmup,
                     micro_batches=micro_batches, variant_ILH=variant_ILH, placement_s=placement_s)
