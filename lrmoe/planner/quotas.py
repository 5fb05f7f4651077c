"""Retention quotas (DESIGN.md §4 step 3): how many forward pairs each (source rank, slot) keeps for the backward.

From the exact forward loads L_n (mean L̄ = Σ_n L_n / N), each rank gets a backward cap, in one of two modes:

    budget:  cap_n = min(ceil(rho · L̄), Q^mem_n)          (:func:`budget_caps`, rho in (0, 1])
    cap:     cap_n = min(ceil((1 + eps) · L̄), Q^mem_n)    (:func:`rank_caps`, eps >= 0)

(Q^mem_n: retained pairs whose buffers fit in the rank's free memory, None = unlimited). ``budget`` is the
demand-side reading: every rank's retained load is B_n = min(L_n, cap_n), balanced at a level declared in
advance, and rho < 1 trims every rank, not only the hot ones. ``cap`` trims only ranks above the mean (once
replicas balance the forward it trims next to nothing; kept as an ablation). Every expert has a floor of
ceil(gamma · C_e) retained pairs (C_e: its computed pairs), so no expert starves. :func:`retention_quotas` trims
each over-cap rank down to its cap, in proportion to what each of its groups can give above its share of the
floor, and reports the pairs the floor forced above a cap: a rank's retained load is min(L_n, cap_n) plus that
floor excess, exactly. Everything is integer and exact; the same counts give the same quotas on every rank, so
no collective is needed.

Like the rest of the planner, the arithmetic runs in NumPy (a fraction of torch's per-call overhead on these
small arrays, with :func:`~lrmoe.checks.apportion` as the proportional split); inputs and outputs are torch
tensors.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from lrmoe.checks import apportion_array, check_fraction, long_array


def memory_cap_pairs(mem_budget_bytes, slots_per_rank: int, slot_bytes: float, pair_buffer_bytes: float) -> Tensor:
    """Q^mem_n = floor((budget_n - slots·slot_bytes) / pair_buffer_bytes), at least 0. LongTensor like the budget."""
    if not pair_buffer_bytes > 0:
        raise ValueError(f"pair_buffer_bytes must be positive, got {pair_buffer_bytes!r}")
    if slot_bytes < 0:
        raise ValueError(f"slot_bytes must be non-negative, got {slot_bytes!r}")
    free = torch.as_tensor(mem_budget_bytes, dtype=torch.float64) - slots_per_rank * slot_bytes
    return torch.floor(free.clamp(min=0) / pair_buffer_bytes).long()


def _with_memory_cap(cap: int, num_ranks: int, mem_cap_pairs_N) -> Tensor:
    cap_N = torch.full((num_ranks,), max(cap, 0), dtype=torch.long)
    if mem_cap_pairs_N is None:
        return cap_N
    mem_N = torch.as_tensor(mem_cap_pairs_N, dtype=torch.long).expand(num_ranks)
    if (mem_N < 0).any():
        raise ValueError(f"mem_cap_pairs_N must be non-negative, got {mem_cap_pairs_N!r}")
    return torch.minimum(cap_N, mem_N)


def rank_caps(fwd_load_N: Tensor, eps: float, mem_cap_pairs_N=None) -> Tensor:
    """``cap`` mode: backward cap per rank min(ceil((1 + eps) · mean load), Q^mem_n). LongTensor[N].

    ``eps`` >= 0 is the balance slack (eps = 0 lets a perfectly balanced load keep everything, the ceiling
    keeps it so when the mean is fractional). ``mem_cap_pairs_N``: None (no memory cap), an int, or [N].
    """
    eps = check_fraction("eps", eps, None)
    N = fwd_load_N.numel()
    total = int(fwd_load_N.sum())
    # exact ceil((1 + eps) * total / N) up to float rounding of eps; the 1e-9 keeps 1.1 * 10 at 11, not 12
    return _with_memory_cap(math.ceil((1.0 + eps) * total / N - 1e-9), N, mem_cap_pairs_N)


def check_rho(rho: float) -> float:
    """The retention budget's level: a number in (0, 1]."""
    rho = check_fraction("rho", rho, 1.0)
    if rho == 0:
        raise ValueError("rho must be in (0, 1], got 0 (a budget of nothing)")
    return rho


def budget_level(total: int, num_ranks: int, rho: float) -> int:
    """ceil(rho · total / num_ranks), exact: rho is read as the decimal it prints as (0.6 is 3/5, not the
    binary float just below it), so the budget never depends on float rounding."""
    return math.ceil(Fraction(repr(check_rho(rho))) * total / num_ranks)


