"""Gradient fidelity of backward recalibration: how close the recalibrated gradients stay to the full ones.

For a reference MoE layer, a batch, a retention ratio ρ, a metric and a selection mode, the backward hook keeps
≈ ρ of every (source rank, expert) group's pairs; we compare against the full gradient

* every expert's weight gradient (its three matrices, concatenated): cosine similarity and relative error
  ‖g − g_full‖ / ‖g_full‖, averaged over the experts that received pairs (and the worst expert);
* all experts' weight gradients together (``*_w_all``);
* the input gradient of the layer (router and shared-expert paths included, ``*_x``) and its part through the
  routed experts alone (``*_x_experts``).

Unbiased mode (and the random metric) are random: each configuration runs ``--draws`` draws; the table reports
the mean single-draw error and ``rel_w_of_mean``, the error of the gradient averaged over the draws (→ 0 for an
unbiased estimator, stays put for a biased one).

The layers are the MoE layers of the debug presets, at random initialisation (training does not exist yet in
this package: rerun on trained weights when it does). The data are random: inputs x ~ N(0, 1) and an upstream
gradient δ that is either i.i.d. Gaussian (``gaussian``) or Gaussian with a log-normal per-token scale,
exp(N(0, 1)) (``heavy``: tokens whose losses differ, as in training). Tokens are split over ``--sources``
simulated source ranks; quotas are ρ · routed pairs per (source rank, expert), apportioned exactly (lrmoe.quotas.apportion).

    python experiments/metric_fidelity.py --out outputs/metric_fidelity.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import torch  # noqa: E402

from lrmoe.config import model_preset  # noqa: E402
from lrmoe.recalibrate import Recalibration, pair_groups, pair_hook, proportional_quotas  # noqa: E402
from lrmoe.reference import ReferenceMoE  # noqa: E402
from lrmoe.scoring import METRICS  # noqa: E402
from lrmoe.selection import MODES  # noqa: E402
from lrmoe.tracking import Tracker, add_tracking_args  # noqa: E402

EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
DATA = ("gaussian", "heavy")
PRESETS = ("qwen3-30b-a3b-debug", "glm-4.5-air-debug")


@dataclass(frozen=True)
class Gradients:
    """The gradients the harness compares, for one backward pass."""

    expert_EV: torch.Tensor  # every expert's weight gradient, flattened (gate, up, down concatenated)
    x_TD: torch.Tensor  # input gradient of the layer


def make_batch(data: str, tokens: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x_TD and upstream gradient delta_TD of one batch of random data (see the module doc)."""
    if data not in DATA:
        raise ValueError(f"data={data!r} is not one of {DATA}")
    gen = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(tokens, hidden, generator=gen)
    delta_TD = torch.randn(tokens, hidden, generator=gen)
    if data == "heavy":
        delta_TD = delta_TD * torch.exp(torch.randn(tokens, 1, generator=gen))
    return x_TD, delta_TD


def layer_gradients(layer: ReferenceMoE, x_TD: torch.Tensor, delta_TD: torch.Tensor, **forward_kwargs) -> Gradients:
    """One forward and backward of ``layer`` with upstream gradient delta_TD."""
    x_TD = x_TD.clone().requires_grad_()
    y_TD, _ = layer(x_TD, **forward_kwargs)
    params = [getattr(layer, name) for name in EXPERT_WEIGHTS]
    *grads, grad_x = torch.autograd.grad(y_TD, params + [x_TD], grad_outputs=delta_TD)
    expert_EV = torch.cat([g.reshape(layer.num_experts, -1) for g in grads], dim=1)
    return Gradients(expert_EV=expert_EV, x_TD=grad_x)


def _cos(a: torch.Tensor, b: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    a, b = a.double(), b.double()
    if dim is None:
        a, b, dim = a.reshape(-1), b.reshape(-1), 0
    return (a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim)).clamp_min(1e-300)


def _rel(a: torch.Tensor, b: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """‖a − b‖ / ‖b‖."""
    a, b = a.double(), b.double()
    if dim is None:
        a, b, dim = a.reshape(-1), b.reshape(-1), 0
    return (a - b).norm(dim=dim) / b.norm(dim=dim).clamp_min(1e-300)


def compare(got: Gradients, full: Gradients, x_fixed_TD: torch.Tensor, active_E: torch.Tensor) -> dict:
    """Fidelity numbers of one recalibrated backward against the full one. ``x_fixed_TD``: the part of the
    input gradient that never changes (router and shared expert), ``active_E``: experts that got pairs."""
    cos_E = _cos(got.expert_EV, full.expert_EV, dim=1)[active_E]
    rel_E = _rel(got.expert_EV, full.expert_EV, dim=1)[active_E]
    return {
        "cos_w_mean": float(cos_E.mean()), "cos_w_min": float(cos_E.min()),
        "rel_w_mean": float(rel_E.mean()), "rel_w_max": float(rel_E.max()),
        "cos_w_all": float(_cos(got.expert_EV, full.expert_EV)),
        "rel_w_all": float(_rel(got.expert_EV, full.expert_EV)),
        "cos_x": float(_cos(got.x_TD, full.x_TD)), "rel_x": float(_rel(got.x_TD, full.x_TD)),
        "cos_x_experts": float(_cos(got.x_TD - x_fixed_TD, full.x_TD - x_fixed_TD)),
        "rel_x_experts": float(_rel(got.x_TD - x_fixed_TD, full.x_TD - x_fixed_TD)),
    }


def fidelity_sweep(layer: ReferenceMoE, x_TD: torch.Tensor, delta_TD: torch.Tensor, *, metrics=METRICS,
                   modes=MODES, rhos=(0.5, 0.7, 0.85), sources: int = 4, draws: int = 4, seed: int = 0) -> list[dict]:
    """Every (metric, mode, ρ) on one layer and batch: one record each, averaged over draws where random."""
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
                      rel_w_of_mean=float(_rel(mean_EV, full.expert_EV)),
                      kept_frac=float(quota_Q.sum()) / max(int(counts_Q.sum()), 1))
        records.append(record)
    return records


