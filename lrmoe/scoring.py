"""Recalibration metrics: how much each token-expert pair's backward is worth, from what its home rank holds.

With g the pair's gate weight, δ = ∂L/∂y of its token, o the expert output and h the expert's hidden activation:

* ``"m1"``  g·‖δ‖            free: the norm of the pair's output gradient grad_o = g·δ;
* ``"m2"``  g·‖δ‖·‖h‖        the exact norm of the pair's term h (g·δ)ᵀ in the down-projection gradient
                             (‖h‖ is one scalar per pair, produced in the forward);
* ``"m3"``  g·|⟨δ, o⟩|       first-order loss change of dropping the pair; ⟨δ, o⟩ is what the router
                             gradient needs anyway;
* ``"gate"`` g               the routing weight alone;
* ``"random"``               i.i.d. uniform scores from a seeded generator: a uniformly random subset at
                             the quota (the baseline backward-selection work found hard to beat).

Two entry points compute the same numbers: :func:`pair_scores` from per-pair output gradients (what the backward
hook receives), :func:`scores_from_parts` from per-pair scalars (what the distributed layer has before the
backward dispatch: per-token ‖δ‖, gates, ‖h‖ and the router's ⟨δ, o⟩).
"""

from __future__ import annotations

import torch

METRICS = ("m1", "m2", "m3", "gate", "random")
# the optional arguments each metric needs, in pair_scores and in scores_from_parts
_NEEDS = {"m1": (), "m2": ("h_norm_P",), "m3": ("o_PD",), "gate": ("gate_P",), "random": ()}
_PART_NEEDS = {"m1": ("delta_norm_P",), "m2": ("delta_norm_P", "h_norm_P"), "m3": ("delta_dot_o_P",),
               "gate": (), "random": ()}


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not one of {METRICS}")


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores in at least float32 (norms of bf16 gradients are upcast)."""
    return torch.promote_types(dtype, torch.float32)


def _check_vector(name: str, value: torch.Tensor | None, num_pairs: int) -> None:
    if value is not None and tuple(value.shape) != (num_pairs,):
        raise ValueError(f"{name} must have shape ({num_pairs},), got {tuple(value.shape)}")


def random_scores(num_pairs: int, generator: torch.Generator | None = None, dtype=torch.float32,
                  device=None) -> torch.Tensor:
    """The ``"random"`` metric: i.i.d. U[0, 1) scores."""
    return torch.rand(num_pairs, generator=generator, dtype=dtype, device=device)


def pair_scores(metric: str, grad_o_PD: torch.Tensor, *, o_PD: torch.Tensor | None = None,
                h_norm_P: torch.Tensor | None = None, gate_P: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Scores [P] of ``metric`` from the per-pair output gradients grad_o_PD = g·δ (one row per pair).

    ``o_PD`` is needed by m3, ``h_norm_P`` by m2, ``gate_P`` by gate, ``generator`` seeds random.
    """
    _check_metric(metric)
    if grad_o_PD.dim() != 2:
        raise ValueError(f"grad_o_PD must be 2-D [pairs, hidden], got shape {tuple(grad_o_PD.shape)}")
    num_pairs = grad_o_PD.shape[0]
    given = {"o_PD": o_PD, "h_norm_P": h_norm_P, "gate_P": gate_P}
    for name in _NEEDS[metric]:
        if given[name] is None:
            raise ValueError(f"metric {metric!r} needs {name}")
    if o_PD is not None and o_PD.shape != grad_o_PD.shape:
        raise ValueError(f"o_PD must have the shape of grad_o_PD {tuple(grad_o_PD.shape)}, got {tuple(o_PD.shape)}")
    _check_vector("h_norm_P", h_norm_P, num_pairs)
    _check_vector("gate_P", gate_P, num_pairs)
    dtype = _score_dtype(grad_o_PD.dtype)
    if metric == "random":
        return random_scores(num_pairs, generator, dtype, grad_o_PD.device)
    if metric == "gate":
        return gate_P.detach().to(dtype)
    grad = grad_o_PD.detach().to(dtype)
    if metric == "m3":
        return (grad * o_PD.detach().to(dtype)).sum(dim=1).abs()
    norm_P = torch.linalg.vector_norm(grad, dim=1)  # = g·‖δ‖ since g ≥ 0
    return norm_P if metric == "m1" else norm_P * h_norm_P.detach().to(dtype)


def scores_from_parts(metric: str, gate_P: torch.Tensor, *, delta_norm_P: torch.Tensor | None = None,
                      h_norm_P: torch.Tensor | None = None, delta_dot_o_P: torch.Tensor | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Scores [P] of ``metric`` from per-pair scalars: gate g, ‖δ‖ of the pair's token, ‖h‖ and ⟨δ, o⟩."""
    _check_metric(metric)
    if gate_P.dim() != 1:
        raise ValueError(f"gate_P must be 1-D [pairs], got shape {tuple(gate_P.shape)}")
    num_pairs = gate_P.shape[0]
    given = {"delta_norm_P": delta_norm_P, "h_norm_P": h_norm_P, "delta_dot_o_P": delta_dot_o_P}
    for name in _PART_NEEDS[metric]:
        if given[name] is None:
            raise ValueError(f"metric {metric!r} needs {name}")
    for name, value in given.items():
        _check_vector(name, value, num_pairs)
    dtype = _score_dtype(gate_P.dtype)
    if metric == "random":
        return random_scores(num_pairs, generator, dtype, gate_P.device)
    g = gate_P.detach().to(dtype)
    if metric == "gate":
        return g
    if metric == "m3":
        return g * delta_dot_o_P.detach().to(dtype).abs()
    m1 = g * delta_norm_P.detach().to(dtype)
    return m1 if metric == "m1" else m1 * h_norm_P.detach().to(dtype)
