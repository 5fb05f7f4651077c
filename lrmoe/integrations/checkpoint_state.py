"""One training state as a sharded checkpoint of ``torch.distributed.checkpoint`` (DCP): what each rank saves, and
how a run of any world size loads it back.

A checkpoint holds three kinds of entries (every rank calls :func:`save_state` and :func:`load_state`; both are
collective):

* **sharded**: each MoE layer's fp32 master weights and Adam moments (DESIGN.md §3.5), as one global [E, P] tensor
  per quantity of which rank n writes its columns ``shard_bounds(P, N)[n]``. Loaded at another world size, each
  rank reads exactly the columns of its new shard (DCP re-shards), so a checkpoint of N ranks resumes on N';
* **replicated**: the dense weights and buffers (the model's state dict without the expert slots and shards), the
  dense optimizer's state, each layer's Adam step, previous counts and placement: equal on every rank, written once;
* **rank-local** (``rank<n>/...``): each rank's generators (its data generator, the layers' backward generators).

The slots are not saved: they are the master weights in the slots' dtype, which the redistribution into the loaded
placement writes again (:meth:`~lrmoe.runtime.distributed.replica.ReplicaStore.redistribute`), bit for bit.

**Resuming on another world size** (N → N') gives the state a fresh N'-rank run would hold if it had been trained
to the checkpoint's step on the checkpoint's N ranks: every sharded and replicated tensor equal, bit for bit, to the
saved one (each rank now holds its new shard), and the planning state of a fresh N'-rank run: the policy's initial
placement and no previous counts (the saved placement names N ranks, and the counts' plan is that placement's);
ranks below min(N, N') continue their saved generators, new ranks start theirs from the seed, as a fresh run's
would.

Loading reads data only: tensors with ``weights_only``, and DCP's pickled metadata with an unpickler that admits
only DCP's metadata classes (:class:`SafeReader`), so a crafted checkpoint cannot run code.
"""

from __future__ import annotations

import pickle
import sys
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

SHARDED = ("master_EW", "exp_avg_EW", "exp_avg_sq_EW")  # the store's fp32 shards (DESIGN.md §3.5)


@contextmanager
def _quiet_sharded_tensor():
    """DCP's ShardedTensor path warns that it is deprecated in favour of DTensor. DTensor shards by torch.chunk's rule
    (the last shard shorter), the store by DESIGN.md §3.5's (the first P mod N one longer), so the explicit shard
    offsets of ShardedTensor are what describes the store's shards exactly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        yield


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader whose metadata unpickler admits DCP's metadata classes and torch's sizes and dtypes only."""

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            allowed = (module in ("torch.distributed.checkpoint.metadata", "collections")
                       or (module, name) in {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                             ("torch", "Size"), ("torch.serialization", "_get_layout"),
                                             ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                                             ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}
                       or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
            if not allowed:
                raise pickle.UnpicklingError(f"a checkpoint's metadata names {module}.{name}, which is not DCP "
                                             f"metadata: refused (it could run code)")
            return super().find_class(module, name)

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = self._Unpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _sharded(local: torch.Tensor, store):
    """``local`` (this rank's [E, P_n] shard of a per-expert quantity) as a view of the global [E, P] tensor."""
    lo, hi = store.bounds[store.rank]
    meta = ShardMetadata(shard_offsets=[0, lo], shard_sizes=[store.num_experts, hi - lo],
                         placement=f"rank:{dist.get_rank()}/{local.device}")  # the global rank
    shards = [Shard(local, meta)] if hi > lo else []
    # on the EP group (lrmoe.runtime.distributed.mesh): its DP copies write the same columns, which DCP saves once
    return init_from_local_shards(shards, store.num_experts, store.numel,
                                  process_group=store.ep_group)  # collective (metadata check)


def dense_state(model: nn.Module, layers) -> dict[str, torch.Tensor]:
    """The model's state dict without the expert slots and shards (rank-local: the layers' entries hold them). No
    collective: a Hugging Face model's swapped experts, which its state dict would gather from every rank in the
    slots' dtype, are left out (lrmoe.integrations.hf.experts.without_experts), so that its fp32 master shards alone
    stand for them in a checkpoint and a resume loads nothing over them."""
    own = {t.data_ptr() for layer in layers for t in (layer.store.slots_SW, *(getattr(layer.store, n)
                                                                            for n in SHARDED))}
    hf_experts = sys.modules.get("lrmoe.integrations.hf.experts")  # imported wherever a model was swapped
    with hf_experts.without_experts(model) if hf_experts is not None else nullcontext():
        state = model.state_dict()
    return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.data_ptr() in own)}


def _planning_key(store, i: int, key: str) -> str:
    """Where layer ``i``'s placement and counts live: each EP group of a mesh plans its own (DP copy k: ``dp<k>/``)."""
    return f"experts/{i}/{key}" if store.dp_size == 1 else f"dp{dist.get_rank(store.dp_group)}/experts/{i}/{key}"


