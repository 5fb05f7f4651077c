"""The data-parallel wrappers a swapped model refuses: DistributedDataParallel at its construction (the
``_ddp_params_and_buffers_to_ignore`` guard), ``nn.DataParallel``'s copies, and FSDP at a training forward."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel


class DataParallelError(RuntimeError):
    """A data-parallel wrapper (DistributedDataParallel, nn.DataParallel) around a swapped model: refused."""


def ddp_refusal(num_ranks: int) -> str:
    """Why DistributedDataParallel cannot wrap a model swapped over ``num_ranks`` ranks, and what to use."""
    return (f"DistributedDataParallel cannot wrap a model whose MoE blocks run on lrmoe's expert-parallel layer "
            f"over {num_ranks} ranks (transformers.Trainer and Accelerate wrap the model in it whenever they run on "
            f"more than one process). Each rank holds only its own share of the experts, outside "
            f"model.parameters(): DDP would all-reduce the dense gradients a second time (ep.optimizer's step "
            f"already reduces them), Trainer's gradient clipping would leave the experts out, and Trainer saves "
            f"checkpoints from rank 0 alone, while model.state_dict() gathers the experts from every rank (rank 0 "
            f"would wait for the others until the process group times out) and each rank's expert optimizer state "
            f"is its own. Train with the "
            f"plain loop instead: opt = ep.optimizer(torch.optim.AdamW, lr=...); loss.backward() per micro-batch; "
            f"opt.step(); opt.zero_grad(); model.save_pretrained(path, is_main_process=rank == 0) on every rank "
            f"(README, 'Use it with transformers').")


DATA_PARALLEL_REFUSAL = (
    "nn.DataParallel (what transformers.Trainer uses in one process that sees several GPUs) cannot run a model whose "
    "MoE blocks run on lrmoe's expert-parallel layer: it copies the model onto every GPU and runs the copies in "
    "threads, but each layer's experts live on one device and its all-to-alls expect one forward per rank. Run one "
    "process per GPU (torchrun) with the plain loop: opt = ep.optimizer(torch.optim.AdamW, lr=...) (README, 'Use it "
    "with transformers'); or make one GPU visible (CUDA_VISIBLE_DEVICES) to run Trainer in one process.")


class _RefuseDDP:
    """Stands where DistributedDataParallel looks for the names it should not synchronise
    (``module._ddp_params_and_buffers_to_ignore``): iterating it raises :class:`DataParallelError` over more than
    one rank; on one rank it is empty (DDP's broadcast and all-reduce over one process change nothing).

    Why there: DDP's constructor reads that attribute (``set(module._ddp_params_and_buffers_to_ignore)``) before it
    checks the parameters' shapes across ranks and broadcasts rank 0's parameters and buffers, so every rank raises
    at construction, before any collective (no rank waits on another) and before any training step, whoever builds
    the DDP (Trainer through Accelerate, Accelerate alone, torch's composable ``replicate``, a hand-written loop).
    ``DistributedDataParallel._active_ddp_module``, the other trace DDP leaves, is set only around a forward (after
    the construction's collectives) and not at all with the Python reducer. A DDP around a module *above* the model
    (``DDP(nn.Sequential(model))``) does not look here; torch's ``_set_params_and_buffers_to_ignore_for_model``
    replaces the guard. FSDP reads nothing of the kind: a training forward refuses it (:func:`fsdp_wrapped`, where
    ``fully_shard`` or an auto-wrapped ``FullyShardedDataParallel`` stands on the path to a swapped block)."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks

    def __iter__(self):
        if self.num_ranks > 1:
            raise DataParallelError(ddp_refusal(self.num_ranks))
        return iter(())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_ranks={self.num_ranks})"


def path_to_blocks(swapped: list[str]) -> list[str]:
    """The names of the model (``""``) and of every module between it and a swapped block, the block included."""
    names = {""}
    for block_name in swapped:
        parts = block_name.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(names, key=lambda n: (n.count("."), n))


def _refuse_ddp(model: nn.Module, swapped: list[str], num_ranks: int) -> None:
    """Put the guard (:class:`_RefuseDDP`) on ``model`` and on every module between it and a swapped block (the
    block included), so that a DDP around any of them is refused. No collective."""
    guard = _RefuseDDP(num_ranks)
    for name in path_to_blocks(swapped):
        setattr(model.get_submodule(name), "_ddp_params_and_buffers_to_ignore", guard)


FSDP_REFUSAL = (
    "FSDP (torch's fully_shard or FullyShardedDataParallel) wraps {where} of a model whose MoE blocks run on lrmoe's "
    "expert-parallel layer: it shards the dense parameters and reduce-scatters their gradients, where ep.optimizer's "
    "step already all-reduces them, and the routed experts are not among model.parameters() (each rank holds its "
    "own share of them in the layer's replica store). Train without FSDP: opt = ep.optimizer(torch.optim.AdamW, "
    "lr=...) in the plain loop (README, 'Use it with transformers').")


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
