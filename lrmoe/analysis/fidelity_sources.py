"""The data sources of the gradient-fidelity sweep (lrmoe.analysis.fidelity), each a layer, an input x and an upstream
gradient δ = ∂L/∂y:

* ``gaussian`` and ``heavy`` (:func:`make_batch`): a preset's MoE layer at random initialisation, x ~ N(0, 1) and δ
  either i.i.d. Gaussian or Gaussian with a log-normal per-token scale exp(N(0, 1)) (tokens whose losses differ);
* ``text``: every MoE layer of a debug preset's transformer trained on byte-level text (:class:`TrainSpec`,
  :func:`trained_model`: trained once, then cached by spec), with that layer's real input x and the real gradient
  δ = ∂(LM loss)/∂y of its output on a held-out batch (:func:`capture_moe_io`, :func:`text_batch`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lrmoe.config import layer_seed, model_preset

# torch, the model and the data load in the functions: the script's --help imports this module's names only
if TYPE_CHECKING:
    import torch

    from lrmoe.config import MoEConfig
    from lrmoe.integrations.data import Corpus
    from lrmoe.integrations.model import MoETransformer
    from lrmoe.runtime.reference import ReferenceMoE

RANDOM_DATA = ("gaussian", "heavy")  # random-init layer, random x and δ
DATA = RANDOM_DATA + ("text",)  # text: trained layers, real x and δ


def make_batch(data: str, tokens: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def corpus_digest(corpus: Corpus) -> str:
    import torch

    return hashlib.sha256(corpus.train.to(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def build_model(cfg: MoEConfig, seed: int) -> MoETransformer:
    """The preset's single-process transformer with reference MoE layers (layer i drawn from
    lrmoe.config.layer_seed, as experiments/train.py draws them)."""
    from lrmoe.integrations.model import MoETransformer
    from lrmoe.runtime.reference import ReferenceMoE

    return MoETransformer(cfg, lambda i: ReferenceMoE.from_config(cfg, seed=layer_seed(seed, i)), seed=seed)


def moe_layers(model: MoETransformer) -> list[ReferenceMoE]:
    return [block.ffn for block in model.blocks if block.is_moe]


def train_model(spec: TrainSpec, corpus: Corpus) -> tuple[MoETransformer, list[float]]:
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


def trained_model(spec: TrainSpec, corpus: Corpus, cache_dir: Path) -> tuple[MoETransformer, dict]:
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


def capture_moe_io(model: MoETransformer, ids_BT: torch.Tensor, targets_BT: torch.Tensor
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """One forward and backward of the LM loss (no auxiliary loss) through ``model``. Returns, for every MoE
    layer, its input x_TD (forward hook on the block's FFN) and the gradient delta_TD = ∂(LM loss)/∂y_TD of its
    output (tensor hook on y), and the loss. Parameter gradients are left cleared."""
    layers = moe_layers(model)
    xs: list[torch.Tensor | None] = [None] * len(layers)
    deltas: list[torch.Tensor | None] = [None] * len(layers)

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


def text_batch(corpus: Corpus, tokens: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A held-out batch of about ``tokens`` tokens: max(1, tokens // seq_len) windows of min(seq_len, tokens)."""
    import torch

    from lrmoe.integrations.data import get_batch

    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    length = min(seq_len, tokens)
    return get_batch(corpus.val, max(1, tokens // length), length, torch.Generator().manual_seed(seed))
