"""Physical compaction: pack the kept token-expert pairs densely by (destination rank, expert), and the inverse
unpack with a weighted sum back to token order.

Pairs are numbered ``p = t * top_k + k`` (token t, its k-th routed expert), ``P = T * top_k``. A rows tensor
given to :func:`pack` holds either one row per pair ([P, D]) or one row per token ([T, D], each token's row
serving its top_k pairs, as MegaBlocks does); the row count says which.

:func:`compact_plan` reduces the routing once (integer bookkeeping, no gradients) to a :class:`CompactPlan`;
:func:`pack` and :func:`unpack` then move rows by it as often as needed (the forward dispatch, the backward
dispatch, the combine). The packed buffer is laid out per destination rank n, in increasing n:

    [ rows block of n: kept pairs, by expert ]  [ carry block of n: carried input rows, by expert ]

``expert`` is the grouping key inside a destination, an integer in [0, E): the caller chooses whether it is the
global expert id or the local slot index on the destination rank (the layer uses the local slot). Inside one
(destination, expert) group of the rows block, the pairs that also carry their input row come first, each
part in increasing pair index; the carry block holds those input rows in the same order, so the first
``carry_counts_NE[n, e]`` rows of group (n, e) line up one to one with the group's carried input rows. The
layout therefore follows from the counts alone, which every rank knows.

Positions come from exclusive prefix sums over the keep and carry masks in (destination, expert) order; the
Triton copy kernels then write each packed row (and each unpacked token row) from exactly one program, with no
atomics: results are bit-identical run to run, and the torch reference reproduces the kernels' arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .amp import amp_backward, amp_forward
from .dispatch import acc_dtype, choose_backend

SECTIONS = ("rows", "carry")


@dataclass(frozen=True)
class CompactPlan:
    """Where every kept pair's row (and carried input row) sits in the packed buffer, and the group sizes.

    M = packed rows (kept + carried), N = destinations, E = experts (groups) per destination, P = pairs.
    """

    num_dests: int  # N
    num_experts: int  # E, the grouping key's range within a destination
    top_k: int  # pairs per token: rows per token map to pairs t * top_k .. t * top_k + top_k - 1
    num_kept: int  # rows in the rows blocks
    num_carried: int  # rows in the carry blocks
    has_carry: bool  # built with a carry_P mask: pack() then needs carry rows
    pos_P: torch.Tensor  # [P] long: packed position of pair p's row, -1 where the pair was dropped
    carry_pos_P: torch.Tensor  # [P] long: packed position of pair p's carried input row, -1 where none
    pair_M: torch.Tensor  # [M] long: the pair each packed row belongs to (the index map)
    carry_M: torch.Tensor  # [M] bool: True where the packed row is a carried input row
    counts_NE: torch.Tensor  # [N, E] long: kept rows per (destination, expert)
    carry_counts_NE: torch.Tensor  # [N, E] long: carried input rows per (destination, expert)

    @property
    def num_pairs(self) -> int:
        return self.pos_P.numel()

    @property
    def num_tokens(self) -> int:
        return self.pos_P.numel() // self.top_k

    @property
    def num_packed(self) -> int:
        return self.num_kept + self.num_carried

    @property
    def splits_N(self) -> torch.Tensor:
        """[N] long: packed rows per destination (its rows block + carry block), for ``all_to_all_single``."""
        return self.counts_NE.sum(1) + self.carry_counts_NE.sum(1)

    @property
    def start_N(self) -> torch.Tensor:
        """[N] long: where each destination's part of the packed buffer begins."""
        return torch.cumsum(self.splits_N, 0) - self.splits_N

    @property
    def offs_NE(self) -> torch.Tensor:
        """[N, E] int32: cumulative end offsets of the experts inside each destination's rows block, counted
        from that block's start: the ``offs`` of a grouped GEMM over the block."""
        return torch.cumsum(self.counts_NE, 1).to(torch.int32)

    @property
    def carry_offs_NE(self) -> torch.Tensor:
        """[N, E] int32: the same for each destination's carry block, counted from that block's start."""
        return torch.cumsum(self.carry_counts_NE, 1).to(torch.int32)

    @property
    def offs_G(self) -> torch.Tensor:
        """[N * E] int32: cumulative end offsets of the (destination, expert) groups over the whole buffer, for
        a grouped GEMM straight over it (group g = n * E + e). Only without carried rows, which break the runs."""
        if self.num_carried:
            raise ValueError(f"offs_G: the plan carries {self.num_carried} input rows between the rows blocks; "
                             f"use offs_NE / carry_offs_NE per destination block")
        return torch.cumsum(self.counts_NE.flatten(), 0).to(torch.int32)

    def send_splits(self) -> list[int]:
        """``splits_N`` as Python ints (one host sync), the split sizes ``all_to_all_single`` takes."""
        return self.splits_N.tolist()


