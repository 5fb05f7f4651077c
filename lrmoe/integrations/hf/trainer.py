"""``transformers.Trainer`` (and its Accelerate launch) on any number of processes with a swapped model: the
callback that makes Trainer's loop the swapped model's own.

    ep = swap_moe_blocks(model, "lrmoe")
    opt = ep.optimizer(torch.optim.AdamW, lr=1e-3)
    trainer = Trainer(model, args, train_dataset=..., optimizers=(opt, scheduler), callbacks=[EPTrainerCallback(ep)])
    trainer.train()                    # or trainer.train(resume_from_checkpoint=True)

What it does, and why (each at the hook where Trainer allows it):

* **gradient scale** (``on_train_begin``): Trainer's micro-batch losses are already shares of the step's mean loss
  (divided by the accumulation steps, or by the window's token count), and DDP averages the dense gradients over
  the ranks; the experts' gradients are summed over the ranks, so the optimizer's ``grad_scale`` is 1 / ranks;
* **clipping once** (``on_train_begin``): ``TrainingArguments.max_grad_norm`` moves into the swapped model's
  optimizer, which clips the global norm over the dense parameters and the experts (each once), and Trainer's own
  clipping (over ``model.parameters()``, where each rank holds its own slots) is set to 0 for the run (restored at
  ``on_train_end``);
* **checkpoints** (``on_step_end`` / ``on_epoch_end``, when Trainer is about to save): every rank gathers the
  experts (:func:`~lrmoe.integrations.hf.experts.hold_gathered_weights`), so that the checkpoint the main process
  writes alone holds HF's full expert tensors (loadable by the unmodified class), and writes its own expert training
  state (slots, fp32 master and Adam shards, placement, planning state) beside it, ``lrmoe-experts-rank{r}-of-{N}.pt``;
  Trainer's own ``optimizer.pt`` (the main process's) keeps the dense optimizer;
* **resume** (``on_train_begin``, after Trainer has loaded the model, the optimizer and the scheduler): each rank
  loads its own expert state from ``<output_dir>/checkpoint-<global step>``, where ``resume_from_checkpoint=True``
  or a path in the output folder resumes (a callback cannot see the path given to ``train``: a checkpoint elsewhere
  is ``EPTrainerCallback(ep, resume_from=path)``).

``EPTrainerCallback(ep, sharded=True)`` gathers nothing: each checkpoint's ``lrmoe-shards/`` holds the per-rank
shards of :func:`~lrmoe.integrations.hf.checkpoint.save_sharded`, and Trainer's own model file the dense part alone;
``python -m lrmoe.integrations.hf.checkpoint <checkpoint>/lrmoe-shards OUT`` makes it a checkpoint of the unmodified
class. Resuming works the same (each rank's expert state is beside it either way).

Checkpoints are written on Trainer's ``save_strategy`` ``"steps"`` and ``"epoch"`` (a save Trainer decides after an
evaluation, ``"best"``, is not prepared for). ``trainer.save_model(path)`` outside ``train()`` needs the experts
gathered on every rank: ``with hold_gathered_weights(model): trainer.save_model(path)`` on every rank.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch
from transformers import TrainerCallback

from lrmoe.integrations.hf.experts import hold_gathered_weights, without_experts

__all__ = ["SHARDS", "EPTrainerCallback", "expert_state_file"]

SHARDS = "lrmoe-shards"  # the per-rank shards' folder inside a checkpoint, with EPTrainerCallback(ep, sharded=True)


def expert_state_file(folder: str, rank: int, num_ranks: int) -> str:
    """Where rank ``rank`` of ``num_ranks`` keeps its expert training state in a checkpoint folder."""
    return os.path.join(folder, f"lrmoe-experts-rank{rank}-of-{num_ranks}.pt")


def _own_optimizer(optimizer, ep):
    """The swapped model's optimizer inside Trainer's (Accelerate wraps it), or a clear error."""
    inner = optimizer
    while inner is not None and getattr(inner, "ep", None) is not ep:
        inner = getattr(inner, "optimizer", None)
    if inner is None:
        raise ValueError("EPTrainerCallback needs the swapped model's own optimizer in Trainer: "
                         "Trainer(..., optimizers=(ep.optimizer(torch.optim.AdamW, lr=...), scheduler))")
    return inner


class EPTrainerCallback(TrainerCallback):
    """Trainer's loop as the swapped model's own loop (module doc): ``callbacks=[EPTrainerCallback(ep)]``."""

    def __init__(self, ep, resume_from: str | None = None, sharded: bool = False):
        self.ep, self.resume_from, self.sharded = ep, resume_from, sharded
        self._held = ExitStack()
        self._trainer_max_grad_norm: float | None = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        opt = _own_optimizer(optimizer, self.ep)  # its GLM bias update reads the gates' buffers at every step
        opt.grad_scale = 1.0 / self.ep.num_ranks
        if args.max_grad_norm and args.max_grad_norm > 0:
            opt.max_grad_norm = float(args.max_grad_norm)
            self._trainer_max_grad_norm, args.max_grad_norm = args.max_grad_norm, 0.0
        if state.global_step > 0:  # resumed: Trainer loaded the main process's optimizer.pt on every rank
            folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            path = expert_state_file(folder, self.ep.rank, self.ep.num_ranks)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"resuming at step {state.global_step}: no expert state {path}; resume from a "
                                        f"checkpoint this callback saved in {args.output_dir}, or name the one you "
                                        f"resume from: EPTrainerCallback(ep, resume_from=path)")
            self.ep.load_expert_state_dict(torch.load(path, weights_only=True))

    def _prepare_save(self, args, state, control, model=None, **kwargs) -> None:
        if not control.should_save or model is None:
            return
        self._held.close()
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        if self.sharded:  # each rank its own master shards; Trainer's model file the dense part alone
            from lrmoe.integrations.hf.checkpoint import save_sharded

            save_sharded(model, os.path.join(folder, SHARDS), step=state.global_step)  # collective: every rank
            self._held.enter_context(without_experts(model))
        else:
            self._held.enter_context(hold_gathered_weights(model))  # collective: every rank is here
        path = expert_state_file(folder, self.ep.rank, self.ep.num_ranks)
        torch.save(self.ep.expert_state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)

    on_step_end = _prepare_save
    on_epoch_end = _prepare_save

    def on_save(self, args, state, control, **kwargs):
        self._held.close()

    def on_train_end(self, args, state, control, **kwargs):
        self._held.close()
        if self._trainer_max_grad_norm is not None:
            args.max_grad_norm, self._trainer_max_grad_norm = self._trainer_max_grad_norm, None
