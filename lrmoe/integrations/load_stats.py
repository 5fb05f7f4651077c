"""Load statistics of MoE routing, per layer and across layers: the numbers MoE papers and training logs report.

Per layer, from the routed counts ``counts_NE`` [source rank, expert] of one iteration (and, when the layer ran
it, the iteration's :class:`~lrmoe.planner.plan.LayerPlan`):

* tokens per expert: min, max, mean, std (population std over the E experts) and their Gini coefficient;
  ``expert_max_over_mean`` is the hottest expert over the mean;
* rank load: pairs computed per rank in the forward, max / mean (``rank_max_over_mean``). With a plan this is
  the plan's forward load (after replication and forward routing); without one, the load static expert
  parallelism would see (expert e on rank e // (E/N));
* pairs dropped by a capacity (``dropped_pairs``) and pairs the backward did not retain (``trimmed_pairs``,
  with ``retained_frac`` = retained / computed), both 0 for dropless, untrimmed plans.

Across layers (:func:`load_stats`): for each per-layer number, its mean and the requested percentiles over the
layers (``gini_p50``, ``rank_max_over_mean_p90``, ...), plus the totals of dropped and trimmed pairs.
:func:`flat_log` turns the result into one flat ``{name: float}`` row for W&B or a results file.

Pure: no ``torch.distributed``; give it global counts (the layer all-gathers them, a plan carries them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lrmoe.planner.plan import LayerPlan
from lrmoe.traces.stats import gini

PERCENTILES = (50, 90, 99)
LAYER_KEYS = ("tokens_per_expert_min", "tokens_per_expert_max", "tokens_per_expert_mean", "tokens_per_expert_std",
              "expert_max_over_mean", "gini", "rank_max_over_mean", "dropped_pairs", "trimmed_pairs",
              "retained_frac")


def layer_load_stats(counts_NE: torch.Tensor | None = None, plan: LayerPlan | None = None) -> dict[str, float]:
    """One layer's statistics from its routed counts [N, E] (a 1-D [E] is one source rank) and/or its plan
    (the plan's ``routed_NE`` stands for the counts when they are not given)."""
    if counts_NE is None:
        if plan is None:
            raise ValueError("layer_load_stats needs counts_NE or a plan")
        counts_NE = plan.routed_NE
    counts_NE = torch.as_tensor(counts_NE)
    if counts_NE.dim() == 1:
        counts_NE = counts_NE[None]
    if counts_NE.dim() != 2:
        raise ValueError(f"counts_NE must be [ranks, experts], got shape {tuple(counts_NE.shape)}")
    if bool((counts_NE < 0).any()):
        raise ValueError("counts_NE holds negative counts")
    if plan is not None and tuple(plan.routed_NE.shape) != tuple(counts_NE.shape):
        raise ValueError(f"plan covers {tuple(plan.routed_NE.shape)} (ranks, experts), counts_NE "
                         f"{tuple(counts_NE.shape)}")
    N, E = counts_NE.shape
    per_expert_E = counts_NE.sum(0).double()
    mean = float(per_expert_E.mean())
    if plan is not None:
        load_N = plan.fwd_load_N.double()
        computed = float(plan.fwd_NG.sum())
        dropped, retained = float(plan.dropped_NE.sum()), float(plan.bwd_NG.sum())
    else:
        if E % N:
            raise ValueError(f"without a plan the rank load is static expert parallelism's: {E} experts are not "
                             f"divisible by {N} ranks")
        load_N = per_expert_E.view(N, E // N).sum(1)
        computed = float(per_expert_E.sum())
        dropped, retained = 0.0, computed
    load_mean = float(load_N.mean())
    return {
        "tokens_per_expert_min": float(per_expert_E.min()),
        "tokens_per_expert_max": float(per_expert_E.max()),
        "tokens_per_expert_mean": mean,
        "tokens_per_expert_std": float(per_expert_E.std(unbiased=False)),
        "expert_max_over_mean": float(per_expert_E.max()) / mean if mean else 1.0,
        "gini": float(gini(per_expert_E)),
        "rank_max_over_mean": float(load_N.max()) / load_mean if load_mean else 1.0,
        "dropped_pairs": dropped,
        "trimmed_pairs": computed - retained,
        "retained_frac": retained / computed if computed else 1.0,
    }


def load_stats(counts_LNE: Sequence[torch.Tensor] | torch.Tensor | None = None,
               plans: Sequence[LayerPlan | None] | None = None,
               percentiles: Sequence[float] = PERCENTILES) -> dict:
    """Statistics of every layer (``"layers"``: one dict per layer) and across layers (``"summary"``).

    Pass per-layer counts (a [L, N, E] tensor or a list of [N, E]), per-layer plans (what the expert-parallel
    layers ran: ``layer.last_plan``), or both (same length). Summary: ``<key>_mean`` and ``<key>_p<q>`` over the
    layers for every per-layer key, and ``dropped_pairs`` / ``trimmed_pairs`` summed over the layers.
    """
    if counts_LNE is None and plans is None:
        raise ValueError("load_stats needs per-layer counts or plans")
    num = len(plans) if counts_LNE is None else len(counts_LNE)
    if counts_LNE is not None and plans is not None and len(plans) != num:
        raise ValueError(f"{num} layers of counts but {len(plans)} plans")
    if num == 0:
        raise ValueError("load_stats needs at least one layer")
    for q in percentiles:
        if not 0 <= q <= 100:
            raise ValueError(f"percentiles must lie in [0, 100], got {q}")
    layers = [layer_load_stats(None if counts_LNE is None else counts_LNE[i], None if plans is None else plans[i])
              for i in range(num)]
    summary: dict[str, float] = {"layers": float(num)}
    for key in LAYER_KEYS:
        values = torch.tensor([layer[key] for layer in layers], dtype=torch.float64)
        summary[f"{key}_mean"] = float(values.mean())
        for q in percentiles:
            summary[f"{key}_p{q:g}"] = float(torch.quantile(values, q / 100))
    summary["dropped_pairs"] = sum(layer["dropped_pairs"] for layer in layers)
    summary["trimmed_pairs"] = sum(layer["trimmed_pairs"] for layer in layers)
    return {"layers": layers, "summary": summary}


def flat_log(stats: dict, prefix: str = "load/", per_layer: bool = True) -> dict[str, float]:
    """One flat row of :func:`load_stats`'s result: ``{prefix}{key}`` for the summary, and
    ``{prefix}layer{i}/{key}`` for every layer when ``per_layer``."""
    row = {f"{prefix}{k}": v for k, v in stats["summary"].items()}
    if per_layer:
        for i, layer in enumerate(stats["layers"]):
            row.update({f"{prefix}layer{i}/{k}": v for k, v in layer.items()})
    return row
