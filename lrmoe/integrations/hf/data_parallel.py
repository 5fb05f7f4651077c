"""A swapped model under data-parallel wrappers: DistributedDataParallel carries its dense gradients (the expert
slots named to it as parameters to leave alone, :func:`ignore_experts_in_ddp`; whether the running forward's
backward is reduced by it, :func:`ddp_reducing`); ``nn.DataParallel``'s copies and FSDP are refused."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel


class DataParallelError(RuntimeError):
    """A data-parallel wrapper a swapped model cannot run under (nn.DataParallel, FSDP, a DDP that would reduce the
    experts): refused."""


DATA_PARALLEL_REFUSAL = (
    "nn.DataParallel (what transformers.Trainer uses in one process that sees several GPUs) cannot run a model whose "
    "MoE blocks run on lrmoe's expert-parallel layer: it copies the model onto every GPU and runs the copies in "
    "threads, but each layer's experts live on one device and its all-to-alls expect one forward per rank. Run one "
    "process per GPU (torchrun) with the plain loop: opt = ep.optimizer(torch.optim.AdamW, lr=...) (README, 'Use it "
    "with transformers'); or make one GPU visible (CUDA_VISIBLE_DEVICES) to run Trainer in one process.")


def path_to_blocks(swapped: list[str]) -> list[str]:
    """The names of the model (``""``) and of every module between it and a swapped block, the block included."""
    names = {""}
    for block_name in swapped:
        parts = block_name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(names, key=lambda n: (n.count("."), n))


EXPERT_PARAMETER = "experts.slots_SW"  # each swapped block's expert parameter, relative to the block


def ignore_experts_in_ddp(model: nn.Module, swapped: list[str]) -> None:
    """DDP's own mechanism for parameters it must leave alone
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``): on the model and on every module
    between it and a swapped block, the names (relative to that module) of the expert slots below it, added to any
    already there. A DDP around any of them then neither broadcasts the slots (each rank holds its own experts) nor
    all-reduces their gradients (the replica store sums them over each expert's replicas); it carries the dense
    gradients alone. No collective."""
    for name in path_to_blocks(swapped):
        module = model.get_submodule(name)
        below = [b for b in swapped if not name or b == name or b.startswith(name + ".")]
        names = [f"{b[len(name) + 1:] if name else b}.{EXPERT_PARAMETER}".lstrip(".") for b in below]
        old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, old + [n for n in names
                                                                                           if n not in old])


DDP_REDUCES_EXPERTS = (
    "DistributedDataParallel wraps a module above a model whose MoE blocks run on lrmoe's expert-parallel layer and "
    "would all-reduce the experts' slots, which hold different experts on every rank. Wrap the swapped model itself "
    "(Trainer and Accelerate do), or name its slots to DDP first: DistributedDataParallel."
    "_set_params_and_buffers_to_ignore_for_model(wrapper, [name for name, _ in wrapper.named_parameters() if "
    "name.endswith('experts.slots_SW')]).")


def ddp_reducing(expert_params: list[nn.Parameter]) -> bool:
    """Whether the forward running now runs inside a DistributedDataParallel that all-reduces its backward's
    gradients: torch sets ``DistributedDataParallel._active_ddp_module`` around the forward (C++ reducer), and its
    ``require_backward_grad_sync`` is False under ``no_sync()``. Raises :class:`DataParallelError` when that DDP
    would reduce ``expert_params`` too (a wrapper above the model, :data:`DDP_REDUCES_EXPERTS`). DDP's Python
    reducer (compiled autograd) sets no active module: then the step all-reduces the dense gradients again, which
    DDP's averaging leaves exact (the mean of equal tensors), only slower."""
    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is None:
        return False
    reduced = {id(p) for p in getattr(ddp, "_module_parameters", ())}
    if any(id(p) in reduced for p in expert_params):
        raise DataParallelError(DDP_REDUCES_EXPERTS)
    return bool(ddp.require_backward_grad_sync)


FSDP_REFUSAL = (
    "FSDP (torch's fully_shard or FullyShardedDataParallel) wraps {where} of a model whose MoE blocks run on lrmoe's "
    "expert-parallel layer: it would shard the experts' slots, which hold different experts on every rank (the "
    "layer's replica store shards and steps them itself), and reduce-scatter gradients that ep.optimizer's step "
    "expects whole. Use DistributedDataParallel, which carries the dense gradients and leaves the experts to the "
    "replica store (what transformers.Trainer and Accelerate use on several processes), or the plain loop with "
    "opt = ep.optimizer(torch.optim.AdamW, lr=...) (docs/hf.md).")


def fsdp_wrapped(model: nn.Module, names: list[str]) -> str | None:
    """The first of ``names`` (modules of ``model``, e.g. :func:`path_to_blocks`) that FSDP wraps (FSDP2's
    ``fully_shard`` turns the module into an ``FSDPModule``; FSDP1's auto-wrap puts a ``FullyShardedDataParallel``
    in its place), None when none is."""
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            return name
    return None
