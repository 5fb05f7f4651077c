"""Which token-expert pairs keep their backward: top-quota (biased) or quota-sized unbiased sampling.

Pairs are split into groups (in the layer: one group per (source rank, expert)), each with an integer quota.

* ``"topk"`` keeps exactly the ``min(quota, size)`` highest-scoring pairs of each group (ties go to the lower
  pair index) with scale 1: the lowest-variance choice, biased towards high scores.
* ``"unbiased"`` gives pair i the inclusion probability p_i = min(1, c · s_i), with c set per group by
  water-filling so that Σ p_i = quota exactly; pairs with p_i = 1 are kept outright and the others are drawn by
  systematic sampling (one uniform start per group, walked along the group's cumulative probabilities), which
  keeps *exactly* the quota every draw while including each pair with probability exactly p_i. Kept pairs are
  scaled by 1/p_i, so the expected scaled sum over the kept pairs equals the sum over all pairs
  (Horvitz-Thompson). That needs a quota of at least one in every group that has pairs: a group with
  quota 0 drops everything, and its share of the sum is lost.

  Zero scores would get p = 0 and could never be drawn. Each group's scores are therefore mixed with the
  uniform distribution: s_i ← s_i + ``uniform_mix`` · mean(s of the group) (all-zero groups become uniform).
  The default mix, 1e-3, moves probabilities by a negligible amount while bounding every 1/p_i.

Everything is vectorised over groups: one stable sort of an int64 key (group, descending score) and segment
prefix sums, no Python loop over groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("topk", "unbiased")
DEFAULT_UNIFORM_MIX = 1e-3


@dataclass(frozen=True)
class Selection:
    """The outcome of one selection over P pairs."""

    keep_P: torch.Tensor  # bool [P]: the pair's backward is kept
    scale_P: torch.Tensor  # float [P]: gradient multiplier of kept pairs (1 or 1/p), 0 for dropped ones
    prob_P: torch.Tensor  # float [P]: inclusion probability (topk: 1 kept, 0 dropped)


def check_groups(group_P: torch.Tensor, quota_Q: torch.Tensor, where: str = "") -> None:
    """Refuse a grouping unless group_P is int [P] in [0, Q) and quota_Q is int [Q] >= 0 (one host sync).
    ``where`` prefixes the names in the messages (e.g. ``"Recalibration."``)."""
    integer = (torch.int32, torch.int64)
    if group_P.dim() != 1 or group_P.dtype not in integer:
        raise ValueError(f"{where}group_P must be a 1-D integer tensor, got shape {tuple(group_P.shape)} "
                         f"dtype {group_P.dtype}")
    if quota_Q.dim() != 1 or quota_Q.dtype not in integer:
        raise ValueError(f"{where}quota_Q must be a 1-D integer tensor, got shape {tuple(quota_Q.shape)} "
                         f"dtype {quota_Q.dtype}")
    zero = quota_Q.new_zeros(())
    q_min = quota_Q.min() if quota_Q.numel() else zero
    lo, hi = torch.aminmax(group_P) if group_P.numel() else (zero, zero)
    q_min, lo, hi = torch.stack([q_min.to(torch.int64), lo.to(torch.int64), hi.to(torch.int64)]).tolist()
    if q_min < 0:
        raise ValueError(f"{where}quota_Q must be non-negative, got minimum {q_min}")
    if group_P.numel() and (lo < 0 or hi >= quota_Q.numel()):
        raise ValueError(f"{where}group_P values must lie in [0, {quota_Q.numel()}) (one quota per group), "
                         f"got range [{lo}, {hi}]")


def _check(scores_P: torch.Tensor, group_P: torch.Tensor, quota_Q: torch.Tensor, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if scores_P.dim() != 1 or not scores_P.is_floating_point():
        raise ValueError(f"scores_P must be a 1-D float tensor, got shape {tuple(scores_P.shape)} "
                         f"dtype {scores_P.dtype}")
    if group_P.shape != scores_P.shape:
        raise ValueError(f"group_P must be an integer tensor of shape {tuple(scores_P.shape)}, got shape "
                         f"{tuple(group_P.shape)} dtype {group_P.dtype}")
    check_groups(group_P, quota_Q)
    if scores_P.numel():
        finite, low = torch.stack([torch.isfinite(scores_P).all(), scores_P.min() < 0]).tolist()
        if not finite:
            raise ValueError("scores_P must be finite, found NaN or inf")
        if mode == "unbiased" and low:
            raise ValueError(f"scores_P must be non-negative in the unbiased mode (p ∝ score), "
                             f"got minimum {float(scores_P.min())}")


def _float_order_key(values: torch.Tensor) -> torch.Tensor:
    """An int64 in [0, 2^32) that orders like the float32 value (IEEE bits, negatives' magnitude bits flipped)."""
    bits = (values.to(torch.float32) + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # branch-free: torch.where is slow on one CPU thread
    return bits.to(torch.int64) + 2**31


def group_order(scores_P: torch.Tensor, group_P: torch.Tensor) -> torch.Tensor:
    """Permutation sorting the pairs by group, then by descending score, then by ascending index."""
    if scores_P.dtype in (torch.float32, torch.float16, torch.bfloat16):
        # one stable int64 sort: group in the high 32 bits, the reversed score order in the low 32 bits
        key_P = (group_P.to(torch.int64) << 32) | (2**32 - 1 - _float_order_key(scores_P))
        return torch.sort(key_P, stable=True).indices
    # float64 does not fit beside the group in 64 bits: two stable sorts (score descending, then group)
    by_score = torch.sort(scores_P, descending=True, stable=True).indices
    return by_score.index_select(0, torch.sort(group_P.index_select(0, by_score), stable=True).indices)


def select(scores_P: torch.Tensor, group_P: torch.Tensor, quota_Q: torch.Tensor, mode: str = "topk",
           generator: torch.Generator | None = None, *, uniform_mix: float = DEFAULT_UNIFORM_MIX) -> Selection:
    """Keep at most ``quota_Q[q]`` pairs of every group q, by score, in the given ``mode`` (see the module doc).

    scores_P: float [P] (non-negative in the unbiased mode); group_P: int [P] in [0, Q); quota_Q: int [Q].
    ``generator`` drives the unbiased mode's draws (one uniform per group); ``uniform_mix`` is its zero-score
    guard. The kept count of group q is exactly min(quota_Q[q], size of q) in both modes.
    """
    _check(scores_P, group_P, quota_Q, mode)
    if not uniform_mix >= 0:
        raise ValueError(f"uniform_mix must be non-negative, got {uniform_mix}")
    num_pairs, num_groups = scores_P.numel(), quota_Q.numel()
    group_P = group_P.to(torch.int64)
    perm_P = group_order(scores_P, group_P)
    # Z: the pairs in sorted order (a local letter), each group a contiguous segment [start_Q, end_Q)
    group_Z = group_P.index_select(0, perm_P)
    size_Q = torch.bincount(group_P, minlength=num_groups)
    end_Q = torch.cumsum(size_Q, 0)
    start_Q = end_Q - size_Q
    rank_Z = torch.arange(num_pairs, device=scores_P.device) - start_Q.index_select(0, group_Z)
    quota_Q = torch.minimum(quota_Q.to(torch.int64), size_Q)
    quota_Z = quota_Q.index_select(0, group_Z)

    if mode == "topk":
        keep_P = torch.empty(num_pairs, dtype=torch.bool, device=scores_P.device)
        keep_P.scatter_(0, perm_P, rank_Z < quota_Z)
        weight_P = keep_P.to(scores_P.dtype)
        return Selection(keep_P=keep_P, scale_P=weight_P, prob_P=weight_P.clone())

    s_Z = scores_P.index_select(0, perm_P).to(torch.float64)
    prob_Z = _inclusion_probabilities(s_Z, group_Z, rank_Z, start_Q, end_Q, quota_Q, uniform_mix)
    keep_Z = _systematic_sample(prob_Z, group_Z, rank_Z, start_Q, end_Q, quota_Z, generator)
    keep_P = torch.empty_like(keep_Z).scatter_(0, perm_P, keep_Z)
    prob_P = torch.empty_like(prob_Z).scatter_(0, perm_P, prob_Z)
    # kept: 1/p; dropped: 0 (a finite 1/p times 0, never 0/0)
    scale_P = keep_P.to(torch.float64) / prob_P.clamp_min(torch.finfo(torch.float64).tiny)
    return Selection(keep_P=keep_P, scale_P=scale_P.to(scores_P.dtype), prob_P=prob_P.to(scores_P.dtype))


def _segment_cumsum(x_Z: torch.Tensor, start_Q: torch.Tensor, end_Q: torch.Tensor):
    """Prefix sums of x_Z with a leading 0, and each segment's total (segments are contiguous)."""
    prefix = torch.cat([x_Z.new_zeros(1), torch.cumsum(x_Z, 0)])
    return prefix, prefix.index_select(0, end_Q) - prefix.index_select(0, start_Q)


def _inclusion_probabilities(s_Z, group_Z, rank_Z, start_Q, end_Q, quota_Q, uniform_mix) -> torch.Tensor:
    """Water-filling p = min(1, c·s) with Σp = quota per group; s_Z sorted descending inside each group.

    With r pairs capped at 1, c = (q - r) / tail_r, where tail_r sums the scores from position r on. The pairs
    capped are the positions r < q with (q - r)·s_r >= tail_r: a prefix of the group, because
    tail_r - (q - r)·s_r is non-decreasing in r for r < q.
    """
    size_Q = end_Q - start_Q
    _, total_Q = _segment_cumsum(s_Z, start_Q, end_Q)
    # uniform mix, so no pair has p = 0; all-zero groups become uniform
    add_Q = uniform_mix * total_Q / size_Q.clamp_min(1) + (total_Q <= 0).to(torch.float64)
    s_Z = s_Z + add_Q.index_select(0, group_Z)
    prefix, _ = _segment_cumsum(s_Z, start_Q, end_Q)
    tail_Z = prefix.index_select(0, end_Q).index_select(0, group_Z) - prefix[:-1]
    quota_Z = quota_Q.index_select(0, group_Z)
    capped_Z = (rank_Z < quota_Z) & ((quota_Z - rank_Z).to(torch.float64) * s_Z >= tail_Z)
    num_capped_Q = torch.zeros_like(quota_Q).index_add_(0, group_Z, capped_Z.to(torch.int64))
    num_capped_Q = torch.where(quota_Q >= size_Q, size_Q, num_capped_Q)  # q = size: every pair, exactly
    # c from the tail at the first uncapped position (groups with nothing left to draw get c = 0)
    at_Q = (start_Q + num_capped_Q).clamp_max(max(s_Z.numel() - 1, 0))
    tail_at_Q = tail_Z.index_select(0, at_Q) if s_Z.numel() else s_Z.new_zeros(quota_Q.numel())
    left_Q = (quota_Q - num_capped_Q).clamp_min(0).to(torch.float64)
    c_Q = left_Q / tail_at_Q.clamp_min(torch.finfo(torch.float64).tiny)
    prob_Z = (c_Q.index_select(0, group_Z) * s_Z).clamp_(max=1.0)
    return torch.maximum(prob_Z, (rank_Z < num_capped_Q.index_select(0, group_Z)).to(torch.float64))


def _systematic_sample(prob_Z, group_Z, rank_Z, start_Q, end_Q, quota_Z, generator) -> torch.Tensor:
    """Systematic sampling along each group's cumulative probabilities: exactly the quota, P(keep i) = p_i.

    With u ~ U[0, 1) per group and U_i the group's cumulative probability up to and including pair i, pair i
    is kept when floor(U_i + u) > floor(U_{i-1} + u). Pairs with p = 1 span a whole unit and are always kept.
    The group's last U is pinned to its quota so rounding can neither add nor lose a pair.
    """
    num_groups = start_Q.numel()
    prefix, _ = _segment_cumsum(prob_Z, start_Q, end_Q)
    within_Z = prefix[1:] - prefix.index_select(0, start_Q).index_select(0, group_Z)  # U_i
    quota_f_Z = quota_Z.to(torch.float64)
    last_Z = (rank_Z == (end_Q - start_Q - 1).index_select(0, group_Z)).to(torch.float64)
    within_Z = torch.minimum(within_Z, quota_f_Z)
    within_Z = within_Z + last_Z * (quota_f_Z - within_Z)
    u_Q = torch.rand(num_groups, generator=generator, dtype=torch.float64, device=prob_Z.device)
    k_Z = torch.floor(within_Z + u_Q.index_select(0, group_Z))
    k_prev_Z = torch.roll(k_Z, 1) * (rank_Z > 0).to(torch.float64)  # before a group's first pair: floor(u) = 0
    return (k_Z > k_prev_Z) | (prob_Z >= 1.0)
