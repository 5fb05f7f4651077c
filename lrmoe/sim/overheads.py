"""Overheads on an MoE layer's critical path beyond the exchanges and the expert GEMMs, each with its source.

DESIGN.md §5.4: every overhead on the critical path is charged, and each can be switched off
(``CostModel(overheads=...)``) to show its effect. The names in :data:`OVERHEADS`:

``planning``
    The host computes the layer's plan between the counts all-gather and the dispatch, once per micro-batch
    (phase ``plan``). Source: ``experiments/bench_planner.py``, committed results run
    ``bench_planner-20261129-231229-b3966e`` (git 977914e): median ms per plan on one thread of the development
    CPU, E = 128, 4096 tokens x top-8 per rank, Zipf 0.6, for N = 8, 16, 64 (:data:`PLANNER_MS`). Which row a
    system pays is its registry entry's (``SystemSpec.planner``, declared by its policy factory; passed as
    ``CostModel(planner=...)``), never read from a name; a plan priced without one pays no planner. Rule (ours):
    charged as measured, unscaled (a GPU server's host core is not slower than the development CPU's);
    interpolated linearly in log2 N between the measured rank counts, held constant outside them; scaled by E / 128.
    A trimmed plan (the random-trim control, ``CostModel(quota_stage=True)``) pays its planner plus LRMoE's quota
    stage.
``counts``
    The all-gather of the routed counts, an N x E matrix of int64, before planning (phase ``plan``): every rank
    sends its E counts to every other rank, priced like the other all-to-alls (latency per link kind used).
``selection``
    Scoring and selection of a plan that keeps fewer pairs than it computes (phase ``recalibrate``), at each pair's
    home rank, priced per metric and selection mode (``CostModel(metric=..., mode=...)``, from the system's
    backward). Source: ``experiments/bench_scoring.py``, committed run ``bench_scoring-20261201-151653-f0017f``
    (``paper_figures/results/bench_scoring.jsonl``): 65,536 pairs in 2,048 groups, width 2,048, one CPU thread,
    float32; per (metric, mode) the metric alone (``score_ms``) and scoring + the move to the host + selection
    (``select_ms``), :data:`SCORING_MS`. A metric pays what it runs: random selection its draws and the selection,
    no pass over the pairs' rows. Rule (ours): these passes are memory-bound, so the CPU time is scaled by the ratio
    of the CPU thread's memory bandwidth to the GPU's (:data:`CPU_THREAD_BW`, measured, over the cluster's
    datasheet HBM bandwidth), linearly in pairs, plus :data:`SELECTION_KERNELS` kernel launches. A metric that
    needs ‖h‖ (m2) also pays the expert-side norm in the forward (phase ``expert_fwd``): each forward row's h (F
    elements) read once at the HBM bandwidth, plus one launch, on the rank that computes it; and its extra combine
    column rides on the combine's rows (:mod:`lrmoe.bytemodel.layout`, ``combine_cols``).
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

# Median ms per plan at E = 128 (bench_planner run bench_planner-20261129-231229-b3966e), by planner benchmark:
# the policies of experiments/bench_planner.py that a registry entry's factory names (SystemSpec.planner).
PLANNER_MS = {
    "lrmoe": {8: 0.543, 16: 0.659, 64: 0.749},
    "symi-dropless": {8: 0.149, 16: 0.156, 64: 0.238},
    "symi-cf": {8: 0.235, 16: 0.248, 64: 0.364},
    "static-ep": {8: 0.091, 16: 0.098, 64: 0.149},
    "capacity": {8: 0.133, 16: 0.148, 64: 0.232},
}
QUOTAS_MS = {8: 0.013, 16: 0.050, 64: 0.016}  # LRMoE's quota stage alone, same run
PLANNER_EXPERTS = 128

# bench_scoring run bench_scoring-20261201-151653-f0017f (paper_figures/results/bench_scoring.jsonl): one CPU
# thread, float32, width 2,048, 65,536 pairs in 2,048 groups; (metric, mode) -> (score_ms, select_ms), medians of
# 30 repetitions. select_ms holds the scoring, the scores' move to the host and the selection; a pair is charged the
# larger of the two (m3 top-k's scoring alone was timed slower than its scoring + selection: two noisy timings).
SCORING_RUN = "bench_scoring-20261201-151653-f0017f"
SCORING_PAIRS = 65536
SCORING_MS = {
    ("m1", "topk"): (47.22808050019012, 52.276202499797364),
    ("m1", "unbiased"): (47.68829300019206, 57.78488150008343),
    ("m2", "topk"): (49.578819000089425, 56.872123000175634),
    ("m2", "unbiased"): (62.43046649979078, 76.60440850031591),
    ("m3", "topk"): (439.79442749969166, 364.0053439999065),
    ("m3", "unbiased"): (346.3538500004688, 369.03422700015653),
    ("gate", "topk"): (0.011662499673548155, 4.1747564996512665),
    ("gate", "unbiased"): (0.011923499641852686, 8.02647850014182),
    ("random", "topk"): (0.26831150034922757, 4.22024049976244),
    ("random", "unbiased"): (0.017592999938642606, 8.078546000433562),
}
# ours: device ops of lrmoe.recal.scoring's metrics and lrmoe.recal.selection's path, from the code (an upper
# bound for the cheaper metrics)
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


def planner_seconds(planner: str | None, quota_stage: bool, num_ranks: int, num_experts: int) -> float:
    """Host seconds of one plan by the planner benchmark ``planner`` (+ LRMoE's quota stage if ``quota_stage``);
    0 without a planner (a hand-made plan). ValueError for a planner with no benchmark."""
    if planner is None:
        return 0.0
    if planner not in PLANNER_MS:
        raise ValueError(f"no planner benchmark {planner!r}; measured: {sorted(PLANNER_MS)} (a registry entry's "
                         f"factory names one of them as its planner, or drop 'planning' from the overheads)")
    ms = _interp_log2(PLANNER_MS[planner], num_ranks) + (_interp_log2(QUOTAS_MS, num_ranks) if quota_stage else 0.0)
    return ms * 1e-3 * num_experts / PLANNER_EXPERTS


def selection_ms_per_pair(metric: str, mode: str) -> float:
    """CPU ms per pair to score, move and select with ``metric`` in ``mode`` (:data:`SCORING_MS`)."""
    if (metric, mode) not in SCORING_MS:
        raise ValueError(f"no scoring benchmark for metric {metric!r} in mode {mode!r}; measured: "
                         f"{sorted(SCORING_MS)}")
    return max(SCORING_MS[(metric, mode)]) / SCORING_PAIRS


def selection_seconds(pairs_N: Tensor, metric: str, mode: str, hbm_bw: float, launch_s: float) -> Tensor:
    """float64 [N]: device seconds to score and select ``pairs_N`` pairs at each home rank with ``metric`` in
    ``mode`` (nothing where no pair is selected)."""
    cpu_ms_N = pairs_N.double() * selection_ms_per_pair(metric, mode)
    scale = CPU_THREAD_BW / hbm_bw if hbm_bw > 0 else 1.0
    return torch.where(pairs_N > 0, cpu_ms_N * 1e-3 * scale + SELECTION_KERNELS * launch_s, 0.0)
