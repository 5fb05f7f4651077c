"""Cost model: one MoE layer's plan for one iteration turned into seconds, bytes and memory per rank.

The model reads only a :class:`~lrmoe.plan.LayerPlan`'s counted work (pairs per source rank and slot, kept
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
* **Expert GEMM.** A group of m rows on one slot reaches ``eff(m) = eff_max * m / (m + m_half)`` of peak, so its
  time is ``flops_per_row * (m + m_half) / (eff_max * peak)`` for m > 0 and nothing for an empty slot, plus a
  fixed ``launch_s`` per grouped-GEMM call on a rank with any rows. The backward (input and weight gradients)
  costs ``pair_bwd_flops`` per row (about 2x the forward) on the same curve. A pair whose backward was moved to
  another replica recomputes its gate and up projections there (2/3 of the forward FLOPs).
* **Packets** are the layer's own, from the plan's byte model (:mod:`lrmoe.layout`, shared with the layer's
  accounting, so modelled bytes = counted bytes): compact backward (``compaction=True``, where the plan trims or
  moves pairs) sends the retained gradient rows plus the moved pairs' input rows and a 4-byte index per staying row,
  and multiplies the retained rows; the forward layout (``compaction=False``, or a plan that keeps everything)
  sends every forward row (zeros where not retained) plus moved gradient and input rows, and multiplies fwd + moved
  rows. ``combine_cols`` extra elements ride on each combine row when the plan selects (metric m2's ‖h‖).
* **Replica gradient sync** (the substrate of :mod:`lrmoe.distributed.replica`, as the layer runs it; bytes from
  the shared byte model :mod:`lrmoe.sync_model`): the local slots of an expert are summed for free, then
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

Memory per rank (one layer): expert slots (weights + gradients per hosted replica), the optimizer shard, the
activations saved for the backward on the rank that computed a pair's forward (input row, gate and up
projections), and the larger of the forward and backward transient buffers (send, receive and output rows on
both sides of each all-to-all, plus recomputed activations of moved pairs). The budget is one layer's share of
the rank's memory (by default the cluster's budget over the model's MoE layers); ``oom`` flags a layer whose
peak exceeds it, and :mod:`lrmoe.sim.simulator` adds up the layers of a model against the whole budget. The
optimizer shard is reported but, by default, not counted: it is the same E/N experts' worth of fp32 state on
every rank for every system (statically sharded), and at paper scale it lives outside the MoE layers' budget
(offloaded, or sharded further over data-parallel replicas).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checks import non_negative_fields
from ..config import ClusterConfig, MoEConfig
from ..layout import A2A_PHASES, STEP_PHASES, backward_counts, layer_traffic
from ..layout import PHASES as LAYOUT_PHASES
from ..sync_model import check_replica_grad, hosts_mask, shard_sizes, step_bytes

# The modelled phases, named as the layer names them (one vocabulary: lrmoe.layout.PHASES), in execution order. The
# backward all-to-alls are named for the forward one they invert: combine_a2a_bwd carries output gradients from
# the home ranks to the experts, dispatch_a2a_bwd carries input gradients back.
PHASES = tuple(p for p in LAYOUT_PHASES if p in (
    "dispatch_a2a", "expert_fwd", "shared_fwd", "combine_a2a", "combine_a2a_bwd", "bwd_index_a2a", "expert_bwd",
    "shared_bwd", "dispatch_a2a_bwd", "replica_sync", "grad_collect", "adam", "redistribute"))
CATEGORIES = {
    "forward": ("expert_fwd", "shared_fwd"),
    "backward": ("expert_bwd", "shared_bwd"),
    "communication": A2A_PHASES,
    "sync": STEP_PHASES,
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


# Placeholder constants (ours) until experiments/calibrate_gpu.py measures them: large bf16 GEMMs reach about
# 70-80 % of the datasheet peak on A100 / H100-class GPUs (vendor GEMM benchmarks); the half-efficiency row
# counts are our guess, larger on the faster GPU because it needs more rows to fill its SMs.
_GEMM_DEFAULTS = {
    "h200": GemmCurve(eff_max=0.70, m_half=256.0, launch_s=5e-6,
                      source="ours (placeholder): 70 % of datasheet peak for large groups, m_half=256 rows"),
    "a100": GemmCurve(eff_max=0.75, m_half=128.0, launch_s=5e-6,
                      source="ours (placeholder): 75 % of datasheet peak for large groups, m_half=128 rows"),
}


def gemm_preset(cluster_name: str, model_name: str | None = None,
                calibration: str | Path | None = None) -> GemmCurve:
    """The GEMM curve for a cluster preset's GPU: a calibration file's fit if there is one, else the default.

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
    return _GEMM_DEFAULTS[gpu]


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
    :mod:`lrmoe.harness.calibrate_cpu`) holds ``peak_flops``, ``a2a_bw``, ``a2a_latency``, ``mem_bw`` and a ``gemm``
    fit (``eff_max``, ``m_half``, ``launch_s``); ``clock`` picks the constants of one clock from its ``clocks``
    entry instead of the top-level ones.
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
        source=f"CPU micro-benchmarks ({Path(calibration_json).name})")
    g = data["gemm"]
    return cluster, GemmCurve(eff_max=float(g["eff_max"]), m_half=float(g["m_half"]),
                              launch_s=float(g.get("launch_s", 0.0)), source=cluster.source)


