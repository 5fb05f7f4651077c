"""Retention quotas (DESIGN.md §4 step 3): how many forward pairs each (source rank, slot) keeps for the backward.

From the exact forward loads, each rank gets a backward cap

    cap_n = min(Q, Q^mem_n),   Q = ceil((1 + eps) · mean_n L_n),

(Q^mem_n: retained pairs whose buffers fit in the rank's free memory, None = unlimited), and every expert a floor
of ceil(gamma · C_e) retained pairs (C_e: its computed pairs), so no expert starves. :func:`retention_quotas`
trims each over-cap rank down to its cap, in proportion to what each of its groups can give above its share of
the floor, and reports the pairs the floor forced above a cap. Everything is integer and exact; the same
counts give the same quotas on every rank, so no collective is needed.

:func:`apportion` (proportional split of integer totals, exact) is the primitive the planner shares. Like the
rest of the planner, the arithmetic runs in NumPy (a fraction of torch's per-call overhead on these small
arrays); inputs and outputs are torch tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

APPORTION_RULES = ("cumulative", "largest_remainder")


def _zero_weight_error(what: str, total: np.ndarray, weight: np.ndarray) -> None:
    bad = np.flatnonzero((weight == 0) & (total > 0))
    if len(bad):
        raise ValueError(f"apportion: {what} {bad[0]} has total {int(total[bad[0]])} but zero weight")


def _apportion(total_S: np.ndarray, weight_K: np.ndarray, segment_K: np.ndarray,
               rule: str = "cumulative") -> np.ndarray:
    """NumPy core of :func:`apportion` (int64 arrays)."""
    S, K = len(total_S), len(weight_K)
    W_S = np.bincount(segment_K, weights=weight_K, minlength=S).astype(np.int64)
    _zero_weight_error("segment", total_S, W_S)
    if rule == "largest_remainder":
        W_K = np.maximum(W_S, 1)[segment_K]
        scaled_K = total_S[segment_K] * weight_K
        share_K = scaled_K // W_K
        remainder_K = scaled_K - share_K * W_K
        leftover_S = total_S - np.bincount(segment_K, weights=share_K, minlength=S).astype(np.int64)
        order = np.lexsort((-remainder_K, segment_K))  # by segment, largest remainder first, then index
        size_S = np.bincount(segment_K, minlength=S)
        position_K = np.empty_like(order)
        position_K[order] = np.arange(K) - (np.cumsum(size_S) - size_S)[segment_K[order]]
        return share_K + (position_K < leftover_S[segment_K])
    order = None
    if K > 1 and (segment_K[1:] < segment_K[:-1]).any():
        order = np.argsort(segment_K, kind="stable")
        segment_K, weight_K = segment_K[order], weight_K[order]
    before_S = np.cumsum(W_S) - W_S  # weight of all earlier segments
    upto_K = np.cumsum(weight_K) - before_S[segment_K]
    cum_share_K = total_S[segment_K] * upto_K // np.maximum(W_S, 1)[segment_K]
    alloc_K = cum_share_K.copy()
    if K > 1:
        alloc_K[1:] -= cum_share_K[:-1] * (segment_K[1:] == segment_K[:-1])
    if order is None:
        return alloc_K
    out = np.empty_like(alloc_K)
    out[order] = alloc_K
    return out


def _apportion_rows(total_R: np.ndarray, weight_RK: np.ndarray) -> np.ndarray:
    """NumPy core of :func:`apportion_rows`."""
    W_R = weight_RK.sum(1)
    _zero_weight_error("row", total_R, W_R)
    cum_share_RK = total_R[:, None] * np.cumsum(weight_RK, 1) // np.maximum(W_R, 1)[:, None]
    alloc_RK = cum_share_RK.copy()
    alloc_RK[:, 1:] -= cum_share_RK[:, :-1]
    return alloc_RK


def _long_numpy(t: Tensor) -> np.ndarray:
    return t.detach().cpu().long().numpy()


def apportion(total_S: Tensor, weight_K: Tensor, segment_K: Tensor, rule: str = "cumulative") -> Tensor:
    """Split each integer total_S[s] over the items k with segment_K[k] = s, in proportion to weight_K.

    Exact integer arithmetic; sums are exact, every item gets the floor or the ceiling of its share
    T·w_k / W, zero weights get nothing, and when T <= W no item gets more than its weight. Two rules for
    where the rounding units fall:

    * "cumulative" (default, no sort when segments are contiguous and in order): in item order, item k gets
      floor(T·W_{<=k} / W) - floor(T·W_{<k} / W), W_{<=k} the segment's weights up to and including k;
    * "largest_remainder": floor(T·w_k / W) each, the leftover units one each to the largest remainders,
      ties to the lower item index (one sort of K items).

    Raises ``ValueError`` when a segment with a positive total has zero weight. LongTensor[K] on
    weight_K's device.
    """
    if rule not in APPORTION_RULES:
        raise ValueError(f"apportion: rule={rule!r} is not one of {APPORTION_RULES}")
    out = _apportion(_long_numpy(total_S), _long_numpy(weight_K), _long_numpy(segment_K), rule)
    return torch.from_numpy(out).to(weight_K.device)


def apportion_rows(total_R: Tensor, weight_RK: Tensor) -> Tensor:
    """:func:`apportion` with rule "cumulative" where segment r is row r of a dense [R, K] weight matrix."""
    return torch.from_numpy(_apportion_rows(_long_numpy(total_R), _long_numpy(weight_RK))).to(weight_RK.device)


def _check_fraction(name: str, value: float, upper: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (upper is not None and value > upper):
        raise ValueError(f"{name} must be in [0, {upper if upper is not None else 'inf'}), got {value!r}")
    return float(value)


def memory_cap_pairs(mem_budget_bytes, slots_per_rank: int, slot_bytes: float, pair_buffer_bytes: float) -> Tensor:
    """Q^mem_n = floor((budget_n - slots·slot_bytes) / pair_buffer_bytes), at least 0. LongTensor like the budget."""
    if not pair_buffer_bytes > 0:
        raise ValueError(f"pair_buffer_bytes must be positive, got {pair_buffer_bytes!r}")
    if slot_bytes < 0:
        raise ValueError(f"slot_bytes must be non-negative, got {slot_bytes!r}")
    free = torch.as_tensor(mem_budget_bytes, dtype=torch.float64) - slots_per_rank * slot_bytes
    return torch.floor(free.clamp(min=0) / pair_buffer_bytes).long()


def rank_caps(fwd_load_N: Tensor, eps: float, mem_cap_pairs_N=None) -> Tensor:
    """Backward cap per rank: min(ceil((1 + eps) · mean load), Q^mem_n). LongTensor[N].

    ``eps`` >= 0 is the balance slack (eps = 0 lets a perfectly balanced load keep everything, the ceiling
    keeps it so when the mean is fractional). ``mem_cap_pairs_N``: None (no memory cap), an int, or [N].
    """
    eps = _check_fraction("eps", eps, None)
    N = fwd_load_N.numel()
    total = int(fwd_load_N.sum())
    # exact ceil((1 + eps) * total / N) up to float rounding of eps; the 1e-9 keeps 1.1 * 10 at 11, not 12
    cap = math.ceil((1.0 + eps) * total / N - 1e-9)
    cap_N = torch.full((N,), max(cap, 0), dtype=torch.long)
    if mem_cap_pairs_N is not None:
        mem_N = torch.as_tensor(mem_cap_pairs_N, dtype=torch.long).expand(N)
        if (mem_N < 0).any():
            raise ValueError(f"mem_cap_pairs_N must be non-negative, got {mem_cap_pairs_N!r}")
        cap_N = torch.minimum(cap_N, mem_N)
    return cap_N


def _expert_floor(fwd_E: np.ndarray, gamma: float) -> np.ndarray:
    return np.minimum(np.maximum(np.ceil(fwd_E * gamma - 1e-9), 0).astype(np.int64), fwd_E)


def expert_floor(fwd_E: Tensor, gamma: float) -> Tensor:
    """ceil(gamma · C_e): pairs of each expert the quotas must keep. gamma in [0, 1]."""
    gamma = _check_fraction("gamma", gamma, 1.0)
    return torch.from_numpy(_expert_floor(_long_numpy(fwd_E), gamma))


def retention_quotas(fwd_NG: Tensor, expert_G: Tensor, cap_N: Tensor, gamma: float,
                     bwd_flows_F4: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Integer quotas keep_NG <= fwd_NG that bring every rank's backward load down to its cap.

    Args:
        fwd_NG: [N, G] forward pairs per (source rank, global slot).
        expert_G: [G] expert of each slot (-1 empty), i.e. ``placement_NS.reshape(-1)``.
        cap_N: [N] backward cap per rank (:func:`rank_caps`).
        gamma: per-expert floor fraction in [0, 1].
        bwd_flows_F4: rows (src, from_slot, to_slot, count) already planned by the backward replica routing:
            those pairs are retained and counted on the destination rank. Destinations must stay within
            their cap (route_backward guarantees it); a flow landing on a rank it pushes over the cap raises.

    Returns (keep_NG, floor_excess_N). The rule, per over-cap rank r with excess T_r = load_r - cap_r: only
    pairs that stay on r can be trimmed, and r trims T_r of them in proportion to each group's staying pairs
    (:func:`apportion`, in (slot, source) order). If that leaves an expert below its floor, the trim is
    redone with the floor reserved: each expert's need beyond its sure pairs (moved pairs and everything on
    under-cap ranks) is spread over its slots on over-cap ranks in proportion to their staying pairs, then
    within a slot over its sources; rank r trims min(T_r, trimmable_r) in proportion to each group's pairs
    above its reservation, and floor_excess_r = T_r - that (> 0 only when every group on r is down to its
    reservation).
    """
    N, G = fwd_NG.shape
    if cap_N.shape != (N,):
        raise ValueError(f"cap_N has shape {tuple(cap_N.shape)}, expected ({N},)")
    if expert_G.shape != (G,):
        raise ValueError(f"expert_G has shape {tuple(expert_G.shape)}, expected ({G},)")
    gamma = _check_fraction("gamma", gamma, 1.0)
    flows = None if bwd_flows_F4 is None or not len(bwd_flows_F4) else _long_numpy(bwd_flows_F4)
    keep, excess = _retention_quotas(_long_numpy(fwd_NG), _long_numpy(expert_G), _long_numpy(cap_N), gamma, flows)
    return torch.from_numpy(keep), torch.from_numpy(excess)


