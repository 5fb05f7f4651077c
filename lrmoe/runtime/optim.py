"""One optimizer step of the expert-parallel model, as one ``torch.optim.Optimizer`` over the dense parameters and
the experts (DESIGN.md §3.5, §3.9): what the training script, the Hugging Face drop-in and its Trainer path all run.

    dense = torch.optim.AdamW(dense_params, lr=3e-4, weight_decay=0.1)
    opt = ExpertParallelOptimizer(dense, layers, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)   # moves the dense and the experts' rates
    for batch in batches:
        for micro in batch: loss(micro).backward()      # gradients accumulate over micro-batches
        opt.step(); opt.zero_grad(); sched.step()

:meth:`ExpertParallelOptimizer.step` is collective and runs, on every rank, in this order:

1. **dense sync**: the dense gradients summed over the ranks (one flat all-reduce per dtype over ``group``, the
   world by default) with every layer's non-finite flags (:func:`~lrmoe.runtime.dense_sync.sync_dense_grads_`);
2. **global clip**, when ``max_grad_norm`` > 0: the experts' replica-gradient sum and collection, one L2 norm over
   the dense gradients and the experts, every gradient scaled (:func:`~lrmoe.runtime.clip.clip_grad_norm_`);
3. **dense step**: the wrapped torch optimizer;
4. **expert step**: every layer's sharded Adam (DESIGN.md §3.5) with the expert group's hyper-parameters, then the
   redistribution into the next placement, which ends the iteration;
5. **step post-hooks** (torch's ``register_step_post_hook``): GLM's aux-loss-free expert-bias update from the
   iteration's global counts is one, registered when ``biases`` are given (:class:`ExpertBiasUpdate`).

``param_groups`` are the dense optimizer's groups (the same dicts) followed by one group of the experts' slots,
whose ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``decoupled_weight_decay`` the experts' Adam reads at every
step: a scheduler moves both rates. They start as the dense optimizer's own (its defaults), so
``AdamW(..., weight_decay=wd)`` decays the experts as torch's AdamW would (decoupled), ``Adam(..., weight_decay=wd)``
adds the L2 term as torch's Adam would; keys the dense optimizer lacks (SGD's betas) come from the layers'
:class:`~lrmoe.runtime.distributed.replica.AdamConfig`.

Gradients: by default the gradient of the mean loss over ranks and the iteration's micro-batches (the layers'
``mean_grad_scale``); ``grad_scale`` replaces it for every part alike (e.g. 1 / ranks when each micro-batch's loss
is already divided by their number).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from lrmoe.runtime.clip import clip_grad_norm_
from lrmoe.runtime.dense_sync import sync_dense_grads_
from lrmoe.runtime.distributed.replica import AdamConfig
from lrmoe.runtime.layer import EPMoELayer
from lrmoe.runtime.routing import update_expert_bias

__all__ = ["EXPERT_KEYS", "ExpertBiasUpdate", "ExpertParallelOptimizer", "adam_hyperparameters",
           "dense_hyperparameters", "update_expert_biases_"]

EXPERT_KEYS = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay")  # what the expert group holds


def adam_hyperparameters(adam: AdamConfig) -> dict:
    """An :class:`AdamConfig` as the expert group's keys (:data:`EXPERT_KEYS`)."""
    return {"lr": adam.lr, "betas": (adam.beta1, adam.beta2), "eps": adam.eps, "weight_decay": adam.weight_decay,
            "decoupled_weight_decay": adam.decoupled}


def dense_hyperparameters(dense: torch.optim.Optimizer, adam: AdamConfig) -> dict:
    """The expert group's start: the dense optimizer's defaults where it has the key, ``adam``'s otherwise. An
    option the experts' Adam cannot follow is refused rather than ignored."""
    defaults = dense.defaults
    for option in ("amsgrad", "maximize"):
        if defaults.get(option):
            raise ValueError(f"the experts' sharded Adam has no {option}; build the dense optimizer without it")
    out = adam_hyperparameters(adam)
    out.update({k: defaults[k] for k in EXPERT_KEYS if k in defaults})
    out["betas"] = tuple(out["betas"])
    if "weight_decay" in defaults and "decoupled_weight_decay" not in defaults:
        out["decoupled_weight_decay"] = False  # SGD, Adagrad, ...: torch adds their decay to the gradient (L2)
    return out


