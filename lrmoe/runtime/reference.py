"""The single-process reference MoE layer: the ground truth for the distributed layer, kernels and metrics.

Plain torch, clarity first: every routed token-expert pair is computed (a loop over experts), SwiGLU experts,
either router family, an optional shared expert. Pairs are numbered p = t·k + j (token t, its j-th choice).

Gradients "on a retained pair set": given ``keep_TK`` and ``scale_TK``, each pair's expert output enters as

    o' = o.detach() + keep · scale · (o - o.detach())

whose value is exactly o while its gradient is keep · scale times o's. So the expert weight gradients and
the input gradient through the experts come only from kept pairs (scaled), while the router gradient, which
reaches the gate g through y = Σ g·o', sees the true o of every pair and stays exact. The shared expert is
never masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lrmoe.config import ROUTER_FAMILIES, MoEConfig
from lrmoe.runtime.routing import expert_counts, route

EXPERT_WEIGHTS = ("w_router_ED", "bias_E", "w_gate_EDF", "w_up_EDF", "w_down_EFD")
SHARED_WEIGHTS = ("w_shared_gate_DF", "w_shared_up_DF", "w_shared_down_FD")


@dataclass(frozen=True)
class MoEAux:
    """What one forward exposes besides y: routing, and the per-pair quantities the metrics need."""

    logits_TE: torch.Tensor  # router logits
    scores_TE: torch.Tensor  # softmax probabilities or sigmoid scores of every expert
    idx_TK: torch.Tensor  # long: chosen experts
    gate_TK: torch.Tensor  # gate weights g (differentiable: the router gradient flows through them)
    o_TKD: torch.Tensor  # expert output of each pair, before the gate (detached values)
    h_norm_TK: torch.Tensor  # ||h|| of each pair, h = silu(x W_gate) * (x W_up) (detached)
    counts_E: torch.Tensor  # long: routed pairs per expert

    @property
    def num_pairs(self) -> int:
        return self.idx_TK.numel()


def swiglu(x_MD: torch.Tensor, w_gate_DF: torch.Tensor, w_up_DF: torch.Tensor,
           w_down_FD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One SwiGLU FFN: returns (y_MD, h_MF) with h = silu(x W_gate) * (x W_up), y = h W_down."""
    h_MF = F.silu(x_MD @ w_gate_DF) * (x_MD @ w_up_DF)
    return h_MF @ w_down_FD, h_MF


def retain_only(o_PD: torch.Tensor, keep_P: torch.Tensor, scale_P: torch.Tensor | None = None) -> torch.Tensor:
    """o with its value unchanged and its gradient multiplied by keep · scale per pair (row)."""
    weight_P = keep_P.to(o_PD.dtype) if scale_P is None else keep_P.to(o_PD.dtype) * scale_P.to(o_PD.dtype)
    frozen_PD = o_PD.detach()
    return frozen_PD + weight_P[:, None] * (o_PD - frozen_PD)


