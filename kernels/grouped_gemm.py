"""Variable-size grouped GEMM for expert computation, differentiable, and the SwiGLU expert MLP on top of it.

``grouped_mm(x_MK, w_EKN, offs_E)``: rows of ``x`` sorted by expert; expert e owns rows
[offs[e-1], offs[e]) (``offs_E`` int32 cumulative end offsets, as ``torch.nn.functional.grouped_mm``; empty
experts allowed) and gets ``y[rows] = x[rows] @ w[e]``. Rows past ``offs[-1]`` come out zero. The backward
computes dX = dY @ w_e^T (the same grouped kernel on a transposed view of w) and dW_e = X_e^T @ dY_e (a
reduction over each expert's own rows), both variable-size.

Backends (see :mod:`lrmoe.kernels.dispatch`): Triton kernels (compiled or interpreted), or the torch reference:
one ``torch.mm`` per non-empty expert after one host sync of the offsets on CPU, and torch's own grouped GEMM
for bf16 on CUDA. Offsets are value-checked on CPU only (a check on CUDA would cost a host sync; the Triton
kernels clamp every row range, so bad offsets there give wrong numbers, never out-of-bounds memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .amp import amp_backward, amp_forward
from .dispatch import choose_backend


def _check_offs(x_MK: torch.Tensor, offs_E: torch.Tensor, num_groups: int) -> torch.Tensor:
    if offs_E.dim() != 1 or offs_E.numel() != num_groups:
        raise ValueError(f"offs_E must be 1-D with one entry per group ({num_groups}), got shape "
                         f"{tuple(offs_E.shape)}")
    if offs_E.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offs_E must hold int32 cumulative end offsets, got dtype {offs_E.dtype}")
    if offs_E.device != x_MK.device:
        raise ValueError(f"offs_E is on {offs_E.device}, x on {x_MK.device}")
    if offs_E.device.type == "cpu" and num_groups:
        M = x_MK.shape[0]
        steps = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
        if bool((steps < 0).any()) or int(offs_E[-1]) > M:
            raise ValueError(f"offs_E must be non-decreasing from >= 0 to <= M={M} (cumulative end offsets), "
                             f"got {offs_E.tolist()[:16]}{' ...' if num_groups > 16 else ''}")
    return offs_E.to(torch.int32).contiguous()


def _check_operands(x_MK: torch.Tensor, w_EKN: torch.Tensor) -> None:
    if x_MK.dim() != 2:
        raise ValueError(f"x_MK must be 2-D [rows, K], got shape {tuple(x_MK.shape)}")
    if w_EKN.dim() != 3:
        raise ValueError(f"w_EKN must be 3-D [groups, K, N], got shape {tuple(w_EKN.shape)}")
    if x_MK.shape[1] != w_EKN.shape[1]:
        raise ValueError(f"x_MK has K={x_MK.shape[1]} columns but w_EKN has K={w_EKN.shape[1]}")
    if x_MK.dtype != w_EKN.dtype or not x_MK.dtype.is_floating_point:
        raise ValueError(f"x_MK and w_EKN must share one floating dtype, got {x_MK.dtype} and {w_EKN.dtype}")
    if x_MK.device != w_EKN.device:
        raise ValueError(f"x_MK is on {x_MK.device}, w_EKN on {w_EKN.device}")


# --------------------------------------------------------------------------------------------------------------
# torch reference


def _torch_grouped_ok(x: torch.Tensor, n: int) -> bool:
    """Whether torch's own grouped GEMM takes these operands (CUDA bf16, 16-byte aligned rows)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")
            and x.shape[1] % 8 == 0 and n % 8 == 0)


