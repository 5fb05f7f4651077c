"""Recalibration metrics: how much each token-expert pair's backward is worth, from what its home rank holds.

With g the pair's gate weight, δ = ∂L/∂y of its token, o the expert output and h the expert's hidden activation:

* ``"m1"``  g·‖δ‖            free: the norm of the pair's output gradient grad_o = g·δ;
* ``"m2"``  g·‖δ‖·‖h‖        the exact norm of the pair's term h (g·δ)ᵀ in the down-projection gradient
                             (‖h‖ is one scalar per pair, computed at the expert and carried home by the
                             forward combine);
* ``"m3"``  g·|⟨δ, o⟩|       first-order loss change of dropping the pair; ⟨δ, o⟩ is what the router
                             gradient needs anyway (the forward keeps o for it);
* ``"gate"`` g               the routing weight alone;
* ``"random"``               i.i.d. uniform scores from a seeded generator: a uniformly random subset at
                             the quota (the baseline backward-selection work found hard to beat).

Each metric is a :class:`Metric` object that declares what it needs besides grad_o (``needs``), what that costs
the forward (``combine_cols``, ``save_output``) and computes its scores on the device of the data
(:meth:`Metric.score`): no host sync, no host copy. Only the selection (:mod:`lrmoe.recal.selection`) reads the [M]
scores on the host. Adding a metric is one :class:`Metric` subclass and one entry in :data:`METRIC_REGISTRY`;
the hook, the distributed layer, the accounting and the scripts read everything else from the object.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from lrmoe.recal.selection import MODES

# what a metric may need besides grad_o, and the PairParts field that carries it
NEEDS = {"o": "o_MD", "h_norm": "h_norm_M", "gate": "gate_M"}


@dataclass(frozen=True)
class PairParts:
    """What a pair's home rank holds in the backward, one row per pair (M pairs), all on one device."""

    grad_o_MD: Tensor  # g·δ of each pair: the gradient of the pair's expert output
    o_MD: Tensor | None = None  # the pair's expert output (kept by the forward when a metric needs it)
    h_norm_M: Tensor | None = None  # ‖h‖ of the pair's hidden activation (carried home by the combine)
    gate_M: Tensor | None = None  # the pair's gate weight g

    def detached(self) -> PairParts:
        return replace(self, **{f.name: getattr(self, f.name).detach() for f in fields(self)
                                if getattr(self, f.name) is not None})


