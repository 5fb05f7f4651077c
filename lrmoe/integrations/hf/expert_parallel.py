"""The training-loop contract of a swapped model (:class:`HFExpertParallel`) and its optimizer as one
``torch.optim.Optimizer`` (:class:`EPOptimizer`)."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from lrmoe.integrations.hf.families import DEFAULT_BIAS_RATE, Family, reference_to_hf
from lrmoe.integrations.hf.foreign_optimizer import (GRAD_SAMPLE, GRADIENT_EDIT, ForeignOptimizerError,
                                                     GradientEditError, _ForeignStepGuard)
from lrmoe.integrations.load_stats import load_stats
from lrmoe.planner.plan import LayerPlan
from lrmoe.runtime.clip import clip_grad_norm_
from lrmoe.runtime.dense_sync import sync_dense_grads_
from lrmoe.runtime.distributed.replica import unflatten_experts
from lrmoe.runtime.layer import EPMoELayer
from lrmoe.runtime.optim import ExpertParallelOptimizer, adam_hyperparameters, update_expert_biases_

UNSYNCED_DENSE_STEP = (
    "ep.expert_step(): the swapped model's dense parameters were stepped in this iteration before their gradients "
    "were reduced (ep.sync_dense_grads(): the all-reduce over the ranks, the mean over ranks and micro-batches, the "
    "non-finite check). Each rank stepped its own gradient, so on more than one rank their dense weights now differ. "
    "Step with the swapped model's optimizer, opt = ep.optimizer(torch.optim.AdamW, lr=...), which runs the "
    "reduction, the dense step and the experts' step in that order; or call ep.sync_dense_grads() before your "
    "optimizer's step, or ep.step(optimizer) in place of it (README, 'Use it with transformers').")


class HFExpertParallel:
    """The training-loop contract of a swapped model, in one object (every call collective unless noted):

    * :meth:`dense_parameters`: what the dense optimizer owns: every parameter of the model (the routed experts
      are no longer among them; HF's routers, shared experts, attention, norms and embeddings are);
    * :meth:`sync_dense_grads`: all-reduce their gradients (data parallel), times ``grad_scale``;
    * :meth:`expert_step`: the experts' optimizer step (replica-gradient sum, sharded Adam, redistribution into
      the placement the policy planned for the next iteration);
    * :meth:`update_expert_bias`: GLM's aux-loss-free update of ``e_score_correction_bias`` from the step's global
      counts (identical on every rank);
    * :meth:`step`: all four in order (the step core's order, :mod:`lrmoe.runtime.optim`);
    * :meth:`optimizer`: the same as one ``torch.optim.Optimizer`` (:class:`EPOptimizer`), for loops written for
      plain PyTorch and for LR schedulers.

    Gradients: the mean loss over ranks and micro-batches by default (module doc).
    """

    def __init__(self, model: nn.Module, names: list[str], blocks: list[nn.Module], family: Family, system: str):
        self.model, self.names, self.blocks, self.family, self.system = model, names, blocks, family, system
        self._guard = _ForeignStepGuard(model, blocks[0].experts.layer, names)
        blocks[0].experts.__dict__["guard"] = self._guard  # not a submodule

    @property
    def layers(self) -> list[EPMoELayer]:
        return [b.experts.layer for b in self.blocks]

    @property
    def num_ranks(self) -> int:
        return self.layers[0].num_ranks

    @property
    def rank(self) -> int:
        return self.layers[0].rank

    def dense_parameters(self) -> list[nn.Parameter]:
        """Every trainable parameter of the model but the expert slots (no collective)."""
        return [p for p in self._guard.dense_params if p.requires_grad]

    @property
    def dense_reduced_by_ddp(self) -> bool:
        """Whether a DistributedDataParallel all-reduced (averaged over the ranks) the dense gradients of this
        iteration in its backward: its last training forward ran inside a DDP that syncs (not under ``no_sync``).
        Then the step's dense sync sends only the non-finite flags and rescales the average to ``grad_scale``'s
        convention (times the ranks). No collective."""
        return self._guard.ddp_reduces

    def mean_grad_scale(self) -> float:
        """1 / (ranks x micro-batches since the last step): the default ``grad_scale`` of every method (module
        doc). No collective."""
        return self.layers[0].mean_grad_scale()

    def _scale(self, grad_scale: float | None) -> float:
        return self.mean_grad_scale() if grad_scale is None else grad_scale

    def sync_dense_grads(self, grad_scale: float | None = None) -> None:
        """Sum every dense gradient over the ranks (one flat all-reduce per dtype, carrying the non-finite check),
        times ``grad_scale`` (default: the gradient of the mean loss over ranks and micro-batches). A missing
        gradient counts as zeros, so every rank reduces the same tensors (:mod:`lrmoe.runtime.dense_sync`). When a
        DistributedDataParallel averaged them in the backward (:attr:`dense_reduced_by_ddp`) only the check is
        all-reduced, and the average is rescaled to the same convention."""
        sync_dense_grads_(self.dense_parameters(), self.layers, self._scale(grad_scale),
                          averaged=self.dense_reduced_by_ddp)

    def clip_grad_norm_(self, max_norm: float, grad_scale: float | None = None) -> torch.Tensor:
        """Clip every gradient, dense and expert, to a global L2 norm of ``max_norm`` as
        ``torch.nn.utils.clip_grad_norm_`` would over all the parameters of the unswapped model on one process, and
        return the norm before clipping (the same on every rank). Call it after :meth:`sync_dense_grads`; then step
        the dense optimizer and ``expert_step(collected=True)``. It runs the experts' replica-gradient sum and
        collection, times ``grad_scale`` (default: the gradient of the mean loss over ranks and micro-batches):
        each expert counts once, the dense parameters once (:mod:`lrmoe.runtime.clip`). With a retention budget
        (ρ < 1) the norm is that of the recalibrated gradient the experts' Adam applies."""
        return clip_grad_norm_(self.dense_parameters(), self.layers, max_norm, self._scale(grad_scale))

    def expert_step(self, grad_scale: float | None = None, collected: bool = False) -> None:
        """Every swapped layer's expert optimizer step, into the next placement its plans chose, with the
        gradient times ``grad_scale`` (default: the gradient of the mean loss over ranks and micro-batches);
        ``collected``: with the gradient :meth:`clip_grad_norm_` collected and clipped.

        Refused (:class:`ForeignOptimizerError`, :data:`UNSYNCED_DENSE_STEP`) before any expert moves when the dense
        parameters were stepped in this iteration without :meth:`sync_dense_grads` after its last backward (and
        without a DistributedDataParallel that reduced them in it)."""
        guard = self._guard
        stepped = guard.stepped_outside or (guard.versions is not None and guard.dense_versions() != guard.versions)
        if stepped and not (self.layers[0].dense_synced or self.dense_reduced_by_ddp):
            raise ForeignOptimizerError(UNSYNCED_DENSE_STEP)
        scale = self._scale(grad_scale)
        for layer in self.layers:
            layer.expert_step(grad_scale=scale, collected=collected)

    def biases(self) -> list[torch.Tensor | None]:
        """Each swapped block's selection bias (GLM's ``e_score_correction_bias``; None for Qwen3-MoE)."""
        return [b.gate.e_score_correction_bias if self.family.biased else None for b in self.blocks]

    def update_expert_bias(self, rate: float = DEFAULT_BIAS_RATE) -> None:
        """GLM: nudge each gate's ``e_score_correction_bias`` by ``rate`` towards balance, from the global counts of
        the iteration (its micro-batches summed; after :meth:`expert_step`, of the iteration it ended). No
        collective: the counts are already global. A no-op for Qwen3-MoE."""
        update_expert_biases_(self.layers, self.biases(), rate)

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float | None = None,
             bias_rate: float = DEFAULT_BIAS_RATE, max_grad_norm: float = 0.0) -> torch.Tensor | None:
        """One optimizer step after the backward(s), the step core's (:class:`~lrmoe.runtime.optim.
        ExpertParallelOptimizer` around ``optimizer``): dense gradients all-reduced, every gradient clipped to a
        global norm of ``max_grad_norm`` when it is positive (:meth:`clip_grad_norm_`), ``optimizer`` stepped, the
        experts stepped (with the Adam configuration the swap gave them) and redistributed, GLM's bias updated;
        then every gradient cleared. ``grad_scale`` defaults to the gradient of the mean loss over ranks and
        micro-batches. Returns the norm before clipping (None when not clipping)."""
        core = ExpertParallelOptimizer(optimizer, self.layers, grad_scale=grad_scale, max_grad_norm=max_grad_norm,
                                       expert_hparams=adam_hyperparameters(self.layers[0].store.adam),
                                       biases=self.biases(), bias_rate=bias_rate,
                                       dense_averaged=lambda: self.dense_reduced_by_ddp)
        core.step()
        core.zero_grad(set_to_none=True)
        return core.last_grad_norm

    def optimizer(self, dense_optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                  grad_scale: float | None = None, bias_rate: float = DEFAULT_BIAS_RATE,
                  max_grad_norm: float = 0.0, allow_grad_edits: bool = False, **kwargs) -> "EPOptimizer":
        """One ``torch.optim.Optimizer`` for the whole swapped model (:class:`EPOptimizer`): ``dense_optimizer(
        self.dense_parameters(), **kwargs)`` for the dense part, the replica store's sharded Adam for the experts
        with the dense optimizer's ``lr``, ``betas``, ``eps`` and ``weight_decay`` (decoupled as AdamW's, L2 as
        Adam's; :mod:`lrmoe.runtime.optim`); ``max_grad_norm`` > 0 clips the global norm over both at every step;
        a dense gradient changed in place between the backward and the step raises :class:`GradientEditError`
        there unless ``allow_grad_edits``. No collective."""
        return EPOptimizer(self, dense_optimizer, grad_scale=grad_scale, bias_rate=bias_rate,
                           max_grad_norm=max_grad_norm, allow_grad_edits=allow_grad_edits, **kwargs)

    def zero_grad(self) -> None:
        """Clear the dense and the expert slots' gradients (no collective)."""
        self.model.zero_grad(set_to_none=True)
        for layer in self.layers:
            layer.store.slots_SW.grad = None

    # -- inspection ----------------------------------------------------------------------------------------------
    def gather_expert_grads(self, grad_scale: float | None = None) -> dict[str, torch.Tensor]:
        """The routed experts' gradients in HF's layout and names (``<block>.experts.gate_up_proj``, ...), summed
        over replicas and ranks, times ``grad_scale`` (default: the gradient of the mean loss over ranks and
        micro-batches, what :meth:`expert_step` would use). Collective; every rank gets all."""
        scale = self._scale(grad_scale)
        out = {}
        for name, layer in zip(self.names, self.layers):
            store = layer.store
            store.sync_replica_grads()
            flat_EW = store.gather_full(store.collect_grad_shards(scale))
            gate_up, down = reference_to_hf(*unflatten_experts(flat_EW, store.hidden, store.ffn))
            out[f"{name}.experts.gate_up_proj"], out[f"{name}.experts.down_proj"] = gate_up, down
        return out

    def plans(self) -> list[LayerPlan | None]:
        """Each swapped layer's plan of the last training forward (no collective)."""
        return [layer.last_plan for layer in self.layers]

    def load_stats(self, **kw) -> dict:
        """:func:`lrmoe.integrations.load_stats.load_stats` of the last training forward's plans (no collective)."""
        plans = self.plans()
        if any(p is None for p in plans):
            raise ValueError("load_stats needs a training forward first")
        return load_stats(plans=plans, **kw)

    # -- per-rank training state (resume) -------------------------------------------------------------------------
    def expert_state_dict(self) -> list[dict]:
        """This rank's state of every swapped layer after an optimizer step: slots, fp32 master and Adam shards,
        placement, Adam step, previous counts and backward generator, as tensors and ints (``torch.load(...,
        weights_only=True)`` reads it). No collective; save one per rank beside ``model.state_dict()``."""
        out = []
        for layer in self.layers:
            store = layer.store
            out.append({"slots_SW": store.slots_SW.detach().clone(), "master_EW": store.master_EW.clone(),
                        "exp_avg_EW": store.exp_avg_EW.clone(), "exp_avg_sq_EW": store.exp_avg_sq_EW.clone(),
                        "placement_NS": store.placement_NS.clone(), "adam_steps": store.adam_steps,
                        "prev_counts_E": layer.prev_counts_E,
                        "bwd_generator": None if layer.bwd_generator is None else layer.bwd_generator.get_state()})
        return out

    @torch.no_grad()
    def load_expert_state_dict(self, states: list[dict]) -> None:
        """Restore what :meth:`expert_state_dict` saved on this rank (after ``model.load_state_dict``)."""
        if len(states) != len(self.layers):
            raise ValueError(f"{len(states)} layer states for {len(self.layers)} swapped layers")
        for layer, state in zip(self.layers, states):
            store = layer.store
            for key in ("slots_SW", "master_EW", "exp_avg_EW", "exp_avg_sq_EW"):
                getattr(store, key).copy_(state[key])
            store.placement_NS = state["placement_NS"].clone()
            store.adam_steps = state["adam_steps"]
            layer.prev_counts_E, layer.last_plan = state["prev_counts_E"], None
            layer.iteration_counts_NE, layer.micro_batches, layer.decisions = None, 0, []
            if layer.bwd_generator is not None and state["bwd_generator"] is not None:
                layer.bwd_generator.set_state(state["bwd_generator"])


