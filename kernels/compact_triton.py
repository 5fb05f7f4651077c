"""Triton kernels of the compaction: a row scatter-copy (pack) and a gather-reduce over the k pairs of a token
(unpack). Both write every output element from exactly one program with a fixed summation order and no atomics,
so results are bit-identical run to run.

Imported lazily by :mod:`lrmoe.kernels.compact` (``TRITON_INTERPRET`` must be set before this import to
interpret). Written to the triton 3.6 API. Every load and store is masked: in the interpreter an out-of-bounds
write corrupts the process. Arithmetic is done in float32 (float64 for float64 data): the interpreter gets
bf16 arithmetic wrong, and float32 sums keep bf16 combines accurate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import acc_dtype, check_kernel_mode, kernel_is_interpreted


# src_XD [X, D] -> dst_MD [M, D]: for r < R with pos_R[r] >= 0,
#   dst[pos[r]] = scale[r] * src[r // src_div]            (a plain copy without HAS_SCALE)
#   dot[r]      = <src[r // src_div], other[pos[r]]>       (with COMPUTE_DOT; 0 where pos[r] < 0)
@triton.jit
def _scatter_rows_kernel(src_ptr, dst_ptr, pos_ptr, scale_ptr, other_ptr, dot_ptr,
                         R, D, src_div, stride_src, stride_dst, stride_other,
                         HAS_SCALE: tl.constexpr, COMPUTE_DOT: tl.constexpr, F64: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = r < R
    pos = tl.load(pos_ptr + r, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (pos >= 0)
    src_row = (r // src_div).to(tl.int64)
    if F64:  # the arithmetic dtype: float64 for float64 data, else float32
        dot = tl.zeros([BLOCK_R], dtype=tl.float64)
    else:
        dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + r, mask=valid, other=0.0).to(dot.dtype)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = valid[:, None] & (d[None, :] < D)
        x = tl.load(src_ptr + src_row[:, None] * stride_src + d[None, :], mask=m, other=0.0)
        if HAS_SCALE:
            out = (x.to(dot.dtype) * scale[:, None]).to(dst_ptr.dtype.element_ty)
        else:
            out = x.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + pos[:, None] * stride_dst + d[None, :], out, mask=m)
        if COMPUTE_DOT:
            o = tl.load(other_ptr + pos[:, None] * stride_other + d[None, :], mask=m, other=0.0)
            dot += tl.sum(x.to(dot.dtype) * o.to(dot.dtype), axis=1)
    if COMPUTE_DOT:
        tl.store(dot_ptr + r, dot.to(dot_ptr.dtype.element_ty), mask=in_range)


# src_MD [M, D] -> dst_TD [T, D]: dst[t] = sum_{k < K, pos[t, k] >= 0} w[t, k] * src[pos[t, k]],
# summed in float32 (float64 with F64) in increasing k (without HAS_WEIGHT, w = 1).
@triton.jit
def _gather_reduce_kernel(src_ptr, dst_ptr, pos_ptr, w_ptr, T, D, stride_src, stride_dst,
                          K: tl.constexpr, HAS_WEIGHT: tl.constexpr, F64: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    t_in = t < T
    d_in = d < D
    if F64:
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(pos_ptr + t * K + k, mask=t_in, other=-1).to(tl.int64)
        valid = t_in & (pos >= 0)
        x = tl.load(src_ptr + pos[:, None] * stride_src + d[None, :], mask=valid[:, None] & d_in[None, :],
                    other=0.0).to(acc.dtype)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + t * K + k, mask=valid, other=0.0).to(acc.dtype)
            acc = acc + x * w[:, None]
        else:
            acc = acc + x
    out_ptrs = dst_ptr + t[:, None].to(tl.int64) * stride_dst + d[None, :]
    tl.store(out_ptrs, acc.to(dst_ptr.dtype.element_ty), mask=t_in[:, None] & d_in[None, :])


INTERPRETED = kernel_is_interpreted(_scatter_rows_kernel)

# One fixed config in the interpreter (autotuning fails there; small blocks keep programs few but cheap);
# a small autotuned set when compiled. Re-running a config is harmless: every output element is overwritten.
_INTERP_SCATTER = {"BLOCK_R": 16, "BLOCK_D": 32}
_INTERP_REDUCE = {"BLOCK_T": 16, "BLOCK_D": 32}
if INTERPRETED:
    _scatter_rows, _gather_reduce = _scatter_rows_kernel, _gather_reduce_kernel
else:  # pragma: no cover - needs a GPU
    _scatter_rows = triton.autotune(configs=[
        triton.Config({"BLOCK_R": r, "BLOCK_D": d}, num_warps=w)
        for r, d, w in [(4, 512, 4), (8, 1024, 8), (16, 256, 4)]
    ], key=["D"])(_scatter_rows_kernel)
    _gather_reduce = triton.autotune(configs=[
        triton.Config({"BLOCK_T": t, "BLOCK_D": d}, num_warps=w)
        for t, d, w in [(4, 512, 4), (8, 256, 4), (8, 512, 8)]
    ], key=["D"])(_gather_reduce_kernel)


def scatter_rows(src_XD: torch.Tensor, dst_MD: torch.Tensor, pos_R: torch.Tensor, src_div: int,
                 scale_R: torch.Tensor | None, other_MD: torch.Tensor | None, backend: str) -> torch.Tensor | None:
    """``dst[pos[r]] = scale[r] * src[r // src_div]`` in place, for ``pos[r] >= 0``; returns
    ``<src[r // src_div], other[pos[r]]>`` per r (in ``acc_dtype``) when ``other_MD`` is given, else None.
    The last dimension of ``src``, ``dst`` and ``other`` must be contiguous."""
    check_kernel_mode(backend, INTERPRETED)
    R, D = pos_R.numel(), dst_MD.shape[1]
    acc = acc_dtype(dst_MD.dtype)
    dot_R = torch.zeros(R, dtype=acc, device=dst_MD.device) if other_MD is not None else None
    if R == 0 or D == 0:
        return dot_R
    meta = _INTERP_SCATTER if INTERPRETED else {}
    grid = lambda m: (triton.cdiv(R, m["BLOCK_R"]),)  # noqa: E731
    _scatter_rows[grid](
        src_XD, dst_MD, pos_R, scale_R if scale_R is not None else pos_R,
        other_MD if other_MD is not None else dst_MD, dot_R if dot_R is not None else dst_MD,
        R, D, src_div, src_XD.stride(0), dst_MD.stride(0), other_MD.stride(0) if other_MD is not None else 0,
        HAS_SCALE=scale_R is not None, COMPUTE_DOT=other_MD is not None, F64=acc == torch.float64, **meta)
    return dot_R


def gather_reduce(src_MD: torch.Tensor, pos_TK: torch.Tensor, w_TK: torch.Tensor | None, out_dtype: torch.dtype,
                  backend: str) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * src[pos[t, k]]`` over ``pos >= 0`` (summed in increasing k, in
    ``acc_dtype``). ``pos_TK`` and ``w_TK`` contiguous; the last dimension of ``src`` contiguous."""
    check_kernel_mode(backend, INTERPRETED)
    T, K = pos_TK.shape
    D = src_MD.shape[1]
    if T == 0 or D == 0 or K == 0:
        return torch.zeros(T, D, dtype=out_dtype, device=src_MD.device)
    out_TD = torch.empty(T, D, dtype=out_dtype, device=src_MD.device)
    meta = _INTERP_REDUCE if INTERPRETED else {}
    grid = lambda m: (triton.cdiv(T, m["BLOCK_T"]), triton.cdiv(D, m["BLOCK_D"]))  # noqa: E731
    _gather_reduce[grid](
        src_MD, out_TD, pos_TK, w_TK if w_TK is not None else pos_TK, T, D, src_MD.stride(0), out_TD.stride(0),
        K=K, HAS_WEIGHT=w_TK is not None, F64=acc_dtype(out_dtype) == torch.float64,
        **meta)
    return out_TD
