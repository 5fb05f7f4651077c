"""The backward hook that recalibrates an MoE layer's backward load, pair by pair.

:func:`recalibrate` is the identity on the per-pair expert outputs o_PD in the forward. In the backward it
receives grad_o = g·δ for every pair, scores the pairs with the chosen metric (a :class:`lrmoe.recal.scoring.Metric`,
from what the token's home rank holds: grad_o and what the metric needs of o, ‖h‖ and g), selects them inside
the given quotas, records the selection on its :class:`Recalibration` object and returns the gradient masked
and scaled (0 for dropped pairs, 1 or 1/p for kept ones). The gate multiplies o outside the hook, so the router
gradient sees every pair; the shared expert never passes through it. The distributed layer applies the same
decision at the home rank, before the backward all-to-all, so dropped pairs never cross the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from lrmoe.checks import apportion
from lrmoe.recal.scoring import Metric, PairParts, get_metric
from lrmoe.recal.selection import DEFAULT_UNIFORM_MIX, MODES, Selection, check_groups, select


@dataclass
class Recalibration:
    """What the hook is told (metric, mode, a group per pair and a quota per group) and what it did.

    metric: a name of :data:`lrmoe.recal.scoring.METRICS` or a :class:`lrmoe.recal.scoring.Metric` (``scorer`` is the
    object).
    group_P: long [P] in [0, Q), e.g. source rank · E + expert; quota_Q: long [Q] pairs to keep per group.
    After each backward, ``scores_P`` and ``selection`` hold the latest scores and selection, and
    ``num_backward`` counts the backward passes (a retained graph may be run several times: each run draws
    afresh from ``generator``).
    """

    metric: str | Metric
    mode: str
    group_P: torch.Tensor
    quota_Q: torch.Tensor
    generator: torch.Generator | None = None
    uniform_mix: float = DEFAULT_UNIFORM_MIX
    scores_P: torch.Tensor | None = field(default=None, init=False)
    selection: Selection | None = field(default=None, init=False)
    num_backward: int = field(default=0, init=False)
    scorer: Metric = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self.scorer = get_metric(self.metric)
        except ValueError as err:
            raise ValueError(f"Recalibration.{err}") from None
        if self.mode not in MODES:
            raise ValueError(f"Recalibration.mode={self.mode!r} is not one of {MODES}")
        check_groups(self.group_P, self.quota_Q, "Recalibration.")
        if not self.uniform_mix >= 0:
            raise ValueError(f"Recalibration.uniform_mix must be non-negative, got {self.uniform_mix}")

    @property
    def keep_P(self) -> torch.Tensor:
        return self._last().keep_P

    @property
    def scale_P(self) -> torch.Tensor:
        return self._last().scale_P

    def _last(self) -> Selection:
        if self.selection is None:
            raise RuntimeError("no backward has run through this Recalibration yet")
        return self.selection


def score_and_select(rec: Recalibration, grad_o_PD: torch.Tensor, o_PD: torch.Tensor | None = None,
                     gate_P: torch.Tensor | None = None, h_norm_P: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, Selection]:
    """The hook's backward decision, callable on its own: the metric's scores (on the device of grad_o_PD),
    then the selection (on the device of ``rec.group_P``, where the scores are moved). Returns the scores on
    the selection's device, and the selection."""
    parts = PairParts(grad_o_MD=grad_o_PD, o_MD=o_PD, h_norm_M=h_norm_P, gate_M=gate_P)
    scores_P = rec.scorer.score(parts, rec.generator, rec.mode).to(rec.group_P.device)
    selection = select(scores_P, rec.group_P, rec.quota_Q, rec.mode, rec.generator, uniform_mix=rec.uniform_mix)
    return scores_P, selection


class _Recalibrate(torch.autograd.Function):
    """Identity forward; backward = grad_o masked and scaled by the selection made from it."""

    @staticmethod
    def forward(ctx, o_PD, gate_P, h_norm_P, rec):
        ctx.rec = rec
        ctx.save_for_backward(o_PD if rec.scorer.save_output else None, gate_P, h_norm_P)
        return o_PD.view_as(o_PD)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_o_PD):
        o_PD, gate_P, h_norm_P = ctx.saved_tensors
        rec: Recalibration = ctx.rec
        scores_P, selection = score_and_select(rec, grad_o_PD, o_PD, gate_P, h_norm_P)
        rec.scores_P, rec.selection = scores_P, selection
        rec.num_backward += 1
        return grad_o_PD * selection.scale_P.to(grad_o_PD)[:, None], None, None, None


