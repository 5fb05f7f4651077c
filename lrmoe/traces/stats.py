"""Skew statistics of routed-pair counts: Gini, max over mean, per-rank loads under a placement."""

import torch


def gini(x: torch.Tensor) -> torch.Tensor:
    """Gini coefficient over the last dimension (0: all equal; → 1: all mass on one entry)."""
    x = torch.sort(x.double(), dim=-1).values
    n = x.shape[-1]
    rank = torch.arange(1, n + 1, dtype=torch.float64)
    total = x.sum(dim=-1)
    return ((2 * rank - n - 1) * x).sum(dim=-1) / (n * total.clamp_min(1e-300))


def max_over_mean(x: torch.Tensor) -> torch.Tensor:
    """Hottest entry over the mean, over the last dimension."""
    x = x.double()
    return x.max(dim=-1).values / x.mean(dim=-1).clamp_min(1e-300)


def rank_loads(counts_E: torch.Tensor, placement_NS: torch.Tensor) -> torch.Tensor:
    """Per-rank load [N] when each expert's pairs split evenly over its replicas in ``placement_NS`` (-1 empty)."""
    num_experts = counts_E.shape[-1]
    flat = placement_NS.reshape(-1)
    valid = flat >= 0
    replicas_E = torch.bincount(flat[valid], minlength=num_experts)
    if (replicas_E == 0).any():
        raise ValueError(f"experts {torch.nonzero(replicas_E == 0).flatten().tolist()} have no slot in the placement")
    per_slot = torch.zeros(flat.shape, dtype=torch.float64)
    per_slot[valid] = counts_E.double()[flat[valid]] / replicas_E[flat[valid]]
    return per_slot.reshape(placement_NS.shape).sum(dim=-1)
