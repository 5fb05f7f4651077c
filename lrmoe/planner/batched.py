"""The critical-path plans of every MoE layer of a micro-batch in one call (DESIGN.md §4).

:func:`plan_layers` gives exactly ``[policy.plan_on(counts_NE, placement_NS) for each layer]``: the part of a plan
that needs this micro-batch's counts, on placements computed off the critical path. For the even-routing systems
(static EP, capacity, SYMI dropless and with a capacity) the forward routing over the replicas and the capacity
drops of all layers are one set of tensor operations over [L, N, G] (no Python loop over layers, experts or
ranks), on the counts' device (on the host in chunks of layers that stay in cache: one [L, N, G] pass over 48
layers at N = 64 runs slower per entry than a few layers at a time); layers of other policies (LRMoE's balanced
routing, caps and quotas, online replication, the trimmed controls' quotas) are planned one by one by their own
``plan_on``, in NumPy on the host.

The even split and the capacity rule are those of :mod:`lrmoe.planner.replica_routing`, in the same integer
arithmetic, so the plans are equal tensor for tensor (tests/test_batched_planner.py); the capacities'
ceil(cf · pairs / E) is the same float64 expression.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lrmoe.planner.plan import LayerPlan, SplitPolicy
from lrmoe.planner.policies import Capacity, StaticEP, Symi


CPU_CHUNK_ELEMENTS = 1 << 18  # [layers, N, G] entries per vectorised call on the host (temporaries of ~2 MB)


def _vector_kind(policy) -> tuple | None:
    """The batched rule a policy's ``plan_on`` follows, or None (planned layer by layer)."""
    if type(policy) is StaticEP:
        return ("dropless",)
    if type(policy) is Capacity:
        return ("gshard", policy.cf, policy.drop_by)
    if type(policy) is Symi:
        return ("dropless",) if policy.cf is None else ("symi", policy.cf)
    return None


def vectorised(policy) -> bool:
    """Whether :func:`plan_layers` plans this policy's layers with the batched tensor operations."""
    return _vector_kind(policy) is not None