class EPOptimizer(ExpertParallelOptimizer):
    """A swapped model's optimizer as one ``torch.optim.Optimizer``, so that a loop written for plain PyTorch
    (``loss.backward(); opt.step(); opt.zero_grad()``, any number of micro-batches in between) and torch's LR
    schedulers work unchanged: the step core (:class:`~lrmoe.runtime.optim.ExpertParallelOptimizer`) over
    ``dense_optimizer(ep.dense_parameters(), **kwargs)`` and the swapped layers, with HF's gate biases (GLM) as the
    bias update's (read from the gates at every step, not kept: a buffer replaced after the optimizer is built is
    the one updated), and two additions: a check that the dense gradients were not edited since the backward (a step
    pre-hook) and this rank's expert state in :meth:`state_dict`.

    ``max_grad_norm`` > 0 clips at every step, after the dense all-reduce and before both steps, the global L2 norm
    of the dense and the expert gradients (each expert once, after its replicas' gradients are summed) exactly as
    ``torch.nn.utils.clip_grad_norm_`` over all the parameters of the unswapped model on one process would
    (:meth:`HFExpertParallel.clip_grad_norm_`); the norm before clipping is kept as ``last_grad_norm`` (the same
    on every rank; None when not clipping). The systems with a retention budget (ρ < 1) clip the recalibrated
    gradient their experts' Adam applies.

    ``param_groups`` are the dense optimizer's groups (the same dicts) followed by one group of the experts' slots,
    whose ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``decoupled_weight_decay`` the experts' sharded Adam
    reads at every step (so a scheduler moves both learning rates); they start as the dense optimizer's, so AdamW
    decays the experts as it decays the dense weights. :meth:`step` (collective) runs the step core's order: dense
    all-reduce, clipping, the dense step, the expert step and redistribution, GLM's bias update; gradients scaled
    by ``grad_scale`` (default: the mean loss over ranks and micro-batches, module doc). :meth:`zero_grad` clears
    both parts; :meth:`state_dict` holds the dense optimizer's state and this rank's expert state (per rank, like
    the experts' optimizer shards: save one per rank).

    ``transformers.Trainer`` (and Accelerate) on one process: pass ``Trainer(..., optimizers=(ep.optimizer(
    torch.optim.AdamW, lr=..., grad_scale=1.0, max_grad_norm=1.0), scheduler))`` with Trainer's own
    ``max_grad_norm=0``. Trainer's micro-batch losses are already shares of the step's mean (hence
    ``grad_scale=1.0``), and its clipping would see the dense parameters only (the experts are not among
    ``model.parameters()``): clip here instead. A clipping over ``model.parameters()`` that binds (Trainer's
    default ``max_grad_norm=1.0``, or torch's in a loop) changes the dense gradients between the backward and this
    step, which then raises :class:`GradientEditError` before stepping anything (``allow_grad_edits=True``: edits
    meant to be there, e.g. an unscale). So set, it trains exactly as the plain loop
    (``tests/test_hf_trainer.py``: the same weights, bitwise). Without ``optimizers`` Trainer builds its own
    optimizer over the dense parameters, which would never train the experts: the model's next training forward
    after that optimizer's first step raises :class:`ForeignOptimizerError` (:class:`_ForeignStepGuard`). Under
    DistributedDataParallel (Trainer and Accelerate on several processes) DDP carries the dense gradients and the
    step reduces them no second time (:attr:`HFExpertParallel.dense_reduced_by_ddp`).
    """

    def __init__(self, ep: HFExpertParallel, dense_optimizer: type[torch.optim.Optimizer], *,
                 grad_scale: float | None = None, bias_rate: float = DEFAULT_BIAS_RATE, max_grad_norm: float = 0.0,
                 allow_grad_edits: bool = False, **kwargs):
        if not (isinstance(dense_optimizer, type) and issubclass(dense_optimizer, torch.optim.Optimizer)):
            raise ValueError(f"dense_optimizer must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), got "
                             f"{dense_optimizer!r}")
        if not max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {max_grad_norm}")
        self.ep = ep
        super().__init__(dense_optimizer(ep.dense_parameters(), **kwargs), ep.layers, grad_scale=grad_scale,
                         max_grad_norm=max_grad_norm, biases=ep.biases, bias_rate=bias_rate,
                         dense_averaged=lambda: ep.dense_reduced_by_ddp)
        self._bias_rate = bias_rate  # a Qwen3-MoE model has no bias update to hold it
        # each dense gradient's version counter and first few values after the backward last accumulated into it:
        # another version with other values at the step means it was changed in place in between (GradientEditError)
        self._grad_versions: dict[int, tuple[int, torch.Tensor]] = {}
        self._grad_hooks = [] if allow_grad_edits else [
            p.register_post_accumulate_grad_hook(self._noter()) for p in ep.dense_parameters() + self._slots()]
        self.register_step_pre_hook(_check_grad_edits_hook)

    def _slots(self) -> list[torch.Tensor]:
        return [layer.store.slots_SW for layer in self.ep.layers]

    @property
    def bias_rate(self) -> float:
        return self._bias_rate

    @bias_rate.setter
    def bias_rate(self, rate: float) -> None:
        self._bias_rate = rate
        if self.bias_update is not None:
            self.bias_update.rate = rate

    def _noter(self):
        ref = weakref.ref(self)  # the parameters' hooks must not keep the optimizer alive

        def note(p: torch.Tensor) -> None:
            opt = ref()
            if opt is not None and p.grad is not None:
                opt._grad_versions[id(p)] = (p.grad._version, p.grad.detach().reshape(-1)[:GRAD_SAMPLE].clone())
        return note

    def _check_grad_edits(self) -> None:
        """GradientEditError when a dense gradient changed in place since the backward last accumulated into it:
        its version counter moved and its first :data:`GRAD_SAMPLE` values differ. The values tell a rewrite that
        changes nothing (a one-rank DDP's copy back from its bucket, Trainer's norm for its log, a clipping
        coefficient of 1) from one that changes the gradient (a clipping that binds, an unscale)."""
        if not self._grad_hooks:
            return
        # DDP writes its average into the dense gradients after the backward: then the slots (which it leaves
        # alone) show an edit, e.g. a clipping over model.parameters()
        params = self._slots() if self.ep.dense_reduced_by_ddp else self.ep.dense_parameters() + self._slots()
        noted, self._grad_versions = self._grad_versions, {}
        moved = [(p.grad.detach().reshape(-1)[:GRAD_SAMPLE], noted[id(p)][1]) for p in params
                 if p.grad is not None and id(p) in noted and p.grad._version != noted[id(p)][0]]
        if not moved:
            return
        # every moved gradient's values compared at once, in float64 (exact for every float dtype): one host sync
        # per step, not one per parameter
        now = torch.cat([a.to(torch.float64) for a, _ in moved])
        then = torch.cat([b.to(torch.float64) for _, b in moved])
        differs = (now != then).cpu().split([a.numel() for a, _ in moved])
        edited = sum(bool(d.any()) for d in differs)
        if edited:
            raise GradientEditError(GRADIENT_EDIT.format(edited=edited, total=len(params)))

    def __del__(self):
        for hook in getattr(self, "_grad_hooks", ()):
            hook.remove()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "experts": self.ep.expert_state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"dense", "expert_group", "experts"}:
            raise ValueError(f"not an EPOptimizer state dict: keys {sorted(state_dict)}, expected dense, "
                             f"expert_group and experts")
        super().load_state_dict(state_dict)
        self.ep.load_expert_state_dict(state_dict["experts"])


def _check_grad_edits_hook(optimizer: EPOptimizer, args, kwargs) -> None:
    """EPOptimizer's step pre-hook: refuse the step before anything moves when a dense gradient was edited."""
    optimizer._check_grad_edits()
