"""Cost model: one MoE layer's plan for one iteration turned into seconds, bytes and memory per rank.

The model reads only a :class:`~lrmoe.planner.plan.LayerPlan`'s counted work (pairs per source rank and slot, kept
pairs, moved pairs, placement) and a model / cluster preset. It is a pure function of them: no clocks, no
devices. Every number it uses is a field below, with its source or marked as ours.

Timing assumptions (all ours; they are what "time per phase set by the slowest rank" means in DESIGN.md §5):

* **Phases are serial and synchronising.** An iteration of one MoE layer runs the phases of :data:`PHASES` one
  after the other. Each all-to-all is a collective and each grouped GEMM is followed by one, so every phase ends
  when its slowest rank ends: the layer's time is the sum over phases of the per-phase straggler. Nothing is
  overlapped: not the shared expert with the dispatch, not the replica sync with earlier layers' backward.
  This is conservative for every system alike; overlapping would shrink the communication and sync shares.
* **All-to-all.** A rank sends to ranks of its own node at ``intra_bw`` and to other nodes at ``inter_bw``; the
  two kinds of link (NVLink, NIC) run concurrently, and sends and receives run concurrently (full duplex):
  ``t = max(send, recv) + latency`` with ``send = max(intra_bytes / intra_bw, inter_bytes / inter_bw)``. The
  latency is charged once per link kind a rank uses (messages to many peers are pipelined). Rows a rank keeps
  for itself cost nothing (the local permutation is not modelled).
* **Weight push** (online replication, :mod:`lrmoe.planner.online`): a plan's ``push_src_G`` copies whole experts into
  spare slots before the dispatch (bytes: :func:`lrmoe.bytemodel.sync_model.push_bytes`, the layer's accounting's),
  priced as
  an all-to-all on the links it uses (the policy pushes inside nodes only: NVLink). Not overlapped with the
  dispatch, like every phase here (the anchor can overlap it with the permutation; conservative for online). The
  pushed copies hold no optimizer state: unsharded Adam and state count the home placement only.
* **Early selection's keep bits** (``early_selection=True``): the forward sends every pair's keep bit (one byte,
  :data:`lrmoe.bytemodel.layout.KEEP_BYTES`) to its expert in an all-to-all of its own along the dispatch's splits
  (phase ``early_keep_a2a``, as the layer runs it): a few bytes, but one more collective, so one more latency.
* **Expert GEMM.** A group of m rows on one slot reaches ``eff(m) = eff_max * m / (m + m_half)`` of peak, so its
  time is ``flops_per_row * (m + m_half) / (eff_max * peak)`` for m > 0 and nothing for an empty slot, plus a
  fixed ``launch_s`` per grouped-GEMM call on a rank with any rows. The backward (input and weight gradients)
  costs ``pair_bwd_flops`` per row (about 2x the forward) on the same curve. A pair whose backward was moved to
  another replica recomputes its gate and up projections there (2/3 of the forward FLOPs).
* **Packets** are the layer's own, from the plan's byte model (:mod:`lrmoe.bytemodel.layout`, shared with the layer's
  accounting, so modelled bytes = counted bytes): compact backward (``compaction=True``, where the plan trims or
  moves pairs) sends the retained gradient rows plus the moved pairs' input rows and a 4-byte index per staying row,
  and multiplies the retained rows; the forward layout (``compaction=False``, or a plan that keeps everything)
  sends every forward row (zeros where not retained) plus moved gradient and input rows, and multiplies fwd + moved
  rows. ``combine_cols`` extra elements ride on each combine row when the plan selects (metric m2's ‖h‖).
* **Replica gradient sync** (the substrate of :mod:`lrmoe.runtime.distributed.replica`, as the layer runs it; bytes from
  the shared byte model :mod:`lrmoe.bytemodel.sync_model`): the local slots of an expert are summed for free, then
  ``replica_grad="range"`` (SYMI's): every rank of the consecutive range spanned by the expert's hosts
  all-reduces, priced as a ring (each sends and receives about ``2 (h - 1) / h`` of the gradient, plus
  ``2 (h - 1)`` latencies) at the slowest link the range crosses; a rank in several ranges runs them one after
  the other. SYMI's contiguous placements make the range exactly the hosts; LRMoE's scattered replicas widen it.
  ``sync_groups="hosts"`` models groups of the hosting ranks only (a design the layer does not run: it would
  need a process group per host set, which SYMI avoids by creating only the N(N-1)/2 range groups).
  ``replica_grad="shard"`` (ours): every host sends shard q of its sum to rank q, all experts in one
  all-to-all (priced as the other all-to-alls), and there is no gradient collection.
* **Gradient collection / Adam / redistribution** (statically sharded optimizer, SYMI §4): in range mode every
  rank fetches its 1/N shard of every expert's reduced gradient (from itself inside the range, else from the
  range's ranks in round-robin order); every rank runs Adam on E/N experts' worth of parameters at HBM
  bandwidth, then sends each updated shard to every other rank hosting the expert (once per rank; the placement
  of this plan stands in for the next one). A conventional static expert-parallel system
  (``sharded_optimizer=False``) keeps each expert's optimizer state on its one host: no collection, no
  redistribution, and no shard owners for ``replica_grad="shard"`` (it is priced as ``"range"``).

* **Overheads** (:mod:`lrmoe.sim.overheads`, each with its source and a switch, ``overheads=``): the counts
  all-gather and the host's planning (phase ``plan``), scoring, selection and the compaction passes of a plan that
  selects (phase ``recalibrate``), and SYMI-cf1's / the capacity systems' fixed-size buffers (``capacity_cf``:
  every slot multiplies and holds its capacity).
* **GEMM constants** are published figures until a GPU calibrates them (see ``_GEMM_DEFAULTS``); :meth:`CostModel.
  variant` swaps the uncertain ones (GEMM efficiency, half-efficiency rows, link bandwidth) for sensitivity bands.

Memory per rank is :mod:`lrmoe.bytemodel.memory`'s one model, the planner's too (:meth:`CostModel.memory_model`): slots
(weights + gradients of every allocated slot) and saved activations for every layer, in-flight buffers for the
layer in flight, each buffer counted once. The budget is one layer's share of the rank's memory (by default the
cluster's budget over the model's MoE layers); ``oom`` flags a layer that would not fit if every MoE layer were
like it, and :mod:`lrmoe.sim.simulator` adds up the layers of a model against the whole budget. The optimizer
shard is reported but, by default, not counted: it is the same E/N experts' worth of fp32 state on every rank for
every system (statically sharded), and at paper scale it lives outside the MoE layers' budget (offloaded, or
sharded further over data-parallel replicas).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lrmoe.checks import non_negative_fields
from lrmoe.config import ClusterConfig, MoEConfig
from lrmoe.bytemodel.layout import (A2A_PHASES, KEEP_BYTES, STEP_PHASES, Traffic, backward_counts, layer_traffic,
                                    plan_selects, uses_compact)
from lrmoe.bytemodel.layout import PHASES as LAYOUT_PHASES
from lrmoe.bytemodel.memory import (STATE_BYTES_PER_PARAM, Footprint, LayerMemory, footprint, layer_memory,
                                    optimizer_shard_bytes, plan_loads, slot_capacity)
from lrmoe.planner.placement import MemoryModel
from lrmoe.bytemodel.sync_model import (LOCAL_PHASES, REPLICA_GRAD_MODES, check_replica_grad, hosts_mask, push_bytes,
                                        shard_sizes, step_bytes)
from lrmoe.recal.scoring import get_metric
from lrmoe.sim.overheads import (OVERHEADS, check_overheads, placement_seconds, planner_seconds,
                                 selection_ms_per_pair, selection_seconds)

# The modelled phases, named as the layer names them (one vocabulary: lrmoe.bytemodel.layout.PHASES), in execution
# order. The
# backward all-to-alls are named for the forward one they invert: combine_a2a_bwd carries output gradients from
# the home ranks to the experts, dispatch_a2a_bwd carries input gradients back.
PHASES = tuple(p for p in LAYOUT_PHASES if p in (
    "plan", "weight_push", "recalibrate", "early_keep_a2a", "dispatch_a2a", "expert_fwd", "shared_fwd", "combine_a2a",
    "combine_a2a_bwd", "bwd_index_a2a", "expert_bwd", "shared_bwd", "dispatch_a2a_bwd", "replica_sync", "grad_collect",
    "adam", "redistribute"))
CATEGORIES = {
    "forward": ("expert_fwd", "shared_fwd"),
    "backward": ("expert_bwd", "shared_bwd"),
    # weight_push: online replication's copies (lrmoe.planner.online); early_keep_a2a: early selection's keep bits
    "communication": A2A_PHASES + ("weight_push", "early_keep_a2a"),
    "sync": STEP_PHASES,
    "overhead": ("plan", "recalibrate"),  # the counts all-gather and planning; scoring, selection, compaction
}
_P = {name: i for i, name in enumerate(PHASES)}

PRESET_DIR = Path(__file__).resolve().parent / "presets"


# --- GEMM efficiency curves ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmCurve:
    """Throughput of one expert's GEMM vs its rows: ``eff(m) = eff_max * m / (m + m_half)`` of peak FLOP/s."""

    eff_max: float  # fraction of peak that large groups reach
    m_half: float  # rows at which a group reaches half of eff_max
    launch_s: float = 0.0  # fixed seconds per grouped-GEMM call
    source: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.eff_max <= 1:
            raise ValueError(f"GemmCurve.eff_max must be in (0, 1], got {self.eff_max!r}")
        non_negative_fields(self, "m_half", "launch_s")

    def seconds(self, rows: torch.Tensor, flops_per_row: float, peak_flops: float) -> torch.Tensor:
        """Seconds for groups of ``rows`` rows each (elementwise; an empty group costs nothing)."""
        rows = rows.double()
        return torch.where(rows > 0, (rows + self.m_half) * (flops_per_row / (self.eff_max * peak_flops)), 0.0)


