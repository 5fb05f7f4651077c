"""Routers of the two model families, the global-batch load-balancing loss and the aux-free bias update.

* ``softmax_topk`` (Qwen3-MoE): p = softmax(logits) over all experts, keep the top-k, renormalise.
* ``sigmoid_bias`` (GLM-4.5, DeepSeek-V3 style): s = sigmoid(logits); the top-k are chosen on s + bias (the bias
  steers selection only and gets no gradient); weights = chosen s / their sum, times a scaling factor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from lrmoe.config import ROUTER_FAMILIES


class RouterOutput(NamedTuple):
    idx_TK: torch.Tensor  # long [T, k]: chosen experts, in descending selection score
    weight_TK: torch.Tensor  # float [T, k]: gate weights of the chosen experts
    scores_TE: torch.Tensor  # float [T, E]: softmax probabilities or sigmoid scores of every expert


def route(logits_TE: torch.Tensor, family: str, top_k: int, bias_E: torch.Tensor | None = None,
          scaling: float = 1.0) -> RouterOutput:
    """Choose ``top_k`` experts per token and their gate weights, in the router family's form."""
    if logits_TE.dim() != 2:
        raise ValueError(f"logits_TE must be 2-D [tokens, experts], got shape {tuple(logits_TE.shape)}")
    num_experts = logits_TE.shape[1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    logits_TE = logits_TE.float()  # routing in fp32, as both reference implementations do
    if family == "softmax_topk":
        if bias_E is not None:
            raise ValueError("bias_E is only used by the 'sigmoid_bias' router family")
        scores_TE = torch.softmax(logits_TE, dim=-1)
        top_TK, idx_TK = torch.topk(scores_TE, top_k, dim=-1)
        weight_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
    elif family == "sigmoid_bias":
        scores_TE = torch.sigmoid(logits_TE)
        if bias_E is not None and bias_E.shape != (num_experts,):
            raise ValueError(f"bias_E must have shape ({num_experts},), got {tuple(bias_E.shape)}")
        choice_TE = scores_TE.detach() if bias_E is None else scores_TE.detach() + bias_E.float()
        _, idx_TK = torch.topk(choice_TE, top_k, dim=-1)
        top_TK = scores_TE.gather(1, idx_TK)
        weight_TK = top_TK / top_TK.sum(dim=-1, keepdim=True) * scaling
    else:
        raise ValueError(f"unknown router family {family!r}; known: {ROUTER_FAMILIES}")
    return RouterOutput(idx_TK, weight_TK, scores_TE)


def expert_counts(idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed pairs per expert, LongTensor [E]."""
    return torch.bincount(idx_TK.reshape(-1), minlength=num_experts)


def load_balancing_loss(scores_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int,
                        num_tokens: int | None = None) -> torch.Tensor:
    """Switch/GShard auxiliary loss E · Σ_e f_e · P_e, in its global-batch form.

    f_e is the fraction of routed pairs that went to expert e, computed from ``counts_E`` (pass counts summed over
    the global batch, i.e. all-reduced across data-parallel ranks, for the global-batch variant of Qwen3); P_e is
    the mean normalised router score of e over the local tokens (the differentiable part). ``num_tokens`` is the token
    count behind ``counts_E`` (defaults to the local count). The loss is 1 when routing is uniform.
    """
    num_experts = scores_TE.shape[1]
    if counts_E.shape != (num_experts,):
        raise ValueError(f"counts_E must have shape ({num_experts},), got {tuple(counts_E.shape)}")
    tokens = scores_TE.shape[0] if num_tokens is None else num_tokens
    if tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {tokens}")
    f_E = counts_E.to(scores_TE.dtype) / (tokens * top_k)
    # per-token normalisation: a no-op for softmax probabilities, turns sigmoid scores into a distribution
    p_E = (scores_TE / scores_TE.sum(dim=-1, keepdim=True)).mean(dim=0)
    return num_experts * torch.sum(f_E.detach() * p_E)


def update_expert_bias(bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float = 1e-3) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3 §2.1.2, used by GLM-4.5): nudge each expert's selection bias by
    ``rate`` towards the mean load: up when the expert is under-loaded, down when over-loaded. Returns a new
    tensor; ``counts_E`` should be the global counts of the step.

    A non-finite bias would steer every later selection while the loss stays finite (a NaN bias collapses routing
    onto a few experts), out of reach of the activation and gradient checks: a non-finite ``rate``, bias before or
    after the update raises ``ValueError`` (the same on every rank: the counts are global)."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate < 0:
        raise ValueError(f"the selection-bias update rate must be a finite non-negative number, got {rate!r}")
    _check_finite_bias(bias_E, "before the update")
    load_E = counts_E.to(torch.float64)
    new_E = bias_E + rate * torch.sign(load_E.mean() - load_E).to(bias_E.dtype)
    _check_finite_bias(new_E, f"after an update at rate {rate!r}")
    return new_E


def _check_finite_bias(bias_E: torch.Tensor, when: str) -> None:
    bad = (~torch.isfinite(bias_E)).nonzero().flatten()
    if len(bad):
        raise ValueError(f"the routers' selection bias is not finite {when} (experts {bad[:8].tolist()}"
                         f"{' ...' if len(bad) > 8 else ''} of {bias_E.numel()}): routing would collapse")
