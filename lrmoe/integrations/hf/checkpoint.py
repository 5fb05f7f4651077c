"""Per-rank checkpoints of a swapped model (:func:`save_sharded`) and their consolidation into a checkpoint the
unmodified transformers class loads with ``from_pretrained`` (:func:`consolidate`).

``model.save_pretrained`` of a swapped model gathers every expert onto every rank (a collective, and the whole
model's experts in each rank's memory). :func:`save_sharded` gathers nothing: rank 0 writes the dense part once
(every parameter and persistent buffer but the routed experts, in the model's dtypes) with the config, and each rank
writes its own fp32 master shard of every swapped layer's experts (columns ``bounds[r]`` of the flat
``[gate | up | down]`` rows, all experts). The folder:

    config.json                                  the model's config (rank 0)
    dense.safetensors                            the dense part (rank 0)
    experts-rank{r:05d}-of-{N:05d}.safetensors   rank r's master shards, one tensor per swapped layer
    lrmoe-shards.json                            the manifest: class, ranks, the save, per layer its name, shape,
                                                 bounds

Every file of one save carries that save's identity (``save_id``, drawn once per save; ``step``; the world size, in
the manifest and in each safetensors file's metadata), so :func:`consolidate` refuses a folder whose files come from
different saves (a rank's shard left by an earlier save, or by a save on another number of ranks), naming the files.

:func:`consolidate` (one process, no process group; also ``python -m lrmoe.integrations.hf.checkpoint SRC DST
[--max-shard-size 5GB]``) joins each layer's shards, one layer at a time, casts them to the experts' dtype, puts
them in HF's fused layout (:func:`~lrmoe.integrations.hf.families.reference_to_hf`: what a swapped model's
``state_dict`` emits) and lets the unmodified class's own ``save_pretrained`` write them (sharded above
``max_shard_size``, with its ``model.safetensors.index.json``): ``from_pretrained(DST)`` gives the trained model's
logits, and :func:`~lrmoe.integrations.hf.load_safetensors_` reads it back into a model built on the meta device.
The experts' optimizer state (Adam moments, placement, planning state) is not in it: resuming takes
:meth:`~lrmoe.integrations.hf.HFExpertParallel.expert_state_dict`, per rank.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn

from lrmoe.integrations.hf.experts import EPExperts
from lrmoe.integrations.hf.families import reference_to_hf
from lrmoe.runtime.distributed.replica import unflatten_experts

__all__ = ["DENSE_FILE", "MANIFEST", "consolidate", "expert_shard_file", "save_sharded"]

MANIFEST = "lrmoe-shards.json"
DENSE_FILE = "dense.safetensors"
FORMAT = 1  # the manifest's version


def expert_shard_file(rank: int, num_ranks: int) -> str:
    """The file (in a :func:`save_sharded` folder) of rank ``rank``'s master shards."""
    return f"experts-rank{rank:05d}-of-{num_ranks:05d}.safetensors"


def _unwrapped(model: nn.Module) -> nn.Module:
    """The HF model inside a DistributedDataParallel (or any wrapper that keeps it as ``.module``)."""
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``model`` outside the swapped experts, in ``state_dict``'s names,
    each tensor once (a tied weight under its first name; the class ties it again on load). No collective."""
    out, seen = {}, set()
    for mname, module in model.named_modules():
        if isinstance(module, EPExperts):
            continue
        prefix = f"{mname}." if mname else ""
        tensors = [(n, p) for n, p in module._parameters.items() if p is not None]
        tensors += [(n, b) for n, b in module._buffers.items()
                    if b is not None and n not in module._non_persistent_buffers_set]
        for name, t in tensors:
            if id(t) in seen:
                continue
            seen.add(id(t))
            out[prefix + name] = t.detach().contiguous().cpu()
    return out


@torch.no_grad()
def save_sharded(model: nn.Module, folder: str, step: int | None = None) -> list[str]:
    """Write ``model`` (swapped; or the DistributedDataParallel around it) to ``folder`` as per-rank shards (module
    doc): rank 0 the config, the dense part and the manifest, every rank its own master shards, each file marked
    with this save's identity (a save id rank 0 draws, ``step``: the training step saved, and the world size).
    Collective (every rank calls it; it returns when every rank has written). Returns the files this rank wrote."""
    import uuid

    from safetensors.torch import save_file

    model = _unwrapped(model)
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, EPExperts)]
    if not experts:
        raise ValueError(f"{type(model).__name__} has no swapped experts: save it with save_pretrained")
    rank, world = dist.get_rank(), dist.get_world_size()
    stores = [m.layer.store for _, m in experts]
    if any(s.num_ranks != world or s.rank != rank for s in stores):
        raise ValueError("save_sharded writes one expert-parallel group over the whole world; this model's experts "
                         "are sharded over a sub-group")
    os.makedirs(folder, exist_ok=True)
    chosen = [uuid.uuid4().hex if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(chosen, src=0)  # one id for every rank's files of this save
    save = {"save_id": chosen[0], "step": step, "num_ranks": world}
    meta = {k: str(v) for k, v in save.items()}
    written = []
    shards = {f"{name}.master_EW": s.master_EW.detach().contiguous().cpu() for (name, _), s in zip(experts, stores)}
    path = os.path.join(folder, expert_shard_file(rank, world))
    save_file(shards, path + ".tmp", metadata={"rank": str(rank), **meta})
    os.replace(path + ".tmp", path)
    written.append(path)
    if rank == 0:
        dense = os.path.join(folder, DENSE_FILE)
        save_file(_dense_state(model), dense + ".tmp", metadata=meta)
        os.replace(dense + ".tmp", dense)
        model.config.save_pretrained(folder)
        manifest = {"format": FORMAT, "class": type(model).__name__, "num_ranks": world, "save": save,
                    "layers": [{"name": name, "num_experts": s.num_experts, "hidden": s.hidden, "ffn": s.ffn,
                                "dtype": str(s.dtype).removeprefix("torch."),
                                "bounds": [list(b) for b in s.bounds]}
                               for (name, _), s in zip(experts, stores)]}
        with open(os.path.join(folder, MANIFEST + ".tmp"), "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(os.path.join(folder, MANIFEST + ".tmp"), os.path.join(folder, MANIFEST))
        written += [dense, os.path.join(folder, "config.json"), os.path.join(folder, MANIFEST)]
    dist.barrier()  # the folder is whole when any rank returns
    return written


def _joined_experts(handles: list, layer: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (gate_up_proj, down_proj) in HF's layout from every rank's shard, in the experts' dtype."""
    key = f"{layer['name']}.master_EW"
    parts, at = [], 0
    for rank, (f, (lo, hi)) in enumerate(zip(handles, layer["bounds"])):
        shard = f.get_tensor(key)
        if lo != at or tuple(shard.shape) != (layer["num_experts"], hi - lo):
            raise ValueError(f"{key} of rank {rank}: shape {tuple(shard.shape)}, bounds {lo}:{hi}; the manifest "
                             f"expects [{layer['num_experts']}, {hi - lo}] from column {at}")
        parts.append(shard)
        at = hi
    if at != 3 * layer["hidden"] * layer["ffn"]:
        raise ValueError(f"{key}: the shards cover {at} of {3 * layer['hidden'] * layer['ffn']} columns")
    flat_EW = torch.cat(parts, dim=1).to(getattr(torch, layer["dtype"]))
    return reference_to_hf(*unflatten_experts(flat_EW, layer["hidden"], layer["ffn"]))


