"""The raw expert computation of the EP layer, forward and backward by hand, on rows sorted by slot: SwiGLU
experts as variable-size grouped GEMMs (``lrmoe.kernels.grouped_gemm``), no dispatch. :class:`SwiGLUExperts` is the
seam the expert exchange (:mod:`lrmoe.runtime.exchange`) computes through.

The forward keeps its activations (:class:`Activations`) so the backward of the rows that stay on their slot
needs no recomputation; the backward runs on whichever rows it is given (only the retained ones), and rows whose
forward ran elsewhere recompute their activations with :func:`swiglu_forward` first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lrmoe.kernels.grouped_gemm import grouped_mm, grouped_mm_dw, swiglu_experts


@dataclass
class Activations:
    """A SwiGLU's activations on rows sorted by slot: input x, pre-activations gate and up, and h."""

    x_MD: Tensor
    gate_MF: Tensor
    up_MF: Tensor
    h_MF: Tensor

    def __iter__(self):
        return iter((self.x_MD, self.gate_MF, self.up_MF, self.h_MF))


def slot_offsets(counts_S: Tensor, device) -> Tensor:
    """int32 cumulative end offsets of the slots' rows (the ``offs`` of a grouped GEMM)."""
    return torch.cumsum(counts_S, 0).to(torch.int32).to(device)


def swiglu_forward(x_MD: Tensor, weights, offs_S: Tensor, backend: str | None) -> tuple[Tensor, Activations]:
    """y = (silu(x W_gate) ⊙ (x W_up)) W_down per slot, as three grouped GEMMs; returns y and the activations.
    ``weights`` = (w_gate_SDF, w_up_SDF, w_down_SFD)."""
    y_MD, gate_MF, up_MF, h_MF = swiglu_experts(x_MD, *weights, offs_S, backend=backend, return_activations=True)
    return y_MD, Activations(x_MD, gate_MF, up_MF, h_MF)


def swiglu_backward(act: Activations, dy_MD: Tensor, weights, offs_S: Tensor, backend: str | None,
                    input_grad: bool = True) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
    """The SwiGLU backward from saved activations: (dx or None, dW_gate, dW_up, dW_down), all variable-size
    grouped GEMMs over the rows given."""
    w_gate_SDF, w_up_SDF, w_down_SFD = weights
    S = w_gate_SDF.shape[0]
    dw_down = grouped_mm_dw(act.h_MF, dy_MD, offs_S, S, backend)
    dh_MF = grouped_mm(dy_MD, w_down_SFD.transpose(1, 2), offs_S, backend=backend)
    sig_MF = torch.sigmoid(act.gate_MF)
    dup_MF = dh_MF * (act.gate_MF * sig_MF)
    dgate_MF = dh_MF * act.up_MF * sig_MF * (1 + act.gate_MF * (1 - sig_MF))  # silu' = σ(1 + x(1 − σ))
    dw_gate = grouped_mm_dw(act.x_MD, dgate_MF, offs_S, S, backend)
    dw_up = grouped_mm_dw(act.x_MD, dup_MF, offs_S, S, backend)
    dx_MD = None
    if input_grad:
        dx_MD = grouped_mm(dgate_MF, w_gate_SDF.transpose(1, 2), offs_S, backend=backend)
        dx_MD = dx_MD + grouped_mm(dup_MF, w_up_SDF.transpose(1, 2), offs_S, backend=backend)
    return dx_MD, dw_gate, dw_up, dw_down


class SwiGLUExperts:
    """The expert computation seam of the exchange: the local slots' SwiGLU experts on slot-sorted rows.

    ``forward(x_MD, slots_SW, offs_S) -> (y_MD, activations)`` and ``backward(act, dy_MD, slots_SW, offs_S,
    input_grad) -> (dx_MD or None, d_slots_SW)``, with the slots' weights flat [S, 3·D·F] as the replica store holds
    them. Another expert type (or a test's identity expert) is another object with these two calls.
    """

    def __init__(self, hidden: int, ffn: int, backend: str | None = None):
        self.hidden, self.ffn, self.backend = hidden, ffn, backend

    def weights(self, slots_SW: Tensor):
        """(w_gate_SDF, w_up_SDF, w_down_SFD) views of the flat slot weights."""
        DF = self.hidden * self.ffn
        S = slots_SW.shape[0]
        return (slots_SW[:, :DF].view(S, self.hidden, self.ffn), slots_SW[:, DF:2 * DF].view(S, self.hidden, self.ffn),
                slots_SW[:, 2 * DF:].view(S, self.ffn, self.hidden))

    def forward(self, x_MD: Tensor, slots_SW: Tensor, offs_S: Tensor) -> tuple[Tensor, Activations]:
        return swiglu_forward(x_MD, self.weights(slots_SW), offs_S, self.backend)

    def backward(self, act: Activations, dy_MD: Tensor, slots_SW: Tensor, offs_S: Tensor,
                 input_grad: bool = True) -> tuple[Tensor | None, Tensor]:
        dx_MD, dw_gate, dw_up, dw_down = swiglu_backward(act, dy_MD, self.weights(slots_SW), offs_S, self.backend,
                                                         input_grad)
        S = slots_SW.shape[0]
        d_slots_SW = torch.cat([dw_gate.reshape(S, -1), dw_up.reshape(S, -1), dw_down.reshape(S, -1)], 1)
        return dx_MD, d_slots_SW.to(slots_SW.dtype)
