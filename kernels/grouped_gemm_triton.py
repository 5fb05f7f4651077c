"""Triton kernels of the variable-size grouped GEMM: one kernel for ``y = x_e @ w_e`` per group of rows (the
forward, and dX = dY @ w_e^T through a transposed view of w) and one for the weight gradient
``dw_e = x_e^T @ dy_e`` (a reduction over each group's own rows).

Groups are given as ``offs_E``, int32 cumulative end offsets of row ranges (group e owns rows
[offs[e-1], offs[e]), as ``torch.nn.functional.grouped_mm``); zero-size groups are allowed. Rows past
``offs[-1]`` get zeros. The tile -> group map is computed inside the kernel from ``offs`` (a prefix sum over
per-group tile counts), so a launch needs no host sync; programs past the last tile exit.

Imported lazily by :mod:`lrmoe.kernels.grouped_gemm`; written to the triton 3.6 API. All loads and stores are
masked, and row ranges are clamped to [0, M], so even malformed offsets cannot touch memory out of bounds.
Interpreted: one fixed config, operands upcast to float32 before ``tl.dot``. Compiled: autotuned, float32
accumulation, float32 inputs in IEEE precision unless torch allows TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import check_kernel_mode, kernel_is_interpreted


# x_MK [M, K] rows sorted by group, w_EKN [E, K, N] (any strides), offs_E [E] -> y_MN [M, N].
# Program pid covers tile (pid_m, pid_n) of a virtual [cdiv(M, BLOCK_M) + E, cdiv(N, BLOCK_N)] tile grid,
# swizzled by GROUP_M for L2 reuse; tile row pid_m is the (pid_m - first tile of e)-th BLOCK_M rows of group e.
@triton.jit
def _mac(acc, a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc += a @ b, upcasting the tiles first where the dtype needs it (the interpreter's bf16) and in IEEE
    precision where asked (fp32 / fp64 checks)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee", out_dtype=acc.dtype)
    else:
        acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
    return acc


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, M, N, K, E,
                       stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
                       BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                       UPCAST: tl.constexpr, IEEE: tl.constexpr, F64: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M) + E
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Tile map: tiles per group, their inclusive prefix sum, and the group whose tiles hold pid_m.
    e = tl.arange(0, BLOCK_E)
    e_in = e < E
    ends = tl.load(offs_ptr + e, mask=e_in, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=e_in & (e > 0), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), M)
    starts = tl.minimum(tl.maximum(starts, 0), ends)
    tiles = tl.where(e_in, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_end <= pid_m).to(tl.int32), 0)

    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = rn < N
    if expert < E:
        sel = e == expert
        row_start = tl.sum(tl.where(sel, starts, 0), 0)
        row_end = tl.sum(tl.where(sel, ends, 0), 0)
        first_tile = tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        rm = row_start + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rm < row_end
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rk[:, None] * stride_wk + rn[None, :] * stride_wn
        if F64:  # float64 operands accumulate in float64, everything else in float32
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = rk < K - k0
                a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = _mac(acc, a, b, UPCAST, IEEE)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        # Tail tiles: rows past the last group's end are zero.
        last_end = tl.sum(tl.where(e == E - 1, ends, 0), 0)
        rm = last_end + (pid_m - tl.sum(tiles, 0)) * BLOCK_M + tl.arange(0, BLOCK_M)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, zero, mask=(rm[:, None] < M) & col_ok[None, :])


# x_MK [M, K], dy_MN [M, N], offs_E [E] -> dw_EKN [E, K, N]: dw[e] = x[rows of e]^T @ dy[rows of e]
# (zeros for an empty group). Program (pid, e) covers tile (pid_k, pid_n) of dw[e] and loops over e's rows.
@triton.jit
def _grouped_mm_dw_kernel(x_ptr, dy_ptr, dw_ptr, offs_ptr, M, K, N,
                          stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
                          BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          UPCAST: tl.constexpr, IEEE: tl.constexpr, F64: tl.constexpr):
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_k = pid // num_pid_n
    pid_n = pid % num_pid_n
    end = tl.load(offs_ptr + expert)
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.minimum(tl.maximum(end, 0), M)
    start = tl.minimum(tl.maximum(start, 0), end)

    rk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = rk < K
    n_ok = rn < N
    rr = tl.arange(0, BLOCK_R)
    if F64:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float64)
    else:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + rr
        r_ok = rows < end
        a = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xm + rk[:, None] * stride_xk,
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R] = x_e^T tile
        b = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dym + rn[None, :] * stride_dyn,
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        acc = _mac(acc, a, b, UPCAST, IEEE)
    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_we + rk[:, None] * stride_wk + rn[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


INTERPRETED = kernel_is_interpreted(_grouped_mm_kernel)

# Interpreter: one small config (every program instance costs ~1 ms, autotuning fails there).
_INTERP_MM = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4}
_INTERP_DW = {"BLOCK_K": 16, "BLOCK_N": 16, "BLOCK_R": 16}

if INTERPRETED:
    _mm_launch, _dw_launch = _grouped_mm_kernel, _grouped_mm_dw_kernel
else:  # pragma: no cover - needs a GPU
    _even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
    _mm_launch = triton.autotune(configs=[
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for m, n, k, w, s in [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4)]
    ], key=["N", "K", "stride_xk", "stride_wn"])(_even_k(_grouped_mm_kernel))
    _dw_launch = triton.autotune(configs=[
        triton.Config({"BLOCK_K": k, "BLOCK_N": n, "BLOCK_R": r}, num_warps=w, num_stages=s)
        for k, n, r, w, s in [(128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4)]
    ], key=["K", "N"])(_grouped_mm_dw_kernel)


def _precision(dtype: torch.dtype) -> tuple[bool, bool]:
    """(UPCAST, IEEE): upcast 16-bit operands in the interpreter (its bf16 arithmetic is wrong); IEEE float32
    products unless torch allows TF32."""
    if INTERPRETED:
        return dtype in (torch.float16, torch.bfloat16), False
    return False, dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, backend: str) -> torch.Tensor:
    """``y[rows of e] = x[rows of e] @ w[e]``; zeros past ``offs[-1]``. ``offs_E`` int32, contiguous."""
    check_kernel_mode(backend, INTERPRETED)
    M, K = x_MK.shape
    E, _, N = w_EKN.shape
    y_MN = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if M == 0 or N == 0:
        return y_MN
    upcast, ieee = _precision(x_MK.dtype)
    block_e = triton.next_power_of_2(max(E, 1))
    grid = lambda m: ((triton.cdiv(M, m["BLOCK_M"]) + E) * triton.cdiv(N, m["BLOCK_N"]),)  # noqa: E731
    args = (x_MK, w_EKN, y_MN, offs_E, M, N, K, E, x_MK.stride(0), x_MK.stride(1), w_EKN.stride(0),
            w_EKN.stride(1), w_EKN.stride(2), y_MN.stride(0), y_MN.stride(1))
    if INTERPRETED:
        _mm_launch[grid](*args, BLOCK_E=block_e, EVEN_K=K % _INTERP_MM["BLOCK_K"] == 0, UPCAST=upcast, IEEE=ieee,
                         F64=x_MK.dtype == torch.float64, **_INTERP_MM)
    else:  # pragma: no cover
        _mm_launch[grid](*args, BLOCK_E=block_e, UPCAST=upcast, IEEE=ieee, F64=x_MK.dtype == torch.float64)
    return y_MN


def grouped_mm_dw(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_E: torch.Tensor, num_groups: int,
                  out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """``dw[e] = x[rows of e]^T @ dy[rows of e]`` for e < num_groups: [E, K, N], zeros for empty groups."""
    check_kernel_mode(backend, INTERPRETED)
    M, K = x_MK.shape
    N = dy_MN.shape[1]
    dw_EKN = torch.empty(num_groups, K, N, dtype=out_dtype, device=x_MK.device)
    if num_groups == 0 or K == 0 or N == 0:
        return dw_EKN
    upcast, ieee = _precision(x_MK.dtype)
    grid = lambda m: (triton.cdiv(K, m["BLOCK_K"]) * triton.cdiv(N, m["BLOCK_N"]), num_groups)  # noqa: E731
    args = (x_MK, dy_MN, dw_EKN, offs_E, M, K, N, x_MK.stride(0), x_MK.stride(1), dy_MN.stride(0),
            dy_MN.stride(1), dw_EKN.stride(0), dw_EKN.stride(1), dw_EKN.stride(2))
    meta = _INTERP_DW if INTERPRETED else {}
    _dw_launch[grid](*args, UPCAST=upcast, IEEE=ieee, F64=x_MK.dtype == torch.float64, **meta)
    return dw_EKN

