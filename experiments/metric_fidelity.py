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

Three data sources (``--data``), each a layer, an input x and an upstream gradient δ = ∂L/∂y:

* ``gaussian`` and ``heavy``: the MoE layer of a debug preset at random initialisation (``weights:
  "random-init"``, ``layer: 0``), inputs x ~ N(0, 1) and δ either i.i.d. Gaussian or Gaussian with a log-normal
  per-token scale exp(N(0, 1)) (tokens whose losses differ, as in training);
* ``text``: every MoE layer of the debug preset's transformer (reference MoE layers) after ``--train-steps``
  steps of language-model training on byte-level text (Python's standard library by default), with that
  layer's real input x, captured by a forward hook, and the real gradient δ = ∂(LM loss)/∂y of its output,
  captured by a tensor hook, on a held-out batch (``weights: "trained-<steps>"``, ``layer``: the MoE layer's
  index). The trained weights are cached beside the results file, so reruns skip training.

Tokens are split over ``--sources`` simulated source ranks; quotas are ρ · routed pairs per (source rank,
expert), apportioned exactly (lrmoe.planner.quotas.apportion). The headline table (the second to last) is every metric's
error divided by random's at the same ρ and mode, per data source: below 1 the metric beats random. The computation
is lrmoe.analysis.fidelity, the data sources lrmoe.analysis.fidelity_sources; this script sweeps and reports.

    python experiments/metric_fidelity.py --out outputs/metric_fidelity.jsonl
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules (the fidelity modules load torch, the model and the metrics in their
# functions); pandas and matplotlib load in the functions that report and draw.
from lrmoe.analysis.fidelity import fidelity_sweep, ratio_table, verdict, versus_random
from lrmoe.analysis.fidelity_sources import (DATA, RANDOM_DATA, TrainSpec, capture_moe_io, corpus_digest,
                                             make_batch, moe_layers, text_batch, trained_model)
from lrmoe.cli import fraction_arg, positive_float_arg, positive_int_arg
from lrmoe.cli import one_of, script_parser
from lrmoe.config import model_preset
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd

    from lrmoe.integrations.data import Corpus

PRESETS = ("qwen3-30b-a3b-debug", "glm-4.5-air-debug")


def _metric_names() -> tuple[str, ...]:
    from lrmoe.recal.scoring import METRICS

    return tuple(METRICS)


def _mode_names() -> tuple[str, ...]:
    from lrmoe.recal.selection import MODES

    return tuple(MODES)


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/metric_fidelity.jsonl")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS), help="model presets (lrmoe.config)")
    parser.add_argument("--data", nargs="+", default=list(DATA), choices=DATA,
                        help="data sources: random-init layers on gaussian or heavy-tailed x and δ, or trained "
                             "layers on text")
    parser.add_argument("--metrics", nargs="+", default=None, type=one_of(_metric_names, "metric"),
                        help="pair metrics to compare (lrmoe.recal.scoring.METRICS; default all)")
    parser.add_argument("--modes", nargs="+", default=None, type=one_of(_mode_names, "mode"),
                        help="selection modes (lrmoe.recal.selection.MODES; default all)")
    parser.add_argument("--rhos", nargs="+", type=fraction_arg, default=[0.5, 0.7, 0.85],
                        help="retention ratios: the fraction of backward pairs kept")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--sources", type=int, default=4, help="simulated source ranks (quota groups)")
    parser.add_argument("--draws", type=int, default=8, help="draws per random configuration")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random layers, data and draws")
    group = parser.add_argument_group("the text source (trained layers, real gradients)")
    group.add_argument("--train-steps", type=int, default=None, help="training steps (default 150; --quick: 20)")
    group.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
    group.add_argument("--train-seq-len", type=positive_int_arg, default=None,
                       help="tokens per training sequence (default: the preset's seq_len)")
    group.add_argument("--train-lr", type=positive_float_arg, default=3e-3, help="training learning rate (AdamW)")
    group.add_argument("--aux-coef", type=float, default=0.1, help="load-balancing loss weight (as train.py)")
    group.add_argument("--bias-rate", type=float, default=1e-3, help="aux-free bias update rate (GLM)")
    group.add_argument("--corpus", default=None, help="folder or glob of text files (default: Python's stdlib)")
    group.add_argument("--max-bytes", type=int, default=1_000_000, help="bytes per split of the corpus")
    group.add_argument("--cache-dir", default=None,
                       help="where trained weights are cached (default: <results stem>_models beside the results)")
    parser.add_argument("--quick", action="store_true", help="tiny run for tests: 128 tokens, 2 draws, 20 steps")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "metric_fidelity")
    args.metrics = args.metrics or list(_metric_names())
    args.modes = args.modes or list(_mode_names())
    if args.quick:
        args.tokens, args.draws = 128, 2
        args.train_steps = 20 if args.train_steps is None else args.train_steps
    args.train_steps = 150 if args.train_steps is None else args.train_steps
    for name in ("tokens", "sources", "draws", "train_steps", "train_batch", "max_bytes"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.cache_dir is None:
        out = Path(args.out)
        args.cache_dir = str(out.with_name(f"{out.stem}_models"))
    return args


def sources(args, preset: str, corpus: Corpus | None, summary: dict):
    """Yield (labels, layer, x_TD, delta_TD) for every data source of ``preset`` the run asks for."""
    from lrmoe.runtime.reference import ReferenceMoE

    cfg = model_preset(preset)
    for data in args.data:
        if data in RANDOM_DATA:
            layer = ReferenceMoE.from_config(cfg, seed=args.seed)
            x_TD, delta_TD = make_batch(data, args.tokens, cfg.hidden, args.seed + 1)
            yield {"weights": "random-init", "data": data, "layer": 0}, layer, x_TD, delta_TD
            continue
        spec = TrainSpec(preset=preset, steps=args.train_steps, batch=args.train_batch,
                         seq_len=args.train_seq_len or cfg.seq_len, lr=args.train_lr, aux_coef=args.aux_coef,
                         bias_rate=args.bias_rate, seed=args.seed, corpus_digest=corpus_digest(corpus))
        t0 = time.perf_counter()
        model, info = trained_model(spec, corpus, Path(args.cache_dir))
        ids_BT, targets_BT = text_batch(corpus, args.tokens, spec.seq_len, args.seed + 1)
        xs, deltas, batch_loss = capture_moe_io(model, ids_BT, targets_BT)
        losses = info["losses"]
        train_loss = sum(losses[-10:]) / len(losses[-10:])
        summary[preset] = {"weights": spec.weights_label, "cached": info["cached"], "cache": str(info["path"]),
                           "first_loss": losses[0], "train_loss": train_loss, "batch_loss": batch_loss,
                           "seconds": time.perf_counter() - t0}
        print(f"{preset}: {spec.weights_label} ({'cached' if info['cached'] else 'trained'} in "
              f"{time.perf_counter() - t0:.1f} s), LM loss {losses[0]:.2f} → {train_loss:.2f} (last 10 steps), "
              f"held-out batch {batch_loss:.2f} nats/byte", flush=True)
        for i, (layer, x_TD, delta_TD) in enumerate(zip(moe_layers(model), xs, deltas)):
            labels = {"weights": spec.weights_label, "data": data, "layer": i, "train_loss": train_loss,
                      "batch_loss": batch_loss}
            yield labels, layer, x_TD, delta_TD


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import torch

    from lrmoe.integrations.data import load_corpus
    from lrmoe.integrations.tracking import Tracker

    torch.set_num_threads(1)
    rows = []
    start = time.perf_counter()
    corpus = load_corpus(args.corpus, max_bytes=args.max_bytes) if "text" in args.data else None
    with Tracker("metric_fidelity", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        training: dict = {}
        for preset in args.presets:
            for labels, layer, x_TD, delta_TD in sources(args, preset, corpus, training):
                for record in fidelity_sweep(layer, x_TD, delta_TD, metrics=args.metrics, modes=args.modes,
                                             rhos=args.rhos, sources=args.sources, draws=args.draws,
                                             seed=args.seed):
                    record = {"preset": preset, **labels, "tokens": x_TD.shape[0], **record}
                    run.log(record)
                    rows.append(record)
        table = pd.DataFrame(rows)
        index = ["preset", "weights", "data", "layer", "mode", "metric"]
        wide = table.pivot_table(index=index, columns="rho", values=["cos_w_mean", "rel_w_mean", "cos_x"]).round(3)
        wide.columns = [f"{name} ρ={rho:g}" for name, rho in wide.columns]
        print("\nGradient fidelity against the full gradient (debug-preset layers: random-init on random data, "
              "trained on text with real gradients; mean over draws where random):\n")
        print(wide.reset_index().to_markdown(index=False, floatfmt=".3f"))
        headline = pd.DataFrame()
        vs = versus_random(table) if "random" in args.metrics and len(args.metrics) > 1 else pd.DataFrame()
        if len(vs):
            best = vs.loc[vs.groupby(["preset", "weights", "data", "layer", "mode", "rho"])["ratio_to_random"].idxmin()]
            print("\nBest metric against random at the same ρ and mode (relative error of all expert weight "
                  "gradients; ratio < 1: the metric beats random):\n")
            print(best.to_markdown(index=False, floatfmt=".3f"))
            headline = ratio_table(vs)
            print("\nDoes any metric beat random? Per data source (mean over presets, layers and ρ):\n")
            print("\n".join(verdict(vs)))
            print("\nMean ratio to random (error of all expert weight gradients ÷ random's at the same ρ and mode; "
                  "< 1: the metric beats random), over everything, per data source (weights / data), and per ρ "
                  "on trained layers:\n")
            print(headline.to_markdown(index=False, floatfmt=".3f"))
        if (table.draws > 1).any():
            of_mean = table[table.draws > 1].pivot_table(index=["mode", "metric"], columns="rho",
                                                         values=["rel_w_all", "rel_w_of_mean"])
            of_mean.columns = [f"{name} ρ={rho:g}" for name, rho in of_mean.columns]
            print("\nSingle-draw error against the error of the mean over the draws (mean over presets, layers and "
                  "data; the unbiased mode's mean approaches the full gradient, about as 1/sqrt(draws)):\n")
            print(of_mean.reset_index().to_markdown(index=False, floatfmt=".3f"))
        run.log_summary({"ratio_to_random": headline.to_dict("records"), "training": training,
                         "seconds": time.perf_counter() - start})
        from lrmoe.paper_figures.run_figures import fidelity_grid

        fig, _ = fidelity_grid(run.results)
        figs = run.log_figure("fidelity", fig)
        plt.close(fig)
        print(f"\n{len(rows)} configurations in {time.perf_counter() - start:.1f} s; results: {args.out}; "
              f"figure: {figs[0]}")
    return table


if __name__ == "__main__":
    main()
