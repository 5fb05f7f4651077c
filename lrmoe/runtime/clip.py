"""Gradient clipping over the whole expert-parallel model: the global L2 norm of the dense and the expert
gradients, computed and applied as ``torch.nn.utils.clip_grad_norm_`` would on the dense single-process model
(DESIGN.md §3.9).

Before the optimizer step the two halves are held differently. The dense gradients are all-reduced, the same on
every rank: each rank adds their squares itself, so they count once, not once per rank. An expert's gradient is a
partial sum on each of its replicas until the replica-gradient sum, after which rank n holds shard n of every
expert's summed gradient (§3.4-3.5): every rank adds the squares of its shards and one all-reduce adds the ranks',
so each expert counts once, whichever ranks host it. Then every gradient, dense and expert shard, is multiplied by
torch's coefficient min(1, max_norm / (norm + 1e-6)), before the dense optimizer's and the experts' Adam steps.

The norm is that of the gradient the optimizer would apply: the mean loss over ranks and micro-batches by default
(the layers' ``grad_scale``); with a retention budget (ρ < 1) the recalibrated gradient of the retained pairs.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["CLIP_EPS", "clip_grad_norm_"]

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard in max_norm / (norm + eps)


def clip_grad_norm_(dense_params: Iterable[torch.Tensor], layers, max_norm: float,
                    grad_scale: float | None = None) -> torch.Tensor:
    """Clip the dense gradients and every layer's expert gradients to a global L2 norm of ``max_norm`` (module doc);
    return the norm before clipping (an fp32 scalar, fp64 when a gradient is fp64; the same on every rank). Collective.

    Call it after the dense gradients are reduced (identical on every rank, already scaled) and before the steps:
    it runs each :class:`~lrmoe.runtime.layer.EPMoELayer`'s replica-gradient sum and collection
    (``collect_expert_grads(grad_scale)``, default the layer's mean-loss scale), so step the experts with
    ``expert_step(collected=True)``."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    layers = list(layers)
    shards = [layer.collect_expert_grads(grad_scale) for layer in layers]
    grads = [p.grad for p in dense_params if p.grad is not None]
    if not shards and not grads:
        return torch.zeros(())
    device = shards[0].device if shards else grads[0].device
    # squares summed in fp32 (bf16/fp16/fp32 gradients), in fp64 when any gradient is fp64 (no narrowing)
    acc = torch.float64 if any(t.dtype == torch.float64 for t in [*grads, *shards]) else torch.float32
    expert_sq = torch.zeros((), dtype=acc, device=device)
    for shard_EW in shards:
        expert_sq += torch.linalg.vector_norm(shard_EW, dtype=acc) ** 2
    if layers and layers[0].num_ranks > 1:  # each EP rank's shards of every expert: each expert once (the DP
        dist.all_reduce(expert_sq, group=layers[0].store.ep_group)  # copies hold the same summed shards)
    dense_sq = sum((torch.linalg.vector_norm(g, dtype=acc).to(device) ** 2 for g in grads),
                   torch.zeros((), dtype=acc, device=device))  # the same on every rank: once
    norm = (dense_sq + expert_sq).sqrt()
    coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    for g in [*grads, *shards]:
        g.mul_(coef.to(g.device, g.dtype))
    return norm
