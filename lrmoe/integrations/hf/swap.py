"""Swapping a model's sparse MoE blocks onto the expert-parallel layer (:func:`swap_moe_blocks`), and joining the
ranks' router recordings of a swapped model (:func:`gather_trace`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lrmoe.config import layer_seed
from lrmoe.integrations.hf.data_parallel import ignore_experts_in_ddp
from lrmoe.integrations.hf.experts import EPExperts
from lrmoe.integrations.hf.expert_parallel import HFExpertParallel
from lrmoe.integrations.hf.families import _family, hf_to_reference, moe_blocks
from lrmoe.integrations.traces import RouterRecorder
from lrmoe.traces.trace import Trace, join_ranks
from lrmoe.planner.plan import Policy
from lrmoe.planner.policies import initial_placement
from lrmoe.runtime.dense_sync import check_same_weights
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups
from lrmoe.runtime.layer import EPMoELayer
from lrmoe.systems import SystemContext, SystemSpec, get_system


def _resolve_system(system: str | SystemSpec | Policy) -> tuple[str, SystemSpec | None]:
    if isinstance(system, str):
        spec = get_system(system)
        return spec.name, spec
    if isinstance(system, SystemSpec):
        return system.name, system
    if isinstance(system, Policy):
        return system.name, None
    raise ValueError(f"system must be a registry name, a SystemSpec or a policy object, got {type(system).__name__}")


def swap_moe_blocks(model: nn.Module, system="symi-dropless", *, context: SystemContext | None = None,
                    spare_slots: int = 1, pairs_per_rank: int | None = None, seed: int = 0,
                    adam: AdamConfig | None = None, replica_grad: str = "range", backward=None,
                    accountant=None, kernel_backend: str | None = None,
                    groups: RangeGroups | None = None, device: torch.device | str | None = None) -> "HFExpertParallel":
    """Replace the experts of every sparse MoE block of ``model`` (Qwen3-MoE or GLM-4.5) by the expert-parallel
    layer, in place, and return the training-loop helper. Collective: call it on every rank of the default process
    group, with the same model (same weights) on every rank, after moving the model to its device; ranks whose
    weights differ are refused on every rank (:class:`~lrmoe.runtime.dense_sync.WeightsDifferError`, one all-gather
    of a checksum per parameter).

    ``system``: a registry name (:func:`lrmoe.systems.get_system`), a :class:`~lrmoe.systems.SystemSpec`, or a
    policy object (then ``backward`` is the layer's backward config). Its policy is built per MoE layer from
    ``context`` (default: E experts, the world's ranks, ``spare_slots``, ``pairs_per_rank``); the backward seed of
    MoE layer i is ``lrmoe.config.layer_seed(seed, i)``. ``adam``: the experts' optimizer (the replica store's
    sharded Adam).

    A model built on the meta device (``with torch.device("meta"): model = cls(config)``) swaps too, given
    ``device``: each layer then allocates on ``device`` this rank's slots and optimizer shards only (zeros, built
    one layer at a time), and :func:`load_safetensors_` fills them and materialises the dense part from a
    checkpoint, one tensor at a time.
    """
    family = _family(model.config)
    if not dist.is_initialized():
        raise ValueError("swap_moe_blocks needs an initialised default process group (gloo or NCCL)")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no {family.block} block to swap")
    already = [name for name, b in blocks if isinstance(b.experts, EPExperts)]
    if already:
        raise ValueError(f"the MoE blocks {already} are already swapped")
    name, spec = _resolve_system(system)
    N = dist.get_world_size()
    E = blocks[0][1].experts.num_experts
    if context is None:
        context = SystemContext(num_experts=E, num_ranks=N, spare_slots=spare_slots, pairs_per_rank=pairs_per_rank)
    elif (context.num_experts, context.num_ranks) != (E, N):
        raise ValueError(f"context is for {context.num_experts} experts on {context.num_ranks} ranks; the model has "
                         f"{E} experts on {N} ranks")
    # the dense part is data parallel: it stays one model only if every rank starts from the same weights
    check_same_weights(list(model.named_parameters()), "swap_moe_blocks")
    if replica_grad == "range" and groups is None:
        groups = RangeGroups()
    top_k = model.config.num_experts_per_tok
    routed_scaling = float(getattr(model.config, "routed_scaling_factor", 1.0))
    swapped = []
    for i, (block_name, block) in enumerate(blocks):
        hf_experts = block.experts
        dtype, layer_device = hf_experts.gate_up_proj.dtype, hf_experts.gate_up_proj.device
        if layer_device.type == "meta":  # nothing to copy: the store starts from zeros, the checkpoint fills it
            if device is None:
                raise ValueError("the model is on the meta device: pass device= (where each rank's experts live)")
            layer_device = torch.device(device)
            D, F = hf_experts.down_proj.shape[1:]
            w_gate = w_up = torch.empty(E, D, F, dtype=dtype, device="meta")  # shapes: the store allocates its own
            w_down = torch.empty(E, F, D, dtype=dtype, device="meta")
            router = torch.zeros(E, D, dtype=dtype, device=layer_device)  # the layer's own copy is never used
        else:
            w_gate, w_up, w_down = hf_to_reference(hf_experts.gate_up_proj.detach(), hf_experts.down_proj.detach())
            router = block.gate.weight.detach()
        weights = {"w_router_ED": router, "bias_E": torch.zeros(E), "w_gate_EDF": w_gate, "w_up_EDF": w_up,
                   "w_down_EFD": w_down}
        policy = spec.make_policy(context) if spec is not None else system
        layer_backward = spec.layer_backward(layer_seed(seed, i)) if spec is not None else backward
        placement = initial_placement(policy, N, E, pairs_per_rank)
        layer = EPMoELayer(weights, top_k, family.router, policy, placement, groups, routed_scaling=routed_scaling,
                           dtype=dtype, device=layer_device, adam=adam or AdamConfig(), accountant=accountant,
                           kernel_backend=kernel_backend, backward=layer_backward, replica_grad=replica_grad)
        layer.w_router_ED.requires_grad_(False)  # HF's gate routes; the layer's copy never enters the loss
        layer.name = block_name  # errors name the block (e.g. a non-finite input)
        block.experts = EPExperts(layer)  # HF's full expert tensors are released here
        swapped.append(block_name)
    ignore_experts_in_ddp(model, swapped)
    return HFExpertParallel(model, swapped, [b for _, b in blocks], family, name)


def gather_trace(recorder: RouterRecorder, **meta) -> Trace:
    """Join what every rank's :class:`~lrmoe.integrations.traces.RouterRecorder` recorded (its own tokens) into one
    trace with a
    source-rank dimension of N · the recorder's virtual ranks (collective; every rank gets it)."""
    local = recorder.trace(**meta)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.counts_ILNE)
    return join_ranks([Trace(p, local.meta) for p in parts])


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: ``path`` itself (a ``.safetensors`` file), the files a
    ``model.safetensors.index.json`` names (what ``save_pretrained`` writes above its ``max_shard_size``), or, for a
    folder, its ``model.safetensors`` or its index."""
    import json
    import os

    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        path = index if os.path.isfile(index) else os.path.join(path, "model.safetensors")
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        folder = os.path.dirname(path)
        return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    return [path]


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class _SafetensorsReader:
    """One ``.safetensors`` file read tensor by tensor with plain reads, not memory-mapped: a mapped file's pages
    stay in the process's resident set while the file is open (every rank reads every expert's columns, so each
    would hold the whole file), where a read tensor's buffer is freed with it. The format: an 8-byte little-endian
    header length, a JSON header (per tensor its dtype, shape and byte range after the header), the bytes."""

    def __init__(self, path: str):
        import json
        import struct

        self.path, self._file = path, open(path, "rb")
        (size,) = struct.unpack("<Q", self._file.read(8))
        header = json.loads(self._file.read(size))
        header.pop("__metadata__", None)
        self._start, self._header = 8 + size, header

    def keys(self) -> list[str]:
        return list(self._header)

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self._header[key]
        begin, end = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=_SAFETENSORS_DTYPES[entry["dtype"]])
        if end > begin:
            self._file.seek(self._start + begin)
            view = out.view(-1).view(torch.uint8).numpy()
            if self._file.readinto(view) != end - begin:
                raise ValueError(f"{self.path}: {key} is cut short")
        return out

    def close(self) -> None:
        self._file.close()


@torch.no_grad()
def load_safetensors_(model: nn.Module, path: str, device: torch.device | str = "cpu") -> list[str]:
    """Load a safetensors checkpoint of the unmodified HF class into a swapped model, one tensor at a time. ``path``:
    a ``.safetensors`` file, a ``model.safetensors.index.json`` (a checkpoint sharded over several files), or a
    folder holding either (:func:`checkpoint_files`); each tensor is read from the file that holds it, with plain
    reads (not memory-mapped: :class:`_SafetensorsReader`). Each dense tensor is read and assigned (materialising a
    model built on the meta device), each block's experts (HF's two fused tensors, or the per-expert ones
    transformers 5 writes, wherever the files split them) are read, this rank's slots and master shards taken from
    them (``load_hf_weights``), and freed, so the peak holds the dense part, this rank's experts and one layer's
    fused tensors. No collective. Returns the checkpoint's keys the model has no place for. The dense parameters are new
    objects: build the optimizer after loading. Non-persistent buffers (the rotary embedding's ``inv_freq``) are not
    in a checkpoint: a model built on the meta device rebuilds them."""
    from contextlib import ExitStack

    experts = {name: m for name, m in model.named_modules() if isinstance(m, EPExperts)}
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    unexpected = []
    with ExitStack() as stack:
        where = {}  # key -> the open file that holds it
        for file in checkpoint_files(path):
            f = _SafetensorsReader(file)
            stack.callback(f.close)
            where.update(dict.fromkeys(f.keys(), f))

        def read(key: str) -> torch.Tensor:
            return where[key].get_tensor(key).to(device)

        keys = set(where)
        for name, module in experts.items():
            fused = [f"{name}.gate_up_proj", f"{name}.down_proj"]
            if all(k in keys for k in fused):  # the fused layout
                keys -= set(fused)
                module.load_hf_weights(read(fused[0]), read(fused[1]))
                continue
            # the per-expert layout transformers 5 writes (what its checkpoints on the Hub hold): gate_proj and
            # up_proj [F, D] (stacked: HF's gate_up_proj rows), down_proj [D, F]
            parts = {p: [f"{name}.{e}.{p}.weight" for e in range(module.num_experts)]
                     for p in ("gate_proj", "up_proj", "down_proj")}
            absent = [k for ks in parts.values() for k in ks if k not in keys]
            if absent:
                raise ValueError(f"{path} holds neither {fused} nor the per-expert weights of {name} "
                                 f"(missing {absent[:3]}...)")
            keys -= {k for ks in parts.values() for k in ks}
            gate_up_EXD = torch.stack([torch.cat([read(g), read(u)])
                                       for g, u in zip(parts["gate_proj"], parts["up_proj"])])
            module.load_hf_weights(gate_up_EXD, torch.stack([read(k) for k in parts["down_proj"]]))
            del gate_up_EXD
        for key in sorted(keys):
            if key not in params:
                unexpected.append(key)
                continue
            owner_name, _, attr = key.rpartition(".")
            owner, old = model.get_submodule(owner_name), params[key]
            value = read(key).to(old.dtype)
            if isinstance(old, nn.Parameter):  # a new parameter (a meta tensor takes no data)
                setattr(owner, attr, nn.Parameter(value, requires_grad=old.requires_grad))
            else:
                owner._buffers[attr] = value
    return unexpected