def save_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, layers,
               generators: dict[str, torch.Generator]) -> None:
    """Write this rank's part of the checkpoint into ``folder`` (collective: every rank, same folder).
    ``generators``: this rank's own generators by name (e.g. its data generator), saved under ``rank<n>/``."""
    rank = dist.get_rank()
    state: dict = {f"model/{k}": v for k, v in dense_state(model, layers).items()}
    for idx, entry in optimizer.state_dict()["state"].items():
        for name, value in entry.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {idx}.{name} is a {type(value).__name__}, not a tensor")
            state[f"optimizer/{idx}/{name}"] = value
    for i, layer in enumerate(layers):
        store = layer.store
        for name in SHARDED:
            state[f"experts/{i}/{name}"] = _sharded(getattr(store, name), store)
        state[f"experts/{i}/adam_steps"] = torch.tensor(store.adam_steps)
        state[_planning_key(store, i, "placement_NS")] = store.placement_NS
        if layer.prev_counts_E is not None:
            state[_planning_key(store, i, "prev_counts_E")] = layer.prev_counts_E
        if layer.bwd_generator is not None:
            state[f"rank{rank}/experts/{i}/bwd_generator"] = layer.bwd_generator.get_state()
    state.update({f"rank{rank}/{k}": g.get_state() for k, g in generators.items()})
    with _quiet_sharded_tensor():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, single_file_per_rank=True, sync_files=True,
                                                            thread_count=1))


@torch.no_grad()
def load_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, layers, saved_world: int,
               generators: dict[str, torch.Generator]) -> None:
    """Load what :func:`save_state` wrote (by ``saved_world`` ranks) into this run's model, optimizer and layers,
    re-sharding the experts' shards to this world (module doc: what a changed world size keeps and starts anew).
    ``generators``: this rank's generators, restored when the saved run had this rank. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reader = SafeReader(folder)
    saved = reader.read_metadata().state_dict_metadata

    def empty(key: str) -> torch.Tensor:  # a tensor of the saved size and dtype, for state a fresh run lacks
        md = saved[key]
        return torch.empty(tuple(md.size), dtype=md.properties.dtype)

    dense = dense_state(model, layers)
    state: dict = {f"model/{k}": v for k, v in dense.items()}
    opt_keys = [k for k in saved if k.startswith("optimizer/")]
    state.update({k: empty(k) for k in opt_keys})
    for i, layer in enumerate(layers):
        for name in SHARDED:
            state[f"experts/{i}/{name}"] = _sharded(getattr(layer.store, name), layer.store)
        for key in ("adam_steps",) + (("prev_counts_E", "placement_NS") if saved_world == world else ()):
            name = f"experts/{i}/{key}" if key == "adam_steps" else _planning_key(layer.store, i, key)
            if name in saved:
                state[name] = empty(name)
        if layer.bwd_generator is not None and rank < saved_world:
            state[f"rank{rank}/experts/{i}/bwd_generator"] = layer.bwd_generator.get_state()
    if rank < saved_world:
        state.update({f"rank{rank}/{k}": g.get_state() for k, g in generators.items()})
    with _quiet_sharded_tensor():
        dcp.load(state, storage_reader=reader)

    model.load_state_dict({k: state[f"model/{k}"] for k in dense}, strict=False)
    opt_state: dict = {}
    for key in opt_keys:
        _, idx, name = key.split("/", 2)
        opt_state.setdefault(int(idx), {})[name] = state[key]
    optimizer.load_state_dict({"state": opt_state, "param_groups": optimizer.state_dict()["param_groups"]})
    for i, layer in enumerate(layers):
        store = layer.store
        store.adam_steps = int(state[f"experts/{i}/adam_steps"])
        counts = state.get(_planning_key(store, i, "prev_counts_E"))
        layer.prev_counts_E = None if counts is None else counts.to(layer.bias_E.device)
        layer.iteration_counts_NE, layer.micro_batches, layer.decisions, layer.last_plan = None, 0, [], None
        if layer.bwd_generator is not None and rank < saved_world:
            layer.bwd_generator.set_state(state[f"rank{rank}/experts/{i}/bwd_generator"])
        placement = state.get(_planning_key(store, i, "placement_NS"), store.placement_NS)
        store.redistribute(placement)  # the slots from the loaded master weights (collective)
    for k, g in generators.items():
        if rank < saved_world:
            g.set_state(state[f"rank{rank}/{k}"])


def read_full_state(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``folder``, whole (each sharded one joined from its ranks' shards), by its
    saved key; read in one process, no ranks needed (inspection, tests)."""
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}  # filled from the metadata by the planner (torch's own dcp_to_torch_save reads so)
    with _quiet_sharded_tensor(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        _load_state_dict(state, storage_reader=SafeReader(folder), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
