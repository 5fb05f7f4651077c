"""Gradient fidelity of backward recalibration: how close the recalibrated gradients of one MoE layer stay to the full
ones (experiments/metric_fidelity.py sweeps it over presets, data sources, metrics, modes and ρ; the metric notebook
draws one configuration at a time).

For a layer, an input x and an upstream gradient δ, :func:`fidelity_sweep` runs the recalibrated backward of every
(metric, mode, ρ) and :func:`compare` sets it against the full one: every expert's weight gradient (its three
matrices, concatenated), all experts' together (``*_w_all``), the layer's input gradient (``*_x``) and its part
through the routed experts alone (``*_x_experts``). :func:`versus_random`, :func:`ratio_table` and :func:`verdict`
read a sweep's records: every metric's error against random's at the same ρ and mode.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

# torch, the layer and the metrics load in the functions: the script's --help imports this module's names only
if TYPE_CHECKING:
    import pandas as pd
    import torch

    from lrmoe.runtime.reference import ReferenceMoE

EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")


@dataclass(frozen=True)
class Gradients:
    """The gradients the harness compares, for one backward pass."""

    expert_EV: torch.Tensor  # every expert's weight gradient, flattened (gate, up, down concatenated)
    x_TD: torch.Tensor  # input gradient of the layer


def layer_gradients(layer: ReferenceMoE, x_TD: torch.Tensor, delta_TD: torch.Tensor,
                    **forward_kwargs) -> Gradients:
    """One forward and backward of ``layer`` with upstream gradient delta_TD."""
    import torch

    x_TD = x_TD.clone().requires_grad_()
    y_TD, _ = layer(x_TD, **forward_kwargs)
    params = [getattr(layer, name) for name in EXPERT_WEIGHTS]
    *grads, grad_x = torch.autograd.grad(y_TD, params + [x_TD], grad_outputs=delta_TD)
    expert_EV = torch.cat([g.reshape(layer.num_experts, -1) for g in grads], dim=1)
    return Gradients(expert_EV=expert_EV, x_TD=grad_x)


def cosine(a: torch.Tensor, b: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """cos(a, b) in float64, along ``dim`` (None: of the flattened tensors)."""
    a, b = a.double(), b.double()
    if dim is None:
        a, b, dim = a.reshape(-1), b.reshape(-1), 0
    return (a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim)).clamp_min(1e-300)


def relative_error(a: torch.Tensor, b: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """‖a − b‖ / ‖b‖ in float64, along ``dim`` (None: of the flattened tensors)."""
    a, b = a.double(), b.double()
    if dim is None:
        a, b, dim = a.reshape(-1), b.reshape(-1), 0
    return (a - b).norm(dim=dim) / b.norm(dim=dim).clamp_min(1e-300)


def expert_errors(got: Gradients, full: Gradients, active_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert that got pairs (``active_E``): the cosine and the relative error of its weight gradient against the
    full one (float64)."""
    return (cosine(got.expert_EV, full.expert_EV, dim=1)[active_E],
            relative_error(got.expert_EV, full.expert_EV, dim=1)[active_E])


def compare(got: Gradients, full: Gradients, x_fixed_TD: torch.Tensor, active_E: torch.Tensor) -> dict:
    """Fidelity numbers of one recalibrated backward against the full one. ``x_fixed_TD``: the part of the
    input gradient that never changes (router and shared expert), ``active_E``: experts that got pairs."""
    cos_E, rel_E = expert_errors(got, full, active_E)
    return {
        "cos_w_mean": float(cos_E.mean()), "cos_w_min": float(cos_E.min()),
        "rel_w_mean": float(rel_E.mean()), "rel_w_max": float(rel_E.max()),
        "cos_w_all": float(cosine(got.expert_EV, full.expert_EV)),
        "rel_w_all": float(relative_error(got.expert_EV, full.expert_EV)),
        "cos_x": float(cosine(got.x_TD, full.x_TD)), "rel_x": float(relative_error(got.x_TD, full.x_TD)),
        "cos_x_experts": float(cosine(got.x_TD - x_fixed_TD, full.x_TD - x_fixed_TD)),
        "rel_x_experts": float(relative_error(got.x_TD - x_fixed_TD, full.x_TD - x_fixed_TD)),
    }


