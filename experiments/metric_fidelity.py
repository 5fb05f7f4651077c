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
error divided by random's at the same ρ and mode, per data source: below 1 the metric beats random.

    python experiments/metric_fidelity.py --out outputs/metric_fidelity.jsonl
"""

# No ``from __future__ import annotations``: tests load this script by path without entering it in sys.modules,
# and dataclasses cannot resolve string annotations of a module missing there. The annotations naming torch or the
# model are quoted (dotted, so dataclasses leave them be): those modules load in the functions, not for --help.
import argparse
import dataclasses
import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules; torch, the model, the metrics, pandas and matplotlib load in the
# functions that measure and draw.
from lrmoe.cli import fraction_arg, positive_float_arg, positive_int_arg
from lrmoe.cli import one_of, script_parser
from lrmoe.config import model_preset
from lrmoe.integrations.tracking import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from lrmoe.config import MoEConfig
    from lrmoe.integrations.data import Corpus
    from lrmoe.integrations.model import MoETransformer
    from lrmoe.runtime.reference import ReferenceMoE

EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
RANDOM_DATA = ("gaussian", "heavy")  # random-init layer, random x and δ
DATA = RANDOM_DATA + ("text",)  # text: trained layers, real x and δ
PRESETS = ("qwen3-30b-a3b-debug", "glm-4.5-air-debug")


@dataclass(frozen=True)
class Gradients:
    """The gradients the harness compares, for one backward pass."""

    expert_EV: "torch.Tensor"  # every expert's weight gradient, flattened (gate, up, down concatenated)
    x_TD: "torch.Tensor"  # input gradient of the layer


def make_batch(data: str, tokens: int, hidden: int, seed: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """Inputs x_TD and upstream gradient delta_TD of one batch of random data (see the module doc)."""
    import torch

    if data not in RANDOM_DATA:
        raise ValueError(f"data={data!r} is not one of the random sources {RANDOM_DATA}")
    gen = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(tokens, hidden, generator=gen)
    delta_TD = torch.randn(tokens, hidden, generator=gen)
    if data == "heavy":
        delta_TD = delta_TD * torch.exp(torch.randn(tokens, 1, generator=gen))
    return x_TD, delta_TD


def layer_gradients(layer: "ReferenceMoE", x_TD: "torch.Tensor", delta_TD: "torch.Tensor",
                    **forward_kwargs) -> Gradients:
    """One forward and backward of ``layer`` with upstream gradient delta_TD."""
    import torch

    x_TD = x_TD.clone().requires_grad_()
    y_TD, _ = layer(x_TD, **forward_kwargs)
    params = [getattr(layer, name) for name in EXPERT_WEIGHTS]
    *grads, grad_x = torch.autograd.grad(y_TD, params + [x_TD], grad_outputs=delta_TD)
    expert_EV = torch.cat([g.reshape(layer.num_experts, -1) for g in grads], dim=1)
    return Gradients(expert_EV=expert_EV, x_TD=grad_x)


def _cos(a: "torch.Tensor", b: "torch.Tensor", dim: int | None = None) -> "torch.Tensor":
    a, b = a.double(), b.double()
    if dim is None:
        a, b, dim = a.reshape(-1), b.reshape(-1), 0
    return (a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim)).clamp_min(1e-300)


def _rel(a: "torch.Tensor", b: "torch.Tensor", dim: int | None = None) -> "torch.Tensor":
    """‖a − b‖ / ‖b‖."""
    a, b = a.double(), b.double()
    if dim is None:
        a, b, dim = a.reshape(-1), b.reshape(-1), 0
    return (a - b).norm(dim=dim) / b.norm(dim=dim).clamp_min(1e-300)


def compare(got: Gradients, full: Gradients, x_fixed_TD: "torch.Tensor", active_E: "torch.Tensor") -> dict:
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


def fidelity_sweep(layer: "ReferenceMoE", x_TD: "torch.Tensor", delta_TD: "torch.Tensor", *, metrics=None,
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
                      rel_w_of_mean=float(_rel(mean_EV, full.expert_EV)),
                      kept_frac=float(quota_Q.sum()) / max(int(counts_Q.sum()), 1))
        records.append(record)
    return records


# --- the trained source: a debug transformer trained on text, its MoE layers' real x and δ ---------------------
@dataclass(frozen=True)
class TrainSpec:
    """How the ``text`` source's model is trained. Every field is part of the cache key."""

    preset: str
    steps: int
    batch: int  # sequences per step
    seq_len: int
    lr: float  # AdamW, no weight decay
    aux_coef: float  # load-balancing loss weight (global-batch form: one process holds the whole batch)
    bias_rate: float  # aux-loss-free selection-bias update rate (sigmoid_bias routers)
    seed: int
    corpus_digest: str  # sha256 prefix of the training bytes

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"TrainSpec.{name} must be a positive int, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainSpec.lr must be positive, got {self.lr!r}")
        for name in ("aux_coef", "bias_rate"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainSpec.{name} must be non-negative, got {getattr(self, name)!r}")

    @property
    def weights_label(self) -> str:
        return f"trained-{self.steps}"

    def cache_name(self) -> str:
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"{self.preset}-{self.weights_label}-{digest}.pt"


def corpus_digest(corpus: "Corpus") -> str:
    import torch

    return hashlib.sha256(corpus.train.to(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def build_model(cfg: "MoEConfig", seed: int) -> "MoETransformer":
    """The preset's single-process transformer with reference MoE layers (layer i drawn from seed · 1000 + i,
    as experiments/train.py draws them)."""
    from lrmoe.integrations.model import MoETransformer
    from lrmoe.runtime.reference import ReferenceMoE

    return MoETransformer(cfg, lambda i: ReferenceMoE.from_config(cfg, seed=seed * 1000 + i), seed=seed)


def moe_layers(model: "MoETransformer") -> "list[ReferenceMoE]":
    return [block.ffn for block in model.blocks if block.is_moe]


def train_model(spec: TrainSpec, corpus: "Corpus") -> "tuple[MoETransformer, list[float]]":
    """Train the preset's model from its seeded initialisation for ``spec.steps`` steps of next-byte prediction
    on ``corpus.train``. Returns the model and the LM loss of every step (deterministic for a given spec)."""
    import torch

    from lrmoe.integrations.data import get_batch
    from lrmoe.runtime.routing import update_expert_bias

    cfg = model_preset(spec.preset)
    model = build_model(cfg, spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(spec.seed)
    losses = []
    for _ in range(spec.steps):
        ids_BT, targets_BT = get_batch(corpus.train, spec.batch, spec.seq_len, gen)
        _, infos, loss, total = model(ids_BT, targets_BT, aux_coef=spec.aux_coef)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        if cfg.router == "sigmoid_bias":  # GLM-4.5: aux-loss-free balancing of the selection bias
            with torch.no_grad():
                for layer, info in zip(moe_layers(model), infos):
                    layer.bias_E.copy_(update_expert_bias(layer.bias_E, info.counts_E, spec.bias_rate))
        losses.append(float(loss.detach()))
    return model, losses


def trained_model(spec: TrainSpec, corpus: "Corpus", cache_dir: Path) -> "tuple[MoETransformer, dict]":
    """The model of ``spec``: loaded from ``cache_dir`` when a run with the same spec saved it, else trained and
    saved there. Returns the model and {"cached", "path", "losses"}."""
    import torch

    path = Path(cache_dir) / spec.cache_name()
    if path.exists():
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("spec") == dataclasses.asdict(spec):
            model = build_model(model_preset(spec.preset), spec.seed)
            model.load_state_dict(state["model"])
            return model, {"cached": True, "path": path, "losses": state["losses"]}
    model, losses = train_model(spec, corpus)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"spec": dataclasses.asdict(spec), "model": model.state_dict(), "losses": losses}, tmp)
    tmp.replace(path)  # atomic: an interrupted save leaves no half-written cache entry
    return model, {"cached": False, "path": path, "losses": losses}


def capture_moe_io(model: "MoETransformer", ids_BT: "torch.Tensor", targets_BT: "torch.Tensor"
                   ) -> "tuple[list[torch.Tensor], list[torch.Tensor], float]":
    """One forward and backward of the LM loss (no auxiliary loss) through ``model``. Returns, for every MoE
    layer, its input x_TD (forward hook on the block's FFN) and the gradient delta_TD = ∂(LM loss)/∂y_TD of its
    output (tensor hook on y), and the loss. Parameter gradients are left cleared."""
    layers = moe_layers(model)
    xs: "list[torch.Tensor | None]" = [None] * len(layers)
    deltas: "list[torch.Tensor | None]" = [None] * len(layers)

    def forward_hook(i):
        def hook(module, inputs, output):
            xs[i] = inputs[0].detach().clone()
            output[0].register_hook(lambda grad: deltas.__setitem__(i, grad.detach().clone()))
        return hook

    handles = [layer.register_forward_hook(forward_hook(i)) for i, layer in enumerate(layers)]
    try:
        _, _, loss, _ = model(ids_BT, targets_BT)
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    if any(d is None for d in deltas):
        raise RuntimeError("an MoE layer's output received no gradient")
    return xs, deltas, float(loss.detach())


def text_batch(corpus: "Corpus", tokens: int, seq_len: int, seed: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """A held-out batch of about ``tokens`` tokens: max(1, tokens // seq_len) windows of min(seq_len, tokens)."""
    import torch

    from lrmoe.integrations.data import get_batch

    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    length = min(seq_len, tokens)
    return get_batch(corpus.val, max(1, tokens // length), length, torch.Generator().manual_seed(seed))


def versus_random(table: "pd.DataFrame", key: str = "rel_w_all") -> "pd.DataFrame":
    """For each setting, every metric's error divided by the random metric's error at the same ρ and mode."""
    cols = [c for c in ("preset", "weights", "data", "layer", "mode", "rho") if c in table]
    base = table[table.metric == "random"].set_index(cols)[key].rename("random")
    joined = table[table.metric != "random"].join(base, on=cols)
    # undefined where random makes no error either (ρ = 1)
    joined["ratio_to_random"] = joined[key] / joined["random"].where(joined["random"] > 1e-6)
    return joined[cols + ["metric", key, "random", "ratio_to_random"]].dropna(subset=["ratio_to_random"])


def ratio_table(vs: "pd.DataFrame") -> "pd.DataFrame":
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


def verdict(vs: "pd.DataFrame") -> list[str]:
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


def sources(args, preset: str, corpus: "Corpus | None", summary: dict):
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


def main(argv=None) -> "pd.DataFrame":
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
