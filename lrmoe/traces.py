"""Routing traces: routed-pair counts per (step, layer, source rank, expert), synthetic or recorded.

Synthetic generator (labelled ``"synthetic"`` in the metadata): each layer gets a base popularity over experts,
Zipf(s) over a random permutation of the experts or Dirichlet(α); the log-popularity drifts across steps as an
AR(1) process; every token picks top-k experts without replacement by Gumbel-top-k on the log-popularity.

Two sampling modes:

* ``exact=True``: per-token Gumbel-top-k (also yields the tokens' choices and gate weights, see
  :func:`sample_routing`); cost grows with tokens × experts;
* ``exact=False`` (paper scale): each source rank's counts are Multinomial(T·k, π/k), where π are the top-k
  inclusion probabilities of Gumbel-top-k (see :func:`inclusion_probs`). Totals are exact (Σ_e counts = T·k);
  per-expert means match the exact mode's (checked in the tests); per-token distinctness is not modelled.

On-disk format (``.npz``, readable without torch): ``counts`` int64 [S, L, N, E] and ``meta`` (a JSON string:
format name and version, model, seed, generator and its parameters, or ``"source": "recorded"`` with the
training run it came from).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

TRACE_FORMAT = "lrmoe-trace"
TRACE_VERSION = 1


@dataclass
class Trace:
    counts_SLNE: torch.Tensor  # long [steps, layers, source ranks, experts]: routed pairs
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.counts_SLNE.dim() != 4:
            raise ValueError(f"counts_SLNE must be 4-D [steps, layers, ranks, experts], "
                             f"got shape {tuple(self.counts_SLNE.shape)}")
        if (self.counts_SLNE < 0).any():
            raise ValueError("counts_SLNE holds negative counts")

    @property
    def num_steps(self) -> int:
        return self.counts_SLNE.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts_SLNE.shape[1]

    @property
    def num_ranks(self) -> int:
        return self.counts_SLNE.shape[2]

    @property
    def num_experts(self) -> int:
        return self.counts_SLNE.shape[3]

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"trace files end in .npz, got {path}")
        if path.exists() and not overwrite:
            raise FileExistsError(f"trace file {path} exists; pass overwrite=True to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **self.meta}
        np.savez_compressed(path, counts=self.counts_SLNE.numpy().astype(np.int64), meta=np.array(json.dumps(meta)))
        return path

    def summary(self) -> dict:
        """Skew statistics over the whole trace: Gini and max/mean of per-expert counts, per layer-step."""
        per_expert_SLE = self.counts_SLNE.sum(dim=2).double()
        return {"gini_mean": float(gini(per_expert_SLE).mean()),
                "max_over_mean_mean": float(max_over_mean(per_expert_SLE).mean()),
                "max_over_mean_max": float(max_over_mean(per_expert_SLE).max()),
                "steps": self.num_steps, "layers": self.num_layers, "ranks": self.num_ranks,
                "experts": self.num_experts, "source": self.meta.get("source", "unknown")}


def load_trace(path: str | Path) -> Trace:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path} is not an {TRACE_FORMAT} file (format={meta.get('format')!r})")
        if meta.get("version") != TRACE_VERSION:
            raise ValueError(f"{path} has trace version {meta.get('version')}, this package reads {TRACE_VERSION}")
        return Trace(torch.from_numpy(data["counts"].astype(np.int64)), meta)


# -- skew statistics ------------------------------------------------------------------------------------------
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


# -- popularity ------------------------------------------------------------------------------------------------
def zipf_popularity(num_experts: int, s: float, generator: torch.Generator) -> torch.Tensor:
    """p_e ∝ 1 / rank^s over a random permutation of the experts (float64 [E], sums to 1)."""
    if s < 0:
        raise ValueError(f"Zipf exponent s must be non-negative, got {s}")
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s
    perm = torch.randperm(num_experts, generator=generator)
    p = torch.empty(num_experts, dtype=torch.float64)
    p[perm] = weights / weights.sum()
    return p


def dirichlet_popularity(num_experts: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """p ~ Dirichlet(α, ..., α), sampled through normalised Gamma(α) draws from ``generator``."""
    if alpha <= 0:
        raise ValueError(f"Dirichlet alpha must be positive, got {alpha}")
    # torch's Gamma sampler takes no generator: seed a private one from ours for determinism
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        g = torch.distributions.Gamma(torch.full((num_experts,), float(alpha), dtype=torch.float64), 1.0).sample()
    g = g.clamp_min(1e-12)
    return g / g.sum()


def inclusion_probs(p_E: torch.Tensor, top_k: int, iters: int = 60) -> torch.Tensor:
    """Top-k inclusion probabilities of Gumbel-top-k sampling, over the last dimension.

    Gumbel-top-k is a race of exponential clocks T_e ~ Exp(p_e); e is chosen when its clock is among the k
    first. Replacing the k-th arrival time by the deterministic t with Σ_e (1 - exp(-p_e·t)) = k gives
    π_e = 1 - exp(-p_e·t), exact in Σ π = k and within 0.01 of Monte Carlo for Zipf s ≤ 1.2 over 128 experts.
    """
    if not 0 < top_k <= p_E.shape[-1]:
        raise ValueError(f"top_k={top_k} must be in [1, {p_E.shape[-1]}]")
    p = p_E.double() / p_E.double().sum(dim=-1, keepdim=True)
    if top_k == p.shape[-1]:
        return torch.ones_like(p)
    lo = torch.zeros(p.shape[:-1] + (1,), dtype=torch.float64)
    hi = torch.full_like(lo, float(top_k))
    while ((1 - torch.exp(-p * hi)).sum(dim=-1, keepdim=True) < top_k).any():
        hi = hi * 2
    for _ in range(iters):  # bisection on t, vectorised over all leading dimensions
        mid = (lo + hi) / 2
        below = (1 - torch.exp(-p * mid)).sum(dim=-1, keepdim=True) < top_k
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    pi = 1 - torch.exp(-p * (lo + hi) / 2)
    return pi * (top_k / pi.sum(dim=-1, keepdim=True))


def sample_topk(logp_E: torch.Tensor, num_tokens: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """Gumbel-top-k: ``num_tokens`` draws of k distinct experts, P ∝ popularity without replacement. [T, k]."""
    gumbel = _gumbel((num_tokens, logp_E.shape[-1]), generator)
    return torch.topk(logp_E + gumbel, top_k, dim=-1).indices


def _gumbel(shape, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-20, 1 - 1e-16)
    return -torch.log(-torch.log(u))


def sample_routing(p_E: torch.Tensor, num_tokens: int, top_k: int, family: str, generator: torch.Generator,
                   temperature: float = 1.0):
    """Synthetic router output for ``num_tokens`` tokens: logits = (log p + Gumbel) / temperature, routed by the
    family's router, so choices are Gumbel-top-k and gate weights have the family's form."""
    from .routing import route

    logits_TE = (torch.log(p_E.double()) + _gumbel((num_tokens, p_E.shape[-1]), generator)) / temperature
    return route(logits_TE.float(), family, top_k)


def _multinomial_counts(probs_BE: torch.Tensor, totals: int, generator: torch.Generator) -> torch.Tensor:
    """Multinomial(totals, probs) per row by sequential conditional binomials: O(E) vectorised steps."""
    batch, num_experts = probs_BE.shape
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    out = torch.zeros(batch, num_experts, dtype=torch.float64)
    remaining = torch.full((batch,), float(totals), dtype=torch.float64)
    rest = torch.ones(batch, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for e in range(num_experts - 1):
            q = (probs_BE[:, e] / rest.clamp_min(1e-300)).clamp(0.0, 1.0)
            draw = torch.binomial(remaining, q)
            out[:, e] = draw
            remaining -= draw
            rest -= probs_BE[:, e]
        out[:, -1] = remaining
    return out.round().long()


def generate_trace(num_steps: int, num_layers: int, num_ranks: int, num_experts: int, top_k: int,
                   tokens_per_rank: int, skew: str = "zipf", skew_param: float = 0.4, drift_phi: float = 0.9,
                   drift_sigma: float = 0.1, seed: int = 0, exact: bool = False, model: str | None = None) -> Trace:
    """A synthetic trace. ``skew`` is "zipf" (``skew_param`` = s) or "dirichlet" (``skew_param`` = α);
    log-popularity drifts as x_t = φ·x_{t-1} + σ·√(1-φ²)·ε_t (stationary std σ, x_0 = 0)."""
    for name, value in [("num_steps", num_steps), ("num_layers", num_layers), ("num_ranks", num_ranks),
                        ("num_experts", num_experts), ("top_k", top_k), ("tokens_per_rank", tokens_per_rank)]:
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    if not 0 <= drift_phi < 1:
        raise ValueError(f"drift_phi must be in [0, 1), got {drift_phi}")
    if drift_sigma < 0:
        raise ValueError(f"drift_sigma must be non-negative, got {drift_sigma}")
    gen = torch.Generator().manual_seed(seed)
    if skew == "zipf":
        base_LE = torch.stack([zipf_popularity(num_experts, skew_param, gen) for _ in range(num_layers)])
    elif skew == "dirichlet":
        base_LE = torch.stack([dirichlet_popularity(num_experts, skew_param, gen) for _ in range(num_layers)])
    else:
        raise ValueError(f"unknown skew {skew!r}; use 'zipf' or 'dirichlet'")

    logp_SLE = torch.empty(num_steps, num_layers, num_experts, dtype=torch.float64)
    x_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    innovation = drift_sigma * (1 - drift_phi**2) ** 0.5
    for step in range(num_steps):
        if step:
            x_LE = drift_phi * x_LE + innovation * torch.randn(x_LE.shape, generator=gen, dtype=torch.float64)
        logp_SLE[step] = torch.log_softmax(torch.log(base_LE) + x_LE, dim=-1)

    if exact:
        counts = torch.zeros(num_steps, num_layers, num_ranks, num_experts, dtype=torch.long)
        for step in range(num_steps):
            for layer in range(num_layers):
                idx = sample_topk(logp_SLE[step, layer], num_ranks * tokens_per_rank, top_k, gen)
                rank_of_token = torch.arange(num_ranks).repeat_interleave(tokens_per_rank)
                flat = (rank_of_token[:, None] * num_experts + idx).reshape(-1)
                counts[step, layer] = torch.bincount(flat, minlength=num_ranks * num_experts).view(
                    num_ranks, num_experts)
    else:
        pi_SLE = inclusion_probs(logp_SLE.exp(), top_k)
        probs = (pi_SLE / top_k)[:, :, None, :].expand(-1, -1, num_ranks, -1).reshape(-1, num_experts)
        counts = _multinomial_counts(probs, tokens_per_rank * top_k, gen).view(
            num_steps, num_layers, num_ranks, num_experts)

    meta = {"source": "synthetic", "model": model, "seed": seed, "generator": {
        "skew": skew, "skew_param": skew_param, "drift_phi": drift_phi, "drift_sigma": drift_sigma,
        "top_k": top_k, "tokens_per_rank": tokens_per_rank, "exact": exact}}
    return Trace(counts, meta)