def _retention_quotas(fwd_NG: np.ndarray, expert_G: np.ndarray, cap_N: np.ndarray, gamma: float,
                      flows_F4: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    N, G = fwd_NG.shape
    S = G // N
    stay_NG = fwd_NG
    in_N = np.zeros(N, dtype=np.int64)
    if flows_F4 is not None:
        src, frm, to, cnt = flows_F4.T
        stay_NG = fwd_NG - np.bincount(src * G + frm, weights=cnt, minlength=N * G).astype(np.int64).reshape(N, G)
        in_N = np.bincount(to // S, weights=cnt, minlength=N).astype(np.int64)
    load_N = stay_NG.sum(0).reshape(N, S).sum(1) + in_N
    excess_N = np.maximum(load_N - cap_N, 0)
    landed = np.flatnonzero((in_N > 0) & (excess_N > 0))
    if len(landed):
        r = landed[0]
        raise ValueError(f"bwd_flows_F4 move {int(in_N[r])} pairs onto rank {r}, which ends {int(excess_N[r])} "
                         f"pairs above its cap {int(cap_N[r])}")
    over = np.flatnonzero(excess_N)
    if not len(over):
        return fwd_NG.copy(), np.zeros(N, dtype=np.int64)
    hosted_G = expert_G >= 0
    E = int(expert_G.max()) + 1 if hosted_G.any() else 0
    # trimmable groups: [over-cap rank, its S slots × N sources], slot-major (empty slots hold 0 pairs)
    stay_RK = np.ascontiguousarray(stay_NG.T).reshape(N, S * N)[over]
    slots_X = (over[:, None] * S + np.arange(S)).ravel()  # the slots of those rows, in order
    stay_XN = stay_RK.reshape(-1, N)
    e_X = expert_G[slots_X]
    # floor: what each expert still needs beyond its sure pairs, reserved over its trimmable groups
    fwd_E = np.bincount(expert_G[hosted_G], weights=fwd_NG.sum(0)[hosted_G], minlength=E).astype(np.int64)
    stay_X = stay_XN.sum(1)
    hosted_X = e_X >= 0
    sure_E = fwd_E - np.bincount(e_X[hosted_X], weights=stay_X[hosted_X], minlength=E).astype(np.int64)
    floor_E = _expert_floor(fwd_E, gamma)
    # first try: trim each over-cap rank in proportion to its groups' staying pairs
    cut_R = np.minimum(excess_N[over], stay_RK.sum(1))
    cut_RK = _apportion_rows(cut_R, stay_RK)
    kept_X = stay_X - cut_RK.reshape(-1, N).sum(1)
    if (sure_E + np.bincount(e_X[hosted_X], weights=kept_X[hosted_X], minlength=E) < floor_E).any():
        # an expert fell below its floor: reserve what each expert needs beyond its sure pairs and trim only
        # what its groups hold above their reservation
        reserve_E = np.maximum(floor_E - sure_E, 0)
        reserve_X = np.zeros_like(stay_X)
        reserve_X[hosted_X] = _apportion(reserve_E, stay_X[hosted_X], e_X[hosted_X])
        spare_RK = stay_RK - _apportion_rows(reserve_X, stay_XN).reshape(stay_RK.shape)
        cut_R = np.minimum(excess_N[over], spare_RK.sum(1))
        cut_RK = _apportion_rows(cut_R, spare_RK)
    keep_GN = fwd_NG.T.copy()
    keep_GN[slots_X] -= cut_RK.reshape(-1, N)
    floor_excess_N = excess_N.copy()
    floor_excess_N[over] -= cut_R
    return np.ascontiguousarray(keep_GN.T), floor_excess_N