# Published figures until experiments/calibrate_gpu.py measures a GPU:
# * eff_max: the largest bf16 matmul throughput measured on the GPU ("maximum achievable matmul FLOPS", MAMF),
#   S. Bekman, ml-engineering, compute/accelerator/README.md, MAMF comparison table: A100 SXM 267.9 of 312
#   TFLOP/s (85.9 %), H100 SXM 792.1 of 989 (80.1 %; the H200 is the same GH100 chip), CUDA 12.1. A ceiling: expert
#   shapes reach less, which the sensitivity band (eff_max 0.5-0.9) covers.
# * m_half: the roofline's weight-read term. A group of m rows reads its expert's weights once (2 bytes each in
#   bf16) and does 2 FLOPs per weight per row, so its time is about weights / HBM bandwidth + FLOPs / (eff_max ·
#   peak), which is the curve's (m + m_half) form with m_half = eff_max · peak · bytes / (2 · HBM bandwidth):
#   from the cluster's datasheet peak and bandwidth (:func:`roofline_m_half`; A100-40GB 173, A100-80GB 134,
#   H200 165 rows). Band: 32-512 rows.
# * launch_s: a few microseconds per kernel launch (NVIDIA technical blog, "Getting Started with CUDA Graphs",
#   2019); the same for every system.
_MAMF = {"h200": (0.80, "H100 SXM MAMF 792.1/989 TFLOP/s (same GH100 chip)"),
         "a100": (0.86, "A100 SXM MAMF 267.9/312 TFLOP/s")}
_LAUNCH_S = 5e-6
_GEMM_DEFAULTS = {
    gpu: GemmCurve(eff_max=eff, m_half=256.0 if gpu == "h200" else 128.0, launch_s=_LAUNCH_S,
                   source=f"published: eff_max {eff} ({what}; S. Bekman, ml-engineering); m_half from the "
                          f"roofline when the cluster is known; launch 5 us (NVIDIA, CUDA Graphs blog)")
    for gpu, (eff, what) in _MAMF.items()
}


def roofline_m_half(eff_max: float, peak_flops: float, hbm_bw: float, weight_bytes: int = 2) -> float:
    """Rows at which a group of one expert's GEMM reaches half of ``eff_max``: eff_max · peak · bytes / (2 · bw)."""
    return eff_max * peak_flops * weight_bytes / (2.0 * hbm_bw)