def budget_caps(fwd_load_N: Tensor, rho: float, mem_cap_pairs_N=None) -> Tensor:
    """``budget`` mode: backward cap per rank min(ceil(rho · mean load), Q^mem_n). LongTensor[N].

    ``rho`` in (0, 1] is the retained share of the mean forward load that every rank may keep: with the quotas
    of :func:`retention_quotas`, rank n keeps B_n = min(L_n, cap_n) pairs (plus any floor excess).
    ``mem_cap_pairs_N``: None (no memory cap), an int, or [N].
    """
    N = fwd_load_N.numel()
    return _with_memory_cap(budget_level(int(fwd_load_N.sum()), N, rho), N, mem_cap_pairs_N)


def _expert_floor(fwd_E: np.ndarray, gamma: float) -> np.ndarray:
    return np.minimum(np.maximum(np.ceil(fwd_E * gamma - 1e-9), 0).astype(np.int64), fwd_E)


def expert_floor(fwd_E: Tensor, gamma: float) -> Tensor:
    """ceil(gamma · C_e): pairs of each expert the quotas must keep. gamma in [0, 1]."""
    gamma = check_fraction("gamma", gamma, 1.0)
    return torch.from_numpy(_expert_floor(long_array(fwd_E), gamma))


def retention_quotas(fwd_NG: Tensor, expert_G: Tensor, cap_N: Tensor, gamma: float,
                     bwd_flows_V4: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Integer quotas keep_NG <= fwd_NG that bring every rank's backward load down to its cap.

    Args:
        fwd_NG: [N, G] forward pairs per (source rank, global slot).
        expert_G: [G] expert of each slot (-1 empty), i.e. ``placement_NS.reshape(-1)``.
        cap_N: [N] backward cap per rank (:func:`rank_caps`).
        gamma: per-expert floor fraction in [0, 1].
        bwd_flows_V4: rows (src, from_slot, to_slot, count) already planned by the backward replica routing:
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
    gamma = check_fraction("gamma", gamma, 1.0)
    flows = None if bwd_flows_V4 is None or not len(bwd_flows_V4) else long_array(bwd_flows_V4)
    keep, excess = _retention_quotas(long_array(fwd_NG), long_array(expert_G), long_array(cap_N), gamma, flows)
    return torch.from_numpy(keep), torch.from_numpy(excess)


def over_cap(fwd_NG: np.ndarray, cap_N: np.ndarray, flows_V4: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(the pairs that stay on their slot [N, G] after the backward flows move theirs, each rank's pairs above its
    cap [N]); a flow onto a rank that ends above its cap is an error."""
    N, G = fwd_NG.shape
    S = G // N
    stay_NG = fwd_NG
    in_N = np.zeros(N, dtype=np.int64)
    if flows_V4 is not None:
        src, frm, to, cnt = flows_V4.T
        stay_NG = fwd_NG - np.bincount(src * G + frm, weights=cnt, minlength=N * G).astype(np.int64).reshape(N, G)
        in_N = np.bincount(to // S, weights=cnt, minlength=N).astype(np.int64)
    load_N = stay_NG.sum(0).reshape(N, S).sum(1) + in_N
    excess_N = np.maximum(load_N - cap_N, 0)
    landed = np.flatnonzero((in_N > 0) & (excess_N > 0))
    if len(landed):
        r = landed[0]
        raise ValueError(f"bwd_flows_V4 move {int(in_N[r])} pairs onto rank {r}, which ends {int(excess_N[r])} "
                         f"pairs above its cap {int(cap_N[r])}")
    return stay_NG, excess_N


def _retention_quotas(fwd_NG: np.ndarray, expert_G: np.ndarray, cap_N: np.ndarray, gamma: float,
                      flows_V4: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    N, G = fwd_NG.shape
    S = G // N
    stay_NG, excess_N = over_cap(fwd_NG, cap_N, flows_V4)
    over = np.flatnonzero(excess_N)
    if not len(over):
        return fwd_NG.copy(), np.zeros(N, dtype=np.int64)
    hosted_G = expert_G >= 0
    E = int(expert_G.max()) + 1 if hosted_G.any() else 0
    # trimmable groups: the slots of the over-cap ranks (columns X of [N, X], S a rank), each (slot, source) a
    # group, a rank's groups in (slot, source) order; empty slots hold 0 pairs
    slots_X = (over[:, None] * S + np.arange(S)).ravel()
    all_slots = len(over) == N
    stay_NX = stay_NG if all_slots else np.take(stay_NG, slots_X, axis=1)
    e_X = expert_G[slots_X]
    # floor: what each expert still needs beyond its sure pairs, reserved over its trimmable groups
    fwd_E = np.bincount(expert_G[hosted_G], weights=fwd_NG.sum(0)[hosted_G], minlength=E).astype(np.int64)
    stay_X = stay_NX.sum(0)
    hosted_X = e_X >= 0
    sure_E = fwd_E - np.bincount(e_X[hosted_X], weights=stay_X[hosted_X], minlength=E).astype(np.int64)
    floor_E = _expert_floor(fwd_E, gamma)
    # first try: trim each over-cap rank in proportion to its groups' staying pairs
    cut_R = np.minimum(excess_N[over], stay_X.reshape(-1, S).sum(1))
    cut_NX = _apportion_ranks(cut_R, stay_NX, S)
    kept_X = stay_X - cut_NX.sum(0)
    if (sure_E + np.bincount(e_X[hosted_X], weights=kept_X[hosted_X], minlength=E) < floor_E).any():
        # an expert fell below its floor: reserve what each expert needs beyond its sure pairs and trim only
        # what its groups hold above their reservation
        reserve_E = np.maximum(floor_E - sure_E, 0)
        reserve_X = np.zeros_like(stay_X)
        reserve_X[hosted_X] = apportion_array(reserve_E, stay_X[hosted_X], e_X[hosted_X])
        spare_NX = stay_NX - _apportion_columns(reserve_X, stay_NX)
        cut_R = np.minimum(excess_N[over], spare_NX.sum(0).reshape(-1, S).sum(1))
        cut_NX = _apportion_ranks(cut_R, spare_NX, S)
    if all_slots:
        keep_NG = fwd_NG - cut_NX
    else:
        keep_NG = fwd_NG.copy()
        keep_NG[:, slots_X] -= cut_NX
    floor_excess_N = excess_N.copy()
    floor_excess_N[over] -= cut_R
    return keep_NG, floor_excess_N


def _zero_weight_error(total: np.ndarray, weight: np.ndarray) -> None:
    bad = np.flatnonzero((weight == 0) & (total > 0))
    if len(bad):
        raise ValueError(f"apportion: row {bad[0]} has total {int(total[bad[0]])} but zero weight")


_BLOCKED_CUMSUM_SIZE = 1 << 15


def _cumsum_down(x_NX: np.ndarray) -> np.ndarray:
    """np.cumsum(x_NX, 0) of an int64 matrix in C order, by blocks of about sqrt(N) rows (NumPy's own cumsum along
    the first axis walks the matrix a column at a time, several times slower once it leaves the cache; small ones
    take NumPy's): exact, it is integer addition."""
    if x_NX.size < _BLOCKED_CUMSUM_SIZE:
        return np.cumsum(x_NX, 0)
    out = x_NX.copy()
    N = len(out)
    k = max(1, math.isqrt(N))
    for t in range(1, k):  # prefix sums inside each block of k rows, all blocks at once
        row = out[t::k]
        row += out[t - 1::k][:len(row)]
    for start in range(k, N, k):  # then each block adds the total of the rows before it
        out[start:start + k] += out[start - 1]
    return out


def _apportion_columns(total_X: np.ndarray, weight_NX: np.ndarray) -> np.ndarray:
    """Each column's total split over its rows by cumulative rounding in row order (``apportion_rows`` of the
    transposed matrix, without transposing it). int64[N, X]"""
    cum_NX = _cumsum_down(weight_NX)
    _zero_weight_error(total_X, cum_NX[-1])
    share_NX = total_X * cum_NX // np.maximum(cum_NX[-1], 1)
    share_NX[1:] -= share_NX[:-1].copy()
    return share_NX


def _apportion_ranks(total_R: np.ndarray, weight_NX: np.ndarray, S: int) -> np.ndarray:
    """Each total of a group of S consecutive columns split over the group's entries by cumulative rounding in
    (column, row) order: ``apportion_rows`` of the [R, S·N] matrix whose row r is columns r·S .. r·S + S - 1 one
    after another, computed in the [N, X] layout (no transpose). int64[N, X]"""
    N, X = weight_NX.shape
    cum_NX = _cumsum_down(weight_NX)
    column_RS = cum_NX[-1].reshape(-1, S)
    within_RS = np.cumsum(column_RS, 1)
    W_R = within_RS[:, -1]
    _zero_weight_error(total_R, W_R)
    cum_NX += (within_RS - column_RS).reshape(X)  # the group's weight in the columns before
    share_NX = np.repeat(total_R, S) * cum_NX // np.repeat(np.maximum(W_R, 1), S)
    last_X = share_NX[-1].copy()
    share_NX[1:] -= share_NX[:-1].copy()
    if S > 1:  # a column's first entry follows the group's previous column's last
        share_NX[0].reshape(-1, S)[:, 1:] -= last_X.reshape(-1, S)[:, :-1]
    return share_NX