def _check_index(name: str, x: torch.Tensor, P: int, device: torch.device) -> None:
    if x.dim() != 1 or x.numel() != P:
        raise ValueError(f"{name} must be 1-D with {P} entries like dest_P, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, dest_P on {device}")


def compact_plan(dest_P: torch.Tensor, expert_P: torch.Tensor, num_dests: int, num_experts: int,
                 keep_P: torch.Tensor | None = None, carry_P: torch.Tensor | None = None,
                 top_k: int = 1) -> CompactPlan:
    """Plan the packing of pairs by (destination ``dest_P``, expert ``expert_P``), keeping ``keep_P`` (all
    when None) and carrying the input row of the pairs in ``carry_P`` (a subset of the kept ones).

    Two host syncs (input validation, the packed size); integer work only, under ``no_grad``.
    """
    if not isinstance(num_dests, int) or num_dests < 1:
        raise ValueError(f"num_dests must be a positive int, got {num_dests!r}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if dest_P.dim() != 1:
        raise ValueError(f"dest_P must be 1-D, got shape {tuple(dest_P.shape)}")
    P, device = dest_P.numel(), dest_P.device
    if P % top_k:
        raise ValueError(f"the number of pairs ({P}) must be a multiple of top_k={top_k}")
    for name, x in [("dest_P", dest_P), ("expert_P", expert_P)]:
        _check_index(name, x, P, device)
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
    for name, x in [("keep_P", keep_P), ("carry_P", carry_P)]:
        if x is not None:
            _check_index(name, x, P, device)
            if x.dtype != torch.bool:
                raise ValueError(f"{name} must be a bool mask, got dtype {x.dtype}")
    with torch.no_grad():
        dest_P, expert_P = dest_P.long(), expert_P.long()
        keep_P = torch.ones(P, dtype=torch.bool, device=device) if keep_P is None else keep_P
        has_carry = carry_P is not None
        carry_P = torch.zeros(P, dtype=torch.bool, device=device) if carry_P is None else carry_P
        bad = torch.stack([((dest_P < 0) | (dest_P >= num_dests)).any(), ((expert_P < 0) |
                           (expert_P >= num_experts)).any(), (carry_P & ~keep_P).any()]).tolist()
        if bad[0]:
            raise ValueError(f"dest_P holds values outside [0, num_dests={num_dests}): "
                             f"min {int(dest_P.min())}, max {int(dest_P.max())}")
        if bad[1]:
            raise ValueError(f"expert_P holds values outside [0, num_experts={num_experts}): "
                             f"min {int(expert_P.min())}, max {int(expert_P.max())}")
        if bad[2]:
            raise ValueError(f"carry_P flags {int((carry_P & ~keep_P).sum())} pairs that keep_P drops; "
                             f"only kept pairs can carry their input row")
        N, E = num_dests, num_experts
        group_P = dest_P * E + expert_P
        # Sort key (destination, expert, carried first, pair index); dropped pairs last. Stable -> deterministic.
        key_P = torch.where(keep_P, group_P * 2 + (~carry_P).long(), torch.full_like(group_P, 2 * N * E))
        order_P = torch.argsort(key_P, stable=True)
        keep_s, carry_s, dest_s = keep_P[order_P], carry_P[order_P], dest_P[order_P]
        counts_NE = torch.bincount(group_P[keep_P], minlength=N * E).view(N, E)
        carry_counts_NE = torch.bincount(group_P[carry_P], minlength=N * E).view(N, E)
        kept_N, carried_N = counts_NE.sum(1), carry_counts_NE.sum(1)
        splits_N = kept_N + carried_N
        start_N = torch.cumsum(splits_N, 0) - splits_N
        # Exclusive prefix sums over the masks, in sorted order, give each row's rank within its destination.
        kept_rank = torch.cumsum(keep_s.long(), 0) - keep_s.long() - (torch.cumsum(kept_N, 0) - kept_N)[dest_s]
        carry_rank = (torch.cumsum(carry_s.long(), 0) - carry_s.long()
                      - (torch.cumsum(carried_N, 0) - carried_N)[dest_s])
        pos_s = torch.where(keep_s, start_N[dest_s] + kept_rank, -1)
        carry_pos_s = torch.where(carry_s, start_N[dest_s] + kept_N[dest_s] + carry_rank, -1)
        pos_P = torch.empty_like(pos_s).scatter_(0, order_P, pos_s)
        carry_pos_P = torch.empty_like(carry_pos_s).scatter_(0, order_P, carry_pos_s)
        num_kept, num_carried = torch.stack([kept_N.sum(), carried_N.sum()]).tolist()
        M = num_kept + num_carried
        # The index map: kept pairs lead the sorted order; each writes its row's (and carried row's) position.
        # Entries without a carried row write to a spare slot M, cut off afterwards.
        head = slice(0, num_kept)
        carry_dst = torch.where(carry_s[head], carry_pos_s[head], M)
        pair_M = torch.empty(M + 1, dtype=torch.long, device=device)
        pair_M.scatter_(0, pos_s[head], order_P[head]).scatter_(0, carry_dst, order_P[head])
        carry_M = torch.zeros(M + 1, dtype=torch.bool, device=device).scatter_(0, carry_dst, True)
        pair_M, carry_M = pair_M[:M], carry_M[:M]
    return CompactPlan(num_dests=N, num_experts=E, top_k=top_k, num_kept=int(num_kept),
                       num_carried=int(num_carried), has_carry=has_carry, pos_P=pos_P, carry_pos_P=carry_pos_P,
                       pair_M=pair_M, carry_M=carry_M, counts_NE=counts_NE, carry_counts_NE=carry_counts_NE)


# --------------------------------------------------------------------------------------------------------------
# Row movement: a torch reference and the Triton kernels behind one pair of functions.


def _scatter_rows_torch(src_XD, dst_MD, plan, section, scale_P, other_MD):
    """Reference of ``compact_triton.scatter_rows`` for one section of the plan, the same arithmetic, driven
    by the index map: every packed row of the section gathers its pair's row (one pass when it is the whole
    buffer)."""
    acc, div = acc_dtype(dst_MD.dtype), plan.num_pairs // max(src_XD.shape[0], 1)
    if section == "rows" and plan.num_carried == 0:
        pos_S = None  # the section is the whole buffer, in order
        pair_S = plan.pair_M
    else:
        pos_S = ((plan.carry_M if section == "carry" else ~plan.carry_M)).nonzero().squeeze(1)
        pair_S = plan.pair_M[pos_S]
    row_S = pair_S if div == 1 else torch.div(pair_S, div, rounding_mode="floor")
    if pos_S is None and scale_P is None and other_MD is None and src_XD.dtype == dst_MD.dtype:
        torch.index_select(src_XD, 0, row_S, out=dst_MD)  # the plain pack: one gather straight into place
        return None
    x_SD = src_XD.index_select(0, row_S)
    rows_SD = x_SD if scale_P is None else (x_SD.to(acc) * scale_P[pair_S].to(acc)[:, None])
    rows_SD = rows_SD.to(dst_MD.dtype)
    if pos_S is None:
        dst_MD.copy_(rows_SD)
    else:
        dst_MD.index_copy_(0, pos_S, rows_SD)
    if other_MD is None:
        return None
    other_SD = other_MD if pos_S is None else other_MD.index_select(0, pos_S)
    dot_P = torch.zeros(plan.num_pairs, dtype=acc, device=dst_MD.device)
    dot_P[pair_S] = (x_SD.to(acc) * other_SD.to(acc)).sum(1)  # pairs are unique within a section
    return dot_P


def _gather_reduce_torch(src_MD, pos_TK, w_TK, out_dtype):
    """Reference of ``compact_triton.gather_reduce``: sum in increasing k, zero rows where no pair. Gathers from
    the rows plus one zero row (where pos = -1 points), one pass per k."""
    T, K = pos_TK.shape
    dt = acc_dtype(out_dtype)
    M, D = src_MD.shape
    if K == 0:
        return torch.zeros(T, D, dtype=out_dtype, device=src_MD.device)
    padded_MD = torch.cat([src_MD, src_MD.new_zeros(1, D)])
    index_TK = torch.where(pos_TK >= 0, pos_TK, M)
    acc_TD = None
    for k in range(K):  # K = top_k, a handful: the loop is over pair slots, not rows
        x_TD = padded_MD.index_select(0, index_TK[:, k]).to(dt)
        if w_TK is not None:
            x_TD = x_TD.mul_(w_TK[:, k].to(dt)[:, None])
        acc_TD = x_TD if acc_TD is None else acc_TD.add_(x_TD)
    return acc_TD.to(out_dtype)


def _scatter_rows(src_XD, dst_MD, plan, section, scale_P, other_MD, backend):
    """``dst[pos(p)] = scale[p] * src[row(p)]`` for the pairs with a row in ``section``; with ``other_MD`` also
    returns ``<src[row(p)], other[pos(p)]>`` per pair (0 for pairs without a row). row(p) = p // (P / rows)."""
    if backend == "torch":
        return _scatter_rows_torch(src_XD, dst_MD, plan, section, scale_P, other_MD)
    from . import compact_triton

    pos_P = plan.pos_P if section == "rows" else plan.carry_pos_P
    return compact_triton.scatter_rows(src_XD, dst_MD, pos_P, plan.num_pairs // max(src_XD.shape[0], 1), scale_P,
                                       other_MD, backend)


def _gather_reduce(src_MD, pos_TK, w_TK, out_dtype, backend):
    """``out[t] = sum_k w[t, k] * src[pos[t, k]]`` over ``pos >= 0``, summed in increasing k."""
    if backend == "torch":
        return _gather_reduce_torch(src_MD, pos_TK, w_TK, out_dtype)
    from . import compact_triton

    return compact_triton.gather_reduce(src_MD, pos_TK.contiguous(), None if w_TK is None else w_TK.contiguous(),
                                        out_dtype, backend)


def _row_view(pos_P: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``pos_P`` as [rows, pairs per row]: each row's pairs, for a tensor with one row per token or per pair."""
    return pos_P.view(num_rows, pos_P.numel() // num_rows) if num_rows else pos_P.view(0, 1)


class _Pack(torch.autograd.Function):
    """Forward: pack. Backward: the unpack of the packed gradient onto the rows (and carry rows)."""

    @staticmethod
    @amp_forward
    def forward(ctx, rows_XD, carry_YD, plan: CompactPlan, backend: str):
        ctx.plan, ctx.backend = plan, backend
        ctx.shapes = (rows_XD.shape[0], None if carry_YD is None else carry_YD.shape[0])
        packed_MD = torch.empty(plan.num_packed, rows_XD.shape[1], dtype=rows_XD.dtype, device=rows_XD.device)
        rows_XD = rows_XD.contiguous()
        _scatter_rows(rows_XD, packed_MD, plan, "rows", None, None, backend)
        if carry_YD is not None:
            carry_YD = carry_YD.contiguous()
            _scatter_rows(carry_YD, packed_MD, plan, "carry", None, None, backend)
        return packed_MD

    @staticmethod
    @amp_backward
    @once_differentiable
    def backward(ctx, grad_MD):
        plan, backend = ctx.plan, ctx.backend
        grad_MD = grad_MD.contiguous()
        X, Y = ctx.shapes
        grad_rows = _gather_reduce(grad_MD, _row_view(plan.pos_P, X), None, grad_MD.dtype, backend) \
            if ctx.needs_input_grad[0] else None
        grad_carry = _gather_reduce(grad_MD, _row_view(plan.carry_pos_P, Y), None, grad_MD.dtype, backend) \
            if Y is not None and ctx.needs_input_grad[1] else None
        return grad_rows, grad_carry, None, None


class _Unpack(torch.autograd.Function):
    """Forward: weighted gather-sum of one section back to rows. Backward: pack the gradient (scaled by the
    weights) into that section, and the weights' gradient as row dot products."""

    @staticmethod
    @amp_forward
    def forward(ctx, packed_MD, weight_P, plan: CompactPlan, section: str, num_rows: int, backend: str):
        ctx.plan, ctx.section, ctx.backend = plan, section, backend
        packed_MD = packed_MD.contiguous()
        # The packed rows are kept only for the weights' gradient (the router's), the weights only to scale.
        need_rows = weight_P is not None and ctx.needs_input_grad[1]
        ctx.save_for_backward(packed_MD if need_rows else None, weight_P)
        ctx.packed_meta = (packed_MD.shape, packed_MD.dtype, packed_MD.device)
        pos_XK = _row_view(plan.pos_P if section == "rows" else plan.carry_pos_P, num_rows)
        w_XK = None if weight_P is None else weight_P.view(pos_XK.shape)
        return _gather_reduce(packed_MD, pos_XK, w_XK, packed_MD.dtype, backend)

    @staticmethod
    @amp_backward
    @once_differentiable
    def backward(ctx, grad_XD):
        packed_MD, weight_P = ctx.saved_tensors
        plan = ctx.plan
        grad_XD = grad_XD.contiguous()
        need_packed, need_weight = ctx.needs_input_grad[0], weight_P is not None and ctx.needs_input_grad[1]
        shape, dtype, device = ctx.packed_meta
        whole = ctx.section == "rows" and plan.num_carried == 0  # the section fills the buffer
        grad_packed = (torch.empty if whole else torch.zeros)(shape, dtype=dtype, device=device)  # others get 0
        dot_P = _scatter_rows(grad_XD, grad_packed, plan, ctx.section, weight_P,
                              packed_MD if need_weight else None, ctx.backend)
        grad_weight = dot_P.to(weight_P.dtype) if need_weight else None
        return (grad_packed if need_packed else None), grad_weight, None, None, None, None


def _rows_count(name: str, x: torch.Tensor, plan: CompactPlan) -> int:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, D], got shape {tuple(x.shape)}")
    if x.shape[0] not in (plan.num_pairs, plan.num_tokens):
        raise ValueError(f"{name} has {x.shape[0]} rows; the plan has {plan.num_pairs} pairs and "
                         f"{plan.num_tokens} tokens (top_k={plan.top_k}): give one row per pair or per token")
    return x.shape[0]


def pack(rows_XD: torch.Tensor, plan: CompactPlan, carry_YD: torch.Tensor | None = None,
         backend: str | None = None) -> torch.Tensor:
    """Packed rows [M, D] in the plan's layout: kept pairs' rows of ``rows_XD`` and, in the carry blocks, the
    carried pairs' rows of ``carry_YD`` (both one row per pair or per token). Differentiable (backward: unpack)."""
    _rows_count("rows_XD", rows_XD, plan)
    if carry_YD is not None:
        _rows_count("carry_YD", carry_YD, plan)
        if carry_YD.shape[1] != rows_XD.shape[1] or carry_YD.dtype != rows_XD.dtype:
            raise ValueError(f"carry_YD {tuple(carry_YD.shape)} {carry_YD.dtype} must match rows_XD's width and "
                             f"dtype {tuple(rows_XD.shape)} {rows_XD.dtype}: they share one buffer")
        if carry_YD.device != rows_XD.device:
            raise ValueError(f"carry_YD is on {carry_YD.device}, rows_XD on {rows_XD.device}")
    elif plan.num_carried:
        raise ValueError(f"the plan carries {plan.num_carried} input rows: pass carry_YD")
    if rows_XD.device != plan.pos_P.device:
        raise ValueError(f"rows_XD is on {rows_XD.device}, the plan on {plan.pos_P.device}")
    choice = choose_backend(rows_XD, backend=backend)
    return _Pack.apply(rows_XD, carry_YD, plan, choice.name)


def unpack(packed_MD: torch.Tensor, plan: CompactPlan, weight_P: torch.Tensor | None = None,
           section: str = "rows", per_token: bool = True, backend: str | None = None) -> torch.Tensor:
    """Scatter-add a packed buffer back: ``out[row] = sum over its kept pairs p of weight_P[p] * packed[pos(p)]``,
    with one output row per token (``per_token``; the token's top_k pairs summed in increasing k) or per pair.
    ``section`` picks the rows blocks or the carry blocks. Pairs without a row contribute zero.
    Differentiable in ``packed_MD`` and ``weight_P`` (backward: a pack of the gradient, and row dot products)."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {SECTIONS}, got {section!r}")
    if packed_MD.dim() != 2 or packed_MD.shape[0] != plan.num_packed:
        raise ValueError(f"packed_MD must be [{plan.num_packed}, D] for this plan, got shape "
                         f"{tuple(packed_MD.shape)}")
    if packed_MD.device != plan.pos_P.device:
        raise ValueError(f"packed_MD is on {packed_MD.device}, the plan on {plan.pos_P.device}")
    if weight_P is not None:
        if weight_P.shape != (plan.num_pairs,) or not weight_P.dtype.is_floating_point:
            raise ValueError(f"weight_P must be a float tensor of shape ({plan.num_pairs},), got "
                             f"{tuple(weight_P.shape)} {weight_P.dtype}")
        if weight_P.device != packed_MD.device:
            raise ValueError(f"weight_P is on {weight_P.device}, packed_MD on {packed_MD.device}")
        weight_P = weight_P.contiguous()
    num_rows = plan.num_tokens if per_token else plan.num_pairs
    choice = choose_backend(packed_MD, backend=backend)
    return _Unpack.apply(packed_MD, weight_P, plan, section, num_rows, choice.name)
