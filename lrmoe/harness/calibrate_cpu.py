"""CPU micro-benchmarks that calibrate the cost model's "cpu-gloo" cluster (:func:`lrmoe.sim.cost.cpu_gloo_preset`),
so that its predictions can be checked against the layer measured on the same machine (``experiments/validate_sim.py``).

The measurements, each on ``num_ranks`` forked gloo processes (:func:`lrmoe.runtime.distributed.launch.launch`, one
thread
each) running *concurrently*, as the ranks of ``experiments/layer_bench.py`` do: on a machine with fewer cores
than ranks the ranks share the cores, and the constants must describe the machine as the benchmark sees it.

* **Expert GEMM**: the layer's own SwiGLU compute (:func:`lrmoe.runtime.expert_compute.swiglu_forward` and
  :func:`~lrmoe.runtime.expert_compute.swiglu_backward`, torch backend) on ``groups`` slots of ``rows`` rows each, at
  the
  benchmark's D and F. Fitted jointly, forward and backward, to the cost model's curve
  ``t = launch_s + Σ_{groups} flops_per_row · (m + m_half) / rate`` (flops_per_row = 6·D·F forward, 12·D·F backward,
  as :class:`~lrmoe.config.MoEConfig` counts them). Only ``eff_max · peak_flops`` is identifiable on a CPU, so the
  preset sets ``peak_flops = rate`` and ``eff_max = 1``.
* **All-to-all**: the layer's helper :func:`lrmoe.runtime.distributed.comm.all_to_all_rows` (gloo
``all_to_all_single``) with
  ``b`` bytes to every other rank, fitted to ``t = latency + bytes_sent / bandwidth`` (the cost model's all-to-all
  line for one node). Each repetition follows some expert-sized compute of a random size and no barrier, so the
  ranks arrive staggered as in the layer (a staggered collective costs its last rank more than an aligned one).
  The layer's point-to-point exchange (:func:`lrmoe.runtime.distributed.comm.exchange_rows`, gradient collection and
  redistribution) is timed the same way, as a diagnostic the cost model does not use.
* **Memory passes**: the replica store's own packing (:func:`lrmoe.runtime.distributed.replica.pack_owner_major_`) of a
  rank's (E/N + 1) class sums into its owner-major send buffer, reading slot gradients from a pool larger than the
  caches (the optimizer step's passes touch data the backward has evicted), as ``mem_bw = bytes read + written /
  seconds``: the bandwidth at which the cost model prices every memory-bound pass (Adam's 32 bytes per parameter,
  the optimizer step's sums, packing, folding and placing; :func:`lrmoe.bytemodel.sync_model.local_bytes`).
* **Adam**: :func:`lrmoe.runtime.distributed.replica.adam_update_` on one rank's fp32 shard of every expert (E ×
⌈3DF/N⌉),
  kept as a diagnostic: its effective bandwidth at the cost model's 32 bytes of traffic per parameter.
* **Optimizer-step fixed costs**: each phase of a :class:`~lrmoe.runtime.distributed.replica.ReplicaStore` (replica
sync,
  gradient collection, Adam, redistribution), in both replica-gradient modes, on experts of 3 × 1 × N parameters
  (negligible bytes) at the benchmark's expert and rank counts (:func:`host_placement`): what is left is the phase's
  host loops, launches and collective wake-ups, which the cost model adds once per phase in place of that phase's
  latency terms (``step_fixed_s``; :meth:`lrmoe.config.ClusterConfig.step_fixed`).

Clocks and statistics (the same ones the validation applies to the measured layer). Every repetition (of the
compute after a barrier) is timed by two clocks: the process's CPU time (``cpu``, the default constants: a rank
waiting in a collective uses no CPU, and other processes' load does not count) and elapsed time (``wall``). Each
rank's median over repetitions, then the *slowest* rank (the straggler, what ends a phase), except for collectives
by the wall clock: the *fastest* rank (the last to arrive waits for nobody, so its time is the collective's own
duration; the others' extra time is waiting for it). Times on a shared machine are noisy: medians throughout.
Each rank first allocates and frees one large block, so that the C allocator serves large temporaries from its
heap as in the long-running benchmark (a fresh process page-faults on every one: Adam ran 5x slower).

The fits are pure functions (:func:`fit_gemm`, :func:`fit_line`), tested on synthetic timings with known constants.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lrmoe.checks import positive_fields
from lrmoe.bytemodel.layout import STEP_PHASES
from lrmoe.bytemodel.sync_model import REPLICA_GRAD_MODES

GEMM_MODEL = "t = launch_s + sum over non-empty groups of flops_per_row * (rows + m_half) / peak_flops"
A2A_MODEL = "t = a2a_latency + bytes sent to other ranks / a2a_bw"
ADAM_TRAFFIC_BYTES = 32.0  # the cost model's default optimizer_traffic_per_param
ALLOCATOR_WARMUP_BYTES = 24 << 20  # below glibc's largest dynamic mmap threshold (32 MiB)
POOL_BYTES = 64 << 20  # the memory-pass benchmark's pool: larger than any cache of a CPU this runs on


# -- fits (pure) ---------------------------------------------------------------------------------------------------
def _nonneg_lstsq(a_XC: torch.Tensor, t_X: torch.Tensor, required: int) -> torch.Tensor:
    """Least squares of ``a_XC @ c ≈ t_X`` with c ≥ 0, weighted by 1/t (every sample counts by its relative error).

    Exhaustive over the subsets of columns that contain column ``required`` (the fits have 2 or 3 columns): the
    feasible subset with the smallest residual wins; dropped columns get 0."""
    w_X = 1.0 / t_X
    cols = a_XC.shape[1]
    best, best_res = None, math.inf
    others = [c for c in range(cols) if c != required]
    for k in range(len(others) + 1):
        for extra in itertools.combinations(others, k):
            keep = sorted((required, *extra))
            sub = a_XC[:, keep] * w_X[:, None]
            sol = torch.linalg.lstsq(sub, (t_X * w_X)[:, None]).solution[:, 0]
            if bool((sol < 0).any()):
                continue
            res = float(((sub @ sol) - t_X * w_X).square().sum())
            if res < best_res - 1e-15:
                coef = torch.zeros(cols, dtype=torch.float64)
                coef[keep] = sol
                best, best_res = coef, res
    if best is None:
        raise ValueError("the timings do not grow with the work: no non-negative fit exists (check the samples)")
    return best


def _check_samples(name: str, seconds_X: torch.Tensor, minimum: int) -> None:
    if seconds_X.numel() < minimum:
        raise ValueError(f"{name} needs at least {minimum} samples, got {seconds_X.numel()}")
    if not bool(torch.isfinite(seconds_X).all()) or bool((seconds_X <= 0).any()):
        raise ValueError(f"{name}: every time must be positive and finite, got {seconds_X.tolist()}")


@dataclass(frozen=True)
class GemmFit:
    """The fitted expert-GEMM curve: ``peak_flops`` (= eff_max · peak, eff_max set to 1), ``m_half``, ``launch_s``."""

    peak_flops: float
    m_half: float
    launch_s: float
    median_rel_error: float
    samples: int

    def as_preset(self) -> dict:
        """The ``gemm`` entry of a CPU calibration file (what :func:`~lrmoe.sim.cost.cpu_gloo_preset` reads)."""
        return {"eff_max": 1.0, "m_half": self.m_half, "launch_s": self.launch_s}

    def predict(self, rows_G, flops_per_row: float) -> float:
        busy = [m for m in rows_G if m > 0]
        if not busy:
            return 0.0
        return self.launch_s + sum(flops_per_row * (m + self.m_half) for m in busy) / self.peak_flops


def fit_gemm(rows_XG: list[list[int]], flops_per_row_X: list[float], seconds_X: list[float]) -> GemmFit:
    """Fit :data:`GEMM_MODEL` to timings of grouped-GEMM calls: call x ran ``rows_XG[x]`` rows per group at
    ``flops_per_row_X[x]`` FLOPs per row and took ``seconds_X[x]``. Linear in (launch_s, 1/peak, m_half/peak)."""
    if not len(rows_XG) == len(flops_per_row_X) == len(seconds_X):
        raise ValueError(f"fit_gemm: rows_XG, flops_per_row_X and seconds_X differ in length: {len(rows_XG)}, "
                         f"{len(flops_per_row_X)}, {len(seconds_X)}")
    t_X = torch.tensor(seconds_X, dtype=torch.float64)
    _check_samples("fit_gemm", t_X, 3)
    rows = [[int(m) for m in r if m > 0] for r in rows_XG]
    if any(not r for r in rows):
        raise ValueError("fit_gemm: every call must have at least one non-empty group")
    a_XC = torch.tensor([[1.0, f * sum(r), f * len(r)] for r, f in zip(rows, flops_per_row_X)], dtype=torch.float64)
    coef = _nonneg_lstsq(a_XC, t_X, required=1)
    launch, inv_rate, half = (float(c) for c in coef)
    rel = ((a_XC @ coef - t_X).abs() / t_X).median()
    return GemmFit(peak_flops=1.0 / inv_rate, m_half=half / inv_rate, launch_s=launch,
                   median_rel_error=float(rel), samples=len(seconds_X))


@dataclass(frozen=True)
class LinkFit:
    """``t = latency_s + bytes / bandwidth`` of one kind of transfer."""

    latency_s: float
    bandwidth: float  # bytes/s
    median_rel_error: float
    samples: int

    def predict(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


def fit_line(bytes_X: list[float], seconds_X: list[float]) -> LinkFit:
    """Fit :data:`A2A_MODEL` (latency ≥ 0, bandwidth > 0) to transfer timings; needs two distinct sizes."""
    if len(bytes_X) != len(seconds_X):
        raise ValueError(f"fit_line: bytes_X and seconds_X differ in length: {len(bytes_X)}, {len(seconds_X)}")
    t_X = torch.tensor(seconds_X, dtype=torch.float64)
    _check_samples("fit_line", t_X, 2)
    b_X = torch.tensor(bytes_X, dtype=torch.float64)
    if bool((b_X < 0).any()) or len(set(bytes_X)) < 2:
        raise ValueError(f"fit_line needs non-negative byte counts of at least two sizes, got {bytes_X}")
    a_XC = torch.stack([torch.ones_like(b_X), b_X], 1)
    coef = _nonneg_lstsq(a_XC, t_X, required=1)
    rel = ((a_XC @ coef - t_X).abs() / t_X).median()
    return LinkFit(latency_s=float(coef[0]), bandwidth=1.0 / float(coef[1]), median_rel_error=float(rel),
                   samples=len(seconds_X))


# -- what to measure -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationSpec:
    """The micro-benchmark grid: shapes of the benchmark to calibrate for, sizes and repetitions."""

    num_ranks: int
    hidden: int
    ffn: int
    num_experts: int
    dtype: str = "float32"
    gemm_rows: tuple[int, ...] = (1, 8, 32, 128, 512)  # rows per group
    gemm_groups: tuple[int, ...] = (1, 4)  # groups (slots) per call
    max_gemm_rows: int = 2048  # skip calls of more rows in all (the benchmark's ranks never compute more)
    a2a_bytes: tuple[int, ...] = (0, 4096, 65536, 262144, 1048576)  # bytes to every other rank
    repeats: int = 5
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        positive_fields(self, "num_ranks", "hidden", "ffn", "num_experts", "repeats", "max_gemm_rows")
        if self.num_ranks < 2:
            raise ValueError(f"CalibrationSpec.num_ranks must be at least 2 (an all-to-all), got {self.num_ranks}")
        if self.warmup < 0:
            raise ValueError(f"CalibrationSpec.warmup must be non-negative, got {self.warmup}")
        if self.dtype not in ("float32", "float64", "bfloat16"):
            raise ValueError(f"CalibrationSpec.dtype={self.dtype!r} is not float32, float64 or bfloat16")
        if not self.gemm_rows or min(self.gemm_rows) < 1 or not self.gemm_groups or min(self.gemm_groups) < 1:
            raise ValueError(f"CalibrationSpec.gemm_rows and gemm_groups must be positive, got {self.gemm_rows}, "
                             f"{self.gemm_groups}")
        if len(set(self.a2a_bytes)) < 2 or min(self.a2a_bytes) < 0:
            raise ValueError(f"CalibrationSpec.a2a_bytes needs two distinct non-negative sizes, got {self.a2a_bytes}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def elem_bytes(self) -> int:
        return torch.tensor([], dtype=self.torch_dtype).element_size()

    def gemm_calls(self) -> list[tuple[int, int]]:
        """(groups, rows per group) of every timed call, within ``max_gemm_rows`` rows in all."""
        calls = [(g, m) for g in self.gemm_groups for m in self.gemm_rows if g * m <= self.max_gemm_rows]
        if len({m * g for g, m in calls}) < 2:
            raise ValueError(f"CalibrationSpec: fewer than two GEMM sizes fit in max_gemm_rows={self.max_gemm_rows}")
        return calls

    @property
    def packed_bytes(self) -> int:
        """The memory-pass benchmark's size: a rank's replica-gradient sums of (E/N + 1) experts, packed."""
        return (-(-self.num_experts // self.num_ranks) + 1) * 3 * self.hidden * self.ffn * self.elem_bytes

    @property
    def shard_numel(self) -> int:
        return -(-3 * self.hidden * self.ffn // self.num_ranks)


def spec_for_bench(num_ranks: int, hidden: int, ffn: int, num_experts: int, top_k: int, tokens_per_rank: int,
                   slots_per_rank: int, dtype: str = "float32", quick: bool = False, seed: int = 0) -> CalibrationSpec:
    """A grid that covers a layer benchmark's sizes: rows per slot up to twice a rank's mean load, the slot count
    of its ranks, and all-to-all packets up to four times the mean bytes a rank sends to one peer."""
    pairs = tokens_per_rank * top_k  # pairs a rank computes on average (and sends, over all ranks)
    rows = sorted({1, 4, 16, 64, 256, 1024, 4096} & set(range(1, 2 * pairs + 1)) | {max(1, pairs // slots_per_rank)})
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    per_peer = pairs * hidden * elem // num_ranks
    sizes = sorted({0, 1024} | {int(per_peer * f) for f in (0.25, 1.0, 4.0)})
    return CalibrationSpec(num_ranks=num_ranks, hidden=hidden, ffn=ffn, num_experts=num_experts, dtype=dtype,
                           gemm_rows=tuple(rows), gemm_groups=tuple(sorted({1, slots_per_rank})),
                           max_gemm_rows=2 * pairs, a2a_bytes=tuple(sizes), repeats=7 if quick else 15,
                           warmup=2, seed=seed)


# -- the benchmark, on every rank -------------------------------------------------------------------------------
def _timed(fn, spec: CalibrationSpec, between=None) -> dict[str, list[float]]:
    """Seconds of ``fn()`` on this rank for each repetition, by both clocks (``wall``: elapsed, ``cpu``: this
    process's CPU time). Without ``between``, every repetition starts after a barrier; with it, ``between()`` runs
    before each repetition instead (and one barrier before the first), so the ranks arrive as the layer's do:
    staggered by their own work."""
    import torch.distributed as dist

    out = {"wall": [], "cpu": []}
    if between is not None:
        dist.barrier()
    for i in range(spec.warmup + spec.repeats):
        if between is None:
            dist.barrier()
        else:
            between()
        _time_into(out, fn, keep=i >= spec.warmup)
    return out


def _time_into(out: dict[str, list[float]], fn, keep: bool = True) -> None:
    """Run ``fn()``; with ``keep``, append its seconds by both clocks to ``out["wall"]`` and ``out["cpu"]``."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    w1, c1 = time.perf_counter(), time.process_time()
    if keep:
        out["wall"].append(w1 - w0)
        out["cpu"].append(c1 - c0)


def _bench_rank(rank: int, spec: CalibrationSpec) -> dict:
    """Every measurement of the grid on this rank: lists of per-repetition seconds."""
    from lrmoe.runtime.distributed.comm import all_to_all_rows, exchange_rows
    from lrmoe.runtime.distributed.replica import AdamConfig, adam_update_, owner_runs, pack_owner_major_
    from lrmoe.bytemodel.sync_model import shard_bounds
    from lrmoe.runtime.expert_compute import slot_offsets, swiglu_backward, swiglu_forward

    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + rank)
    dtype, D, F = spec.torch_dtype, spec.hidden, spec.ffn

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

    # Steady state of the C allocator: a long-running process (the benchmark's ranks) serves large temporaries from
    # its heap once it has freed a big block; a fresh one maps (and page-faults) every one of them, which made
    # Adam 5x slower here than in the layer. Allocating and freeing one big block moves it to the steady state.
    torch.empty(ALLOCATOR_WARMUP_BYTES, dtype=torch.uint8).fill_(0)
    out: dict = {"gemm": [], "a2a": [], "adam": None}
    for groups, rows in spec.gemm_calls():
        weights = (rand(groups, D, F), rand(groups, D, F), rand(groups, F, D))
        x_MD, dy_MD = rand(groups * rows, D), rand(groups * rows, D)
        offs = slot_offsets(torch.full((groups,), rows, dtype=torch.long), "cpu")
        _, act = swiglu_forward(x_MD, weights, offs, "torch")
        fwd = _timed(lambda: swiglu_forward(x_MD, weights, offs, "torch"), spec)
        bwd = _timed(lambda: swiglu_backward(act, dy_MD, weights, offs, "torch"), spec)
        out["gemm"].append({"groups": groups, "rows": rows, "fwd": fwd, "bwd": bwd})
    # Transfers, each repetition after some expert-sized compute of a random size and no barrier: in the layer the
    # ranks reach every collective staggered by their own (unequal) compute, and a staggered collective costs more
    # than an aligned one (the last rank to arrive waits for its peers to wake up).
    mean_rows = max(1, spec.max_gemm_rows // 2)
    w_DF, x_RD = rand(D, F), rand(mean_rows * 3 // 2, D)

    def work():
        rows = int(mean_rows * (0.5 + float(torch.rand((), generator=gen))))
        for _ in range(3):
            torch.mm(x_RD[:rows], w_DF)

    n = spec.num_ranks
    for nbytes in spec.a2a_bytes:
        numel = nbytes // spec.elem_bytes
        # the layer's all-to-all helper (gloo all_to_all_single, output allocated per call), equal splits
        splits = [0 if r == rank else numel for r in range(n)]  # a rank's exchange with itself is local
        send = rand(sum(splits), 1)
        a2a = _timed(lambda: all_to_all_rows(send, splits, splits), spec, work)
        # the layer's point-to-point exchange (gradient collection, redistribution): one buffer per peer
        bufs = {r: rand(numel) for r in range(n) if r != rank}
        sizes = {r: numel for r in bufs}
        p2p = _timed(lambda: exchange_rows(bufs, sizes, dtype, torch.device("cpu")), spec, work)
        out["a2a"].append({"bytes_per_peer": numel * spec.elem_bytes, "bytes_sent": numel * spec.elem_bytes * (n - 1),
                           "s": a2a, "p2p_s": p2p})
    # memory passes: the replica store's packing of a rank's (E/N + 1) single-slot class sums into its owner-major
    # send buffer, reading slot gradients from a pool of POOL_BYTES so that no pass hits the caches (the optimizer
    # step runs after the backward has evicted them)
    numel, classes = 3 * D * F, spec.packed_bytes // (3 * D * F * spec.elem_bytes)
    pool = rand(max(2 * classes, POOL_BYTES // (numel * spec.elem_bytes)), numel)
    send = torch.empty(classes * numel, dtype=dtype)
    runs = owner_runs(shard_bounds(numel, spec.num_ranks))
    turn = [0]

    def pack():
        for h in range(classes):
            turn[0] = (turn[0] + 1) % pool.shape[0]
            pack_owner_major_(send, pool[turn[0]], h, classes, runs)

    out["mem_passes"] = {"bytes": classes * 2 * numel * spec.elem_bytes, "s": _timed(pack, spec)}  # read + write
    shape = (spec.num_experts, spec.shard_numel)
    master, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    m1, m2 = torch.zeros(shape), torch.zeros(shape)
    cfg, step = AdamConfig(), [0]

    def adam():
        step[0] += 1
        adam_update_(master, grad, m1, m2, step[0], cfg)

    out["adam"] = {"params": spec.num_experts * spec.shard_numel, "s": _timed(adam, spec)}
    out["step_host"] = _step_host(rank, spec)
    return out


def host_placement(num_ranks: int, num_experts: int) -> torch.Tensor:
    """[N, S] the host-cost benchmark's placement: experts round-robin over the ranks, then one extra slot per rank
    with a replica of an expert homed on the next rank (so every class with a replica spans two ranks)."""
    per_rank = -(-num_experts // num_ranks)
    placement_NS = torch.full((num_ranks, per_rank + 1), -1, dtype=torch.long)
    for e in range(num_experts):
        placement_NS[e % num_ranks, e // num_ranks] = e
    for n in range(num_ranks):
        placement_NS[n, per_rank] = (n + 1) % min(num_ranks, num_experts)
    return placement_NS


def _step_host(rank: int, spec: CalibrationSpec) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Seconds of each optimizer-step phase of a :class:`~lrmoe.runtime.distributed.replica.ReplicaStore` whose experts
    hold
    one parameter per rank (3 x 1 x N): the bytes are negligible, what is left is each phase's fixed host cost (its
    Python loops over classes and peers, launches, a collective's wake-up), in both replica-gradient modes, at the
    benchmark's expert and rank counts. {mode: {phase: {clock: [seconds per repetition]}}}."""
    import torch.distributed as dist

    from lrmoe.runtime.distributed.replica import RangeGroups, ReplicaStore

    n, e = spec.num_ranks, spec.num_experts
    placement_NS = host_placement(n, e)
    zeros = torch.zeros(e, 1, n, dtype=spec.torch_dtype)
    out = {}
    for mode in REPLICA_GRAD_MODES:
        store = ReplicaStore(zeros, zeros, zeros.transpose(1, 2).contiguous(), placement_NS,
                             RangeGroups() if mode == "range" else None, replica_grad=mode)
        phases = (store.sync_replica_grads, store.collect_grad_shards, store.adam_step, store.redistribute)
        times = {p: {"wall": [], "cpu": []} for p in STEP_PHASES}
        for i in range(spec.warmup + spec.repeats):
            store.slots_SW.grad = torch.zeros_like(store.slots_SW)
            dist.barrier()
            for name, fn in zip(STEP_PHASES, phases):  # the store's order, which is the step's
                _time_into(times[name], fn, keep=i >= spec.warmup)
        out[mode] = times
    return out


# -- aggregation and the calibration file ------------------------------------------------------------------------
CLOCKS = ("cpu", "wall")  # process CPU time (the default constants), elapsed time
# How each clock's ranks reduce to one time per repetition: see the module doc.
STATISTIC = {("cpu", "local"): "max", ("cpu", "collective"): "max",
             ("wall", "local"): "max", ("wall", "collective"): "min"}


def across_ranks(per_rank: list[list[float]], how: str) -> float:
    """The slowest (``"max"``) or fastest (``"min"``) rank's median over repetitions. Medians per rank first: a
    rank's times have rare spikes of a few ms (the Python runtime, the scheduler) that a per-repetition maximum
    over ranks would pick up often."""
    if how not in ("max", "min"):
        raise ValueError(f"how must be 'max' or 'min', got {how!r}")
    medians = [statistics.median(reps) for reps in per_rank]
    return max(medians) if how == "max" else min(medians)


def summarise(spec: CalibrationSpec, per_rank: list[dict], clock: str = "cpu") -> dict:
    """Aggregate the ranks' timings by one clock, fit, and return that clock's constants (the keys
    :func:`~lrmoe.sim.cost.cpu_gloo_preset` reads), the fits and the aggregated measurements."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    local, coll = STATISTIC[(clock, "local")], STATISTIC[(clock, "collective")]
    fwd_flops, bwd_flops = 6.0 * spec.hidden * spec.ffn, 12.0 * spec.hidden * spec.ffn
    gemm = []
    for i, call in enumerate(per_rank[0]["gemm"]):
        for kind, flops in (("fwd", fwd_flops), ("bwd", bwd_flops)):
            gemm.append({"kind": kind, "groups": call["groups"], "rows": call["rows"], "flops_per_row": flops,
                         "seconds": across_ranks([r["gemm"][i][kind][clock] for r in per_rank], local)})
    a2a = [{"bytes_per_peer": c["bytes_per_peer"], "bytes_sent": c["bytes_sent"],
            "seconds": across_ranks([r["a2a"][i]["s"][clock] for r in per_rank], coll),
            "p2p_seconds": across_ranks([r["a2a"][i]["p2p_s"][clock] for r in per_rank], coll)}
           for i, c in enumerate(per_rank[0]["a2a"])]
    adam_s = across_ranks([r["adam"]["s"][clock] for r in per_rank], local)
    passes_s = across_ranks([r["mem_passes"]["s"][clock] for r in per_rank], local)
    mem_bw = per_rank[0]["mem_passes"]["bytes"] / passes_s
    params = per_rank[0]["adam"]["params"]
    gfit = fit_gemm([[s["rows"]] * s["groups"] for s in gemm], [s["flops_per_row"] for s in gemm],
                    [s["seconds"] for s in gemm])
    for s in gemm:
        s["predicted_s"] = gfit.predict([s["rows"]] * s["groups"], s["flops_per_row"])
    per_kind = {kind: statistics.median(abs(s["predicted_s"] / s["seconds"] - 1) for s in gemm if s["kind"] == kind)
                for kind in ("fwd", "bwd")}
    lfit = fit_line([s["bytes_sent"] for s in a2a], [s["seconds"] for s in a2a])
    pfit = fit_line([s["bytes_sent"] for s in a2a], [s["p2p_seconds"] for s in a2a])
    for s in a2a:
        s["predicted_s"] = lfit.predict(s["bytes_sent"])
    step_fixed = {f"{mode}/{phase}": across_ranks([r["step_host"][mode][phase][clock] for r in per_rank],
                                                  local if phase == "adam" else coll)
                  for mode in REPLICA_GRAD_MODES for phase in STEP_PHASES}
    return {
        "peak_flops": gfit.peak_flops, "gemm": gfit.as_preset(), "a2a_bw": lfit.bandwidth,
        "a2a_latency": lfit.latency_s, "mem_bw": mem_bw, "step_fixed_s": step_fixed,
        "fits": {"gemm": {**asdict(gfit), "median_rel_error_fwd": per_kind["fwd"],
                          "median_rel_error_bwd": per_kind["bwd"], "model": GEMM_MODEL, "ranks": local},
                 "a2a": {**asdict(lfit), "model": A2A_MODEL, "ranks": coll},
                 # not used by the cost model, which charges its point-to-point phases as all-to-alls
                 "p2p": {**asdict(pfit), "model": "t = latency_s + bytes sent to other ranks / bandwidth",
                         "ranks": coll,
                         "note": "diagnostic: lrmoe.runtime.distributed.comm.exchange_rows, one buffer per peer"},
                 "mem_passes": {"bytes": per_rank[0]["mem_passes"]["bytes"], "seconds": passes_s, "ranks": local,
                          "model": "mem_bw = bytes read + written / seconds of the store's owner-major packing"},
                 "step_fixed": {"placement": host_placement(spec.num_ranks, spec.num_experts).tolist(),
                                "model": "a step phase's fixed seconds (the store's phase, experts of 3 x 1 x N "
                                         "parameters): added once per phase, its latency terms dropped",
                                "ranks": f"{local} (adam), {coll} (the exchanges)"},
                 # a diagnostic: the cost model prices Adam at mem_bw and this many bytes per parameter
                 "adam": {"params": params, "seconds": adam_s, "traffic_bytes_per_param": ADAM_TRAFFIC_BYTES,
                          "effective_bw": ADAM_TRAFFIC_BYTES * params / adam_s, "ranks": local}},
        "measurements": {"gemm": gemm, "a2a": a2a},
    }


def calibration_data(spec: CalibrationSpec, per_rank: list[dict], default_clock: str = "cpu") -> dict:
    """The calibration file's content: ``default_clock``'s constants at the top level (what
    :func:`~lrmoe.sim.cost.cpu_gloo_preset` reads by default), every clock's under ``clocks``, and the spec."""
    clocks = {clock: summarise(spec, per_rank, clock) for clock in CLOCKS}
    top = {k: v for k, v in clocks[default_clock].items() if k not in ("fits", "measurements")}
    return {**top, "clock": default_clock, "clocks": clocks, "spec": asdict(spec)}


def provenance(spec: CalibrationSpec) -> dict:
    """Date, machine, versions and protocol of a calibration (what a reader needs to trust or redo it)."""
    prov = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "module": "lrmoe.harness.calibrate_cpu", "ranks": spec.num_ranks, "threads_per_rank": 1,
            "protocol": "forked gloo ranks running concurrently (one thread each), allocator warmed; compute after a "
                        "barrier, transfers after random expert-sized compute (staggered arrival); each rank's median "
                        "over repetitions, then the slowest rank, except collectives by the wall clock: the fastest"}
    try:
        import triton

        prov["triton"] = triton.__version__
    except ImportError:
        prov["triton"] = "absent"
    from lrmoe.integrations.provenance import git_commit

    prov["git_commit"] = git_commit()
    return prov


def calibrate(spec: CalibrationSpec, timeout_s: float = 600.0) -> dict:
    """Run the micro-benchmarks on ``spec.num_ranks`` forked ranks; return the calibration data with provenance."""
    from lrmoe.runtime.distributed.launch import launch

    per_rank = launch(_bench_rank, spec.num_ranks, spec, timeout_s=timeout_s)
    return {**calibration_data(spec, per_rank), "provenance": provenance(spec)}


def write_calibration(data: dict, path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write calibration data as JSON; refuses to replace an existing file unless ``overwrite``."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"calibration file {path} exists; pass overwrite=True (--overwrite) to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path