def fidelity_sweep(layer: ReferenceMoE, x_TD: torch.Tensor, delta_TD: torch.Tensor, *, metrics=None,
                   modes=None, rhos=(0.5, 0.7, 0.85), sources: int = 4, draws: int = 4, seed: int = 0) -> list[dict]:
    """Every (metric, mode, ρ) on one layer and batch (metrics and modes: all by default): one record each,
    averaged over draws where random."""
    import torch

    from lrmoe.recal.recalibrate import Recalibration, pair_groups, pair_hook, proportional_quotas
    from lrmoe.recal.scoring import METRICS
    from lrmoe.recal.selection import MODES

    metrics, modes = metrics or METRICS, modes or MODES
    full = layer_gradients(layer, x_TD, delta_TD)
    with torch.no_grad():
        _, aux = layer(x_TD)
    K = layer.top_k
    x_fixed_TD = layer_gradients(layer, x_TD, delta_TD,
                                 keep_TK=torch.zeros(x_TD.shape[0], K, dtype=torch.bool)).x_TD
    active_E = aux.counts_E > 0
    group_P, counts_Q = pair_groups(aux.idx_TK, layer.num_experts, sources)
    records = []
    for metric, mode, rho in itertools.product(metrics, modes, rhos):
        quota_Q = proportional_quotas(counts_Q, rho)
        random_draws = mode == "unbiased" or metric == "random"
        n_draws = draws if random_draws else 1
        gen = torch.Generator().manual_seed(seed)
        rec = Recalibration(metric, mode, group_P, quota_Q, gen)
        per_draw, mean_EV = [], torch.zeros_like(full.expert_EV)
        for _ in range(n_draws):
            got = layer_gradients(layer, x_TD, delta_TD, pair_hook=pair_hook(rec))
            per_draw.append(compare(got, full, x_fixed_TD, active_E))
            mean_EV += got.expert_EV / n_draws
        record = {key: sum(d[key] for d in per_draw) / n_draws for key in per_draw[0]}
        if n_draws > 1:
            record["rel_w_all_std"] = float(torch.tensor([d["rel_w_all"] for d in per_draw]).std())
        record.update(metric=metric, mode=mode, rho=rho, draws=n_draws,
                      rel_w_of_mean=float(relative_error(mean_EV, full.expert_EV)),
                      kept_frac=float(quota_Q.sum()) / max(int(counts_Q.sum()), 1))
        records.append(record)
    return records


def versus_random(table: pd.DataFrame, key: str = "rel_w_all") -> pd.DataFrame:
    """For each setting, every metric's error divided by the random metric's error at the same ρ and mode."""
    cols = [c for c in ("preset", "weights", "data", "layer", "mode", "rho") if c in table]
    base = table[table.metric == "random"].set_index(cols)[key].rename("random")
    joined = table[table.metric != "random"].join(base, on=cols)
    # undefined where random makes no error either (ρ = 1)
    joined["ratio_to_random"] = joined[key] / joined["random"].where(joined["random"] > 1e-6)
    return joined[cols + ["metric", key, "random", "ratio_to_random"]].dropna(subset=["ratio_to_random"])


def ratio_table(vs: pd.DataFrame) -> pd.DataFrame:
    """The headline: mean ratio to random per (mode, metric), over everything (``all``), per data source
    (weights / data) and, for trained sources, per ρ."""
    vs = vs.assign(source=vs["weights"] + " / " + vs["data"])
    table = vs.groupby(["mode", "metric"])["ratio_to_random"].mean().rename("all").to_frame()
    table = table.join(vs.pivot_table(index=["mode", "metric"], columns="source", values="ratio_to_random"))
    trained = vs[vs.weights.str.startswith("trained")]
    if len(trained):
        per_rho = trained.pivot_table(index=["mode", "metric"], columns=["source", "rho"], values="ratio_to_random")
        per_rho.columns = [f"{source} ρ={rho:g}" for source, rho in per_rho.columns]
        table = table.join(per_rho)
    return table.reset_index()


def verdict(vs: pd.DataFrame) -> list[str]:
    """Lines per data source: the best metric against random in each mode (mean over presets, layers and ρ), and
    the best (metric, mode) against the stronger of the two random baselines (random in the top-k mode shrinks
    the gradient by about ρ; random in the unbiased mode rescales kept pairs by 1/p and does not)."""
    lines = []
    vs = vs.assign(source=vs["weights"] + " / " + vs["data"])
    mean = vs.groupby(["source", "mode", "metric"], as_index=False)[["rel_w_all", "random", "ratio_to_random"]].mean()
    for source, by_source in mean.groupby("source"):
        for mode, part in by_source.groupby("mode"):
            best = part.loc[part["ratio_to_random"].idxmin()]
            beats = "beats" if best.ratio_to_random < 1 else "does not beat"
            lines.append(f"* {source}, {mode}: best metric {best.metric} {beats} random, error "
                         f"{best.rel_w_all:.3f} vs {best.random:.3f} (ratio {best.ratio_to_random:.2f})")
        best = by_source.loc[by_source["rel_w_all"].idxmin()]
        base = by_source.groupby("mode")["random"].first()
        ratio = best.rel_w_all / base.min()
        lines.append(f"* {source}, across modes: best {best.metric} ({best['mode']}), error {best.rel_w_all:.3f} "
                     f"vs the better random baseline ({base.idxmin()}) {base.min():.3f}: ratio {ratio:.2f}")
    return lines
