"""Replica routing: which slot computes each routed pair, in the forward and in the backward.

Forward (:func:`route_forward`) turns C[src, e] into fwd_NG[src, g], counts per (source rank, global slot):

* ``"even"`` (SYMI): each source splits its pairs of e evenly over e's replicas; the remainder goes one pair each
  to the replicas j with (j - src) mod r_e < remainder, so different sources favour different replicas.
* ``"balanced"`` (LRMoE, dropless): first decide how many pairs of e each hosting rank computes so the
  maximum per-rank load is (approximately) minimal, then assign sources, each one first to e's replica on
  its own rank, the rest in rank order (north-west corner). The rank-level split is a block water-filling
  descent on Σ_n load_n² (its minimiser is also min-max for divisible loads), started from the even split,
  accelerated by nonlinear conjugate directions with exact line search, at most ``iters`` steps (it stops
  once a step moves no unit by a quarter pair); if it ends with a higher maximum than the even split it
  started from, the even split is kept.

Capacity (:func:`apply_capacity`): per-expert capacities (:func:`gshard_capacity`, :func:`symi_capacity`) with the
overflow dropped; each source keeps a share of the capacity in proportion to its demand (integer split by
cumulative rounding in rank order, :func:`~lrmoe.checks.apportion`). That cross-source rule is ours; within a
(source, expert) group the layer drops the last pairs by position or the lowest-gate ones, as the plan says.

Backward (:func:`route_backward`): pairs above a rank's backward cap move to a replica of the same expert on a
rank with spare capacity: the replica on the pair's home (source) rank first, then replicas in proportion to
their spare capacity, without pushing any destination over its cap. Greedy, not a maximum flow: what it
cannot move is left for the quotas to trim.

Plans live on the CPU: inputs on another device are copied there. The arithmetic of the balanced split, the
capacity and the backward routing runs in NumPy (on arrays of a few hundred entries torch's per-call overhead
would dominate); inputs and outputs are torch tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from lrmoe.checks import apportion_array, apportion_rows_array, check_cf
from lrmoe.planner.placement import ReplicaTable, replica_table

FORWARD_MODES = ("even", "balanced")


def check_counts(counts_NE: Tensor, num_ranks: int | None = None, name: str = "counts_NE") -> Tensor:
    """Validate a [N, E] integer count matrix (non-negative, N = num_ranks when given); returns it as long."""
    if not isinstance(counts_NE, Tensor) or counts_NE.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor, got shape {tuple(getattr(counts_NE, 'shape', ()))}")
    if counts_NE.dtype.is_floating_point or counts_NE.dtype.is_complex or counts_NE.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {counts_NE.dtype}")
    if num_ranks is not None and counts_NE.shape[0] != num_ranks:
        raise ValueError(f"{name} has {counts_NE.shape[0]} source ranks but the placement has {num_ranks}")
    counts_NE = counts_NE.detach().cpu().long()
    if counts_NE.numel() and int(counts_NE.min()) < 0:
        raise ValueError(f"{name} must be non-negative, got min {int(counts_NE.min())}")
    return counts_NE


def _check_hosted(counts_E: Tensor, table: ReplicaTable) -> None:
    orphan_E = (table.replicas_E == 0) & (counts_E > 0)
    if bool(orphan_E.any()):
        e = int(torch.nonzero(orphan_E)[0])
        raise ValueError(f"expert {e} has {int(counts_E[e])} routed pairs but no slot in the placement")


# --- forward --------------------------------------------------------------------------------------------------

def route_forward(counts_NE: Tensor, placement_NS: Tensor, mode: str = "even", iters: int = 8) -> Tensor:
    """Forward pairs per (source rank, global slot), LongTensor[N, G]; every pair of counts_NE assigned once.

    ``mode``: "even" or "balanced" (module docstring). ``iters``: descent steps of the balanced split.
    Raises ``ValueError`` for negative counts, disagreeing shapes, or pairs of an expert with no slot.
    """
    if mode not in FORWARD_MODES:
        raise ValueError(f"mode={mode!r} is not one of {FORWARD_MODES}")
    N = placement_NS.shape[0] if isinstance(placement_NS, Tensor) and placement_NS.dim() == 2 else None
    counts_NE = check_counts(counts_NE, N)
    return forward_on(counts_NE, replica_table(placement_NS, counts_NE.shape[1]), mode, iters)


def forward_on(counts_NE: Tensor, table: ReplicaTable, mode: str, iters: int = 8) -> Tensor:
    """:func:`route_forward` on an already built table and validated (CPU, long) counts."""
    _check_hosted(counts_NE.sum(0), table)
    if mode == "even":
        return _route_even(counts_NE, table)
    return _route_balanced(counts_NE, table, iters)


def _route_even(counts_NE: Tensor, table: ReplicaTable) -> Tensor:
    """Each source splits its pairs of e evenly over e's replicas; replica j gets one of the remainder iff
    (j - src) mod r_e < remainder."""
    N = table.num_ranks
    hosted_G = table.expert_G >= 0
    e_G = table.expert_G.clamp(min=0)
    r_G = table.replicas_E[e_G].clamp(min=1)
    C_NG = counts_NE[:, e_G]
    share_NG = C_NG // r_G
    rem_NG = C_NG - share_NG * r_G
    turn_NG = (table.replica_G.clamp(min=0)[None, :] - torch.arange(N)[:, None]) % r_G
    return (share_NG + (turn_NG < rem_NG).long()) * hosted_G


def _route_balanced(counts_NE: Tensor, table: ReplicaTable, iters: int) -> Tensor:
    counts = counts_NE.numpy()
    expert_U, rank_U, slots_U = table.expert_U.numpy(), table.rank_U.numpy(), table.slots_U.numpy()
    replicas_E = table.replicas_E.numpy()
    counts_E = counts.sum(0)
    pairs_U = _balance_units(counts_E, expert_U, rank_U, slots_U, replicas_E, table.num_ranks, iters)
    unit_R = table.unit_G[table.hosted_R].numpy()
    room_R = _split_units(pairs_U, unit_R, slots_U)
    return torch.from_numpy(_fill_local_first(counts, table, room_R))


def _waterfill(base_MK: np.ndarray, total_M: np.ndarray, flat_MK: np.ndarray, inv_rank_K: np.ndarray) -> np.ndarray:
    """Per row m: the split a_mk >= 0 of total_m minimising max_k(base_mk + a_mk) (a water level). Padding
    entries carry a huge base and get nothing. flat_MK = m·K (row offsets), inv_rank_K = 1 / (1..K)."""
    index_MK = np.argsort(base_MK, axis=1, kind="stable") + flat_MK
    sorted_MK = base_MK.ravel()[index_MK]
    level_MK = (total_M[:, None] + np.cumsum(sorted_MK, 1)) * inv_rank_K
    wet_M = (level_MK >= sorted_MK).sum(1)  # the level is valid for the first `wet` entries
    fill_MK = np.maximum(level_MK.ravel()[flat_MK[:, 0] + wet_M - 1][:, None] - sorted_MK, 0.0)
    out = np.empty(base_MK.size)
    out[index_MK.ravel()] = fill_MK.ravel()
    return out.reshape(base_MK.shape)


_PAD_LOAD = 1e30  # load of the dummy rank padding the [M, K] layout: never worth filling


def _balance_units(counts_E: np.ndarray, expert_U: np.ndarray, rank_U: np.ndarray, slots_U: np.ndarray,
                   replicas_E: np.ndarray, N: int, iters: int) -> np.ndarray:
    """Pairs per unit (expert, rank) with small maximum rank load; sums per expert exact. int64[U].

    Starts from the even split (pairs in proportion to the unit's slots) and keeps it if the descent ends
    with a higher maximum.
    """
    E = len(counts_E)
    units_E = np.bincount(expert_U, minlength=E)
    multi_U = units_E[expert_U] > 1
    start_U = counts_E[expert_U] * slots_U / np.maximum(replicas_E[expert_U], 1)
    if iters <= 0 or not multi_U.any():
        return _round_shares(start_U, counts_E, expert_U)
    # experts with one unit are fixed load; the others live in a padded [M, K] layout (pad: dummy rank N).
    # Units are sorted by expert, so each multi-unit expert's units are one contiguous run.
    width_M = units_E[units_E > 1]
    row_V = np.repeat(np.arange(len(width_M)), width_M)
    col_V = np.arange(len(row_V)) - np.repeat(np.cumsum(width_M) - width_M, width_M)
    rank_MK = np.full((len(width_M), int(width_M.max())), N, dtype=np.int64)
    rank_MK[row_V, col_V] = rank_U[multi_U]
    a_MK = np.zeros(rank_MK.shape)
    a_MK[row_V, col_V] = start_U[multi_U]
    total_M = counts_E[units_E > 1].astype(np.float64)
    rank_flat = rank_MK.ravel()
    load_N1 = np.bincount(rank_U, weights=start_U, minlength=N + 1)
    start_max = load_N1[:N].max()
    pad_N1 = np.zeros(N + 1)
    pad_N1[N] = _PAD_LOAD
    M, K = rank_MK.shape
    flat_MK, inv_rank_K = np.arange(M)[:, None] * K, 1.0 / np.arange(1, K + 1)
    step_MK = grad_MK = None
    for _ in range(iters):
        # best response of every expert against the others' current load (water-filling): a descent direction,
        # and a feasible one (a + eta·d >= 0 for eta <= 1, since the best response is >= 0)
        d_MK = _waterfill((load_N1 + pad_N1)[rank_MK] - a_MK, total_M, flat_MK, inv_rank_K) - a_MK
        beta = 0.0
        if step_MK is not None:  # Polak-Ribière conjugate direction, restarted when it turns back
            beta = max(0.0, float((d_MK * (d_MK - grad_MK)).sum()) / max(float((grad_MK * grad_MK).sum()), 1e-300))
        p_MK, dload_N1, eta, bound = _line_search(d_MK + beta * step_MK if beta else d_MK, a_MK, load_N1, rank_flat, N)
        if beta and eta > bound:  # the conjugate step would cut a share below 0: restart from the best response
            p_MK, dload_N1, eta, bound = _line_search(d_MK, a_MK, load_N1, rank_flat, N)
        if eta <= 0.0:
            break
        a_MK = np.maximum(a_MK + min(eta, bound) * p_MK, 0.0)
        load_N1 = load_N1 + min(eta, bound) * dload_N1
        if eta * float(np.abs(p_MK).max()) < 0.25:  # converged: no unit would move a quarter pair
            break
        step_MK, grad_MK = p_MK, d_MK
    if load_N1[:N].max() > start_max:
        return _round_shares(start_U, counts_E, expert_U)
    alloc_U = start_U.copy()
    alloc_U[multi_U] = a_MK[row_V, col_V]
    return _round_shares(alloc_U, counts_E, expert_U)


def _line_search(p_MK: np.ndarray, a_MK: np.ndarray, load_N1: np.ndarray, rank_flat: np.ndarray, N: int):
    """Exact line search of Σ_n load_n² along p: (p, its load change, the best step >= 0, the largest step
    keeping a + step·p >= 0)."""
    dload_N1 = np.bincount(rank_flat, weights=p_MK.ravel(), minlength=N + 1)
    dload_N1[N] = 0.0
    curvature = float(dload_N1 @ dload_N1)
    eta = max(0.0, -float(load_N1[:N] @ dload_N1[:N]) / curvature) if curvature > 1e-18 else 0.0
    shrinking = p_MK < 0
    bound = float((a_MK[shrinking] / -p_MK[shrinking]).min()) if shrinking.any() else math.inf
    return p_MK, dload_N1, eta, bound


def _round_shares(alloc_U: np.ndarray, counts_E: np.ndarray, expert_U: np.ndarray) -> np.ndarray:
    """Integer pairs per unit from float shares of each expert's count: the shares are first rescaled to sum to
    the count exactly (the descent's clipping and float error can drift), then floored, and the leftover pairs
    of each expert go one each to its largest fractional parts, ties to the lower unit. Sums exact. int64[U]"""
    E = len(counts_E)
    alloc_U = np.maximum(alloc_U, 0.0)
    size_E = np.bincount(expert_U, minlength=E)
    total_E = np.bincount(expert_U, weights=alloc_U, minlength=E)
    even_U = counts_E[expert_U] / np.maximum(size_E[expert_U], 1)
    scaled_U = alloc_U * (counts_E / np.where(total_E > 0, total_E, 1.0))[expert_U]
    alloc_U = np.where(total_E[expert_U] > 0, scaled_U, even_U)
    floor_U = np.floor(alloc_U)
    frac_U = alloc_U - floor_U
    floor_U = floor_U.astype(np.int64)
    leftover_E = counts_E - np.bincount(expert_U, weights=floor_U, minlength=E).astype(np.int64)
    order = np.lexsort((-frac_U, expert_U))  # by expert, then largest fraction first (stable: lower unit)
    position = np.empty_like(order)
    position[order] = np.arange(len(order)) - (np.cumsum(size_E) - size_E)[expert_U[order]]
    return floor_U + (position < leftover_E[expert_U])


def _split_units(pairs_U: np.ndarray, unit_R: np.ndarray, slots_U: np.ndarray) -> np.ndarray:
    """Pairs per hosted slot (in ReplicaTable.hosted_R order): a unit's pairs split evenly over its slots, the
    remainder to its lowest slots. int64[R]"""
    index_R = np.arange(len(unit_R)) - (np.cumsum(slots_U) - slots_U)[unit_R]  # position inside the unit
    n_R = slots_U[unit_R]
    return pairs_U[unit_R] // n_R + (index_R < pairs_U[unit_R] % n_R)


def _fill_local_first(counts_NE: np.ndarray, table: ReplicaTable, room_R: np.ndarray) -> np.ndarray:
    """fwd_NG from per-slot totals: each source fills its own rank's slots of e first (in slot order), then the
    remaining demand meets the remaining slot room in (expert, source) × (expert, slot) order, north-west
    corner rule, computed for all experts at once from two cumulative sums. Experts with one slot skip it.

    Built slot-major ([G, N]: a slot's sources are contiguous, so the corner's pieces, expert-major, are written
    in order) and transposed once at the end."""
    N, E = counts_NE.shape
    G = table.expert_G.numel()
    hosted_R, replicas_E = table.hosted_R.numpy(), table.replicas_E.numpy()
    counts_EN = _transpose(counts_NE)
    # experts with one slot: that slot's row is the expert's (one gather of whole rows, the other slots zero)
    single_E = replicas_E == 1
    row_G = np.full(G, E)
    row_G[hosted_R[table.start_E.numpy()[single_E]]] = np.flatnonzero(single_E)
    fwd_GN = np.take(np.concatenate([counts_EN, np.zeros((1, N), dtype=np.int64)]), row_G, axis=0)
    multi_E = replicas_E > 1
    if not multi_E.any():
        return _transpose(fwd_GN)
    expert_R = table.expert_G.numpy()[hosted_R]
    multi_R = multi_E[expert_R]
    hosted_R, e_R, room_R = hosted_R[multi_R], expert_R[multi_R], room_R[multi_R]
    rank_R = hosted_R // table.slots_per_rank
    unit_R = table.unit_G.numpy()[hosted_R]
    # room before each slot inside its unit (a unit is a run of hosted_R)
    first_R = np.ones(len(unit_R), dtype=bool)
    first_R[1:] = unit_R[1:] != unit_R[:-1]
    before_R = np.cumsum(room_R) - room_R
    before_R -= before_R[first_R][np.cumsum(first_R) - 1]
    local_R = np.minimum(np.maximum(counts_EN[e_R, rank_R] - before_R, 0), room_R)
    fwd_GN[hosted_R, rank_R] = local_R
    row_E = np.cumsum(multi_E) - 1  # row of each multi-replica expert in the demand matrix
    demand = counts_EN[multi_E].ravel()  # expert-major (expert, source)
    demand = demand - np.bincount(row_E[e_R] * N + rank_R, weights=local_R, minlength=len(demand)).astype(np.int64)
    room_R = room_R - local_R
    # north-west corner: both sequences are expert-major and sum to the same total per expert, so each non-empty
    # demand interval [before, upto) of the (expert, source) line starts in the room interval of slot s (found by
    # bisection in the short room sequence) and, when it ends past that slot's, meets the next ones too: one piece
    # per (demand, slot) it meets, its length the intervals' overlap
    upto_D = np.cumsum(demand)
    room_upto_R = np.cumsum(room_R)
    nz_P = np.flatnonzero(demand)
    upto_P, length_P = upto_D[nz_P], demand[nz_P]
    before_P = upto_P - length_P
    s_P = np.searchsorted(room_upto_R, before_P, side="right")
    cross_C = np.flatnonzero(upto_P > room_upto_R[s_P])
    if len(cross_C):  # few: a slot's room ends inside at most one demand interval
        last_C = np.searchsorted(room_upto_R, upto_P[cross_C] - 1, side="right")
        length_P[cross_C] = room_upto_R[s_P[cross_C]] - before_P[cross_C]  # the first slot's piece
        count_C = last_C - s_P[cross_C]
        first_C = np.cumsum(count_C) - count_C
        c_Q = np.repeat(np.arange(len(cross_C)), count_C)
        s_Q = s_P[cross_C][c_Q] + 1 + np.arange(int(count_C.sum())) - first_C[c_Q]
        p_Q = cross_C[c_Q]
        length_Q = np.minimum(upto_P[p_Q], room_upto_R[s_Q]) - room_upto_R[s_Q - 1]
        real_Q = length_Q > 0
        nz_P = np.concatenate([nz_P, nz_P[p_Q[real_Q]]])
        s_P = np.concatenate([s_P, s_Q[real_Q]])
        length_P = np.concatenate([length_P, length_Q[real_Q]])
    fwd_GN.ravel()[hosted_R[s_P] * N + nz_P % N] += length_P  # (slot, source) pieces are distinct
    return _transpose(fwd_GN)


def _transpose(x: np.ndarray) -> np.ndarray:
    """A contiguous transposed copy of a 2-D array: torch's blocked copy for large ones (NumPy's is several times
    slower once the array leaves the cache), NumPy's for small ones (torch's call costs more)."""
    if x.size < _TORCH_TRANSPOSE_SIZE:
        return np.ascontiguousarray(x.T)
    return torch.from_numpy(x).t().contiguous().numpy()


_TORCH_TRANSPOSE_SIZE = 1 << 15


# --- capacity -------------------------------------------------------------------------------------------------

def gshard_capacity(counts_NE: Tensor, cf: float) -> Tensor:
    """GShard / DeepSpeed capacity per expert, ceil(cf · tokens · k / E) with tokens · k = Σ counts. [E]"""
    cf = check_cf(cf)
    counts_NE = check_counts(counts_NE)
    E = counts_NE.shape[1]
    return torch.full((E,), math.ceil(cf * int(counts_NE.sum()) / E - 1e-9), dtype=torch.long)


def symi_capacity(counts_NE: Tensor, placement_NS: Tensor, cf: float) -> Tensor:
    """SYMI's capacity per expert, slot_capacity · r_e with slot_capacity = ceil(cf · tokens · k / (s·N)). [E]

    (SYMI is top-1, where tokens = pairs; for top-k we count pairs, so cf = 1 still means a balanced load fits.)
    """
    cf = check_cf(cf)
    counts_NE = check_counts(counts_NE, placement_NS.shape[0])
    table = replica_table(placement_NS, counts_NE.shape[1])
    slot_capacity = math.ceil(cf * int(counts_NE.sum()) / placement_NS.numel() - 1e-9)
    return slot_capacity * table.replicas_E


def apply_capacity(counts_NE: Tensor, capacity_E: Tensor) -> Tensor:
    """Pairs dropped per (source, expert) when expert e accepts at most capacity_E[e] pairs. LongTensor[N, E].

    Expert e keeps min(C_e, capacity_e) pairs, shared by the sources in proportion to their pairs of e
    (exact integer split, :func:`~lrmoe.checks.apportion`): which source loses pairs depends on counts alone.
    """
    counts_NE = check_counts(counts_NE)
    N, E = counts_NE.shape
    if capacity_E.shape != (E,):
        raise ValueError(f"capacity_E has shape {tuple(capacity_E.shape)}, expected ({E},)")
    if bool((capacity_E < 0).any()):
        raise ValueError(f"capacity_E must be non-negative, got min {int(capacity_E.min())}")
    counts = counts_NE.numpy()
    kept_E = np.minimum(counts.sum(0), capacity_E.detach().cpu().long().numpy())
    kept_EN = apportion_rows_array(kept_E, np.ascontiguousarray(counts.T))
    return torch.from_numpy(counts - kept_EN.T)


# --- backward -------------------------------------------------------------------------------------------------

def _capped_moves(want_K: np.ndarray, from_K: np.ndarray, to_K: np.ndarray, excess_N: np.ndarray,
                  spare_N: np.ndarray) -> np.ndarray:
    """Scale wanted moves down so no source rank sheds more than its excess and no destination takes more than
    its spare: x_k = min(want, ⌊want·excess/asked_from⌋, ⌊want·spare/asked_to⌋), exact integers."""
    N = len(excess_N)
    asked_from_N = np.maximum(np.bincount(from_K, weights=want_K, minlength=N).astype(np.int64), 1)
    asked_to_N = np.maximum(np.bincount(to_K, weights=want_K, minlength=N).astype(np.int64), 1)
    by_from = want_K * excess_N[from_K] // asked_from_N[from_K]
    by_to = want_K * spare_N[to_K] // asked_to_N[to_K]
    return np.minimum(want_K, np.minimum(by_from, by_to))


def _sum_into(index_K: np.ndarray, value_K: np.ndarray, size: int) -> np.ndarray:
    return np.bincount(index_K, weights=value_K, minlength=size).astype(np.int64)


def route_backward(fwd_NG: Tensor, placement_NS: Tensor, cap_N: Tensor, rounds: int = 2) -> Tensor:
    """Move retained pairs above a rank's cap to other replicas of the same expert. LongTensor[F, 4].

    Rows (src, from_slot, to_slot, count), sorted, one per distinct triple. ``fwd_NG`` holds the pairs that
    are retained before any trimming. Pairs stay where their forward ran unless their rank is above its cap;
    only that excess moves, and only into spare room (cap - load) of other ranks:
    1. to the replica on the pair's home (source) rank: it holds the input row already;
    2. then ``rounds`` times, each slot's remaining excess spread over its expert's replicas on ranks with
       spare room, in proportion to that room (the least loaded take most); sources in rank order.
    A destination is the first slot of the expert on that rank.
    """
    N, G = fwd_NG.shape
    if placement_NS.numel() != G or placement_NS.shape[0] != N:
        raise ValueError(f"fwd_NG has shape {tuple(fwd_NG.shape)} but placement_NS has shape "
                         f"{tuple(placement_NS.shape)}")
    if cap_N.shape != (N,):
        raise ValueError(f"cap_N has shape {tuple(cap_N.shape)}, expected ({N},)")
    return backward_on(fwd_NG, lambda: replica_table(placement_NS, int(placement_NS.max()) + 1), cap_N, rounds)


def backward_on(fwd_NG: Tensor, table, cap_N: Tensor, rounds: int = 2) -> Tensor:
    """:func:`route_backward` with the placement's table (or a callable building it, only when pairs move)."""
    N, G = fwd_NG.shape
    fwd = fwd_NG.detach().cpu().long().numpy()
    cap = cap_N.detach().cpu().long().numpy()
    load_N = fwd.sum(0).reshape(N, G // N).sum(1)
    excess_N, spare_N = np.maximum(load_N - cap, 0), np.maximum(cap - load_N, 0)
    if not excess_N.any() or not spare_N.any():
        return torch.zeros(0, 4, dtype=torch.long)
    if callable(table):
        table = table()
    return torch.from_numpy(_route_backward(fwd, table, excess_N, spare_N, rounds))


def _route_backward(fwd_NG: np.ndarray, table: ReplicaTable, excess_N: np.ndarray, spare_N: np.ndarray,
                    rounds: int) -> np.ndarray:
    N, G = fwd_NG.shape
    expert_G, rank_G = table.expert_G.numpy(), table.rank_G.numpy()
    expert_U, rank_U, first_slot_U = table.expert_U.numpy(), table.rank_U.numpy(), table.first_slot_U.numpy()
    units_E = np.bincount(expert_U, minlength=table.num_experts)
    unit_start_E = np.cumsum(units_E) - units_E
    # edges: slot g on an over-cap rank -> unit v of g's expert on another rank with spare room
    fwd_G = fwd_NG.sum(0)
    g_L = np.flatnonzero((excess_N[rank_G] > 0) & (expert_G >= 0) & (fwd_G > 0))
    fan_L = units_E[expert_G[g_L]]
    g_K = np.repeat(g_L, fan_L)
    v_K = np.repeat(unit_start_E[expert_G[g_L]], fan_L) + np.arange(len(g_K)) - np.repeat(np.cumsum(fan_L) - fan_L,
                                                                                          fan_L)
    from_K, to_K = rank_G[g_K], rank_U[v_K]
    edge = (spare_N[to_K] > 0) & (to_K != from_K)
    g_K, v_K, from_K, to_K = g_K[edge], v_K[edge], from_K[edge], to_K[edge]
    if not len(g_K):
        return np.zeros((0, 4), dtype=np.int64)
    # 1. home replicas: pairs of source n on slot g may go to g's expert on rank n
    home_K = _capped_moves(fwd_NG[to_K, g_K], from_K, to_K, excess_N, spare_N)
    excess_N = excess_N - _sum_into(from_K, home_K, N)
    spare_N = spare_N - _sum_into(to_K, home_K, N)
    taken_NG = _sum_into(to_K * G + g_K, home_K, N * G).reshape(N, G)
    left_G = fwd_G - taken_NG.sum(0)
    # 2. proportional to spare room, a few rounds
    moved_K = np.zeros_like(home_K)
    for _ in range(rounds):
        live_K = (spare_N[to_K] > 0) & (excess_N[from_K] > 0)
        if not live_K.any():
            break
        weight_K = spare_N[to_K] * live_K
        live_G = _sum_into(g_K, weight_K, G) > 0
        want_K = apportion_array(np.minimum(left_G * live_G, excess_N[rank_G]), weight_K, g_K)
        step_K = _capped_moves(want_K, from_K, to_K, excess_N, spare_N)
        moved_K += step_K
        excess_N = excess_N - _sum_into(from_K, step_K, N)
        spare_N = spare_N - _sum_into(to_K, step_K, N)
        left_G = left_G - _sum_into(g_K, step_K, G)
    rows = [np.stack([to_K, g_K, first_slot_U[v_K], home_K], 1)]
    if moved_K.any():
        rows.append(_attribute_sources(fwd_NG - taken_NG, g_K, first_slot_U[v_K], moved_K))
    rows = np.concatenate(rows)
    rows = rows[rows[:, 3] > 0]
    key = (rows[:, 0] * G + rows[:, 1]) * G + rows[:, 2]
    key_F, inverse = np.unique(key, return_inverse=True)
    count_F = _sum_into(inverse.ravel(), rows[:, 3], len(key_F))
    return np.stack([key_F // (G * G), key_F // G % G, key_F % G, count_F], 1)


def _attribute_sources(avail_NG: np.ndarray, g_K: np.ndarray, to_slot_K: np.ndarray,
                       moved_K: np.ndarray) -> np.ndarray:
    """Rows (src, g, to, count) for moves of `moved_K` pairs out of slot g_K: the pairs of each slot are taken
    in source order (north-west corner between sources and the slot's moves, with a final 'stays' bucket)."""
    N, G = avail_NG.shape
    slots = np.unique(g_K)
    # supply: (slot, source) in slot-major order; demand: the slot's moves in edge order, then what stays
    supply_XN = avail_NG[:, slots].T
    slot_of_move = np.searchsorted(slots, g_K)
    stays = supply_XN.sum(1) - _sum_into(slot_of_move, moved_K, len(slots))
    demand_slot = np.concatenate([slot_of_move, np.arange(len(slots))])
    by_slot = np.argsort(demand_slot, kind="stable")  # a slot's moves in edge order, then its 'stays'
    demand = np.concatenate([moved_K, stays])[by_slot]
    demand_to = np.concatenate([to_slot_K, np.full(len(slots), -1)])[by_slot]
    supply_cum, demand_cum = np.cumsum(supply_XN.ravel()), np.cumsum(demand)
    cuts = np.sort(np.concatenate([supply_cum, demand_cum]))
    starts = np.concatenate([[0], cuts[:-1]])
    length = cuts - starts
    supply_i = np.searchsorted(supply_cum, starts, side="right")
    demand_i = np.minimum(np.searchsorted(demand_cum, starts, side="right"), len(demand) - 1)
    real = (length > 0) & (demand_to[demand_i] >= 0)
    supply_i, demand_i, length = supply_i[real], demand_i[real], length[real]
    return np.stack([supply_i % N, slots[supply_i // N], demand_to[demand_i], length], 1)