def versus_random(table: pd.DataFrame, key: str = "rel_w_all") -> pd.DataFrame:
    """For each setting, every metric's error divided by the random metric's error at the same ρ and mode."""
    cols = ["preset", "data", "mode", "rho"]
    base = table[table.metric == "random"].set_index(cols)[key].rename("random")
    joined = table[table.metric != "random"].join(base, on=cols)
    # undefined where random makes no error either (ρ = 1)
    joined["ratio_to_random"] = joined[key] / joined["random"].where(joined["random"] > 1e-6)
    return joined[cols + ["metric", key, "random", "ratio_to_random"]].dropna(subset=["ratio_to_random"])


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--data", nargs="+", default=list(DATA), choices=DATA)
    parser.add_argument("--metrics", nargs="+", default=list(METRICS), choices=METRICS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rhos", nargs="+", type=float, default=[0.5, 0.7, 0.85])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--sources", type=int, default=4, help="simulated source ranks (quota groups)")
    parser.add_argument("--draws", type=int, default=8, help="draws per random configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run for tests: 128 tokens, 2 draws")
    add_tracking_args(parser, "outputs/metric_fidelity.jsonl")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.draws = 128, 2
    torch.set_num_threads(1)
    rows = []
    start = time.perf_counter()
    with Tracker("metric_fidelity", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        for preset, data in itertools.product(args.presets, args.data):
            cfg = model_preset(preset)
            layer = ReferenceMoE.from_config(cfg, seed=args.seed)  # random init: no trained weights yet
            x_TD, delta_TD = make_batch(data, args.tokens, cfg.hidden, args.seed + 1)
            for record in fidelity_sweep(layer, x_TD, delta_TD, metrics=args.metrics, modes=args.modes,
                                         rhos=args.rhos, sources=args.sources, draws=args.draws, seed=args.seed):
                record = {"preset": preset, "data": data, "weights": "random-init", **record}
                run.log(record)
                rows.append(record)
        table = pd.DataFrame(rows)
        wide = table.pivot_table(index=["preset", "data", "mode", "metric"], columns="rho",
                                 values=["cos_w_mean", "rel_w_mean", "cos_x"]).round(3)
        wide.columns = [f"{name} ρ={rho:g}" for name, rho in wide.columns]
        print("Gradient fidelity against the full gradient (random-init debug-preset layers, random data; "
              "mean over draws where random):\n")
        print(wide.reset_index().to_markdown(index=False, floatfmt=".3f"))
        summary_rows = []
        vs = versus_random(table) if "random" in args.metrics and len(args.metrics) > 1 else pd.DataFrame()
        if len(vs):
            best = vs.loc[vs.groupby(["preset", "data", "mode", "rho"])["ratio_to_random"].idxmin()]
            print("\nBest metric against random at the same ρ and mode (relative error of all expert weight "
                  "gradients; ratio < 1: the metric beats random):\n")
            print(best.to_markdown(index=False, floatfmt=".3f"))
            mean_ratio = vs.groupby(["mode", "metric"])["ratio_to_random"].mean().reset_index()
            print("\nMean ratio to random over presets, data and ρ:\n")
            print(mean_ratio.to_markdown(index=False, floatfmt=".3f"))
            summary_rows = mean_ratio.to_dict("records")
        if (table.draws > 1).any():
            of_mean = table[table.draws > 1].pivot_table(index=["mode", "metric"], columns="rho",
                                                         values=["rel_w_all", "rel_w_of_mean"])
            of_mean.columns = [f"{name} ρ={rho:g}" for name, rho in of_mean.columns]
            print(f"\nSingle-draw error against the error of the mean over the draws (mean over presets and data; "
                  f"the unbiased mode's mean approaches the full gradient, about as 1/sqrt(draws)):\n")
            print(of_mean.reset_index().to_markdown(index=False, floatfmt=".3f"))
        run.log_summary({"ratio_to_random": summary_rows, "seconds": time.perf_counter() - start})
        sns.set_theme(style="whitegrid", context="paper")
        table["setting"] = table["preset"].str.replace("-debug", "") + " / " + table["data"]
        grid = sns.relplot(table, x="rho", y="rel_w_mean", hue="metric", style="metric", col="mode", row="setting",
                           kind="line", markers=True, height=2.2, aspect=1.6, facet_kws={"sharey": False})
        grid.set_titles("{row_name} | {col_name}")
        grid.set_axis_labels("retention ρ", "expert-gradient rel. error")
        grid.figure.suptitle("Recalibrated vs full expert weight gradients (random-init layers, random data)",
                             y=1.02)
        figs = run.log_figure("fidelity", grid.figure)
        plt.close(grid.figure)
        print(f"\n{len(rows)} configurations in {time.perf_counter() - start:.1f} s; results: {args.out}; "
              f"figure: {figs[0]}")
    return table


if __name__ == "__main__":
    main()