def gemm_preset(cluster_name: str, model_name: str | None = None,
                calibration: str | Path | None = None, cluster: ClusterConfig | None = None) -> GemmCurve:
    """The GEMM curve for a cluster preset's GPU: a calibration file's fit if there is one, else the published
    default (its m_half from ``cluster``'s datasheet peak and HBM bandwidth when given).

    ``calibration`` defaults to ``presets/<gpu>_gemm.json`` beside this module (written by
    ``experiments/calibrate_gpu.py``); a fit for ``model_name``'s expert shape wins over the file's pooled fit.
    """
    gpu = cluster_name.split("@")[0].split("x")[0].split("-")[0]
    path = Path(calibration) if calibration is not None else PRESET_DIR / f"{gpu}_gemm.json"
    if path.is_file():
        return load_gemm_calibration(path, model_name)
    if calibration is not None:
        raise ValueError(f"calibration file {str(path)!r} does not exist")
    if gpu not in _GEMM_DEFAULTS:
        raise ValueError(f"no GEMM curve for cluster {cluster_name!r} (GPU {gpu!r}); known: {sorted(_GEMM_DEFAULTS)}"
                         f"; pass CostModel(gemm=GemmCurve(...))")
    curve = _GEMM_DEFAULTS[gpu]
    if cluster is not None and cluster.hbm_bw > 0:
        m_half = roofline_m_half(curve.eff_max, cluster.peak_flops, cluster.hbm_bw)
        curve = GemmCurve(eff_max=curve.eff_max, m_half=m_half, launch_s=curve.launch_s,
                          source=curve.source.replace("m_half from the roofline when the cluster is known",
                                                      f"m_half {m_half:.0f} rows from the roofline (datasheet)"))
    return curve


def load_gemm_calibration(path: str | Path, model_name: str | None = None) -> GemmCurve:
    """A :class:`GemmCurve` from a calibration JSON (``{"pooled": {...}, "fits": {model: {...}}, "provenance"}``)."""
    data = json.loads(Path(path).read_text())
    fit = data.get("fits", {}).get(model_name) if model_name else None
    fit = fit or data.get("pooled")
    if not fit:
        raise ValueError(f"calibration file {str(path)!r} has no 'pooled' fit")
    prov = data.get("provenance", {})
    source = (f"calibrated {prov.get('date', '?')} on {prov.get('device', '?')} "
              f"(torch {prov.get('torch', '?')}, triton {prov.get('triton', '?')}) from {Path(path).name}")
    return GemmCurve(eff_max=float(fit["eff_max"]), m_half=float(fit["m_half"]),
                     launch_s=float(fit.get("launch_s", 0.0)), source=source)


def cpu_gloo_preset(calibration_json: str | Path, num_ranks: int,
                    clock: str | None = None) -> tuple[ClusterConfig, GemmCurve]:
    """A CPU "cluster" (one node of gloo processes) and its GEMM curve, from micro-benchmark constants.

    The seam for validating the model against measured CPU runs: the calibration file (written by
    :mod:`lrmoe.harness.calibrate_cpu`) holds ``peak_flops``, ``a2a_bw``, ``a2a_latency``, ``mem_bw``, a ``gemm``
    fit (``eff_max``, ``m_half``, ``launch_s``) and the step phases' ``step_fixed_s`` (older files: none);
    ``clock`` picks the constants of one clock from its ``clocks`` entry instead of the top-level ones.
    """
    data = json.loads(Path(calibration_json).read_text())
    if clock is not None:
        if clock not in data.get("clocks", {}):
            raise ValueError(f"CPU calibration {str(calibration_json)!r} has no constants for clock={clock!r}; "
                             f"it has {sorted(data.get('clocks', {}))}")
        data = data["clocks"][clock]
    missing = [k for k in ("peak_flops", "a2a_bw", "a2a_latency", "gemm") if k not in data]
    if missing:
        raise ValueError(f"CPU calibration {str(calibration_json)!r} lacks {missing}")
    cluster = ClusterConfig(
        name="cpu-gloo", num_ranks=num_ranks, ranks_per_node=num_ranks, mem_budget_bytes=float(data.get(
            "mem_budget_bytes", 8e9)), intra_bw=float(data["a2a_bw"]), inter_bw=float(data["a2a_bw"]),
        intra_latency=float(data["a2a_latency"]), inter_latency=float(data["a2a_latency"]),
        peak_flops=float(data["peak_flops"]), hbm_bw=float(data.get("mem_bw", 0.0)),
        step_fixed_s=tuple(sorted((k, float(v)) for k, v in data.get("step_fixed_s", {}).items())),
        source=f"CPU micro-benchmarks ({Path(calibration_json).name})")
    g = data["gemm"]
    return cluster, GemmCurve(eff_max=float(g["eff_max"]), m_half=float(g["m_half"]),
                              launch_s=float(g.get("launch_s", 0.0)), source=cluster.source)