class ReferenceMoE(nn.Module):
    """A dense reference MoE layer holding w_router_ED, bias_E (buffer), stacked expert weights w_gate_EDF,
    w_up_EDF, w_down_EFD and, with ``shared_ffn > 0``, one shared SwiGLU expert (w_shared_*).

    Weights are drawn from ``seed`` in float64 (std 1/sqrt(fan-in)) and then cast to ``dtype``, so the same
    seed gives the same weights at every precision.
    """

    def __init__(self, hidden: int, expert_ffn: int, num_experts: int, top_k: int, router: str = "softmax_topk",
                 *, shared_ffn: int = 0, routed_scaling: float = 1.0, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        for name, value in (("hidden", hidden), ("expert_ffn", expert_ffn), ("num_experts", num_experts),
                            ("top_k", top_k)):
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
        if router not in ROUTER_FAMILIES:
            raise ValueError(f"router={router!r} is not one of {ROUTER_FAMILIES}")
        if shared_ffn < 0:
            raise ValueError(f"shared_ffn must be non-negative, got {shared_ffn}")
        if not routed_scaling > 0:
            raise ValueError(f"routed_scaling must be positive, got {routed_scaling}")
        self.hidden, self.expert_ffn, self.num_experts, self.top_k = hidden, expert_ffn, num_experts, top_k
        self.router, self.shared_ffn, self.routed_scaling, self.seed = router, shared_ffn, routed_scaling, seed
        gen = torch.Generator().manual_seed(seed)

        def draw(*shape: int, fan_in: int) -> nn.Parameter:
            w = torch.randn(*shape, generator=gen, dtype=torch.float64) / fan_in**0.5
            return nn.Parameter(w.to(dtype))

        E, D, Fw = num_experts, hidden, expert_ffn
        self.w_router_ED = draw(E, D, fan_in=D)
        self.w_gate_EDF = draw(E, D, Fw, fan_in=D)
        self.w_up_EDF = draw(E, D, Fw, fan_in=D)
        self.w_down_EFD = draw(E, Fw, D, fan_in=Fw)
        self.register_buffer("bias_E", torch.zeros(E, dtype=torch.float32))  # selection bias, no gradient
        if shared_ffn:
            self.w_shared_gate_DF = draw(D, shared_ffn, fan_in=D)
            self.w_shared_up_DF = draw(D, shared_ffn, fan_in=D)
            self.w_shared_down_FD = draw(shared_ffn, D, fan_in=shared_ffn)

    # -- construction and weight exchange ---------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: MoEConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> "ReferenceMoE":
        """The MoE layer of a model config. Several shared experts become one SwiGLU of their summed width
        (the same function: a SwiGLU is a sum over its hidden units)."""
        return cls(cfg.hidden, cfg.expert_ffn, cfg.num_experts, cfg.top_k, cfg.router,
                   shared_ffn=cfg.num_shared_experts * cfg.shared_ffn, routed_scaling=cfg.routed_scaling,
                   seed=seed, dtype=dtype)

    @property
    def weight_names(self) -> tuple[str, ...]:
        return EXPERT_WEIGHTS + (SHARED_WEIGHTS if self.shared_ffn else ())

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Every weight in the shared layout (names carry the shape suffixes), as detached copies."""
        return {name: getattr(self, name).detach().clone() for name in self.weight_names}

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy weights in the shared layout into this layer; names and shapes must match exactly."""
        expected = set(self.weight_names)
        if set(weights) != expected:
            raise ValueError(f"weights: expected keys {sorted(expected)}, got {sorted(weights)} "
                             f"(missing {sorted(expected - set(weights))}, extra {sorted(set(weights) - expected)})")
        with torch.no_grad():
            for name in self.weight_names:
                mine, theirs = getattr(self, name), weights[name]
                if tuple(theirs.shape) != tuple(mine.shape):
                    raise ValueError(f"weights[{name!r}] has shape {tuple(theirs.shape)}, expected {tuple(mine.shape)}")
                mine.copy_(theirs)

    # -- forward ----------------------------------------------------------------------------------------------
    def expert_outputs(self, x_TD: torch.Tensor, idx_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every pair's expert output o_PD (before the gate) and hidden norm h_norm_P, in pair order t·k + j."""
        K = idx_TK.shape[1]
        idx_P = idx_TK.reshape(-1)
        order_P = torch.argsort(idx_P, stable=True)  # expert-major order
        x_sorted = x_TD[order_P // K]
        counts = expert_counts(idx_P, self.num_experts).tolist()  # one host sync; a loop over experts
        outs, norms = [], []
        for e, x_rows in enumerate(torch.split(x_sorted, counts)):
            o_rows, h_rows = swiglu(x_rows, self.w_gate_EDF[e], self.w_up_EDF[e], self.w_down_EFD[e])
            outs.append(o_rows)
            norms.append(h_rows.detach().norm(dim=1))
        inverse_P = torch.argsort(order_P)  # the inverse permutation, back to pair order
        return torch.cat(outs)[inverse_P], torch.cat(norms)[inverse_P]

    def shared_output(self, x_TD: torch.Tensor) -> torch.Tensor | None:
        if not self.shared_ffn:
            return None
        return swiglu(x_TD, self.w_shared_gate_DF, self.w_shared_up_DF, self.w_shared_down_FD)[0]

    def forward(self, x_TD: torch.Tensor, keep_TK: torch.Tensor | None = None,
                scale_TK: torch.Tensor | None = None,
                pair_hook: Callable[[torch.Tensor, MoEAux], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, MoEAux]:
        """y_TD = Σ_j g_tj · o_tj + shared(x_t), and the aux record.

        ``keep_TK`` / ``scale_TK``: backward only through the kept pairs, scaled (module doc).
        ``pair_hook(o_PD, aux)``: applied to the per-pair outputs before the gate (e.g. the recalibration hook);
        it must not change their values. The two are exclusive.
        """
        if x_TD.dim() != 2 or x_TD.shape[1] != self.hidden:
            raise ValueError(f"x_TD must have shape [tokens, {self.hidden}], got {tuple(x_TD.shape)}")
        if keep_TK is not None and pair_hook is not None:
            raise ValueError("pass either keep_TK/scale_TK or pair_hook, not both")
        if scale_TK is not None and keep_TK is None:
            raise ValueError("scale_TK needs keep_TK")
        T, K, D = x_TD.shape[0], self.top_k, self.hidden
        for name, t in (("keep_TK", keep_TK), ("scale_TK", scale_TK)):
            if t is not None and tuple(t.shape) != (T, K):
                raise ValueError(f"{name} must have shape ({T}, {K}), got {tuple(t.shape)}")

        logits_TE = x_TD @ self.w_router_ED.T
        bias_E = self.bias_E if self.router == "sigmoid_bias" else None
        routed = route(logits_TE, self.router, K, bias_E=bias_E, scaling=self.routed_scaling)
        gate_TK = routed.weight_TK.to(x_TD.dtype)
        o_PD, h_norm_P = self.expert_outputs(x_TD, routed.idx_TK)
        aux = MoEAux(logits_TE=logits_TE, scores_TE=routed.scores_TE, idx_TK=routed.idx_TK, gate_TK=gate_TK,
                     o_TKD=o_PD.detach().view(T, K, D), h_norm_TK=h_norm_P.view(T, K),
                     counts_E=expert_counts(routed.idx_TK, self.num_experts))
        if keep_TK is not None:
            o_PD = retain_only(o_PD, keep_TK.reshape(-1), None if scale_TK is None else scale_TK.reshape(-1))
        if pair_hook is not None:
            o_PD = pair_hook(o_PD, aux)
        y_TD = (gate_TK[..., None] * o_PD.view(T, K, D)).sum(dim=1)
        shared_TD = self.shared_output(x_TD)
        if shared_TD is not None:
            y_TD = y_TD + shared_TD
        return y_TD, aux
