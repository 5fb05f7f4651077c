"""The trace file: routed-pair counts per (step, layer, source rank, expert) and their metadata.

On-disk format (``.npz``, loaded without pickle): ``counts`` int64 [I, L, N, E] and ``meta`` (a JSON string:
format name and version, model, seed, generator and its parameters, or ``"source": "recorded"`` with where the
routing came from). :func:`load_trace` checks a file before trusting it: anything else (a text file, a pickle, a
bare array, a Megatron-Core JSON-lines trace) raises :class:`TraceFormatError` naming the file and what is wrong
with it. Reading a file needs only NumPy: this module imports neither torch nor anything of the runtime, so the
simulator, the analysis and a user inspecting a trace load it without the distributed stack (DESIGN.md §7).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

TRACE_FORMAT = "lrmoe-trace"
TRACE_VERSION = 1


class Trace:
    """Routed-pair counts [steps, layers, source ranks, experts] and their metadata.

    ``counts_ILNE`` may be given as a torch tensor or a NumPy integer array; :func:`load_trace` gives the array, so
    reading a file needs no torch, and the tensor (``torch.from_numpy``, shared memory) is made on first access.
    """

    def __init__(self, counts_ILNE, meta: dict | None = None):
        if counts_ILNE.ndim != 4:
            raise ValueError(f"counts_ILNE must be 4-D [steps, layers, ranks, experts], "
                             f"got shape {tuple(counts_ILNE.shape)}")
        if (counts_ILNE < 0).any():
            raise ValueError("counts_ILNE holds negative counts")
        self._counts = counts_ILNE
        self.meta = {} if meta is None else meta

    @property
    def counts_ILNE(self):
        """long tensor [steps, layers, source ranks, experts]: routed pairs."""
        if isinstance(self._counts, np.ndarray):
            import torch  # only here: loading and inspecting a trace does not import torch

            self._counts = torch.from_numpy(self._counts.astype(np.int64, copy=False))
        return self._counts

    def counts_array(self) -> np.ndarray:
        """The counts as an int64 NumPy array (no copy where they already are one)."""
        if isinstance(self._counts, np.ndarray):
            return self._counts.astype(np.int64, copy=False)
        return self._counts.detach().cpu().numpy().astype(np.int64, copy=False)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self._counts.shape)

    @property
    def num_steps(self) -> int:
        return self._counts.shape[0]

    @property
    def num_layers(self) -> int:
        return self._counts.shape[1]

    @property
    def num_ranks(self) -> int:
        return self._counts.shape[2]

    @property
    def num_experts(self) -> int:
        return self._counts.shape[3]

    def __repr__(self) -> str:
        return f"Trace(shape={self.shape}, source={self.meta.get('source', 'unknown')!r})"

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            raise ValueError(f"trace files end in .npz, got {path}")
        if path.exists() and not overwrite:
            raise FileExistsError(f"trace file {path} exists; pass overwrite=True to replace it")
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **self.meta}
        np.savez_compressed(path, counts=self.counts_array(), meta=np.array(json.dumps(meta)))
        return path

    def summary(self) -> dict:
        """Skew statistics over the whole trace: Gini and max/mean of per-expert counts, per layer-step."""
        from lrmoe.traces.stats import gini, max_over_mean

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
    return Trace(counts.astype(np.int64, copy=False), meta)


def join_ranks(traces: Sequence[Trace]) -> Trace:
    """One trace from per-rank traces of the same steps and layers (each with its own source ranks), ranks in the
    order given: what every rank of a data-parallel run recorded, as one N-rank trace."""
    if not traces:
        raise ValueError("join_ranks needs at least one trace")
    shape = traces[0].shape
    for i, t in enumerate(traces):
        if (t.num_steps, t.num_layers, t.num_experts) != (shape[0], shape[1], shape[3]):
            raise ValueError(f"trace {i} has {t.num_steps} steps, {t.num_layers} layers, {t.num_experts} experts; "
                             f"trace 0 has {shape[0]}, {shape[1]}, {shape[3]}")
    meta = dict(traces[0].meta)
    return Trace(np.concatenate([t.counts_array() for t in traces], axis=2), meta)