@torch.no_grad()
def update_expert_biases_(layers: Sequence[EPMoELayer], biases: Sequence[torch.Tensor | None], rate: float) -> None:
    """GLM's aux-loss-free balancing: nudge each layer's selection bias (``biases``, None: the layer has none) by
    ``rate`` towards the mean load, from the global counts of the iteration: after the expert step, those of the
    iteration it ended summed over the data-parallel copies too (``layer.global_counts_E``, the same on every
    rank); before it, the open iteration's micro-batches summed (its expert-parallel group's). No collective."""
    if not rate:
        return
    for layer, bias_E in zip(layers, biases, strict=True):
        if bias_E is None:
            continue
        counts_E = layer.iteration_counts_NE.sum(0) if layer.iteration_counts_NE is not None else \
            layer.global_counts_E
        if counts_E is None:
            raise ValueError("the expert-bias update needs a training forward first")
        bias_E.copy_(update_expert_bias(bias_E, counts_E.to(bias_E.device), rate))


class ExpertBiasUpdate:
    """A step post-hook (``optimizer.register_step_post_hook(ExpertBiasUpdate(...))``) that runs
    :func:`update_expert_biases_` after every step; ``rate`` may be changed between steps.

    ``biases``: the tensors, or a function returning them that is asked at every step, so that the update reaches
    the model's buffers as they are then (``model.to(device)``, a loader assigning new buffers, or an engine's
    preparation of the model replaces them after the optimizer is built)."""

    def __init__(self, layers: Sequence[EPMoELayer],
                 biases: Sequence[torch.Tensor | None] | Callable[[], Sequence[torch.Tensor | None]], rate: float):
        if not rate >= 0:
            raise ValueError(f"the expert-bias rate must be non-negative, got {rate}")
        self.layers, self.rate = list(layers), rate
        self.biases = biases if callable(biases) else list(biases)

    def current(self) -> list[torch.Tensor | None]:
        """The bias tensors this step updates."""
        return list(self.biases()) if callable(self.biases) else self.biases

    def __call__(self, optimizer, args, kwargs) -> None:
        update_expert_biases_(self.layers, self.current(), self.rate)