# --- the result of costing one plan ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PhaseTimes:
    """Seconds, bytes and memory of one layer-iteration, per rank; phase ``p`` is ``PHASES[p]``."""

    time_NP: torch.Tensor  # float64 [N, P] seconds each rank spends in each phase
    bytes_NP: torch.Tensor  # float64 [N, P] bytes each rank sends in each phase
    fwd_rows_N: torch.Tensor  # long [N] forward pairs computed on each rank
    bwd_rows_N: torch.Tensor  # long [N] backward rows multiplied on each rank (padded when compaction is off)
    slot_bytes_N: torch.Tensor  # float64 [N] weights + gradients of the hosted replicas
    state_bytes_N: torch.Tensor  # float64 [N] optimizer state (fp32 master weights and Adam moments)
    saved_bytes_N: torch.Tensor  # float64 [N] activations saved for the backward
    buffer_bytes_N: torch.Tensor  # float64 [N] peak transient all-to-all / GEMM buffers
    mem_budget_bytes: float
    dropped_pairs: int
    routed_pairs: int
    optimizer_in_budget: bool = False  # whether state_bytes_N counts towards the peak
    phases: tuple[str, ...] = field(default=PHASES)

    @property
    def num_ranks(self) -> int:
        return self.time_NP.shape[0]

    @property
    def straggler_P(self) -> torch.Tensor:
        """float64 [P]: the slowest rank's seconds in each phase, which is the phase's duration."""
        return self.time_NP.max(dim=0).values

    @property
    def straggler_rank_P(self) -> torch.Tensor:
        return self.time_NP.argmax(dim=0)

    @property
    def total_s(self) -> float:
        return float(self.straggler_P.sum())

    def phase_s(self, name: str) -> float:
        return float(self.straggler_P[self.phases.index(name)])

    def category_s(self) -> dict[str, float]:
        """Seconds of forward compute, backward compute, all-to-all communication and sync."""
        strag = self.straggler_P
        return {cat: float(sum(strag[self.phases.index(p)] for p in names)) for cat, names in CATEGORIES.items()}

    @property
    def bytes_P(self) -> torch.Tensor:
        """float64 [P]: bytes sent by all ranks in each phase."""
        return self.bytes_NP.sum(dim=0)

    @property
    def resident_bytes_N(self) -> torch.Tensor:
        """Memory this layer holds from its forward to the end of the iteration: slots, activations (and the
        optimizer shard when it counts against the budget)."""
        resident_N = self.slot_bytes_N + self.saved_bytes_N
        return resident_N + self.state_bytes_N if self.optimizer_in_budget else resident_N

    @property
    def peak_bytes_N(self) -> torch.Tensor:
        return self.resident_bytes_N + self.buffer_bytes_N

    @property
    def oom(self) -> bool:
        return bool((self.peak_bytes_N > self.mem_budget_bytes).any())


# --- the model ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _link_masks(num_ranks: int, ranks_per_node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [N, N] masks of the intra-node and inter-node pairs of distinct ranks."""
    node_N = torch.arange(num_ranks) // ranks_per_node
    same_NM = node_N[:, None] == node_N[None, :]
    off_NM = ~torch.eye(num_ranks, dtype=torch.bool)
    return (same_NM & off_NM).double(), (~same_NM).double()