def recalibrate(o_PD: torch.Tensor, rec: Recalibration, *, gate_P: torch.Tensor | None = None,
                h_norm_P: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the recalibration hook to per-pair expert outputs o_PD (see the module doc).

    gate_P and h_norm_P are per-pair scalars from the forward, given when the metric needs them (``gate``,
    ``h_norm``); they are read as values (detached).
    """
    if o_PD.dim() != 2:
        raise ValueError(f"o_PD must be 2-D [pairs, hidden], got shape {tuple(o_PD.shape)}")
    num_pairs = o_PD.shape[0]
    if rec.group_P.numel() != num_pairs:
        raise ValueError(f"Recalibration.group_P has {rec.group_P.numel()} entries for {num_pairs} pairs")
    for name, value, need in (("gate_P", gate_P, "gate"), ("h_norm_P", h_norm_P, "h_norm")):
        if value is None and need in rec.scorer.needs:
            raise ValueError(f"metric {rec.scorer.name!r} needs {name}")
        if value is not None and tuple(value.shape) != (num_pairs,):
            raise ValueError(f"{name} must have shape ({num_pairs},), got {tuple(value.shape)}")
    gate_P, h_norm_P = (None if t is None else t.detach() for t in (gate_P, h_norm_P))
    return _Recalibrate.apply(o_PD, gate_P, h_norm_P, rec)


def pair_hook(rec: Recalibration) -> Callable:
    """A ``pair_hook`` for :class:`lrmoe.runtime.reference.ReferenceMoE` that applies :func:`recalibrate`."""

    def hook(o_PD, aux):
        return recalibrate(o_PD, rec, gate_P=aux.gate_TK.reshape(-1), h_norm_P=aux.h_norm_TK.reshape(-1))

    return hook


def pair_groups(idx_TK: torch.Tensor, num_experts: int, num_sources: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Group of every pair, (source rank, expert) → source · E + expert, and the routed pairs per group.

    Tokens are split over ``num_sources`` simulated source ranks in contiguous, near-equal blocks
    (token t belongs to rank t · N // T), as a batch sharded over data-parallel ranks would be.
    Returns (group_P long [T·k], counts_Q long [N·E]).
    """
    if idx_TK.dim() != 2:
        raise ValueError(f"idx_TK must be 2-D [tokens, k], got shape {tuple(idx_TK.shape)}")
    if num_sources <= 0:
        raise ValueError(f"num_sources must be positive, got {num_sources}")
    T = idx_TK.shape[0]
    source_T = torch.arange(T, device=idx_TK.device) * num_sources // max(T, 1)
    group_P = (source_T[:, None] * num_experts + idx_TK).reshape(-1)
    return group_P, torch.bincount(group_P, minlength=num_sources * num_experts)


def proportional_quotas(counts_Q: torch.Tensor, rho: float) -> torch.Tensor:
    """Quotas ≈ rho · counts per group: round(rho · Σ counts) split in proportion to the counts (the planner's
    :func:`~lrmoe.checks.apportion`), then at least one pair for every group that has pairs (rho > 0).

    The floor of one matters for the unbiased mode: a group with quota 0 can only drop all its pairs, so their
    expected contribution is lost and the estimate is biased. A single-process stand-in for the planner's
    quotas (uniform retention ratio, no caps), used by the fidelity harness and the tests.
    """
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must lie in [0, 1], got {rho}")
    if counts_Q.dim() != 1 or counts_Q.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts_Q must be a 1-D integer tensor, got shape {tuple(counts_Q.shape)} "
                         f"dtype {counts_Q.dtype}")
    if counts_Q.numel() and int(counts_Q.min()) < 0:
        raise ValueError(f"counts_Q must be non-negative, got minimum {int(counts_Q.min())}")
    counts_Q = counts_Q.to(torch.int64)
    if rho == 0 or not counts_Q.numel():
        return torch.zeros_like(counts_Q)
    total = int(torch.floor(counts_Q.sum().to(torch.float64) * rho + 0.5))
    quota_Q = apportion(torch.tensor([total]), counts_Q, torch.zeros_like(counts_Q))  # one segment: all groups
    return torch.maximum(quota_Q, counts_Q.clamp(max=1))
