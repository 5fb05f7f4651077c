"""Recorded routing traces (from real routers) and synthetic router output through the runtime's routers.

The trace type, its file format and the synthetic generator live below the simulator, in :mod:`lrmoe.traces`
(DESIGN.md §7); this module holds what needs the model or the runtime:

* :class:`RouterRecorder`: forward hooks on the router modules of any Hugging Face MoE model (Qwen3-MoE,
  GLM-4.5, Mixtral, ...; swapped onto the expert-parallel layer or not). One model forward is one step (the
  routers' recomputation in the backward, under activation checkpointing, is not counted again); the
  tokens of a forward can be split over ``num_ranks`` virtual source ranks (contiguous blocks, as data parallelism
  splits a batch). Under ``torch.distributed`` each rank records its own tokens and
  ``lrmoe.integrations.hf.gather_trace``
  joins them (:func:`lrmoe.traces.trace.join_ranks`).
* :func:`import_megatron_trace`: Megatron-Core's router traces (``--moe-routing-trace-path``: one JSON-lines file
  per rank, one record per step, layer and rank with the top-k expert indices of its tokens).
* :func:`sample_routing`: synthetic router output (choices and gate weights) of a family's router.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lrmoe.runtime.layer import recomputing
from lrmoe.traces.synthetic import gumbel_noise
from lrmoe.traces.trace import Trace, TraceFormatError


def sample_routing(p_E: torch.Tensor, num_tokens: int, top_k: int, family: str, generator: torch.Generator,
                   temperature: float = 1.0):
    """Synthetic router output for ``num_tokens`` tokens: logits = (log p + Gumbel) / temperature, routed by the
    family's router, so choices are Gumbel-top-k and gate weights have the family's form."""
    from lrmoe.runtime.routing import route

    logits_TE = (torch.log(p_E.double()) + gumbel_noise((num_tokens, p_E.shape[-1]), generator)) / temperature
    return route(logits_TE.float(), family, top_k)


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


MAX_INFERRED_EXPERTS = 4096  # more routed experts than any released MoE: a larger inferred E is a stray index


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
    layers, "mtp") are skipped. ``num_experts`` defaults to the largest index seen + 1, at most
    :data:`MAX_INFERRED_EXPERTS` (pass it: an expert never chosen is invisible, and a stray index is caught only
    against the declared E).

    Every (step, layer, rank) must have a record: a hole (a rank's file cut short, a layer not traced) is an error
    naming the missing keys, never a zero count that would read as a rank that routed nothing.
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
        if seen_max >= MAX_INFERRED_EXPERTS:
            where = next(r[0] for r in recs if r[4].size and int(r[4].max()) == seen_max)
            raise TraceFormatError(f"{where}: expert index {seen_max}: more experts than any MoE this reads "
                                   f"(at most {MAX_INFERRED_EXPERTS} without num_experts); a stray record? Pass "
                                   f"num_experts (the model's E) to check every index against it")
        num_experts = seen_max + 1
    elif seen_max >= num_experts:
        where = next(r[0] for r in recs if r[4].size and int(r[4].max()) >= num_experts)
        raise TraceFormatError(f"{where}: expert index {seen_max} is outside [0, num_experts={num_experts})")
    steps, layers, rank_ids = (sorted({r[i] for r in recs}) for i in (1, 2, 3))
    present = {r[1:4] for r in recs}
    holes = [key for key in itertools.product(steps, layers, rank_ids) if key not in present]
    if holes:
        shown = ", ".join(map(str, holes[:5])) + (", ..." if len(holes) > 5 else "")
        raise TraceFormatError(f"{', '.join(map(str, files))}: no record for {len(holes)} of the "
                               f"{len(steps) * len(layers) * len(rank_ids)} (step, layer, rank) the records span: "
                               f"{shown}; a rank's file cut short or a layer not traced (keep complete ranks with "
                               f"ranks=[...])")
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
