"""Overheads on an MoE layer's critical path beyond the exchanges and the expert GEMMs, each with its source.

DESIGN.md §5.4: every overhead on the critical path is charged, and each can be switched off
(``CostModel(overheads=...)``) to show its effect. The names in :data:`OVERHEADS`:

``planning``
    The host computes the layer's plan between the counts all-gather and the dispatch, once per micro-batch
    (phase ``plan``). Source: ``experiments/bench_planner.py``, committed results run
    ``bench_planner-20261129-231229-b3966e`` (git 977914e): median ms per plan on one thread of the development
    CPU, E = 128, 4096 tokens x top-8 per rank, Zipf 0.6, for N = 8, 16, 64 (:data:`PLANNER_MS`). Rule (ours):
    charged as measured, unscaled (a GPU server's host core is not slower than the development CPU's);
    interpolated linearly in log2 N between the measured rank counts, held constant outside them; scaled by E / 128.
    A trimmed plan (the random-trim control) pays its policy's planner plus LRMoE's quota stage.
``counts``
    The all-gather of the routed counts, an N x E matrix of int64, before planning (phase ``plan``): every rank
    sends its E counts to every other rank, priced like the other all-to-alls (latency per link kind used).
``selection``
    Scoring and selection of a plan that keeps fewer pairs than it computes (phase ``recalibrate``), on the device
    at each pair's home rank. Source: ``experiments/bench_scoring.py``, committed run
    ``bench_scoring-20261129-231235-994277``: metric m2 with top-k selection, 65,536 pairs in 2,048 groups, one
    CPU thread: select 1.213 ms, the metric's per-pair hook 1.843 ms, token norms 1.934 ms for 8,192 tokens of
    width 2,048. Rule (ours): these passes are memory-bound, so the CPU time is scaled by the ratio of the CPU
    thread's memory bandwidth to the GPU's (:data:`CPU_THREAD_BW`, measured, over the cluster's datasheet HBM
    bandwidth), linearly in pairs (tokens x width for the norms), plus :data:`SELECTION_KERNELS` kernel launches.
``compaction``
    The compact backward's two passes (phase ``recalibrate``): the home packs the retained gradient rows, and the
    expert gathers the saved activations (input row, gate, up, h) of the rows it keeps; each reads and writes its
    bytes once at the datasheet HBM bandwidth, plus one launch each. The padded layout has no such pass.
``capacity_buffers``
    Fixed-size capacity buffers (SYMI-cf1 and the capacity systems, ``CostModel(capacity_cf=...)``): every slot
    holds and multiplies ceil(cf · routed pairs / slots) rows however many arrive, in memory
    (:mod:`lrmoe.bytemodel.memory`)
    and in the expert GEMMs, forward and backward. Source: the fixed-capacity dispatch of GShard / DeepSpeed-MoE
    (Lepikhin et al. 2020; Rajbhandari et al. 2022) and SYMI's slot capacity (DESIGN.md §3.3). Ours: the exchange
    still sends only the filled rows.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

OVERHEADS = ("planning", "counts", "selection", "compaction", "capacity_buffers")

# Median ms per plan at E = 128 (bench_planner run bench_planner-20261129-231229-b3966e), by policy label family.
PLANNER_MS = {
    "lrmoe": {8: 0.543, 16: 0.659, 64: 0.749},
    "symi-dropless": {8: 0.149, 16: 0.156, 64: 0.238},
    "symi-cf": {8: 0.235, 16: 0.248, 64: 0.364},
    "static-ep": {8: 0.091, 16: 0.098, 64: 0.149},
    "capacity": {8: 0.133, 16: 0.148, 64: 0.232},
}
QUOTAS_MS = {8: 0.013, 16: 0.050, 64: 0.016}  # LRMoE's quota stage alone, same run
PLANNER_EXPERTS = 128

# bench_scoring run bench_scoring-20261129-231235-994277 (m2, top-k, one thread)
SELECT_MS_PER_PAIR = (1.213 + 1.843) / 65536  # selection + the metric's per-pair hook
TOKEN_NORM_MS_PER_ELEMENT = 1.934 / (8192 * 2048)  # ‖δ‖ of each token
# ours: device ops of lrmoe.recal.scoring's m2 and lrmoe.recal.selection's top-k path, from the code
SELECTION_KERNELS = 20
CPU_THREAD_BW = 8.7e9  # bytes/s: one thread's numpy copy (read + write) of 256 MB on the development CPU, best of 7


def check_overheads(names) -> tuple[str, ...]:
    names = tuple(names)
    unknown = [n for n in names if n not in OVERHEADS]
    if unknown:
        raise ValueError(f"unknown overheads {unknown}; known: {OVERHEADS}")
    return names


def _interp_log2(table: dict[int, float], n: int) -> float:
    """Linear in log2 n between the table's points, constant outside them."""
    xs = sorted(table)
    if n <= xs[0]:
        return table[xs[0]]
    if n >= xs[-1]:
        return table[xs[-1]]
    hi = next(x for x in xs if x >= n)
    lo = max(x for x in xs if x <= n)
    if hi == lo:
        return table[lo]
    w = (math.log2(n) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return table[lo] + w * (table[hi] - table[lo])


def planner_family(label: str) -> tuple[str, bool] | None:
    """(measured planner, adds LRMoE's quota stage) for a plan's policy label; None for a hand-made plan ("")."""
    if not label:
        return None
    if label.startswith("lrmoe"):
        return "lrmoe", False
    if label.startswith("online"):  # ours, a proxy: its greedy placement + LRMoE's balanced forward, timed as LRMoE's
        return "lrmoe", "-rho" in label
    base, trimmed = (label.split("-rho")[0], True) if "-rho" in label else (label, False)
    for family in ("symi-dropless", "symi-cf", "static-ep", "capacity"):
        if base.startswith(family):
            return family, trimmed
    raise ValueError(f"no planner benchmark for policy {label!r}; measured: {sorted(PLANNER_MS)} "
                     f"(pass CostModel(planner=...) or drop 'planning' from its overheads)")


def planner_seconds(label: str, num_ranks: int, num_experts: int) -> float:
    """Host seconds of one plan by the policy called ``label`` (0 for a hand-made plan)."""
    fam = planner_family(label)
    if fam is None:
        return 0.0
    family, trimmed = fam
    ms = _interp_log2(PLANNER_MS[family], num_ranks) + (_interp_log2(QUOTAS_MS, num_ranks) if trimmed else 0.0)
    return ms * 1e-3 * num_experts / PLANNER_EXPERTS


def selection_seconds(pairs_N: Tensor, tokens_N: Tensor, hidden: int, hbm_bw: float, launch_s: float) -> Tensor:
    """float64 [N]: device seconds to score and select ``pairs_N`` pairs of ``tokens_N`` tokens of width ``hidden``
    at each home rank (nothing where no pair is selected)."""
    cpu_ms_N = pairs_N.double() * SELECT_MS_PER_PAIR + tokens_N.double() * hidden * TOKEN_NORM_MS_PER_ELEMENT
    scale = CPU_THREAD_BW / hbm_bw if hbm_bw > 0 else 1.0
    return torch.where(pairs_N > 0, cpu_ms_N * 1e-3 * scale + SELECTION_KERNELS * launch_s, 0.0)
