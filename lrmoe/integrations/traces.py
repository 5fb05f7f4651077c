"""Routing traces: routed-pair counts per (step, layer, source rank, expert), synthetic or recorded.

Synthetic generator (labelled ``"synthetic"`` in the metadata): each layer gets a base popularity over experts,
Zipf(s) over a random permutation of the experts or Dirichlet(α); the log-popularity drifts across steps as an
AR(1) process; every token picks top-k experts without replacement by Gumbel-top-k on the log-popularity.

Two sampling modes:

* ``exact=True``: per-token Gumbel-top-k (also yields the tokens' choices and gate weights, see
  :func:`sample_routing`); cost grows with tokens × experts;
* ``exact=False`` (paper scale): each source rank's counts are Multinomial(T·k, π/k), where π are the top-k
  inclusion probabilities of Gumbel-top-k (see :func:`inclusion_probs`). Totals are exact (Σ_e counts = T·k);
  per-expert means match the exact mode's (checked in the tests); per-token distinctness is not modelled.

On-disk format (``.npz``, readable without torch, loaded without pickle): ``counts`` int64 [I, L, N, E] and
``meta`` (a JSON string: format name and version, model, seed, generator and its parameters, or ``"source":
"recorded"`` with where the routing came from). :func:`load_trace` checks a file before trusting it: anything else
(a text file, a pickle, a bare array, a Megatron-Core JSON-lines trace) raises :class:`TraceFormatError` naming the
file and what is wrong with it.

Recorded traces come from real routers:

* :class:`RouterRecorder`: forward hooks on the router modules of any Hugging Face MoE model (Qwen3-MoE,
  GLM-4.5, Mixtral, ...; swapped onto the expert-parallel layer or not). One model forward is one step (the
  routers' recomputation in the backward, under activation checkpointing, is not counted again); the
  tokens of a forward can be split over ``num_ranks`` virtual source ranks (contiguous blocks, as data parallelism
  splits a batch). Under ``torch.distributed`` each rank records its own tokens and
  ``lrmoe.integrations.hf.gather_trace``
  joins them (:func:`join_ranks`).
* :func:`import_megatron_trace`: Megatron-Core's router traces (``--moe-routing-trace-path``: one JSON-lines file
  per rank, one record per step, layer and rank with the top-k expert indices of its tokens).
"""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lrmoe.runtime.layer import recomputing

TRACE_FORMAT = "lrmoe-trace"
TRACE_VERSION = 1