# --- the result of costing one plan ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PhaseTimes:
    """Seconds, bytes and memory of one layer-iteration, per rank; phase ``p`` is ``PHASES[p]``.

    Memory follows :mod:`lrmoe.bytemodel.memory`: what the layer keeps from its forward to its backward (slots, saved
    activations), what it holds only while it runs (the larger of its forward and backward in-flight buffers),
    and the optimizer shard. ``peak_bytes_N`` is the whole model's peak if all ``num_layers`` MoE layers looked
    like this one, which is what the planner checks; ``oom`` compares it with the whole budget.
    """

    time_NH: torch.Tensor  # float64 [N, H] seconds each rank spends in each phase
    bytes_NH: torch.Tensor  # float64 [N, H] bytes each rank sends in each phase
    fwd_rows_N: torch.Tensor  # long [N] forward pairs computed on each rank
    bwd_rows_N: torch.Tensor  # long [N] backward rows multiplied on each rank (padded when compaction is off)
    slot_bytes_N: torch.Tensor  # float64 [N] weights + gradients of the allocated slots
    state_bytes_N: torch.Tensor  # float64 [N] optimizer state (fp32 master weights and Adam moments)
    saved_bytes_N: torch.Tensor  # float64 [N] activations kept from the forward to the backward
    fwd_buffer_bytes_N: torch.Tensor  # float64 [N] forward in-flight buffers
    bwd_buffer_bytes_N: torch.Tensor  # float64 [N] backward in-flight buffers
    mem_budget_bytes: float  # one MoE layer's share of a rank's budget
    dropped_pairs: int
    routed_pairs: int
    num_layers: int = 1  # MoE layers sharing the budget
    optimizer_in_budget: bool = False  # whether state_bytes_N counts towards the peak
    phases: tuple[str, ...] = field(default=PHASES)

    @property
    def num_ranks(self) -> int:
        return self.time_NH.shape[0]

    @property
    def straggler_H(self) -> torch.Tensor:
        """float64 [H]: the slowest rank's seconds in each phase, which is the phase's duration."""
        return self.time_NH.max(dim=0).values

    @property
    def straggler_rank_H(self) -> torch.Tensor:
        return self.time_NH.argmax(dim=0)

    @property
    def total_s(self) -> float:
        return float(self.straggler_H.sum())

    def phase_s(self, name: str) -> float:
        return float(self.straggler_H[self.phases.index(name)])

    def category_s(self) -> dict[str, float]:
        """Seconds of forward compute, backward compute, all-to-all communication, sync and overheads."""
        strag = self.straggler_H
        return {cat: float(sum(strag[self.phases.index(p)] for p in names)) for cat, names in CATEGORIES.items()}

    @property
    def bytes_H(self) -> torch.Tensor:
        """float64 [H]: bytes sent by all ranks in each phase."""
        return self.bytes_NH.sum(dim=0)

    @property
    def resident_bytes_N(self) -> torch.Tensor:
        """Memory this layer holds from its forward to the end of its backward: slots and saved activations."""
        return self.slot_bytes_N + self.saved_bytes_N

    @property
    def buffer_bytes_N(self) -> torch.Tensor:
        """In-flight buffers while this layer runs: the larger of its forward's and its backward's."""
        return torch.maximum(self.fwd_buffer_bytes_N, self.bwd_buffer_bytes_N)

    @property
    def fixed_bytes_N(self) -> torch.Tensor:
        """Bytes outside the layers that count against the budget: the optimizer shard, if it counts."""
        return self.state_bytes_N if self.optimizer_in_budget else torch.zeros_like(self.state_bytes_N)

    @property
    def peak_bytes_N(self) -> torch.Tensor:
        """The model's peak per rank if every one of its ``num_layers`` MoE layers were this one."""
        return self.num_layers * self.resident_bytes_N + self.buffer_bytes_N + self.fixed_bytes_N

    @property
    def model_budget_bytes(self) -> float:
        return self.num_layers * self.mem_budget_bytes

    @property
    def oom(self) -> bool:
        return bool((self.peak_bytes_N > self.model_budget_bytes).any())


@dataclass(frozen=True)
class PlanWork:
    """What one plan asks of a cluster, before any clock: rows, bytes, memory (:meth:`CostModel.work`). Pricing it
    (:meth:`CostModel.price`) is cheap, so the sensitivity variants of a cost model share one."""

    num_experts: int
    placement_NS: torch.Tensor
    a2a_NN: dict  # phase -> long [N, N] bytes of each all-to-all (the counts all-gather under "plan")
    fwd_rows_NS: torch.Tensor  # GEMM rows per slot, forward (padded to the capacity with fixed buffers)
    bwd_rows_NS: torch.Tensor  # GEMM rows per slot, backward
    moved_NS: torch.Tensor | None  # moved pairs recomputed per slot
    tokens_N: torch.Tensor  # tokens per rank (the shared expert's rows)
    # {replica-gradient mode: lrmoe.bytemodel.sync_model.StepBytes of the optimizer step}: each mode priceable
    steps: dict
    memory: LayerMemory
    state_N: torch.Tensor
    planner_s: float  # host seconds of the plan
    select_pairs_N: torch.Tensor  # pairs scored and selected at each home rank (0 when the plan keeps all)
    expert_norm_bytes_N: torch.Tensor  # bytes of h each rank reads for the metric's ‖h‖ in the forward (m2)
    compact_bytes_N: torch.Tensor  # bytes the compaction passes read and write on each rank
    compact_passes_N: torch.Tensor  # compaction kernels per rank
    fwd_rows_N: torch.Tensor
    bwd_rows_N: torch.Tensor
    dropped: int
    routed: int
    resident_NS: torch.Tensor | None = None  # the slots' placement before a weight push (None: placement_NS)
    # byte sums of its exchanges, computed once and shared by every variant that prices it (CostModel._once)
    links: dict = field(default_factory=dict, compare=False, repr=False)


