"""Overheads on an MoE layer's critical path beyond the exchanges and the expert GEMMs, each with its source.

DESIGN.md §5.4: every overhead on the critical path is charged, and each can be switched off
(``CostModel(overheads=...)``) to show its effect. The names in :data:`OVERHEADS`:

``planning``
    The host's planning between the counts all-gather and the dispatch, once per micro-batch (phase ``plan``): only
    the plan's critical path, what needs this micro-batch's counts (forward routing over the replicas, capacities,
    caps, quotas, backward routing: ``policy.plan_on``). The placement needs only the previous iteration's counts
    and runs on a background thread while the iteration runs (:mod:`lrmoe.runtime.placement_ahead`, one placement
    per layer and iteration); it is charged only where the layers' placements do not fit under the iteration
    (:func:`lrmoe.sim.simulator.simulate` adds the excess). Sources: the whole plan's median ms
    (``experiments/bench_planner.py``, committed results run ``bench_planner-20261129-231229-b3966e``, git
    977914e: one thread of the development CPU, E = 128, 4096 tokens x top-8 per rank, Zipf 0.6, N = 8, 16, 64;
    :data:`PLANNER_MS`), times one placement's share of it from run :data:`SHARES_RUN`
    (``paper_figures/results/bench_planner_shares.jsonl``, same E, tokens, skew and ranks: ``plan_on``, one
    ``placement`` and ``plan`` timed back to back in each of 150 rounds in a shuffled order, the median of the
    rounds' ratios; :data:`PLACEMENT_SHARE`) and the critical path's, the rest of the plan
    (:data:`CRITICAL_PATH_SHARE`). The shares, not that run's times: it ran
    on a machine shared by many jobs, where times are several-fold the quiet run's but a ratio of calls made back
    to back holds better. Which row a system pays is its registry entry's (``SystemSpec.planner``, declared by its
    policy factory; passed as ``CostModel(planner=...)``), never read from a name; a plan priced without one pays
    no planner. Rule (ours): charged as measured, unscaled (a GPU server's host core is not slower than the
    development CPU's); interpolated linearly in log2 N between the measured rank counts, held constant outside
    them; times scaled by E / 128, shares held. A trimmed plan (the random-trim control,
    ``CostModel(quota_stage=True)``) pays its planner's critical path plus LRMoE's quota stage (all of it on the
    critical path).
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

# Shares of the whole plan by planner benchmark and N at E = 128 (bench_planner run SHARES_RUN,
# paper_figures/results/bench_planner_shares.jsonl): one placement's time over plan's, the median over rounds of the
# two calls back to back. The critical path is the plan minus its two placements (plan_on is exactly that code):
# 1 - 2 x the placement's share. plan_on's share measured directly agrees for every planner but LRMoE (sums of
# 0.91-1.03 with the placements); LRMoE's direct share, 0.57 / 0.57 / 0.36, is below its complement, 0.90 / 0.86 /
# 0.89, for a reason not found: the complement, the larger charge, is the one charged.
SHARES_RUN = "bench_planner-20261203-144622-38269b"
PLACEMENT_SHARE = {
    "lrmoe": {8: 0.052, 16: 0.069, 64: 0.056},
    "symi-dropless": {8: 0.267, 16: 0.26, 64: 0.192},
    "symi-cf": {8: 0.178, 16: 0.184, 64: 0.147},
    "static-ep": {8: 0.075, 16: 0.073, 64: 0.059},
    "capacity": {8: 0.059, 16: 0.055, 64: 0.044},
}
CRITICAL_PATH_SHARE = {name: {n: 1.0 - 2.0 * s for n, s in row.items()} for name, row in PLACEMENT_SHARE.items()}

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


def _whole_plan_ms(planner: str, num_ranks: int, num_experts: int) -> float:
    if planner not in PLANNER_MS:
        raise ValueError(f"no planner benchmark {planner!r}; measured: {sorted(PLANNER_MS)} (a registry entry's "
                         f"factory names one of them as its planner, or drop 'planning' from the overheads)")
    return _interp_log2(PLANNER_MS[planner], num_ranks) * num_experts / PLANNER_EXPERTS


def planner_seconds(planner: str | None, quota_stage: bool, num_ranks: int, num_experts: int) -> float:
    """Host seconds of one plan's critical path by the planner benchmark ``planner`` (+ LRMoE's quota stage if
    ``quota_stage``); 0 without a planner (a hand-made plan). ValueError for a planner with no benchmark."""
    if planner is None:
        return 0.0
    ms = _whole_plan_ms(planner, num_ranks, num_experts) * _interp_log2(CRITICAL_PATH_SHARE[planner], num_ranks)
    if quota_stage:
        ms += _interp_log2(QUOTAS_MS, num_ranks) * num_experts / PLANNER_EXPERTS
    return ms * 1e-3


def placement_seconds(planner: str | None, num_ranks: int, num_experts: int) -> float:
    """Host seconds of one layer's placement, computed off the critical path once per iteration; 0 without a
    planner."""
    if planner is None:
        return 0.0
    return _whole_plan_ms(planner, num_ranks, num_experts) * _interp_log2(PLACEMENT_SHARE[planner], num_ranks) * 1e-3


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