@dataclass
class Trace:
    counts_ILNE: torch.Tensor  # long [steps, layers, source ranks, experts]: routed pairs
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.counts_ILNE.dim() != 4:
            raise ValueError(f"counts_ILNE must be 4-D [steps, layers, ranks, experts], "
                             f"got shape {tuple(self.counts_ILNE.shape)}")
        if (self.counts_ILNE < 0).any():
            raise ValueError("counts_ILNE holds negative counts")

    @property
    def num_steps(self) -> int:
        return self.counts_ILNE.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts_ILNE.shape[1]

    @property
    def num_ranks(self) -> int:
        return self.counts_ILNE.shape[2]

    @property
    def num_experts(self) -> int:
        return self.counts_ILNE.shape[3]

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"trace files end in .npz, got {path}")
        if path.exists() and not overwrite:
            raise FileExistsError(f"trace file {path} exists; pass overwrite=True to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **self.meta}
        np.savez_compressed(path, counts=self.counts_ILNE.numpy().astype(np.int64), meta=np.array(json.dumps(meta)))
        return path

    def summary(self) -> dict:
        """Skew statistics over the whole trace: Gini and max/mean of per-expert counts, per layer-step."""
        per_expert_ILE = self.counts_ILNE.sum(dim=2).double()
        return {"gini_mean": float(gini(per_expert_ILE).mean()),
                "max_over_mean_mean": float(max_over_mean(per_expert_ILE).mean()),
                "max_over_mean_max": float(max_over_mean(per_expert_ILE).max()),
                "steps": self.num_steps, "layers": self.num_layers, "ranks": self.num_ranks,
                "experts": self.num_experts, "source": self.meta.get("source", "unknown")}


class TraceFormatError(ValueError):
    """A file that is not a valid trace; the message names the file and what is wrong."""


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip archive (an .npz), or an empty one


def _describe(head: bytes) -> str:
    """What a file that is not a zip archive looks like, from its first bytes."""
    if not head:
        return "an empty file"
    if head.startswith(b"\x93NUMPY"):
        return "a bare .npy array (traces are .npz archives with 'counts' and 'meta')"
    if head[:1] == b"\x80":
        return "a Python pickle (e.g. torch.save output); traces never hold pickled data"
    if head.lstrip()[:1] in (b"{", b"["):
        return ("JSON text: if it is a Megatron-Core router trace (--moe-routing-trace-path), convert it with "
                "lrmoe.integrations.traces.import_megatron_trace")
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError:
        return f"binary data starting with {head[:8]!r}"


def load_trace(path: str | Path) -> Trace:
    """Read a trace file written by :meth:`Trace.save`, without pickle. Raises :class:`TraceFormatError` (a
    ``ValueError``) naming the file for anything that is not a valid trace, ``FileNotFoundError`` if it is absent."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file {path} does not exist")
    if path.is_dir():
        raise TraceFormatError(f"{path} is a directory, not a trace file (.npz); a folder of Megatron-Core router "
                               f"traces is read by lrmoe.integrations.traces.import_megatron_trace")
    with open(path, "rb") as f:
        head = f.read(64)
    if head[:4] not in _ZIP_MAGIC:
        raise TraceFormatError(f"{path} is not an {TRACE_FORMAT} file (an .npz archive holding 'counts' and "
                               f"'meta'): it is {_describe(head)}")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("counts", "meta") if k not in data.files]
            if missing:
                raise TraceFormatError(f"{path} is an .npz archive but not an {TRACE_FORMAT} file: it lacks "
                                       f"{missing} (it holds {sorted(data.files)})")
            counts, meta_raw = data["counts"], data["meta"]
    except TraceFormatError:
        raise
    except ValueError as exc:
        if "pickle" not in str(exc):  # numpy refuses object arrays without pickle; anything else is a bad file
            raise TraceFormatError(f"{path} is not a readable .npz archive: {exc}") from None
        raise TraceFormatError(f"{path} holds pickled (object) arrays; an {TRACE_FORMAT} file holds only integer "
                               f"counts and a JSON string, and is read without pickle") from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise TraceFormatError(f"{path} is not a readable .npz archive: {exc}") from None
    if meta_raw.dtype.kind != "U" or meta_raw.ndim != 0:
        raise TraceFormatError(f"{path}: 'meta' must be one JSON string, got a {meta_raw.dtype} array of shape "
                               f"{meta_raw.shape}")
    try:
        meta = json.loads(str(meta_raw))
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: 'meta' is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise TraceFormatError(f"{path}: 'meta' must be a JSON object, got {type(meta).__name__}")
    if meta.get("format") != TRACE_FORMAT:
        raise TraceFormatError(f"{path} is not an {TRACE_FORMAT} file (format={meta.get('format')!r})")
    if meta.get("version") != TRACE_VERSION:
        raise TraceFormatError(f"{path} has trace version {meta.get('version')}, this package reads {TRACE_VERSION}")
    if counts.dtype.kind not in "iu" or counts.ndim != 4:
        raise TraceFormatError(f"{path}: 'counts' must be an integer array [steps, layers, ranks, experts], got "
                               f"{counts.dtype} of shape {counts.shape}")
    if counts.size and counts.min() < 0:
        raise TraceFormatError(f"{path}: 'counts' holds negative counts")
    return Trace(torch.from_numpy(counts.astype(np.int64)), meta)


def join_ranks(traces: Sequence[Trace]) -> Trace:
    """One trace from per-rank traces of the same steps and layers (each with its own source ranks), ranks in the
    order given: what every rank of a data-parallel run recorded, as one N-rank trace."""
    if not traces:
        raise ValueError("join_ranks needs at least one trace")
    shape = traces[0].counts_ILNE.shape
    for i, t in enumerate(traces):
        if (t.num_steps, t.num_layers, t.num_experts) != (shape[0], shape[1], shape[3]):
            raise ValueError(f"trace {i} has {t.num_steps} steps, {t.num_layers} layers, {t.num_experts} experts; "
                             f"trace 0 has {shape[0]}, {shape[1]}, {shape[3]}")
    meta = dict(traces[0].meta)
    return Trace(torch.cat([t.counts_ILNE for t in traces], dim=2), meta)


# -- skew statistics ------------------------------------------------------------------------------------------
def gini(x: torch.Tensor) -> torch.Tensor:
    """Gini coefficient over the last dimension (0: all equal; → 1: all mass on one entry)."""
    x = torch.sort(x.double(), dim=-1).values
    n = x.shape[-1]
    rank = torch.arange(1, n + 1, dtype=torch.float64)
    total = x.sum(dim=-1)
    return ((2 * rank - n - 1) * x).sum(dim=-1) / (n * total.clamp_min(1e-300))


def max_over_mean(x: torch.Tensor) -> torch.Tensor:
    """Hottest entry over the mean, over the last dimension."""
    x = x.double()
    return x.max(dim=-1).values / x.mean(dim=-1).clamp_min(1e-300)


def rank_loads(counts_E: torch.Tensor, placement_NS: torch.Tensor) -> torch.Tensor:
    """Per-rank load [N] when each expert's pairs split evenly over its replicas in ``placement_NS`` (-1 empty)."""
    num_experts = counts_E.shape[-1]
    flat = placement_NS.reshape(-1)
    valid = flat >= 0
    replicas_E = torch.bincount(flat[valid], minlength=num_experts)
    if (replicas_E == 0).any():
        raise ValueError(f"experts {torch.nonzero(replicas_E == 0).flatten().tolist()} have no slot in the placement")
    per_slot = torch.zeros(flat.shape, dtype=torch.float64)
    per_slot[valid] = counts_E.double()[flat[valid]] / replicas_E[flat[valid]]
    return per_slot.reshape(placement_NS.shape).sum(dim=-1)


# -- popularity ------------------------------------------------------------------------------------------------
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
    gumbel = _gumbel((num_tokens, logp_E.shape[-1]), generator)
    return torch.topk(logp_E + gumbel, top_k, dim=-1).indices


def _gumbel(shape, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-20, 1 - 1e-16)
    return -torch.log(-torch.log(u))


def sample_routing(p_E: torch.Tensor, num_tokens: int, top_k: int, family: str, generator: torch.Generator,
                   temperature: float = 1.0):
    """Synthetic router output for ``num_tokens`` tokens: logits = (log p + Gumbel) / temperature, routed by the
    family's router, so choices are Gumbel-top-k and gate weights have the family's form."""
    from lrmoe.runtime.routing import route

    logits_TE = (torch.log(p_E.double()) + _gumbel((num_tokens, p_E.shape[-1]), generator)) / temperature
    return route(logits_TE.float(), family, top_k)


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


# -- recorded traces: Hugging Face router hooks, Megatron-Core router-trace files -------------------------------
def _config_num_experts(config) -> int | None:
    for name in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The router modules of a Hugging Face MoE model, in layer order: instances of the class its
    ``_can_record_outputs["router_logits"]`` hooks (the class ``output_router_logits=True`` collects from), else
    the ``gate`` / ``router`` child of every module that also has an ``experts`` child."""
    spec = getattr(model, "_can_record_outputs", None) or {}
    targets = spec.get("router_logits")
    targets = targets if isinstance(targets, (list, tuple)) else [targets] if targets is not None else []
    classes = tuple(getattr(t, "target_class", t) for t in targets if isinstance(getattr(t, "target_class", t), type))
    if classes:
        found = [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
        if found:
            return found
    found = []
    for name, m in model.named_modules():
        children = dict(m.named_children())
        if "experts" in children:
            for key in ("gate", "router"):
                if key in children:
                    found.append((f"{name}.{key}" if name else key, children[key]))
                    break
    return found


class RouterRecorder:
    """Records the routing of a Hugging Face MoE model as a trace: one forward hook per router module.

    Each router call contributes its tokens' top-k choices: the integer [tokens, k] tensor of the router's output
    (HF 5.x routers return ``(logits, weights, indices)``), or, for a router that returns only logits, their
    top-``top_k`` (the choice of a softmax router; a router that selects on biased scores must return indices).
    Every ``micro_batches``-th forward of ``model`` closes one step (``auto_step=False``: call :meth:`next_step`),
    so that with gradient accumulation a step of the trace is an optimizer step, summed over its micro-batches, and
    the trace's metadata says so (``micro_batches``; the simulator splits each step into that many,
    :func:`lrmoe.sim.simulator.micro_batch_counts`). A recomputation inside the backward (activation checkpointing)
    is not a forward. The tokens of a call are split into ``num_ranks`` contiguous blocks, one per virtual source
    rank.

        with RouterRecorder(model) as rec:
            for batch in batches:
                model(**batch)
        rec.trace().save("routing.npz")

    A real checkpoint on a machine with the weights: ``model = AutoModelForCausalLM.from_pretrained(path)``, then
    the same lines. A model swapped onto the expert-parallel layer keeps HF's routers, so it records the same way
    (each rank its own tokens; ``lrmoe.integrations.hf.gather_trace`` joins the ranks).
    """

    def __init__(self, model: nn.Module, num_ranks: int = 1, num_experts: int | None = None,
                 top_k: int | None = None, auto_step: bool = True, routers: list[tuple[str, nn.Module]] | None = None,
                 micro_batches: int = 1):
        for name, value in (("num_ranks", num_ranks), ("micro_batches", micro_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model, self.num_ranks, self.micro_batches = model, num_ranks, micro_batches
        self._forwards = 0  # model forwards since the last closed step
        config = getattr(model, "config", None)
        self.routers = router_modules(model) if routers is None else list(routers)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no router module to record (no class in "
                             f"_can_record_outputs['router_logits'], no gate/router beside experts)")
        self.num_experts = num_experts or _config_num_experts(config)
        self.top_k = top_k or getattr(config, "num_experts_per_tok", None)
        self.steps: list[torch.Tensor] = []  # closed steps, each [L, N, E]
        self._current: torch.Tensor | None = None
        self._handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self.routers)]
        if auto_step:
            self._handles.append(model.register_forward_hook(lambda *_: self._forward_done()))

    def _forward_done(self) -> None:
        if recomputing():
            return
        self._forwards += 1
        if self._forwards >= self.micro_batches:
            self.next_step()

    def _hook(self, layer: int):
        def hook(module, args, output):
            if recomputing():
                return  # a recomputation inside the backward (activation checkpointing): its forward was counted
            idx_TK = self._indices(module, output)
            E = self.num_experts
            if self._current is None:
                self._current = torch.zeros(len(self.routers), self.num_ranks, E, dtype=torch.long)
            for n, part in enumerate(torch.tensor_split(idx_TK.detach().reshape(-1, idx_TK.shape[-1]).cpu(),
                                                        self.num_ranks)):
                self._current[layer, n] += torch.bincount(part.reshape(-1), minlength=E)
        return hook

    def _indices(self, module: nn.Module, output) -> torch.Tensor:
        outs = output if isinstance(output, (tuple, list)) else (output,)
        ints = [o for o in outs if torch.is_tensor(o) and not o.is_floating_point() and o.dim() >= 2]
        logits = [o for o in outs if torch.is_tensor(o) and o.is_floating_point() and o.dim() >= 2]
        if self.num_experts is None:
            self.num_experts = getattr(module, "num_experts", None) or (logits[0].shape[-1] if logits else None)
            if self.num_experts is None:
                raise ValueError("RouterRecorder: the number of experts is unknown: pass num_experts")
        if ints:
            idx = ints[-1]
        elif logits:
            if self.top_k is None:
                raise ValueError(f"router {type(module).__name__} returns logits only: pass top_k")
            idx = torch.topk(logits[0].reshape(-1, logits[0].shape[-1]), self.top_k, dim=-1).indices
        else:
            raise ValueError(f"router {type(module).__name__} returned neither indices nor logits")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_experts):
            raise ValueError(f"router {type(module).__name__} chose experts outside [0, {self.num_experts})")
        return idx

    def next_step(self) -> None:
        """Close the current step (a no-op if no router fired since the last one)."""
        self._forwards = 0
        if self._current is not None:
            self.steps.append(self._current)
            self._current = None

    def remove(self) -> None:
        """Remove the hooks (the recorded steps stay)."""
        self.next_step()
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "RouterRecorder":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def trace(self, **meta) -> Trace:
        """The recorded steps as a :class:`Trace` (source "recorded"; ``meta`` adds to the metadata)."""
        self.next_step()
        if not self.steps:
            raise ValueError("RouterRecorder recorded no step: run the model first")
        config = getattr(self.model, "config", None)
        info = {"source": "recorded", "recorder": "hf-router-hooks",
                "model": getattr(config, "_name_or_path", None) or getattr(config, "model_type", None),
                "model_type": getattr(config, "model_type", None), "top_k": self.top_k,
                "routers": [name for name, _ in self.routers], "virtual_ranks": self.num_ranks,
                "micro_batches": self.micro_batches}
        return Trace(torch.stack(self.steps), {**info, **meta})


def _megatron_files(paths) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("router_trace_rank*.jsonl"))
            if not found:
                raise FileNotFoundError(f"{p} holds no Megatron-Core router trace (router_trace_rank*.jsonl)")
            files += found
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"Megatron-Core router trace {p} does not exist")
    return files


def _megatron_records(files: Iterable[Path], block: str):
    """(file, line, step, layer, rank, top indices as an int64 array [tokens, k]) of every record of ``block``."""
    for path in files:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise TraceFormatError(f"{where}: not a JSON record of a Megatron-Core router trace ({exc})") \
                        from None
                if not isinstance(rec, dict):
                    raise TraceFormatError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
                if rec.get("block", "decoder") != block:
                    continue
                missing = [k for k in ("step", "layer", "rank", "top_indices") if k not in rec]
                if missing:
                    raise TraceFormatError(f"{where}: the record lacks {missing} (a Megatron-Core router-trace record "
                                           f"has step, layer, rank and top_indices)")
                for key in ("step", "layer", "rank"):
                    if isinstance(rec[key], bool) or not isinstance(rec[key], int) or rec[key] < 0:
                        raise TraceFormatError(f"{where}: {key} must be a non-negative integer, got {rec[key]!r}")
                try:
                    top = np.asarray(rec["top_indices"])
                except ValueError:  # ragged lists
                    top = np.asarray([], dtype=object)
                if top.size == 0 and rec["top_indices"] == []:
                    top = np.zeros((0, int(rec.get("topk", 1))), dtype=np.int64)
                if top.ndim != 2 or top.dtype.kind not in "iu":
                    raise TraceFormatError(f"{where}: top_indices must be a [tokens, k] list of integer lists")
                if "topk" in rec and top.shape[1] != rec["topk"]:
                    raise TraceFormatError(f"{where}: top_indices has {top.shape[1]} columns but topk={rec['topk']}")
                if "num_tokens" in rec and top.shape[0] != rec["num_tokens"]:
                    raise TraceFormatError(f"{where}: top_indices has {top.shape[0]} rows but "
                                           f"num_tokens={rec['num_tokens']}")
                if top.size and top.min() < 0:
                    raise TraceFormatError(f"{where}: top_indices holds a negative expert index")
                yield where, rec["step"], rec["layer"], rec["rank"], top.astype(np.int64)


def import_megatron_trace(paths, num_experts: int | None = None, *, block: str = "decoder",
                          ranks: Sequence[int] | None = None, model: str | None = None) -> Trace:
    """A :class:`Trace` from Megatron-Core router-trace files (``--moe-routing-trace-path``).

    ``paths``: the trace folder (its ``router_trace_rank*.jsonl``), one file, or a list of them. Each JSON line
    ``{"step", "layer", "rank", "top_indices": [[e, ...], ...], ...}`` adds its tokens' choices to
    counts[step, layer, rank]; several records of one (step, layer, rank) (micro-batches) add up, and their number,
    when every (step, layer, rank) has the same, is the metadata's ``micro_batches`` (None otherwise), which the
    simulator reads to price each micro-batch on its share (:func:`lrmoe.sim.simulator.micro_batch_counts`).
    Steps, layers and ranks are the distinct values found, in increasing order (recorded in the metadata);
    ``ranks`` keeps only those ranks (e.g. one tensor-parallel rank per data-parallel replica, since
    tensor-parallel ranks route the same tokens). Records of another ``block`` (Megatron's multi-token-prediction
    layers, "mtp") are skipped. ``num_experts`` defaults to the largest index seen + 1 (pass it: an expert never
    chosen is invisible).
    """
    files = _megatron_files(paths)
    keep = None if ranks is None else set(ranks)
    recs = [r for r in _megatron_records(files, block) if keep is None or r[3] in keep]
    if not recs:
        raise TraceFormatError(f"no {block!r} record in {', '.join(map(str, files))}")
    top_k = {r[4].shape[1] for r in recs if r[4].size}
    if len(top_k) > 1:
        raise TraceFormatError(f"records disagree on top-k: {sorted(top_k)}")
    seen_max = max((int(r[4].max()) for r in recs if r[4].size), default=-1)
    if num_experts is None:
        num_experts = seen_max + 1
    elif seen_max >= num_experts:
        where = next(r[0] for r in recs if r[4].size and int(r[4].max()) >= num_experts)
        raise TraceFormatError(f"{where}: expert index {seen_max} is outside [0, num_experts={num_experts})")
    steps, layers, rank_ids = (sorted({r[i] for r in recs}) for i in (1, 2, 3))
    s_of, l_of, n_of = ({v: i for i, v in enumerate(vals)} for vals in (steps, layers, rank_ids))
    counts = np.zeros((len(steps), len(layers), len(rank_ids), num_experts), dtype=np.int64)
    for _, step, layer, rank, top in recs:
        counts[s_of[step], l_of[layer], n_of[rank]] += np.bincount(top.reshape(-1), minlength=num_experts)
    records_per_key = set(Counter(r[1:4] for r in recs).values())  # micro-batches of each (step, layer, rank)
    meta = {"source": "recorded", "recorder": "megatron-core-router-trace", "model": model,
            "files": [str(f) for f in files], "block": block, "steps": steps, "layers": layers, "ranks": rank_ids,
            "top_k": top_k.pop() if top_k else None,
            "micro_batches": records_per_key.pop() if len(records_per_key) == 1 else None}
    return Trace(torch.from_numpy(counts), meta)