class Metric:
    """A recalibration metric. Subclasses set ``name``, ``needs`` (a subset of {"o", "h_norm", "gate"}; grad_o
    is always there) and implement :meth:`compute`; :meth:`score` checks the parts and calls it."""

    name: str = ""
    needs: frozenset[str] = frozenset()
    doc: str = ""

    @property
    def combine_cols(self) -> int:
        """Extra per-pair columns the forward combine carries home (‖h‖ is computed at the expert)."""
        return int("h_norm" in self.needs)

    @property
    def save_output(self) -> bool:
        """Whether the forward must keep the pairs' outputs o_MD for the backward."""
        return "o" in self.needs

    def score(self, parts: PairParts, generator: torch.Generator | None = None, mode: str = "topk") -> Tensor:
        """Scores [M] in at least float32 on ``parts.grad_o_MD.device``, for selection in ``mode``
        ("topk" or "unbiased"); ``generator`` seeds metrics that draw. Raises ValueError naming what is missing
        or malformed. Reads the parts as values (detached)."""
        self.check(parts, mode)
        dtype = torch.promote_types(parts.grad_o_MD.dtype, torch.float32)
        return self.compute(parts.detached(), dtype, generator, mode)

    def compute(self, parts: PairParts, dtype: torch.dtype, generator: torch.Generator | None,
                mode: str) -> Tensor:
        """The metric's formula on checked, detached parts; returns [M] scores of ``dtype``."""
        raise NotImplementedError

    def check(self, parts: PairParts, mode: str = "topk") -> None:
        """Refuse parts this metric cannot score (shapes and devices only: no host sync)."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        grad = parts.grad_o_MD
        if grad.dim() != 2:
            raise ValueError(f"PairParts.grad_o_MD must be 2-D [pairs, hidden], got shape {tuple(grad.shape)}")
        for need in self.needs:
            if getattr(parts, NEEDS[need]) is None:
                raise ValueError(f"metric {self.name!r} needs {need} (PairParts.{NEEDS[need]}), which is missing")
        num_pairs = grad.shape[0]
        for name in NEEDS.values():
            value = getattr(parts, name)
            if value is None:
                continue
            want = tuple(grad.shape) if name == "o_MD" else (num_pairs,)
            if tuple(value.shape) != want:
                raise ValueError(f"PairParts.{name} must have shape {want}, got {tuple(value.shape)}")
            if value.device != grad.device:
                raise ValueError(f"PairParts.{name} is on {value.device}, grad_o_MD on {grad.device}: "
                                 f"the parts must share one device")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, needs={sorted(self.needs)})"


class GradNorm(Metric):
    name, doc = "m1", "g·‖δ‖: the norm of the pair's output gradient"

    def compute(self, parts, dtype, generator, mode):
        return torch.linalg.vector_norm(parts.grad_o_MD.to(dtype), dim=1)  # = g·‖δ‖ since g ≥ 0


class DownProjNorm(Metric):
    name, needs, doc = "m2", frozenset({"h_norm"}), "g·‖δ‖·‖h‖: the norm of the pair's down-projection gradient"

    def compute(self, parts, dtype, generator, mode):
        return torch.linalg.vector_norm(parts.grad_o_MD.to(dtype), dim=1) * parts.h_norm_M.to(dtype)


class LossChange(Metric):
    name, needs, doc = "m3", frozenset({"o"}), "g·|⟨δ, o⟩|: the first-order loss change of dropping the pair"

    def compute(self, parts, dtype, generator, mode):
        return (parts.grad_o_MD.to(dtype) * parts.o_MD.to(dtype)).sum(dim=1).abs()


class Gate(Metric):
    name, needs, doc = "gate", frozenset({"gate"}), "g: the routing weight alone"

    def compute(self, parts, dtype, generator, mode):
        return parts.gate_M.to(dtype)


class Random(Metric):
    """i.i.d. U[0, 1) scores drawn on the generator's device (the CPU without one) and moved to the data, so a
    seeded CPU generator picks the same pairs whether the data is on the CPU or a GPU. In the unbiased mode the
    scores are equal, i.e. equal inclusion probabilities quota / group size: uniform random at the quota,
    unbiased, drawn by the selection alone (probabilities proportional to i.i.d. uniform scores would be
    unbiased too, but with needlessly huge 1/p weights)."""

    name, doc = "random", "uniform random scores: a random subset at the quota"

    def compute(self, parts, dtype, generator, mode):
        grad = parts.grad_o_MD
        if mode == "unbiased":
            return torch.ones(grad.shape[0], dtype=dtype, device=grad.device)
        draw_on = generator.device if generator is not None else torch.device("cpu")
        return torch.rand(grad.shape[0], generator=generator, dtype=dtype, device=draw_on).to(grad.device)


METRIC_REGISTRY: dict[str, Metric] = {m.name: m for m in (GradNorm(), DownProjNorm(), LossChange(), Gate(), Random())}
METRICS = tuple(METRIC_REGISTRY)  # the names, in the order of the module doc


def get_metric(metric: str | Metric) -> Metric:
    """The registered metric of that name (a :class:`Metric` is returned as it is)."""
    if isinstance(metric, Metric):
        return metric
    if metric not in METRIC_REGISTRY:
        raise ValueError(f"metric={metric!r} is not one of {METRICS}")
    return METRIC_REGISTRY[metric]


def pair_scores(metric: str | Metric, grad_o_PD: Tensor, *, o_PD: Tensor | None = None,
                h_norm_P: Tensor | None = None, gate_P: Tensor | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Scores [P] of ``metric`` (top-k mode) from the per-pair output gradients grad_o_PD = g·δ (one row per
    pair) and the parts it needs: ``o_PD`` (m3), ``h_norm_P`` (m2), ``gate_P`` (gate); ``generator`` seeds random.
    A keyword front end of :meth:`Metric.score`."""
    parts = PairParts(grad_o_MD=grad_o_PD, o_MD=o_PD, h_norm_M=h_norm_P, gate_M=gate_P)
    return get_metric(metric).score(parts, generator, "topk")
