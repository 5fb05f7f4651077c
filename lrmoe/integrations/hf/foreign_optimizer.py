"""The guards against an optimizer that leaves the experts out: a dense step by another optimizer inside an open
iteration (:class:`_ForeignStepGuard`), and dense gradients edited between the backward and the swapped model's
step (:class:`GradientEditError`, raised by :class:`~lrmoe.integrations.hf.expert_parallel.EPOptimizer`)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from lrmoe.integrations.hf.data_parallel import (FSDP_REFUSAL, DataParallelError, ddp_reducing, fsdp_wrapped,
                                                 path_to_blocks)
from lrmoe.runtime.layer import EPMoELayer


class ForeignOptimizerError(RuntimeError):
    """An optimizer other than the swapped model's own stepped its dense parameters: the experts would never train."""


FOREIGN_OPTIMIZER = (
    "an optimizer other than lrmoe's stepped this model: its dense parameters were stepped (or changed in place) "
    "between two training forwards while the routed experts' gradients of the backward in between still waited for "
    "their optimizer step. The routed experts of a model swapped onto lrmoe's expert-parallel layer are stepped by "
    "its own optimizer (each rank's shard of the experts' Adam, then their redistribution), so an optimizer built "
    "over model.parameters() (torch.optim.AdamW(model.parameters()), or transformers.Trainer without optimizers=) "
    "never trains them. Use the swapped model's optimizer: opt = ep.optimizer(torch.optim.AdamW, lr=...) in place "
    "of yours, in a plain loop (loss.backward(); opt.step(); opt.zero_grad()) or in Trainer(..., optimizers=(opt, "
    "scheduler), callbacks=[EPTrainerCallback(ep)]) (lrmoe.integrations.hf.trainer); or, with your own dense "
    "optimizer, ep.step(optimizer) in place of optimizer.step() (docs/hf.md).")


GRAD_SAMPLE = 8  # values of each dense gradient EPOptimizer keeps after the backward, to see an edit before its step


class GradientEditError(RuntimeError):
    """The dense gradients were changed in place between the backward and the swapped model's optimizer step."""


GRADIENT_EDIT = (
    "{edited} of the {total} gradients of the swapped model that its optimizer checks were changed in place after "
    "the backward and before ep.optimizer's step: most likely clipped over model.parameters() "
    "(torch.nn.utils.clip_grad_norm_, or transformers.Trainer with max_grad_norm > 0 in TrainingArguments, its "
    "default 1.0). Each rank holds only its own expert slots, and a replicated expert's slots hold partial sums of "
    "its gradient until the step sums them, so that clipping measures no global norm, and ep.optimizer's own "
    "clipping (max_grad_norm=) would scale the gradients a second time. Clip in the optimizer instead: "
    "ep.optimizer(..., max_grad_norm=1.0); under Trainer, callbacks=[EPTrainerCallback(ep)] (lrmoe.integrations.hf."
    "trainer) moves TrainingArguments.max_grad_norm there, or set TrainingArguments(max_grad_norm=0). Gradients that "
    "are meant to be edited before the step (e.g. a gradient scaler's unscale): ep.optimizer(..., "
    "allow_grad_edits=True).")


class _ForeignStepGuard:
    """Detects a dense step that leaves the experts out (:data:`FOREIGN_OPTIMIZER`), at the model's next training
    forward (grad enabled, not an activation-checkpoint recomputation).

    An iteration is open from its first training forward until the experts' step (``expert_step``, run by
    ``ep.optimizer``'s and ``ep.step``'s steps) ends it; once a backward has run in it, the experts' gradients wait
    for that step. Two events inside such an open iteration mean that the dense parameters were stepped without the
    experts, and the next training forward (which would start accumulating on top) raises:

    * a ``torch.optim.Optimizer`` stepped any of the model's parameters (torch's global step post-hook; every torch
      optimizer, fused ones included, and any subclass). The swapped model's own optimizer steps its dense part and
      then the experts, which ends the iteration before that forward; so does the low-level API
      (``sync_dense_grads``, any dense optimizer's step, ``expert_step``);
    * a dense parameter changed in place since the previous training forward (its version counter ``p._version``:
      e.g. a hand-written update under ``torch.no_grad()``; one through ``p.data`` and a fused optimizer's kernel
      leave it as it was, the first signal catches the latter). ``model.load_state_dict`` (a resume) resets this
      record.

    Micro-batches (several forwards and backwards before one step), evaluation forwards (no grad), recomputation and
    online replication (it writes expert slots, not dense parameters) change no dense parameter and step no
    optimizer inside an iteration.

    Each training forward also records whether a DistributedDataParallel reduces its backward's dense gradients
    (``ddp_reduces``, :func:`~lrmoe.integrations.hf.data_parallel.ddp_reducing`): the last one before a step
    decides whether that step's dense all-reduce has been done already."""

    def __init__(self, model: nn.Module, layer: EPMoELayer, swapped: list[str]):
        self.model, self.layer, self.path = model, layer, path_to_blocks(swapped)
        self.expert_params = [model.get_submodule(name).experts.slots_SW for name in swapped]
        self._expert_ids = {id(p) for p in self.expert_params}
        self.ddp_reduces = False  # the last training forward ran inside a DDP that reduces its backward
        self.versions: list[int] | None = None  # the dense parameters' versions at the last training forward
        self.stepped_outside = False  # a torch optimizer stepped them inside the open iteration
        model.register_load_state_dict_post_hook(self._forget)
        ref = weakref.ref(self)  # the global hook must not keep the model alive: removed with the guard

        def on_step(optimizer, args, kwargs) -> None:
            guard = ref()
            if guard is not None:
                guard._on_step(optimizer)

        weakref.finalize(self, register_optimizer_step_post_hook(on_step).remove)

    def _waiting(self) -> bool:
        """Whether an iteration is open and a backward ran in it: the experts' gradients wait for their step."""
        return self.layer.micro_batches > 0 and self.layer.grad_finite is not None

    def _on_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._waiting() and any(id(p) in self.param_ids for g in optimizer.param_groups for p in g["params"]):
            self.stepped_outside = True

    def _forget(self, module, incompatible_keys) -> None:
        self.versions = None

    @property
    def dense_params(self) -> list[nn.Parameter]:
        """The model's parameters but the expert slots (read each time: loading a meta-device model replaces them)."""
        return [p for p in self.model.parameters() if id(p) not in self._expert_ids]

    @property
    def param_ids(self) -> set[int]:
        return {id(p) for p in self.dense_params}

    def dense_versions(self) -> list[int]:
        """The dense parameters' version counters (the expert slots' move with online replication's writes)."""
        return [p._version for p in self.dense_params]

    def check(self) -> None:
        wrapped = fsdp_wrapped(self.model, self.path)
        if wrapped is not None:
            raise DataParallelError(FSDP_REFUSAL.format(where=f"module {wrapped!r}" if wrapped else "the root"))
        self.ddp_reduces = ddp_reducing(self.expert_params)
        versions = self.dense_versions()
        changed = self.versions is not None and versions != self.versions
        self.versions = versions
        if not self._waiting():
            self.stepped_outside = False
        elif self.stepped_outside or changed:
            self.stepped_outside, self.versions = False, None
            raise ForeignOptimizerError(FOREIGN_OPTIMIZER)