@dataclass(frozen=True)
class CostModel:
    """Turns a :class:`~lrmoe.plan.LayerPlan` into :class:`PhaseTimes` on ``cluster`` for ``model``."""

    model: MoEConfig
    cluster: ClusterConfig
    gemm: GemmCurve | None = None  # None: gemm_preset(cluster.name, model.name)
    compaction: bool = True  # False: backward packets padded to forward sizes
    combine_cols: int = 0  # the recalibration metric's extra combine columns (m2: 1), when a plan selects
    sharded_optimizer: bool = True  # False: static EP, optimizer state stays with the one host of each expert
    grad_bytes: int | None = None  # bytes per gradient element of a replica; None: the model dtype (ours)
    state_bytes_per_param: float = 12.0  # fp32 master weights + two fp32 Adam moments
    optimizer_traffic_per_param: float = 32.0  # HBM bytes Adam reads and writes per parameter (ours)
    recompute_fraction: float = 2 / 3  # share of forward FLOPs a moved pair recomputes (gate and up GEMMs)
    mem_budget_bytes: float | None = None  # one layer's share of a rank's memory; None: cluster's / MoE layers
    optimizer_in_budget: bool = False  # count the optimizer shard against the budget (ours: no, see below)
    sync_groups: str = "range"  # "range": the layer's consecutive-range groups; "hosts": only the hosting ranks
    replica_grad: str = "range"  # "range": SYMI's group all-reduce + collection; "shard": straight to the owners

    def __post_init__(self) -> None:
        if self.gemm is None:
            object.__setattr__(self, "gemm", gemm_preset(self.cluster.name, self.model.name))
        if self.grad_bytes is None:
            object.__setattr__(self, "grad_bytes", self.model.dtype_bytes)
        if self.mem_budget_bytes is None:
            object.__setattr__(self, "mem_budget_bytes",
                               float(self.cluster.mem_budget_bytes) / self.model.num_moe_layers)
        if self.sync_groups not in ("range", "hosts"):
            raise ValueError(f"CostModel.sync_groups={self.sync_groups!r} is not 'range' or 'hosts'")
        check_replica_grad(self.replica_grad)
        non_negative_fields(self, "grad_bytes", "state_bytes_per_param", "optimizer_traffic_per_param",
                            "recompute_fraction", "mem_budget_bytes")

    # -- memory per slot and per pair (what LRMoE's placement MemoryModel should be given) ------------------------
    @property
    def slot_bytes(self) -> float:
        """One hosted replica: weights and gradients."""
        return float(self.model.expert_params) * (self.model.dtype_bytes + self.grad_bytes)

    @property
    def pair_bytes(self) -> float:
        """Buffers one pair occupies on the rank computing it: its input row received, its output row, and the
        activations saved for the backward (input row, gate and up projections)."""
        m = self.model
        return float((2 * m.hidden + m.hidden + 2 * m.expert_ffn) * m.dtype_bytes)

    # -- building blocks ---------------------------------------------------------------------------------------
    def a2a_seconds(self, bytes_NM: torch.Tensor) -> torch.Tensor:
        """float64 [N]: each rank's time in an all-to-all where rank n sends ``bytes_NM[n, m]`` to rank m."""
        return self._a2a(bytes_NM)[0]

    def _a2a(self, bytes_NM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(seconds [N], bytes sent to other ranks [N]) of an all-to-all; the diagonal stays local."""
        c = self.cluster
        n = bytes_NM.shape[0]
        intra_w_NM, inter_w_NM = _link_masks(n, c.ranks_per_node)
        b_NM = bytes_NM.double()
        intra_NM, inter_NM = b_NM * intra_w_NM, b_NM * inter_w_NM
        intra_out_N, inter_out_N = intra_NM.sum(1), inter_NM.sum(1)
        intra_in_N, inter_in_N = intra_NM.sum(0), inter_NM.sum(0)
        send_N = torch.maximum(intra_out_N / c.intra_bw, inter_out_N / c.inter_bw)
        recv_N = torch.maximum(intra_in_N / c.intra_bw, inter_in_N / c.inter_bw)
        latency_N = torch.maximum(((intra_out_N + intra_in_N) > 0) * c.intra_latency,
                                  ((inter_out_N + inter_in_N) > 0) * c.inter_latency)
        return torch.maximum(send_N, recv_N) + latency_N, intra_out_N + inter_out_N

    def gemm_seconds_N(self, rows_NS: torch.Tensor, flops_per_row: float) -> torch.Tensor:
        """float64 [N]: grouped GEMM of ``rows_NS[n, s]`` rows on slot s of rank n, plus a launch per busy rank."""
        t_N = self.gemm.seconds(rows_NS, flops_per_row, self.cluster.peak_flops).sum(1)
        return t_N + (rows_NS.sum(1) > 0) * self.gemm.launch_s

    # -- the plan's cost ----------------------------------------------------------------------------------------
    def cost(self, plan) -> PhaseTimes:
        """Seconds per rank and phase, bytes, and memory of one layer-iteration executing ``plan``."""
        m, c = self.model, self.cluster
        placement_NS = plan.placement_NS
        n, s = placement_NS.shape
        if n != c.num_ranks:
            raise ValueError(f"plan has {n} ranks but cluster {c.name!r} has num_ranks={c.num_ranks}")
        e = plan.dropped_NE.shape[1]
        if e != m.num_experts:
            raise ValueError(f"plan has {e} experts but model {m.name!r} has num_experts={m.num_experts}")
        fwd_NG = plan.fwd_NG
        # The layer's own packet layout (lrmoe.layout): the same rows it sends, compact or padded.
        traffic = layer_traffic(plan, m.hidden, m.dtype_bytes, compact=self.compaction,
                                combine_cols=self.combine_cols)
        _, grad_NG, _ = backward_counts(plan, self.compaction)  # backward rows per (source, slot): the GEMM's
        moves = bool(len(plan.bwd_flows_F4))
        carry_NG, moved_G = (plan.carry_NG, plan.moved_NG.sum(0)) if moves else (None, None)
        fwd_rows_NS = fwd_NG.sum(0).view(n, s)
        bwd_rows_NS = grad_NG.sum(0).view(n, s)

        time_NP = torch.zeros(n, len(PHASES), dtype=torch.float64)
        bytes_NP = torch.zeros_like(time_NP)
        for phase, t in traffic.items():
            time_NP[:, _P[phase]], bytes_NP[:, _P[phase]] = self._a2a(t.bytes_NN)

        fwd_f, bwd_f = float(m.pair_fwd_flops), float(m.pair_bwd_flops)
        time_NP[:, _P["expert_fwd"]] = self.gemm_seconds_N(fwd_rows_NS, fwd_f)
        time_NP[:, _P["expert_bwd"]] = self.gemm_seconds_N(bwd_rows_NS, bwd_f)
        if moved_G is not None:  # moved pairs recompute their gate and up projections where they land
            time_NP[:, _P["expert_bwd"]] += self.gemm.seconds(
                moved_G.view(n, s), self.recompute_fraction * fwd_f, c.peak_flops).sum(1)
        pairs_N = fwd_NG.sum(1) + plan.dropped_NE.sum(1)  # routed pairs per source rank
        if m.num_shared_experts:
            tokens_N = pairs_N.double() / m.top_k
            shared_f = 6.0 * m.hidden * m.shared_ffn * m.num_shared_experts
            time_NP[:, _P["shared_fwd"]] = self.gemm.seconds(tokens_N, shared_f, c.peak_flops)
            time_NP[:, _P["shared_bwd"]] = self.gemm.seconds(tokens_N, 2 * shared_f, c.peak_flops)

        used_N = self._sync(placement_NS, e, time_NP, bytes_NP)

        # Memory.
        w_b = float(m.dtype_bytes)
        p_e = float(m.expert_params)
        slot_bytes_N = used_N * self.slot_bytes
        if self.sharded_optimizer:
            state_bytes_N = torch.full((n,), e * p_e / n * self.state_bytes_per_param, dtype=torch.float64)
        else:
            state_bytes_N = used_N * p_e * self.state_bytes_per_param
        fwd_rows_N, bwd_rows_N = fwd_rows_NS.sum(1), bwd_rows_NS.sum(1)
        saved_bytes_N = fwd_rows_N.double() * (m.hidden + 2 * m.expert_ffn) * w_b
        home_fwd_N = 2.0 * fwd_NG.sum(1)  # rows sent, then their outputs received back
        dest_fwd_N = 2.0 * fwd_rows_N  # rows received, and their outputs
        home_bwd_N = 2.0 * grad_NG.sum(1)  # output-gradient rows out, input-gradient rows back
        dest_bwd_N = 2.0 * bwd_rows_N
        bwd_extra_N = torch.zeros(n, dtype=torch.float64)
        if carry_NG is not None:  # carried input rows on both sides, and the recomputed activations
            home_bwd_N = home_bwd_N + carry_NG.sum(1)
            dest_bwd_N = dest_bwd_N + carry_NG.sum(0).view(n, s).sum(1)
            bwd_extra_N = moved_G.view(n, s).sum(1).double() * 2 * m.expert_ffn
        fwd_buf_N = (home_fwd_N + dest_fwd_N).double() * m.hidden * w_b
        bwd_buf_N = ((home_bwd_N + dest_bwd_N).double() * m.hidden + bwd_extra_N) * w_b
        buffer_bytes_N = torch.maximum(fwd_buf_N, bwd_buf_N)

        return PhaseTimes(time_NP=time_NP, bytes_NP=bytes_NP, fwd_rows_N=fwd_rows_N, bwd_rows_N=bwd_rows_N,
                          slot_bytes_N=slot_bytes_N, state_bytes_N=state_bytes_N, saved_bytes_N=saved_bytes_N,
                          buffer_bytes_N=buffer_bytes_N, mem_budget_bytes=float(self.mem_budget_bytes),
                          dropped_pairs=int(plan.dropped_NE.sum()), routed_pairs=int(pairs_N.sum()),
                          optimizer_in_budget=self.optimizer_in_budget)

    def _sync(self, placement_NS: torch.Tensor, num_experts: int, time_NP: torch.Tensor,
              bytes_NP: torch.Tensor) -> torch.Tensor:
        """Replica sync, gradient collection, Adam and redistribution, in place; returns the used slots [N].

        The bytes are :func:`lrmoe.sync_model.step_bytes`'s, the layer's own byte model (the placement of this plan
        stands in for the next one); this only turns them into time, on the links of :meth:`_a2a`:

        * ``replica_grad="range"``: each expert's group all-reduce is priced as a ring, ``bytes / bw + 2 (h - 1)``
          latencies (one per hop), at the slowest link the group crosses (inter-node as soon as its members sit on
          two nodes); a rank in several groups runs them one after the other (the layer issues one collective per
          expert, in expert order), so its time is the sum. Gradient collection: one all-to-all.
        * ``replica_grad="shard"``: the one exchange is an all-to-all (latency once per link kind a rank uses:
          its messages are pipelined); there is no collection phase (the owners' fold of what they receive is a
          local add, not priced).
        * Redistribution: one all-to-all in both modes; Adam: E/N experts' state at HBM bandwidth.

        No overlap: each phase starts when the previous one ends on the slowest rank (the module's rule), and the
        step's phases are not overlapped with the backward of later layers. ``sharded_optimizer=False`` (static EP)
        has no shard owners: its hosts all-reduce (range groups), and there is no collection or redistribution.
        """
        m, c = self.model, self.cluster
        n = placement_NS.shape[0]
        e = num_experts
        p_e = m.expert_params
        used_N = (placement_NS >= 0).sum(1).double()
        mode = self.replica_grad if self.sharded_optimizer else "range"
        sb = step_bytes(placement_NS, placement_NS, e, p_e, self.grad_bytes, m.dtype_bytes, mode, self.sync_groups)
        if mode == "range":
            group_NE = sb.group_NE
            h_E = group_NE.sum(0)
            node_N = torch.arange(n) // c.ranks_per_node
            lo_node_E = torch.where(group_NE, node_N[:, None], n).min(0).values
            hi_node_E = torch.where(group_NE, node_N[:, None], -1).max(0).values
            crosses_E = hi_node_E > lo_node_E
            bw_E = torch.where(crosses_E, c.inter_bw, c.intra_bw).double()
            lat_E = torch.where(crosses_E, c.inter_latency, c.intra_latency).double()
            ring_NE = sb.allreduce_NE.double()
            t_NE = torch.where(group_NE, ring_NE / bw_E + 2 * (h_E - 1) * lat_E, 0.0)
            time_NP[:, _P["replica_sync"]] = t_NE.sum(1)
            bytes_NP[:, _P["replica_sync"]] = ring_NE.sum(1)
        else:
            time_NP[:, _P["replica_sync"]], bytes_NP[:, _P["replica_sync"]] = self._a2a(sb.sync_NM)

        if not self.sharded_optimizer:
            if c.hbm_bw > 0:
                hosted_N = hosts_mask(placement_NS, e).double().sum(1)
                time_NP[:, _P["adam"]] = hosted_N * p_e * self.optimizer_traffic_per_param / c.hbm_bw
            return used_N
        if mode == "range":
            time_NP[:, _P["grad_collect"]], bytes_NP[:, _P["grad_collect"]] = self._a2a(sb.collect_NM)
        if c.hbm_bw > 0:
            shard_N = torch.tensor(shard_sizes(p_e, n), dtype=torch.float64)
            time_NP[:, _P["adam"]] = e * shard_N * self.optimizer_traffic_per_param / c.hbm_bw
        time_NP[:, _P["redistribute"]], bytes_NP[:, _P["redistribute"]] = self._a2a(sb.redistribute_NM)
        return used_N
