"""The data-parallel half of the expert-parallel model: the dense gradients' all-reduce, which carries the
non-finite check of every layer, and the check that every rank starts from the same weights.

The dense parameters (routers, shared experts, attention, embeddings) are replicated: every rank holds them whole
and steps them with the same all-reduced gradient, so they stay identical only if they start identical and every
dense step follows the all-reduce. :func:`sync_dense_grads_` is the one all-reduce (the layer's, the Hugging Face
drop-in's and the training script's all call it); :func:`check_same_weights` refuses ranks that start apart.

Non-finite gradients fail loudly, on every rank, before any weight moves: each rank's "a gradient into my layer
(or my dense gradients) holds a NaN or inf" rides as one entry per rank in the all-reduce (:func:`grad_flags`,
:func:`raise_on_grad_flags`), which raise :class:`NonFiniteError` naming the layer and the rank.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["NonFiniteError", "WeightsDifferError", "check_same_weights", "grad_flags", "raise_on_grad_flags",
           "sync_dense_grads_", "weight_checksums"]


class NonFiniteError(FloatingPointError):
    """A NaN or inf in a layer's input or in a gradient, raised on every rank (the message names the layer and the
    ranks where it arose)."""


class WeightsDifferError(ValueError):
    """Ranks that should hold the same replicated weights hold different ones (raised on every rank)."""


def grad_flags(layers, rank: int, num_ranks: int, dense_finite: torch.Tensor) -> torch.Tensor:
    """This rank's entries of the gradient check, to ride in the dense-gradient all-reduce: [num_ranks] zeros but
    at ``rank``: 1 + the index of the first of ``layers`` whose output gradient held a NaN or inf, else
    len(layers) + 1 when only this rank's dense gradients did (``dense_finite`` False), else 0. No host sync."""
    device = dense_finite.device
    codes = [torch.where(layer.grad_finite, 0.0, float(i + 1)).to(device) for i, layer in enumerate(layers)
             if layer.grad_finite is not None]
    codes.append(torch.where(dense_finite, 0.0, float(len(layers) + 1)))
    codes_C = torch.stack(codes)
    code = codes_C[(codes_C > 0).float().argmax()]  # the first non-zero (0 when none)
    return torch.zeros(num_ranks, device=device).index_put_((torch.tensor([rank], device=device),), code.view(1))


def raise_on_grad_flags(flags_N: torch.Tensor, layers, rank: int) -> None:
    """After the all-reduce: raise :class:`NonFiniteError` (on every rank alike) when any rank flagged a gradient."""
    flags = flags_N.cpu().round().long()
    if not bool(flags.any()):
        return
    where = [f"rank {r} (gradient into {layers[c - 1].name if c <= len(layers) else 'the dense parameters'})"
             for r, c in enumerate(flags.tolist()) if c]
    raise NonFiniteError(f"non-finite gradient (NaN or inf) on {', '.join(where)}; stopped on every rank before any "
                         f"weight was updated (this is rank {rank})")


def sync_dense_grads_(params: Iterable[torch.Tensor], layers: Sequence, grad_scale: float, group=None,
                      averaged: bool = False) -> None:
    """Sum the gradients of ``params`` over the ranks of ``group`` (default: the world) and multiply them by
    ``grad_scale``, in place: one flat all-reduce per (dtype, device), each carrying the gradient check of
    ``layers`` and of these gradients (:class:`NonFiniteError` on every rank, before any gradient is written). A
    missing gradient counts as zeros (it is set), so every rank reduces the same tensors. ``averaged``: another
    engine (DistributedDataParallel) has already averaged them over the ranks, so only the check is all-reduced
    and each gradient is multiplied by ``grad_scale`` x ranks (the mean stands for the sum). Then every layer is
    marked synced (``layer.dense_synced``) until its next backward. Collective."""
    params = list(params)
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for part in by_kind.values():
        finite = torch.stack([torch.isfinite(p.grad).all() for p in part]).all()
        flags_N = grad_flags(layers, rank, num_ranks, finite).to(part[0].grad)
        flat = flags_N if averaged else torch.cat([*(p.grad.reshape(-1) for p in part), flags_N])
        if num_ranks > 1:
            dist.all_reduce(flat, group=group)
        raise_on_grad_flags(flat[-num_ranks:], layers, rank)
        if averaged:
            torch._foreach_mul_([p.grad for p in part], grad_scale * num_ranks)
            continue
        flat = flat[:-num_ranks].mul_(grad_scale)
        offset = 0
        for p in part:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    for layer in layers:
        layer.dense_synced = True


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements widened to int64 at a time


def weight_checksums(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """[P, 2] int64: per tensor, the sum of its elements' bit patterns and the sum of their squares (both modulo
    2^64). Integer arithmetic, so the result does not depend on the order of summation: equal tensors give equal
    checksums on any device, and two differently seeded initialisations differ in both almost surely."""
    out = []
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1)
        bits = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() else flat
        acc = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for lo in range(0, bits.numel(), _CHUNK):
            b = bits[lo:lo + _CHUNK].to(torch.int64)
            acc += torch.stack([b.sum(), (b * b).sum()])
        out.append(acc)
    if not out:
        return torch.zeros(0, 2, dtype=torch.int64)
    return torch.stack(out)


def _all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """[ranks, *t.shape] on the CPU: every rank's ``t`` (on the backend's device: NCCL's is the GPU)."""
    if dist.get_backend(group) == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t, group=group)
    return torch.stack(gathered).cpu()


def check_same_weights(named: Sequence[tuple[str, torch.Tensor]], what: str, group=None) -> None:
    """Raise :class:`WeightsDifferError` on every rank of ``group`` (default: the world) unless every rank holds
    bitwise the same ``named`` tensors, naming the ranks that differ from rank 0 and the first tensor where they do.
    Tensors on the meta device (no values yet: a checkpoint fills them later) are not compared. Two all-gathers:
    the number of tensors, then a checksum per tensor (:func:`weight_checksums`). Collective."""
    num_ranks = dist.get_world_size(group)
    if num_ranks == 1:
        return
    named = [(n, t) for n, t in named if not t.is_meta]
    here = f"(this is rank {dist.get_rank(group)})"
    counts_N = _all_gather(torch.tensor([len(named)], dtype=torch.int64), group).flatten()
    if (counts_N != counts_N[0]).any():
        ranks = (counts_N != counts_N[0]).nonzero().flatten().tolist()
        raise WeightsDifferError(f"{what}: ranks {ranks} hold another number of tensors with values than rank 0 "
                                 f"({counts_N.tolist()}); build the same model on every rank {here}")
    all_NP2 = _all_gather(weight_checksums([t for _, t in named]).reshape(len(named), 2), group)
    differs_NP = (all_NP2 != all_NP2[:1]).any(dim=2)
    ranks = differs_NP.any(dim=1).nonzero().flatten().tolist()
    if ranks:
        first = named[int(differs_NP.any(dim=0).nonzero()[0])][0]
        raise WeightsDifferError(
            f"{what}: ranks {ranks} hold other initial weights than rank 0 (the first that differs: {first!r}); "
            f"build the model from the same seed (torch.manual_seed before constructing it) or the same checkpoint "
            f"on every rank {here}")