def link_sums(bytes_KNM: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """float64 [K, 4, N]: for each of K exchanges where rank n sends ``bytes_KNM[k, n, m]`` to rank m, each rank's
    bytes out and in on each link kind: (intra out, inter out, intra in, inter in); the diagonal stays local."""
    intra_w_NM, inter_w_NM = _link_masks(bytes_KNM.shape[-1], ranks_per_node)
    b_KNM = bytes_KNM.double()
    intra_KNM, inter_KNM = b_KNM * intra_w_NM, b_KNM * inter_w_NM
    return torch.stack([intra_KNM.sum(2), inter_KNM.sum(2), intra_KNM.sum(1), inter_KNM.sum(1)], 1)


# --- the model ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _link_masks(num_ranks: int, ranks_per_node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [N, N] masks of the intra-node and inter-node pairs of distinct ranks."""
    node_N = torch.arange(num_ranks) // ranks_per_node
    same_NM = node_N[:, None] == node_N[None, :]
    off_NM = ~torch.eye(num_ranks, dtype=torch.bool)
    return (same_NM & off_NM).double(), (~same_NM).double()


COUNT_BYTES = 8  # the layer all-gathers int64 counts


@dataclass(frozen=True)
class CostModel:
    """Turns a :class:`~lrmoe.planner.plan.LayerPlan` into :class:`PhaseTimes` on ``cluster`` for ``model``."""

    model: MoEConfig
    cluster: ClusterConfig
    gemm: GemmCurve | None = None  # None: gemm_preset(cluster.name, model.name, cluster=cluster)
    compaction: bool = True  # False: backward packets padded to forward sizes
    combine_cols: int | None = None  # the metric's extra combine columns when a plan selects; None: the metric's
    sharded_optimizer: bool = True  # False: static EP, optimizer state stays with the one host of each expert
    grad_bytes: int | None = None  # bytes per gradient element of a replica; None: the model dtype (ours)
    state_bytes_per_param: float = STATE_BYTES_PER_PARAM  # fp32 master weights + two fp32 Adam moments
    optimizer_traffic_per_param: float = 32.0  # HBM bytes Adam reads and writes per parameter (ours)
    recompute_fraction: float = 2 / 3  # share of forward FLOPs a moved pair recomputes (gate and up GEMMs)
    mem_budget_bytes: float | None = None  # one layer's share of a rank's memory; None: cluster's / MoE layers
    early_selection: bool = False  # the forward saves activations only for the pairs the plan keeps (DESIGN.md §4)
    optimizer_in_budget: bool = False  # count the optimizer shard against the budget (ours: no, see the module doc)
    sync_groups: str = "range"  # "range": the layer's consecutive-range groups; "hosts": only the hosting ranks
    replica_grad: str = "range"  # "range": SYMI's group all-reduce + collection; "shard": straight to the owners
    overheads: tuple[str, ...] = OVERHEADS  # the overheads charged (lrmoe.sim.overheads); () charges none
    capacity_cf: float | None = None  # fixed-size capacity buffers of this factor per slot (SYMI-cf1, capacity)
    planner: str | None = None  # the planner benchmark to charge (a registry entry's); None: no planner
    quota_stage: bool = False  # the plans add LRMoE's quota stage to the planner (trimmed plans)
    metric: str = "m2"  # what a selecting plan scores with (lrmoe.recal.scoring), and its selection mode
    mode: str = "topk"
    selection_scale: float = 1.0  # the scoring and selection's charge times this (a sensitivity; 1: as measured)

    def __post_init__(self) -> None:
        if self.gemm is None:
            object.__setattr__(self, "gemm", gemm_preset(self.cluster.name, self.model.name, cluster=self.cluster))
        if self.grad_bytes is None:
            object.__setattr__(self, "grad_bytes", self.model.dtype_bytes)
        if self.combine_cols is None:
            object.__setattr__(self, "combine_cols", get_metric(self.metric).combine_cols)
        selection_ms_per_pair(self.metric, self.mode)  # raises for a metric and mode with no scoring benchmark
        if self.mem_budget_bytes is None:
            object.__setattr__(self, "mem_budget_bytes",
                               float(self.cluster.mem_budget_bytes) / self.model.num_moe_layers)
        if self.sync_groups not in ("range", "hosts"):
            raise ValueError(f"CostModel.sync_groups={self.sync_groups!r} is not 'range' or 'hosts'")
        check_replica_grad(self.replica_grad)
        object.__setattr__(self, "overheads", check_overheads(self.overheads))
        if self.capacity_cf is not None and not self.capacity_cf > 0:
            raise ValueError(f"CostModel.capacity_cf must be positive or None, got {self.capacity_cf!r}")
        non_negative_fields(self, "grad_bytes", "state_bytes_per_param", "optimizer_traffic_per_param",
                            "recompute_fraction", "mem_budget_bytes", "selection_scale")

    # -- memory (lrmoe.bytemodel.memory): what LRMoE's placement MemoryModel is given
    # ---------------------------------------
    @property
    def footprint(self) -> Footprint:
        m = self.model
        return footprint(m.hidden, m.expert_ffn, m.dtype_bytes, self.grad_bytes, self.combine_cols)

    @property
    def slot_bytes(self) -> float:
        """One replica slot: weights and gradients."""
        return self.footprint.slot

    @property
    def pair_bytes(self) -> float:
        """Resident bytes per pair a rank computes: its received input row (the saved GEMM input) and the saved
        gate, up and h."""
        return self.footprint.expert_pair

    def state_bytes_N(self, placement_NS: torch.Tensor | None = None) -> torch.Tensor:
        """float64 [N] optimizer state per rank (sharded: E/N experts' worth; static EP: its hosted experts')."""
        m, n = self.model, self.cluster.num_ranks
        hosted = None if placement_NS is None else hosts_mask(placement_NS, m.num_experts).sum(1)
        return optimizer_shard_bytes(m.num_experts, m.expert_params, n, self.sharded_optimizer, hosted)

    def placement_s(self) -> float:
        """Host seconds of one layer's placement, computed off the critical path once per iteration
        (:func:`lrmoe.sim.overheads.placement_seconds`; 0 without a planner or without the planning overhead)."""
        if "planning" not in self.overheads:
            return 0.0
        return placement_seconds(self.planner, self.cluster.num_ranks, self.model.num_experts)

    def memory_model(self) -> MemoryModel:
        """The planner's :class:`~lrmoe.planner.placement.MemoryModel` of this cost model's accounting: the whole
        budget of
        the model's MoE layers, the footprint, and the optimizer shard when it counts."""
        fixed = float(self.state_bytes_N().max()) if self.optimizer_in_budget else 0.0
        n_l = self.model.num_moe_layers
        return MemoryModel.for_model(self.footprint, self.mem_budget_bytes * n_l, n_l, fixed)

    def push_cost_rows(self) -> float:
        """One online-replication push's cost in pairs of the busiest rank's work (ours): a whole expert's weights
        on NVLink with its latency, over the seconds one more pair costs the rank that computes it (its forward and
        backward GEMM rows at ``eff_max`` of peak, and its four all-to-all rows on the link that bounds them when
        the sources are spread evenly over the ranks). The threshold of :class:`~lrmoe.planner.online.Online`."""
        m, c = self.model, self.cluster
        push_s = m.expert_params * m.dtype_bytes / c.intra_bw + c.intra_latency
        n, rpn = c.num_ranks, c.ranks_per_node
        row = m.hidden * m.dtype_bytes
        link_s = max((rpn - 1) / n / c.intra_bw, (n - rpn) / n / c.inter_bw)  # per byte, the bounding link
        pair_s = (m.pair_fwd_flops + m.pair_bwd_flops) / (self.gemm.eff_max * c.peak_flops) + 4 * row * link_s
        return push_s / pair_s

    def slot_capacity_rows(self, plan) -> int | None:
        """Rows of each slot's fixed-size buffer, or None (dropless, or capacity buffers not charged)."""
        if self.capacity_cf is None or "capacity_buffers" not in self.overheads:
            return None
        return slot_capacity(plan, self.capacity_cf)

    # -- sensitivity ---------------------------------------------------------------------------------------------
    def variant(self, eff_max: float | None = None, m_half: float | None = None,
                bw_scale: float | None = None, replica_grad: str | None = None,
                selection_scale: float | None = None) -> "CostModel":
        """The same model with other uncertain constants: the GEMM curve's ``eff_max`` and ``m_half``, and every
        link's bandwidth times ``bw_scale`` (1: the datasheet's); or in the other ``replica_grad`` mode (the work of a
        plan holds the step's bytes in both, so a variant prices either from the same work); or with the scoring and
        selection's charge times ``selection_scale``."""
        g = self.gemm
        gemm = GemmCurve(eff_max=g.eff_max if eff_max is None else eff_max,
                         m_half=g.m_half if m_half is None else m_half, launch_s=g.launch_s,
                         source=f"{g.source} (sensitivity variant)")
        c = self.cluster
        if bw_scale is not None:
            c = c.replace(intra_bw=c.intra_bw * bw_scale, inter_bw=c.inter_bw * bw_scale)
        mode = self.replica_grad if replica_grad is None else check_replica_grad(replica_grad)
        scale = self.selection_scale if selection_scale is None else float(selection_scale)
        return dataclasses.replace(self, gemm=gemm, cluster=c, replica_grad=mode, selection_scale=scale)

    # -- building blocks ---------------------------------------------------------------------------------------
    def a2a_seconds(self, bytes_NM: torch.Tensor) -> torch.Tensor:
        """float64 [N]: each rank's time in an all-to-all where rank n sends ``bytes_NM[n, m]`` to rank m."""
        return self._link_times(link_sums(bytes_NM[None], self.cluster.ranks_per_node))[0][0]

    def _link_times(self, sums_K4N: torch.Tensor, latency: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(seconds [K, N], bytes sent [K, N]) of K all-to-alls from their :func:`link_sums`: each rank's time is the
        larger of its sending and receiving, each the slower link kind's, plus one latency per link kind it uses
        (``latency=False``: the transfer alone, for a phase whose fixed time is measured as a whole)."""
        c = self.cluster
        intra_out, inter_out, intra_in, inter_in = sums_K4N.unbind(1)
        send = torch.maximum(intra_out / c.intra_bw, inter_out / c.inter_bw)
        recv = torch.maximum(intra_in / c.intra_bw, inter_in / c.inter_bw)
        lat = torch.maximum(((intra_out + intra_in) > 0) * c.intra_latency,
                            ((inter_out + inter_in) > 0) * c.inter_latency)
        return torch.maximum(send, recv) + latency * lat, intra_out + inter_out

    def _once(self, w: PlanWork, name: str, compute) -> torch.Tensor:
        """``compute()``, kept in the plan's ``links`` under ``name`` (and this cluster's ranks per node, which the
        sums depend on): a plan's byte sums are the same for every sensitivity variant that prices it."""
        key = (name, self.cluster.ranks_per_node)
        if key not in w.links:
            w.links[key] = compute()
        return w.links[key]

    def _work_a2a(self, w: PlanWork, name: str, bytes_NM: torch.Tensor, latency: bool = True):
        """(seconds [N], bytes sent [N]) of one of a plan's all-to-alls, its link sums computed once per plan."""
        sums = self._once(w, name, lambda: link_sums(bytes_NM[None], self.cluster.ranks_per_node))
        t_KN, sent_KN = self._link_times(sums, latency)
        return t_KN[0], sent_KN[0]

    def gemm_seconds_N(self, rows_NS: torch.Tensor, flops_per_row: float) -> torch.Tensor:
        """float64 [N]: grouped GEMM of ``rows_NS[n, s]`` rows on slot s of rank n, plus a launch per busy rank."""
        t_N = self.gemm.seconds(rows_NS, flops_per_row, self.cluster.peak_flops).sum(1)
        return t_N + (rows_NS.sum(1) > 0) * self.gemm.launch_s

    # -- the plan's cost ----------------------------------------------------------------------------------------
    def cost(self, plan) -> PhaseTimes:
        """Seconds per rank and phase, bytes, and memory of one layer-iteration executing ``plan``."""
        return self.price(self.work(plan))

    def work(self, plan) -> PlanWork:
        """Everything ``plan`` asks of the cluster, independent of its speeds (:class:`PlanWork`)."""
        m, c = self.model, self.cluster
        placement_NS = plan.placement_NS
        n, s = placement_NS.shape
        if n != c.num_ranks:
            raise ValueError(f"plan has {n} ranks but cluster {c.name!r} has num_ranks={c.num_ranks}")
        e = plan.dropped_NE.shape[1]
        if e != m.num_experts:
            raise ValueError(f"plan has {e} experts but model {m.name!r} has num_experts={m.num_experts}")
        fwd_NG = plan.fwd_NG
        # The layer's own packet layout (lrmoe.bytemodel.layout): the same rows it sends, compact or padded.
        traffic = layer_traffic(plan, m.hidden, m.dtype_bytes, compact=self.compaction,
                                combine_cols=self.combine_cols)
        a2a = {phase: t.bytes_NN for phase, t in traffic.items()}
        push_src_G, resident_NS = getattr(plan, "push_src_G", None), getattr(plan, "resident_NS", placement_NS)
        if push_src_G is not None:  # online replication: whole experts into spare slots before the expert compute
            a2a["weight_push"] = push_bytes(placement_NS, push_src_G, m.expert_params, m.dtype_bytes)
        if self.early_selection:  # the keep bit of every pair to its expert, an all-to-all of its own in the forward
            a2a["early_keep_a2a"] = Traffic(traffic["dispatch_a2a"].rows_NN, KEEP_BYTES).bytes_NN
        if "counts" in self.overheads:  # every rank's E counts to every other rank
            a2a["plan"] = torch.full((n, n), e * COUNT_BYTES, dtype=torch.long)
        _, grad_NG, _ = backward_counts(plan, self.compaction)  # backward rows per (source, slot): the GEMM's
        fwd_rows_NS = fwd_NG.sum(0).view(n, s)
        bwd_rows_NS = grad_NG.sum(0).view(n, s)
        fwd_rows_N, bwd_rows_N = fwd_rows_NS.sum(1), bwd_rows_NS.sum(1)
        cap = self.slot_capacity_rows(plan)
        if cap is not None:  # fixed-size buffers: every hosted slot multiplies its capacity, forward and backward
            hosted_NS = placement_NS >= 0
            fwd_rows_NS = torch.where(hosted_NS, torch.clamp(fwd_rows_NS, min=cap), 0)
            bwd_rows_NS = torch.where(hosted_NS, torch.clamp(bwd_rows_NS, min=cap), 0)
        moved_NS = plan.moved_NG.sum(0).view(n, s) if len(plan.bwd_flows_V4) else None
        pairs_N = fwd_NG.sum(1) + plan.dropped_NE.sum(1)  # routed pairs per source rank
        tokens_N = pairs_N.double() / m.top_k
        modes = REPLICA_GRAD_MODES if self.sharded_optimizer else ("range",)
        steps = {mode: step_bytes(placement_NS, placement_NS, e, m.expert_params, self.grad_bytes, m.dtype_bytes,
                                  mode, self.sync_groups) for mode in modes}
        loads = plan_loads(plan, self.compaction, cap, early=self.early_selection)
        memory = layer_memory(self.footprint, loads, combine=plan_selects(plan))
        planner_s = 0.0
        if "planning" in self.overheads:
            planner_s = planner_seconds(self.planner, self.quota_stage, n, e)
        zero_N = torch.zeros(n, dtype=torch.float64)
        selects = plan_selects(plan) and "selection" in self.overheads
        select_N = loads.home_N if selects else zero_N
        # a metric that needs ‖h‖ computes it at the expert in the forward: each forward row's h read once
        norm_N = fwd_rows_N.double() * m.expert_ffn * m.dtype_bytes \
            if selects and "h_norm" in get_metric(self.metric).needs else zero_N
        compact_bytes_N, passes_N = zero_N, zero_N
        if uses_compact(plan, self.compaction) and "compaction" in self.overheads:
            fp = self.footprint
            compact_bytes_N = 2.0 * (loads.bwd_home_send_N * fp.row + loads.bwd_gemm_N * fp.expert_pair)
            passes_N = (loads.bwd_home_send_N > 0).double() + (loads.bwd_gemm_N > 0).double()
        return PlanWork(num_experts=e, placement_NS=placement_NS, a2a_NN=a2a, fwd_rows_NS=fwd_rows_NS,
                        bwd_rows_NS=bwd_rows_NS, moved_NS=moved_NS, tokens_N=tokens_N, steps=steps, memory=memory,
                        state_N=self.state_bytes_N(resident_NS), planner_s=planner_s, select_pairs_N=select_N,
                        expert_norm_bytes_N=norm_N,
                        compact_bytes_N=compact_bytes_N, compact_passes_N=passes_N, fwd_rows_N=fwd_rows_N,
                        bwd_rows_N=bwd_rows_N, dropped=int(plan.dropped_NE.sum()), routed=int(pairs_N.sum()),
                        resident_NS=resident_NS)

    def price(self, w: PlanWork) -> PhaseTimes:
        """:class:`PhaseTimes` of a plan's :class:`PlanWork` on this model's cluster and GEMM curve."""
        m, c = self.model, self.cluster
        n = w.placement_NS.shape[0]
        time_NH = torch.zeros(n, len(PHASES), dtype=torch.float64)
        bytes_NH = torch.zeros_like(time_NH)
        if w.a2a_NN:  # every all-to-all of the layer at once (their link sums once per plan)
            t_KN, sent_KN = self._link_times(self._once(
                w, "a2a", lambda: link_sums(torch.stack(list(w.a2a_NN.values())), c.ranks_per_node)))
            cols = [_P[phase] for phase in w.a2a_NN]
            time_NH[:, cols], bytes_NH[:, cols] = t_KN.T, sent_KN.T
        time_NH[:, _P["plan"]] += w.planner_s

        fwd_f, bwd_f = float(m.pair_fwd_flops), float(m.pair_bwd_flops)
        time_NH[:, _P["expert_fwd"]] = self.gemm_seconds_N(w.fwd_rows_NS, fwd_f)
        time_NH[:, _P["expert_bwd"]] = self.gemm_seconds_N(w.bwd_rows_NS, bwd_f)
        if w.moved_NS is not None:  # moved pairs recompute their gate and up projections where they land
            time_NH[:, _P["expert_bwd"]] += self.gemm.seconds(w.moved_NS, self.recompute_fraction * fwd_f,
                                                              c.peak_flops).sum(1)
        if m.num_shared_experts:
            shared_f = 6.0 * m.hidden * m.shared_ffn * m.num_shared_experts
            time_NH[:, _P["shared_fwd"]] = self.gemm.seconds(w.tokens_N, shared_f, c.peak_flops)
            time_NH[:, _P["shared_bwd"]] = self.gemm.seconds(w.tokens_N, 2 * shared_f, c.peak_flops)
        launch = self.gemm.launch_s
        recal_N = self.selection_scale * selection_seconds(w.select_pairs_N, self.metric, self.mode, c.hbm_bw, launch)
        if c.hbm_bw > 0:  # the expert-side ‖h‖ of the metric, in the forward
            time_NH[:, _P["expert_fwd"]] += w.expert_norm_bytes_N / c.hbm_bw + (w.expert_norm_bytes_N > 0) * launch
        if c.hbm_bw > 0:
            recal_N = recal_N + w.compact_bytes_N / c.hbm_bw
        time_NH[:, _P["recalibrate"]] = recal_N + w.compact_passes_N * launch
        self._sync(w, time_NH, bytes_NH)
        mem = w.memory
        return PhaseTimes(time_NH=time_NH, bytes_NH=bytes_NH, fwd_rows_N=w.fwd_rows_N, bwd_rows_N=w.bwd_rows_N,
                          slot_bytes_N=mem.slot_N, state_bytes_N=w.state_N, saved_bytes_N=mem.saved_N,
                          fwd_buffer_bytes_N=mem.fwd_N, bwd_buffer_bytes_N=mem.bwd_N,
                          mem_budget_bytes=float(self.mem_budget_bytes), dropped_pairs=w.dropped,
                          routed_pairs=w.routed, num_layers=m.num_moe_layers,
                          optimizer_in_budget=self.optimizer_in_budget)

    def _sync(self, w: PlanWork, time_NH: torch.Tensor, bytes_NH: torch.Tensor) -> None:
        """Replica sync, gradient collection, Adam and redistribution, in place.

        The bytes are :func:`lrmoe.bytemodel.sync_model.step_bytes`'s, the layer's own byte model (the placement of
        this plan
        stands in for the next one); this only turns them into time, on the links of :meth:`_a2a`:

        * ``replica_grad="range"``: each expert's group all-reduce is priced as a ring, ``bytes / bw + 2 (h - 1)``
          latencies (one per hop), at the slowest link the group crosses (inter-node as soon as its members sit on
          two nodes); a rank in several groups runs them one after the other (the layer issues one collective per
          expert, in expert order), so its time is the sum. Gradient collection: one all-to-all.
        * ``replica_grad="shard"``: the one exchange is an all-to-all (latency once per link kind a rank uses:
          its messages are pipelined); there is no collection phase (the owners' fold of what they receive is a
          local add, not priced).
        * Redistribution: one all-to-all in both modes; Adam: E/N experts' state at HBM bandwidth.
        * Each exchange phase also pays its local passes (the sums, packing, folding and placing of
          :func:`lrmoe.bytemodel.sync_model.local_bytes`) at HBM bandwidth, after its transfer.
        * Where the cluster holds a measured fixed time of a phase (:meth:`ClusterConfig.step_fixed`, the phase run
          with negligible bytes: its host loops, launches and collective wake-ups), every rank pays it once and the
          phase's latency terms are dropped (they are part of it); elsewhere the latency model above stands.

        No overlap: each phase starts when the previous one ends on the slowest rank (the module's rule), and the
        step's phases are not overlapped with the backward of later layers. ``sharded_optimizer=False`` (static EP)
        has no shard owners: its hosts all-reduce (range groups), and there is no collection or redistribution.
        """
        m, c = self.model, self.cluster
        placement_NS, e = w.placement_NS, w.num_experts
        n = placement_NS.shape[0]
        p_e = m.expert_params
        mode = self.replica_grad if self.sharded_optimizer else "range"
        sb = w.steps[mode]
        fixed = {phase: c.step_fixed(mode, phase) for phase in STEP_PHASES}
        lat = {phase: fixed[phase] is None for phase in STEP_PHASES}  # latency terms, unless measured as a whole
        if mode == "range":
            ring_intra, ring_inter, hops_intra, hops_inter = self._range_sums(w, sb)
            time_NH[:, _P["replica_sync"]] = (ring_intra / c.intra_bw + ring_inter / c.inter_bw
                                              + lat["replica_sync"] * (hops_intra * c.intra_latency
                                                                       + hops_inter * c.inter_latency))
            bytes_NH[:, _P["replica_sync"]] = ring_intra + ring_inter
        else:
            time_NH[:, _P["replica_sync"]], bytes_NH[:, _P["replica_sync"]] = self._work_a2a(
                w, f"sync/{mode}", sb.sync_NM, lat["replica_sync"])
        local_N3 = sb.local_N3.double() / c.hbm_bw if c.hbm_bw > 0 else torch.zeros(n, 3, dtype=torch.float64)
        time_NH[:, _P["replica_sync"]] += local_N3[:, LOCAL_PHASES.index("replica_sync")]

        if not self.sharded_optimizer:
            if c.hbm_bw > 0:
                resident_NS = placement_NS if w.resident_NS is None else w.resident_NS  # pushed copies: no state
                hosted_N = hosts_mask(resident_NS, e).double().sum(1)
                time_NH[:, _P["adam"]] = hosted_N * p_e * self.optimizer_traffic_per_param / c.hbm_bw
            self._add_fixed(time_NH, fixed, ("replica_sync", "adam"))
            return
        if mode == "range":
            time_NH[:, _P["grad_collect"]], bytes_NH[:, _P["grad_collect"]] = self._work_a2a(
                w, f"collect/{mode}", sb.collect_NM, lat["grad_collect"])
        time_NH[:, _P["grad_collect"]] += local_N3[:, LOCAL_PHASES.index("grad_collect")]
        if c.hbm_bw > 0:
            shard_N = torch.tensor(shard_sizes(p_e, n), dtype=torch.float64)
            time_NH[:, _P["adam"]] = e * shard_N * self.optimizer_traffic_per_param / c.hbm_bw
        time_NH[:, _P["redistribute"]], bytes_NH[:, _P["redistribute"]] = self._work_a2a(
            w, f"redistribute/{mode}", sb.redistribute_NM, lat["redistribute"])
        time_NH[:, _P["redistribute"]] += local_N3[:, LOCAL_PHASES.index("redistribute")]
        self._add_fixed(time_NH, fixed, STEP_PHASES)

    def _range_sums(self, w: PlanWork, sb) -> torch.Tensor:
        """float64 [4, N], once per plan: each rank's ring all-reduce bytes and hops (2 (h - 1) per group of h
        members) summed over the groups it is in, split by the link its group's slowest hop takes (inter-node as
        soon as the group's members sit on two nodes): (bytes intra, bytes inter, hops intra, hops inter)."""
        def compute() -> torch.Tensor:
            group_NE = sb.group_NE
            node_N = torch.arange(group_NE.shape[0]) // self.cluster.ranks_per_node
            lo_node_E = torch.where(group_NE, node_N[:, None], group_NE.shape[0]).min(0).values
            hi_node_E = torch.where(group_NE, node_N[:, None], -1).max(0).values
            crosses_E = hi_node_E > lo_node_E
            ring_NE = torch.where(group_NE, sb.allreduce_NE.double(), 0.0)
            hops_NE = group_NE * 2.0 * (group_NE.sum(0) - 1).double()
            return torch.stack([(ring_NE * ~crosses_E).sum(1), (ring_NE * crosses_E).sum(1),
                                (hops_NE * ~crosses_E).sum(1), (hops_NE * crosses_E).sum(1)])

        return self._once(w, "range", compute)

    @staticmethod
    def _add_fixed(time_NH: torch.Tensor, fixed: dict[str, float | None], phases) -> None:
        """Every rank pays each of ``phases``' measured fixed time (where the cluster has one)."""
        for phase in phases:
            if fixed[phase] is not None:
                time_NH[:, _P[phase]] += fixed[phase]