class ExpertParallelOptimizer(torch.optim.Optimizer):
    """The expert-parallel model's optimizer (module doc): ``dense`` (any torch optimizer over the replicated
    parameters) and the experts of ``layers`` (each layer's sharded Adam), stepped in one order.

    ``expert_hparams``: the expert group's start (:data:`EXPERT_KEYS`; default: the dense optimizer's, module doc).
    ``biases``: per layer its selection bias or None (GLM), updated at ``bias_rate`` after every step (or a function
    returning them, asked at every step: :class:`ExpertBiasUpdate`). ``group``:
    the process group of the dense sync (default: the world). ``dense_averaged``: asked at every step whether
    another engine (DistributedDataParallel) already averaged the dense gradients over the ranks in the backward;
    then the sync all-reduces only the non-finite check. ``last_grad_norm``: the global norm before clipping of the
    last step (the same on every rank; None when not clipping).

    ``param_groups`` and ``state`` are always the dense optimizer's current ones (plus the expert group): loading
    the dense optimizer's state dict on its own, which makes new group dicts, leaves the core and a scheduler on
    it in step with it."""

    def __init__(self, dense: torch.optim.Optimizer, layers: Sequence[EPMoELayer], *,
                 grad_scale: float | None = None, max_grad_norm: float = 0.0, expert_hparams: dict | None = None,
                 biases: Sequence[torch.Tensor | None] | Callable[[], Sequence[torch.Tensor | None]] | None = None,
                 bias_rate: float = 0.0, group=None,
                 dense_averaged: Callable[[], bool] | None = None):
        if not isinstance(dense, torch.optim.Optimizer):
            raise ValueError(f"dense must be a torch.optim.Optimizer, got {type(dense).__name__}")
        layers = list(layers)
        if not layers:
            raise ValueError("ExpertParallelOptimizer needs at least one expert-parallel layer")
        if not max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {max_grad_norm}")
        if grad_scale is not None and not grad_scale > 0:
            raise ValueError(f"grad_scale must be positive, got {grad_scale}")
        hparams = dict(dense_hyperparameters(dense, layers[0].store.adam) if expert_hparams is None
                       else expert_hparams)
        missing = [k for k in EXPERT_KEYS if k not in hparams]
        if missing:
            raise ValueError(f"expert_hparams lacks {missing}")
        experts = {"params": [layer.store.slots_SW for layer in layers], **hparams, "experts": True}
        dense_ids = {id(p) for group in dense.param_groups for p in group["params"]}
        if any(id(p) in dense_ids for p in experts["params"]):
            raise ValueError("the dense optimizer holds expert slots: build it over the dense parameters only")
        super().__init__([experts], dense.defaults)  # the expert group; the dense ones are the dense optimizer's
        self.dense, self.layers, self.group = dense, layers, group
        self.grad_scale, self.max_grad_norm, self.dense_averaged = grad_scale, max_grad_norm, dense_averaged
        self.last_grad_norm: torch.Tensor | None = None
        self.bias_update: ExpertBiasUpdate | None = None
        if biases is not None and any(b is not None for b in (biases() if callable(biases) else biases)):
            self.bias_update = ExpertBiasUpdate(layers, biases, bias_rate)
            self.register_step_post_hook(self.bias_update)

    @property
    def param_groups(self) -> list[dict]:
        own = self.__dict__.setdefault("_own_groups", [])
        dense = self.__dict__.get("dense")
        return own if dense is None else [*dense.param_groups, *own]

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:  # torch's constructor: the core's own (expert) group
        self.__dict__["_own_groups"] = groups

    @property
    def state(self):
        dense = self.__dict__.get("dense")
        return self.__dict__.get("_own_state") if dense is None else dense.state

    @state.setter
    def state(self, state) -> None:
        self.__dict__["_own_state"] = state

    @property
    def expert_group(self) -> dict:
        return self.__dict__["_own_groups"][-1]

    def dense_parameters(self) -> list[torch.Tensor]:
        """The parameters the dense optimizer steps, in its order: the ones the dense sync reduces."""
        return [p for group in self.dense.param_groups for p in group["params"]]

    def scale(self) -> float:
        """The gradient scale of this step: ``grad_scale``, or the mean over ranks and micro-batches."""
        return self.grad_scale if self.grad_scale is not None else self.layers[0].mean_grad_scale()

    def _apply_expert_group(self) -> None:
        group = self.expert_group
        beta1, beta2 = group["betas"]
        for layer in self.layers:
            layer.store.adam = replace(layer.store.adam, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                                       eps=group["eps"], weight_decay=group["weight_decay"],
                                       decoupled=bool(group["decoupled_weight_decay"]))

    @torch.no_grad()
    def step(self, closure=None):
        """Dense sync, clip, dense step, expert step (module doc); the post-hooks follow. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale, dense = self.scale(), self.dense_parameters()
        averaged = self.dense_averaged is not None and self.dense_averaged()
        sync_dense_grads_(dense, self.layers, scale, self.group, averaged=averaged)
        clip = self.max_grad_norm > 0
        self.last_grad_norm = clip_grad_norm_(dense, self.layers, self.max_grad_norm, scale) if clip else None
        self.dense.step()
        self._apply_expert_group()
        for layer in self.layers:
            layer.expert_step(grad_scale=scale, collected=clip)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the dense gradients (as the dense optimizer's ``zero_grad``) and the experts' slots' (no
        collective)."""
        self.dense.zero_grad(set_to_none=set_to_none)
        for layer in self.layers:
            layer.store.slots_SW.grad = None

    def state_dict(self) -> dict:
        """The dense optimizer's state and the expert group's hyper-parameters (the experts' Adam moments live in
        the layers' replica stores, per rank)."""
        group = {k: v for k, v in self.expert_group.items() if k != "params"}
        return {"dense": self.dense.state_dict(), "expert_group": group}

    def load_state_dict(self, state_dict: dict) -> None:
        for key in ("dense", "expert_group"):
            if key not in state_dict:
                raise ValueError(f"not an {type(self).__name__} state dict: keys {sorted(state_dict)}, no {key!r}")
        self.dense.load_state_dict(state_dict["dense"])
        self.expert_group.update(state_dict["expert_group"])