def _mm_torch(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    M, N = x_MK.shape[0], w_EKN.shape[2]
    if _torch_grouped_ok(x_MK, N) and w_EKN.shape[0] > 0:
        y_MN = F.grouped_mm(x_MK, w_EKN, offs=offs_E)
        return y_MN.masked_fill_(torch.arange(M, device=y_MN.device)[:, None] >= offs_E[-1], 0)
    y_MN = torch.zeros(M, N, dtype=x_MK.dtype, device=x_MK.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):  # one host sync; a loop over experts, not rows
        if end > start:
            torch.mm(x_MK[start:end], w_EKN[e], out=y_MN[start:end])
        start = end
    return y_MN


def _mm_dw_torch(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_E: torch.Tensor, num_groups: int) -> torch.Tensor:
    K, N = x_MK.shape[1], dy_MN.shape[1]
    if _torch_grouped_ok(x_MK, N) and num_groups > 0:
        dw_EKN = F.grouped_mm(x_MK.t(), dy_MN, offs=offs_E)
        sizes_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
        return dw_EKN.masked_fill_((sizes_E == 0)[:, None, None], 0)
    dw_EKN = torch.zeros(num_groups, K, N, dtype=x_MK.dtype, device=x_MK.device)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            torch.mm(x_MK[start:end].t(), dy_MN[start:end], out=dw_EKN[e])
        start = end
    return dw_EKN


def _mm(x_MK, w_EKN, offs_E, backend):
    if backend == "torch":
        return _mm_torch(x_MK, w_EKN, offs_E)
    from . import grouped_gemm_triton

    return grouped_gemm_triton.grouped_mm(x_MK, w_EKN, offs_E, backend)


def _mm_dw(x_MK, dy_MN, offs_E, num_groups, backend):
    if backend == "torch":
        return _mm_dw_torch(x_MK, dy_MN, offs_E, num_groups)
    from . import grouped_gemm_triton

    return grouped_gemm_triton.grouped_mm_dw(x_MK, dy_MN, offs_E, num_groups, x_MK.dtype, backend)


class GroupedMM(torch.autograd.Function):
    """``y = grouped_mm(x, w, offs)``; backward dX = grouped_mm(dY, w^T, offs), dW_e = X_e^T dY_e."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MK, w_EKN, offs_E, backend: str):
        ctx.save_for_backward(x_MK, w_EKN, offs_E)
        ctx.backend = backend
        return _mm(x_MK, w_EKN, offs_E, backend)

    @staticmethod
    @amp_backward
    @once_differentiable
    def backward(ctx, dy_MN):
        x_MK, w_EKN, offs_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx_MK = _mm(dy_MN, w_EKN.transpose(1, 2), offs_E, ctx.backend) if ctx.needs_input_grad[0] else None
        dw_EKN = _mm_dw(x_MK, dy_MN, offs_E, w_EKN.shape[0], ctx.backend) if ctx.needs_input_grad[1] else None
        return dx_MK, dw_EKN, None, None


def grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor,
               backend: str | None = None) -> torch.Tensor:
    """Grouped GEMM ``y[rows of e] = x[rows of e] @ w[e]`` -> [M, N]; differentiable in x and w.

    ``w_EKN`` may be any strided view (e.g. ``w_ENK.transpose(-2, -1)``); ``x_MK`` rows must have unit stride
    in K for the Triton path's speed, not for correctness."""
    _check_operands(x_MK, w_EKN)
    offs_E = _check_offs(x_MK, offs_E, w_EKN.shape[0])
    choice = choose_backend(x_MK, backend=backend)
    if choice.name == "triton" and x_MK.dtype == torch.float64:
        raise ValueError("grouped_mm: float64 has no compiled Triton configuration (its tiles overflow shared "
                         "memory); use backend='torch'")
    return GroupedMM.apply(x_MK, w_EKN, offs_E, choice.name)


def grouped_mm_dw(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_E: torch.Tensor, num_groups: int,
                  backend: str | None = None) -> torch.Tensor:
    """The weight gradient of a grouped GEMM on its own: ``dW_e = x[rows of e]^T @ dy[rows of e]`` -> [E, K, N]
    (zero for an empty group). For callers that write their own backward, e.g. the recalibrated expert backward,
    which runs it on the retained rows only."""
    if x_MK.dim() != 2 or dy_MN.dim() != 2 or x_MK.shape[0] != dy_MN.shape[0]:
        raise ValueError(f"grouped_mm_dw: x_MK and dy_MN must be 2-D with the same rows, got {tuple(x_MK.shape)} "
                         f"and {tuple(dy_MN.shape)}")
    offs_E = _check_offs(x_MK, offs_E, num_groups)
    choice = choose_backend(x_MK, backend=backend)
    return _mm_dw(x_MK.contiguous(), dy_MN.contiguous(), offs_E, num_groups, choice.name)


def swiglu_experts(x_MD: torch.Tensor, w_gate_EDF: torch.Tensor, w_up_EDF: torch.Tensor,
                   w_down_EFD: torch.Tensor, offs_E: torch.Tensor, backend: str | None = None,
                   return_hidden: bool = False, return_activations: bool = False):
    """The routed experts' SwiGLU on rows sorted by expert: ``y = (silu(x W_gate) * (x W_up)) W_down`` per
    expert, three grouped GEMMs -> y [M, D] (rows past ``offs[-1]`` zero). With ``return_hidden`` also the
    hidden activations h [M, F] (the recalibration metric M2 uses ||h|| per pair); with ``return_activations``
    (y, gate [M, F], up [M, F], h [M, F]), what a hand-written backward saves."""
    if w_gate_EDF.dim() != 3 or w_gate_EDF.shape != w_up_EDF.shape:
        raise ValueError(f"w_gate_EDF {tuple(w_gate_EDF.shape)} and w_up_EDF {tuple(w_up_EDF.shape)} must be "
                         f"3-D [E, D, F] and match")
    E, D, F_ = w_gate_EDF.shape
    if tuple(w_down_EFD.shape) != (E, F_, D):
        raise ValueError(f"w_down_EFD must be [E, F, D] = {(E, F_, D)} for w_gate_EDF {(E, D, F_)}, "
                         f"got {tuple(w_down_EFD.shape)}")
    gate_MF = grouped_mm(x_MD, w_gate_EDF, offs_E, backend=backend)
    up_MF = grouped_mm(x_MD, w_up_EDF, offs_E, backend=backend)
    h_MF = F.silu(gate_MF) * up_MF
    y_MD = grouped_mm(h_MF, w_down_EFD, offs_E, backend=backend)
    if return_activations:
        return y_MD, gate_MF, up_MF, h_MF
    return (y_MD, h_MF) if return_hidden else y_MD
