"""Synthetic routing traces (labelled ``"synthetic"`` in the metadata).

Each layer gets a base popularity over experts, Zipf(s) over a random permutation of the experts or Dirichlet(α);
the log-popularity drifts across steps as an AR(1) process; every token picks top-k experts without replacement by
Gumbel-top-k on the log-popularity.

Two sampling modes:

* ``exact=True``: per-token Gumbel-top-k (:func:`sample_topk`; the tokens' choices and gate weights through a
  family's router: :func:`lrmoe.integrations.traces.sample_routing`); cost grows with tokens × experts;
* ``exact=False`` (paper scale): each source rank's counts are Multinomial(T·k, π/k), where π are the top-k
  inclusion probabilities of Gumbel-top-k (see :func:`inclusion_probs`). Totals are exact (Σ_e counts = T·k);
  per-expert means match the exact mode's (checked in the tests); per-token distinctness is not modelled.
"""

import torch

from lrmoe.traces.trace import Trace

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
    gumbel = gumbel_noise((num_tokens, logp_E.shape[-1]), generator)
    return torch.topk(logp_E + gumbel, top_k, dim=-1).indices


def gumbel_noise(shape, generator: torch.Generator) -> torch.Tensor:
    """Standard Gumbel draws (float64) of ``shape`` from ``generator``."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-20, 1 - 1e-16)
    return -torch.log(-torch.log(u))


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

    logp_ILE = torch.empty(num_steps, num_layers, num_experts, dtype=torch.float64)
    x_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    innovation = drift_sigma * (1 - drift_phi**2) ** 0.5
    for step in range(num_steps):
        if step:
            x_LE = drift_phi * x_LE + innovation * torch.randn(x_LE.shape, generator=gen, dtype=torch.float64)
        logp_ILE[step] = torch.log_softmax(torch.log(base_LE) + x_LE, dim=-1)

    if exact:
        counts = torch.zeros(num_steps, num_layers, num_ranks, num_experts, dtype=torch.long)
        for step in range(num_steps):
            for layer in range(num_layers):
                idx = sample_topk(logp_ILE[step, layer], num_ranks * tokens_per_rank, top_k, gen)
                rank_of_token = torch.arange(num_ranks).repeat_interleave(tokens_per_rank)
                flat = (rank_of_token[:, None] * num_experts + idx).reshape(-1)
                counts[step, layer] = torch.bincount(flat, minlength=num_ranks * num_experts).view(
                    num_ranks, num_experts)
    else:
        pi_ILE = inclusion_probs(logp_ILE.exp(), top_k)
        probs = (pi_ILE / top_k)[:, :, None, :].expand(-1, -1, num_ranks, -1).reshape(-1, num_experts)
        counts = _multinomial_counts(probs, tokens_per_rank * top_k, gen).view(
            num_steps, num_layers, num_ranks, num_experts)

    meta = {"source": "synthetic", "model": model, "seed": seed, "generator": {
        "skew": skew, "skew_param": skew_param, "drift_phi": drift_phi, "drift_sigma": drift_sigma,
        "top_k": top_k, "tokens_per_rank": tokens_per_rank, "exact": exact}}
    return Trace(counts, meta)