def _check_one_save(folder: str, save: dict, paths: list[str], handles: list) -> None:
    """ValueError naming the files among ``paths`` (open as ``handles``) that another save wrote than the one the
    manifest records (``save``: save id, step, world size), with what each holds."""
    want = {k: str(v) for k, v in save.items()}
    other = []
    for path, f in zip(paths, handles):
        got = {k: (f.metadata() or {}).get(k) for k in want}
        if got != want:
            other.append(f"{os.path.basename(path)} ({', '.join(f'{k} {v}' for k, v in got.items())})")
    if other:
        raise ValueError(f"{folder} mixes files of different saves: its manifest {MANIFEST} records save "
                         f"{want['save_id']} of step {want['step']} on {want['num_ranks']} ranks, but "
                         f"{'; '.join(other)}; save the model again into an empty folder")


@torch.no_grad()
def consolidate(folder: str, out: str, max_shard_size: int | str = "5GB") -> str:
    """Join a :func:`save_sharded` folder into ``out``, a checkpoint of the unmodified transformers class (its own
    ``save_pretrained`` writes it, in files of at most ``max_shard_size``): ``<class>.from_pretrained(out)`` loads
    it. One process, no process group; it holds the whole model once (built on the meta device, every tensor
    assigned, not copied), each layer's shards only while that layer is joined. Returns ``out``."""
    import transformers
    from safetensors import safe_open

    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{folder}/{MANIFEST}: format {manifest.get('format')!r}, this version reads {FORMAT}")
    cls = getattr(transformers, manifest["class"])
    config = transformers.AutoConfig.from_pretrained(folder)
    N = manifest["num_ranks"]
    files = [os.path.join(folder, expert_shard_file(r, N)) for r in range(N)]
    absent = [p for p in files if not os.path.isfile(p)]
    if absent:
        raise FileNotFoundError(f"{folder} was saved by {N} ranks; missing {absent}")
    state: dict[str, torch.Tensor] = {}
    handles = [safe_open(p, framework="pt") for p in files]
    with safe_open(os.path.join(folder, DENSE_FILE), framework="pt") as dense:
        if "save" in manifest:  # a folder saved before save ids has nothing to compare
            _check_one_save(folder, manifest["save"], [os.path.join(folder, DENSE_FILE), *files], [dense, *handles])
        for key in dense.keys():
            state[key] = dense.get_tensor(key)
    for layer in manifest["layers"]:
        gate_up, down = _joined_experts(handles, layer)
        state[f"{layer['name']}.gate_up_proj"], state[f"{layer['name']}.down_proj"] = gate_up, down
    del handles
    with torch.device("meta"):
        model = cls(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"{folder}: tensors {result.unexpected_keys[:5]} have no place in {manifest['class']}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{folder}: no tensors for {left[:5]} of {manifest['class']}")
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lrmoe.integrations.hf.checkpoint",
                                     description="Join a swapped model's per-rank shards (save_sharded) into a "
                                                 "checkpoint the unmodified transformers class loads.")
    parser.add_argument("src", help="the folder save_sharded wrote")
    parser.add_argument("dst", help="the checkpoint folder to write")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (transformers' syntax)")
    args = parser.parse_args(argv)
    print(consolidate(args.src, args.dst, args.max_shard_size))


if __name__ == "__main__":
    main()