def replica_index_LG(expert_LG: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(replicas per expert [L, E], index of each slot among its expert's slots in increasing g [L, G], -1 empty):
    :class:`~lrmoe.planner.placement.ReplicaTable`'s ``replicas_E`` and ``replica_G`` of every layer at once."""
    L, G = expert_LG.shape
    hosted_LG = expert_LG >= 0
    key_LG = torch.where(hosted_LG, expert_LG, num_experts) * G + torch.arange(G, device=expert_LG.device)
    order_LG = torch.sort(key_LG, dim=1, stable=True).indices
    replicas_LE1 = torch.zeros(L, num_experts + 1, dtype=torch.long, device=expert_LG.device)
    replicas_LE1.scatter_add_(1, torch.where(hosted_LG, expert_LG, num_experts), torch.ones_like(expert_LG))
    start_LE1 = torch.cumsum(replicas_LE1, 1) - replicas_LE1
    sorted_e_LG = torch.gather(torch.where(hosted_LG, expert_LG, num_experts), 1, order_LG)
    position_LG = torch.arange(G, device=expert_LG.device).expand(L, G) - torch.gather(start_LE1, 1, sorted_e_LG)
    replica_LG = torch.empty_like(expert_LG).scatter_(1, order_LG, position_LG)
    return replicas_LE1[:, :num_experts], torch.where(hosted_LG, replica_LG, -1)


def even_routing_LNG(counts_LNE: Tensor, expert_LG: Tensor, replicas_LE: Tensor, replica_LG: Tensor) -> Tensor:
    """The even split of every layer (:func:`~lrmoe.planner.replica_routing.route_forward` "even"): each source
    splits its pairs of e over e's replicas, replica j getting one of the remainder iff (j - src) mod r_e < rem."""
    L, N, _ = counts_LNE.shape
    hosted_LG = expert_LG >= 0
    e_LG = expert_LG.clamp(min=0)
    r_L1G = torch.gather(replicas_LE, 1, e_LG).clamp(min=1)[:, None, :]
    C_LNG = torch.gather(counts_LNE, 2, e_LG[:, None, :].expand(L, N, -1))
    share_LNG = torch.div(C_LNG, r_L1G, rounding_mode="floor")
    rem_LNG = C_LNG - share_LNG * r_L1G
    turn_LNG = (replica_LG.clamp(min=0)[:, None, :] - torch.arange(N, device=counts_LNE.device)[None, :, None]) \
        % r_L1G
    return (share_LNG + (turn_LNG < rem_LNG).long()) * hosted_LG[:, None, :]


def capacity_drops_LNE(counts_LNE: Tensor, capacity_LE: Tensor) -> Tensor:
    """Pairs dropped per (layer, source, expert) when expert e keeps min(C_e, capacity_e), the kept pairs shared
    by the sources by cumulative rounding in rank order (:func:`~lrmoe.planner.replica_routing.apply_capacity`)."""
    kept_LE = torch.minimum(counts_LNE.sum(1), capacity_LE)
    weight_LEN = counts_LNE.transpose(1, 2)
    cum_LEN = kept_LE[:, :, None] * torch.cumsum(weight_LEN, 2) // weight_LEN.sum(2).clamp(min=1)[:, :, None]
    kept_LEN = cum_LEN.clone()
    kept_LEN[:, :, 1:] -= cum_LEN[:, :, :-1]
    return counts_LNE - kept_LEN.transpose(1, 2)


def _ceil_share(cf: float, total_L: Tensor, parts: int) -> Tensor:
    """ceil(cf · total / parts - 1e-9) per layer, the same float64 expression as the per-layer capacities."""
    return torch.ceil(cf * total_L.double() / parts - 1e-9).long()


def _check_batch(counts_LNE: Tensor, expert_LG: Tensor, replicas_LE: Tensor) -> None:
    if counts_LNE.dtype.is_floating_point or counts_LNE.dtype.is_complex or counts_LNE.dtype == torch.bool:
        raise ValueError(f"counts must hold integers, got dtype {counts_LNE.dtype}")
    if counts_LNE.numel() and int(counts_LNE.min()) < 0:
        raise ValueError(f"counts must be non-negative, got min {int(counts_LNE.min())}")
    orphan_LE = (replicas_LE == 0) & (counts_LNE.sum(1) > 0)
    if bool(orphan_LE.any()):
        layer, e = (int(v) for v in torch.nonzero(orphan_LE)[0])
        raise ValueError(f"layer {layer}: expert {e} has {int(counts_LNE[layer, :, e].sum())} routed pairs but no "
                         f"slot in the placement")


def _plan_vectorised(kind: tuple, policies: Sequence, counts_LNE: Tensor, placement_LNS: Tensor) -> list[LayerPlan]:
    L, N, E = counts_LNE.shape
    expert_LG = placement_LNS.reshape(L, -1)
    replicas_LE, replica_LG = replica_index_LG(expert_LG, E)
    _check_batch(counts_LNE, expert_LG, replicas_LE)
    if kind[0] == "dropless":
        fwd_LNG = even_routing_LNG(counts_LNE, expert_LG, replicas_LE, replica_LG)
        return _plans(policies, placement_LNS, fwd_LNG, torch.zeros_like(counts_LNE), "position")
    total_L = counts_LNE.sum((1, 2))
    if kind[0] == "gshard":
        capacity_LE = _ceil_share(kind[1], total_L, E)[:, None].expand(L, E)
    else:  # SYMI: the slot capacity times the expert's replicas
        capacity_LE = _ceil_share(kind[1], total_L, expert_LG.shape[1])[:, None] * replicas_LE
    dropped_LNE = capacity_drops_LNE(counts_LNE, capacity_LE)
    fwd_LNG = even_routing_LNG(counts_LNE - dropped_LNE, expert_LG, replicas_LE, replica_LG)
    return _plans(policies, placement_LNS, fwd_LNG, dropped_LNE, kind[2] if kind[0] == "gshard" else "position")


def _plans(policies: Sequence, placement_LNS: Tensor, fwd_LNG: Tensor, dropped_LNE: Tensor,
           drop_by: str) -> list[LayerPlan]:
    """One forward-only plan per layer (:meth:`LayerPlan.forward_only`), its tensors slices of the batch's."""
    L, N, _ = fwd_LNG.shape
    keep_LNG = fwd_LNG.clone()
    excess_LN = torch.zeros(L, N, dtype=torch.long, device=fwd_LNG.device)
    flows = torch.zeros(0, 4, dtype=torch.long, device=fwd_LNG.device)
    return [LayerPlan(placement_NS=placement_LNS[i], fwd_NG=fwd_LNG[i], dropped_NE=dropped_LNE[i], keep_NG=keep_LNG[i],
                      bwd_flows_V4=flows, floor_excess_N=excess_LN[i], policy=policies[i].name, drop_by=drop_by)
            for i in range(L)]


def plan_layers(policies: Sequence[SplitPolicy], counts_LNE: Tensor,
                placements: Sequence[Tensor] | Tensor) -> list[LayerPlan]:
    """``[policies[l].plan_on(counts_LNE[l], placements[l]) for l]``, with the layers whose policies share an
    even-routing rule and a placement shape planned together (module doc). ``counts_LNE`` [L, N, E] integer counts
    of one micro-batch, on any device (the vectorised layers' plans stay there, the others' are on the host; a
    plan's tensors are slices of the batch's);
    ``placements``: [L, N, S] or one [N, S] per layer. The plans' ``next_placement_NS`` is left unfilled."""
    if counts_LNE.dim() != 3:
        raise ValueError(f"counts_LNE must be [layers, ranks, experts], got shape {tuple(counts_LNE.shape)}")
    L = counts_LNE.shape[0]
    if len(policies) != L or len(placements) != L:
        raise ValueError(f"{L} layers of counts but {len(policies)} policies and {len(placements)} placements")
    for p in policies:
        if not hasattr(p, "plan_on"):
            raise ValueError(f"policy {getattr(p, 'name', p)!r} has no plan_on: plan it with plan()")
    plans: list[LayerPlan | None] = [None] * L
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(policies):
        kind = _vector_kind(p)
        if kind is None:
            plans[i] = p.plan_on(counts_LNE[i], placements[i])
        else:
            groups.setdefault((kind, tuple(placements[i].shape)), []).append(i)
    for (kind, shape), index in groups.items():
        # on the host, chunks of layers whose [l, N, G] temporaries stay in cache; on a device, all at once
        per_layer = counts_LNE.shape[1] * shape[0] * shape[1]
        step = len(index) if counts_LNE.device.type != "cpu" else max(1, CPU_CHUNK_ELEMENTS // per_layer)
        for start in range(0, len(index), step):
            chunk = index[start:start + step]
            stacked_LNS = torch.stack([torch.as_tensor(placements[i]).long() for i in chunk]).to(counts_LNE.device)
            for i, plan in zip(chunk, _plan_vectorised(kind, [policies[i] for i in chunk], counts_LNE[chunk].long(),
                                                       stacked_LNS)):
                plans[i] = plan
    return plans
