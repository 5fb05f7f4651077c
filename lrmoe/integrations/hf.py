"""Hugging Face transformers drop-in: the sparse MoE blocks of a Qwen3-MoE or GLM-4.5 (``glm4_moe``) model on the
expert-parallel layer, running any system of the registry (:mod:`lrmoe.systems`), on gloo or NCCL.

What is swapped is the block's fused experts module only (``block.experts``, HF's ``forward(hidden_TD,
top_k_index, top_k_weights)``); the block's own forward, its router (``block.gate``), the shared experts and the
rest of the model stay HF's. So HF's router decides (its parameter names, its precision, fp32 for GLM;
``norm_topk_prob`` either way, ``routed_scaling_factor``, the ``e_score_correction_bias`` buffer, group-limited
routing with ``n_group`` / ``topk_group``), its hooks still collect ``output_router_logits``, and its top-k
indices and weights reach the layer as ``routing=`` (:class:`~lrmoe.runtime.routing.RouterOutput`): the layer plans,
dispatches and computes the experts, and the router gradient flows back through HF's weights.

    dist.init_process_group(...)                     # every rank, then the same model on every rank
    ep = swap_moe_blocks(model, "lrmoe")             # each rank keeps its slots and optimizer shard of the experts
    opt = ep.optimizer(torch.optim.AdamW, lr=1e-3,   # a torch Optimizer: HF's dense parameters and the experts,
                       max_grad_norm=1.0)            # clipped to one global gradient norm over both
    for ids in micro_batches:                        # gradient accumulation: k micro-batches, one step
        model(ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()                      # dense all-reduce, clipping, AdamW, expert Adam +
                                                     # redistribution, GLM bias
    model.save_pretrained(path, is_main_process=rank == 0)   # every rank: the experts are gathered

**One gradient convention.** Every method here that reduces gradients (:meth:`HFExpertParallel.sync_dense_grads`,
:meth:`~HFExpertParallel.expert_step`, :meth:`~HFExpertParallel.gather_expert_grads`, :meth:`~HFExpertParallel.step`
and the optimizer object's ``step``) defaults to the gradient of the *mean* loss over the ranks and the step's
micro-batches: the summed gradients times 1 / (ranks x micro-batches), the micro-batches being the training
forwards since the last step. A loop that already divides each micro-batch's loss by their number (HF's Trainer,
Accelerate) passes ``grad_scale=1 / ranks``; ``grad_scale=1.0`` gives the plain sum.

**Gradient clipping** cannot be ``torch.nn.utils.clip_grad_norm_(model.parameters())``: the routed experts are not
among them, and before the step each replica holds a partial sum of its expert's gradient. ``max_grad_norm`` of
:meth:`HFExpertParallel.optimizer` (or of :meth:`~HFExpertParallel.step`; :meth:`~HFExpertParallel.clip_grad_norm_`
in the low-level API) clips that gradient, after the dense all-reduce and the experts' replica-gradient sum, to one
global L2 norm over the dense parameters (once) and the experts (each once), exactly as ``clip_grad_norm_`` over
every parameter of the unswapped model on one process would (:mod:`lrmoe.runtime.clip`). The systems with a
retention budget (ρ < 1) clip the recalibrated gradient their experts' Adam applies.

**A foreign optimizer** (``torch.optim.AdamW(model.parameters())``, ``transformers.Trainer`` without
``optimizers=``) would step the dense parameters and never the experts: the model's next training forward after
such a step raises :class:`ForeignOptimizerError` (:data:`FOREIGN_OPTIMIZER` names the fix; how it is detected:
:class:`_ForeignStepGuard`).

**Trainer and data parallelism.** ``transformers.Trainer`` works on one process with ``optimizers=(ep.optimizer(...,
grad_scale=1.0, max_grad_norm=...), scheduler)`` and Trainer's own ``max_grad_norm=0`` (:class:`EPOptimizer`). On
more than one process it (and Accelerate, and any loop) wraps the model in DistributedDataParallel: a swapped model
refuses that at the wrapper's construction, on every rank, before any step (:class:`DataParallelError`; the message
says why and what to use), and refuses to run as a copy made by ``nn.DataParallel``. FSDP is not supported and not
detected.

Weights. HF fuses the experts as ``gate_up_proj`` [E, 2F, D] (gate rows first: ``linear(x, W).chunk(2)``) and
``down_proj`` [E, D, F]; the layer keeps the reference layout ``w_gate_EDF``, ``w_up_EDF``, ``w_down_EFD``
(:func:`hf_to_reference`, :func:`reference_to_hf`). The swapped module owns no parameter of its own: the replica
store holds the slots and the fp32 master shards (DESIGN.md §3.5), stepped by :meth:`HFExpertParallel.step`, never
by the dense optimizer. Its ``state_dict`` emits HF's two fused tensors, gathered from every rank's shard, so
``model.state_dict()`` and ``save_pretrained`` of a swapped model are **collective** (call them on every rank, as
with FSDP's full state dict) and give what the unmodified HF class loads; ``load_state_dict`` takes HF's tensors
back (no collective). The training state of the experts (moments, placement, planning state) is per rank:
:meth:`HFExpertParallel.expert_state_dict`.

Planning state. A forward with gradients is a training forward: it plans with the system's policy and advances
the layer's state (previous counts, the plan whose next placement :meth:`~HFExpertParallel.expert_step` moves to).
A forward without gradients (evaluation, generation) computes every pair on the placement the slots hold and
leaves that state as it was (between micro-batches under online replication: on the home slots). Every rank must run
the same number of forwards (they are collective): generate with ``synced_gpus=True``. Several training forwards
before a step are micro-batches of one iteration (their gradients accumulate; the placement holds until the step,
:mod:`lrmoe.runtime.layer`). Activation checkpointing (``model.activation_checkpointing_enable()``, or the
``gradient_checkpointing_enable()`` it replaces in transformers 5; non-reentrant as HF's default) works: the
recomputed forward replays the plan its original forward made.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from lrmoe.config import MoEConfig
from lrmoe.runtime.clip import clip_grad_norm_
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, flatten_experts, unflatten_experts
from lrmoe.runtime.layer import EPMoELayer, grad_flags, raise_on_grad_flags, recomputing
from lrmoe.integrations.load_stats import load_stats
from lrmoe.planner.plan import LayerPlan, Policy
from lrmoe.planner.policies import initial_placement
from lrmoe.planner.replica_routing import route_forward
from lrmoe.runtime.routing import RouterOutput, update_expert_bias
from lrmoe.systems import SystemContext, SystemSpec, get_system
from lrmoe.integrations.traces import RouterRecorder, Trace, join_ranks

__all__ = ["FAMILIES", "DataParallelError", "EPExperts", "EPOptimizer", "ForeignOptimizerError", "HFExpertParallel",
           "ddp_refusal", "gather_trace", "hf_config", "hf_to_reference", "moe_blocks", "reference_to_hf",
           "swap_moe_blocks"]

DEFAULT_BIAS_RATE = 1e-3  # aux-loss-free bias update speed (DeepSeek-V3 §2.1.2; GLM-4.5 trains with it)


@dataclass(frozen=True)
class Family:
    """What lrmoe needs to know about one HF MoE architecture."""

    model_type: str
    block: str  # the sparse MoE block's class, in transformers.models.<model_type>.modeling_<model_type>
    router: str  # the lrmoe router family of its gate (the layer's own router is unused: HF's routing is passed)
    biased: bool  # its gate carries e_score_correction_bias (aux-loss-free balancing)


FAMILIES = {
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "softmax_topk", biased=False),
    "glm4_moe": Family("glm4_moe", "Glm4MoeMoE", "sigmoid_bias", biased=True),
}


def _family(config) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"lrmoe.integrations.hf swaps the MoE blocks of {sorted(FAMILIES)} models; "
                         f"this model's model_type is "
                         f"{model_type!r}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"the expert-parallel layer computes SwiGLU experts (silu); this config has "
                         f"hidden_act={act!r}")
    return FAMILIES[model_type]


def _block_class(family: Family) -> type:
    import importlib

    module = importlib.import_module(f"transformers.models.{family.model_type}.modeling_{family.model_type}")
    return getattr(module, family.block)


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every sparse MoE block of a Qwen3-MoE or GLM-4.5 model, in layer order."""
    cls = _block_class(_family(model.config))
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def hf_config(cfg: MoEConfig, **overrides):
    """A transformers config of ``cfg``'s shape: ``Qwen3MoeConfig`` for the softmax_topk family, ``Glm4MoeConfig``
    for sigmoid_bias (e.g. the ``-debug`` presets, to train HF's architectures at CPU scale). The router keeps
    lrmoe's semantics (``norm_topk_prob=True``, no group-limited routing); ``overrides`` set any other field.
    :meth:`MoEConfig.from_hf` reads it back."""
    from transformers import Glm4MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, moe_intermediate_size=cfg.expert_ffn,
                  num_experts_per_tok=cfg.top_k, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim or cfg.hidden // cfg.num_heads,
                  max_position_embeddings=cfg.seq_len, intermediate_size=cfg.dense_ffn or 4 * cfg.hidden,
                  norm_topk_prob=True, tie_word_embeddings=False, dtype=cfg.dtype)
    if cfg.router == "softmax_topk":
        if cfg.num_shared_experts:
            raise ValueError(f"{cfg.name}: Qwen3-MoE has no shared expert (num_shared_experts="
                             f"{cfg.num_shared_experts})")
        qwen = dict(num_experts=cfg.num_experts, mlp_only_layers=list(range(cfg.first_dense_layers)))
        config = Qwen3MoeConfig(**{**common, **qwen, **overrides})
    else:
        if cfg.num_shared_experts and cfg.shared_ffn != cfg.expert_ffn:
            raise ValueError(f"{cfg.name}: GLM-4.5's shared experts are as wide as the routed ones "
                             f"(moe_intermediate_size); shared_ffn={cfg.shared_ffn}, expert_ffn={cfg.expert_ffn}")
        glm = dict(n_routed_experts=cfg.num_experts, n_shared_experts=cfg.num_shared_experts,
                   first_k_dense_replace=cfg.first_dense_layers, routed_scaling_factor=cfg.routed_scaling,
                   n_group=1, topk_group=1)
        config = Glm4MoeConfig(**{**common, **glm, **overrides})
    config._name_or_path = cfg.name
    return config


# -- weight layout -----------------------------------------------------------------------------------------------
def hf_to_reference(gate_up_EXD: torch.Tensor, down_EDF: torch.Tensor):
    """HF's fused experts (``gate_up_proj`` [E, 2F, D], X = 2F, gate rows first; ``down_proj`` [E, D, F]) as
    (w_gate_EDF, w_up_EDF, w_down_EFD), the reference layout (y = (silu(x W_gate) * (x W_up)) W_down)."""
    E, X, D = gate_up_EXD.shape
    if X % 2 or tuple(down_EDF.shape) != (E, D, X // 2):
        raise ValueError(f"gate_up_proj {tuple(gate_up_EXD.shape)} and down_proj {tuple(down_EDF.shape)} are not "
                         f"HF's fused experts [E, 2F, D] and [E, D, F]")
    F = X // 2
    return (gate_up_EXD[:, :F].transpose(1, 2).contiguous(), gate_up_EXD[:, F:].transpose(1, 2).contiguous(),
            down_EDF.transpose(1, 2).contiguous())


def reference_to_hf(w_gate_EDF: torch.Tensor, w_up_EDF: torch.Tensor, w_down_EFD: torch.Tensor):
    """(gate_up_proj [E, 2F, D], down_proj [E, D, F]) from the reference layout: the inverse of
    :func:`hf_to_reference`."""
    gate_up_EXD = torch.cat([w_gate_EDF.transpose(1, 2), w_up_EDF.transpose(1, 2)], dim=1).contiguous()
    return gate_up_EXD, w_down_EFD.transpose(1, 2).contiguous()


# -- the swapped experts module ----------------------------------------------------------------------------------
class _HeldPlacement:
    """The plan of a forward without gradients: every pair computed on the placement the slots hold (even split
    over replicas), nothing dropped or trimmed, the placement kept."""

    name = "held"

    def __init__(self, placement_NS: torch.Tensor):
        self.placement_NS = placement_NS.clone()

    def plan(self, counts_NE: torch.Tensor, prev_counts_E: torch.Tensor | None = None) -> LayerPlan:
        fwd_NG = route_forward(counts_NE, self.placement_NS, "even")
        return LayerPlan.dropless(self.placement_NS, fwd_NG, counts_NE.shape[1], policy=self.name)


class EPExperts(nn.Module):
    """Drop-in for HF's fused experts module: ``forward(hidden_TD, top_k_index_TK, top_k_weights_TK) -> y_TD``
    (Σ_k weight · expert output, as HF's), computed by an :class:`~lrmoe.runtime.layer.EPMoELayer` given HF's routing.

    The layer is held as a plain attribute, not a submodule: its slots are stepped by the replica store, not by a
    dense optimizer, and its router copy is unused. The state dict speaks HF's names (module doc).
    """

    def __init__(self, layer: EPMoELayer):
        super().__init__()
        self.__dict__["layer"] = layer  # not registered: model.parameters() stays the dense parameters
        self.num_experts, self.hidden_dim, self.intermediate_dim = layer.num_experts, layer.hidden, layer.expert_ffn
        self.register_state_dict_post_hook(_emit_hf_weights)
        self.register_load_state_dict_pre_hook(_take_hf_weights)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, ffn={self.intermediate_dim}, "
                f"policy={getattr(self.layer.policy, 'name', type(self.layer.policy).__name__)}, "
                f"rank={self.layer.rank}/{self.layer.num_ranks}")

    def forward(self, hidden_TD: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if getattr(self, "_is_replica", False):  # nn.Module._replicate_for_data_parallel marks nn.DataParallel's copies
            raise DataParallelError(DATA_PARALLEL_REFUSAL)
        layer = self.layer
        routing = RouterOutput(top_k_index, top_k_weights, None)
        guard = self.__dict__.get("guard")  # the first swapped block's: one check per model forward
        if guard is not None and torch.is_grad_enabled() and not recomputing():
            guard.check()
        if torch.is_grad_enabled():
            return layer(hidden_TD, routing=routing)[0]
        # the resident placement: online replication's replicas of a micro-batch are emptied before it (their
        # gradients kept for the step), so an evaluation between micro-batches runs on the home slots
        store = layer.store
        held = _HeldPlacement(store.resident_NS if store.pushed else store.placement_NS)
        return layer(hidden_TD, policy=held, routing=routing)[0]  # changes no planning state

    # -- HF's weights in and out of the replica store ----------------------------------------------------------
    def gather_hf_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) of every expert in the slots' dtype, from the fp32 master shards of all ranks
        (collective)."""
        store = self.layer.store
        flat_EW = store.full_master().to(store.dtype)
        return reference_to_hf(*unflatten_experts(flat_EW, store.hidden, store.ffn))

    @torch.no_grad()
    def load_hf_weights(self, gate_up_EXD: torch.Tensor, down_EDF: torch.Tensor) -> None:
        """Set every expert's weights from HF's fused tensors (each rank its master shard and its slots; no
        collective). The optimizer moments are left as they are."""
        store = self.layer.store
        expected = ((store.num_experts, 2 * store.ffn, store.hidden), (store.num_experts, store.hidden, store.ffn))
        if (tuple(gate_up_EXD.shape), tuple(down_EDF.shape)) != expected:
            raise ValueError(f"gate_up_proj {tuple(gate_up_EXD.shape)} and down_proj {tuple(down_EDF.shape)} do not "
                             f"match this layer's experts {expected}")
        flat_EW = flatten_experts(*hf_to_reference(gate_up_EXD, down_EDF)).to(store.device)
        lo, hi = store.bounds[store.rank]
        store.master_EW.copy_(flat_EW[:, lo:hi].to(torch.float32))
        for j, e in enumerate(store.placement_NS[store.rank].tolist()):
            if e >= 0:
                store.slots_SW[j].copy_(flat_EW[e].to(store.dtype))
            else:
                store.slots_SW[j].zero_()


def _emit_hf_weights(module: EPExperts, state_dict: dict, prefix: str, local_metadata) -> None:
    gate_up, down = module.gather_hf_weights()
    state_dict[prefix + "gate_up_proj"] = gate_up
    state_dict[prefix + "down_proj"] = down


def _take_hf_weights(module: EPExperts, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                     unexpected_keys, error_msgs) -> None:
    keys = [prefix + "gate_up_proj", prefix + "down_proj"]
    absent = [k for k in keys if k not in state_dict]
    if absent:
        missing_keys.extend(absent)
        return
    module.load_hf_weights(state_dict.pop(keys[0]), state_dict.pop(keys[1]))


# -- swapping ------------------------------------------------------------------------------------------------------
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
                    groups: RangeGroups | None = None) -> "HFExpertParallel":
    """Replace the experts of every sparse MoE block of ``model`` (Qwen3-MoE or GLM-4.5) by the expert-parallel
    layer, in place, and return the training-loop helper. Collective: call it on every rank of the default process
    group, with the same model (same weights) on every rank, after moving the model to its device.

    ``system``: a registry name (:func:`lrmoe.systems.get_system`), a :class:`~lrmoe.systems.SystemSpec`, or a
    policy object (then ``backward`` is the layer's backward config). Its policy is built per MoE layer from
    ``context`` (default: E experts, the world's ranks, ``spare_slots``, ``pairs_per_rank``); the backward seed of
    MoE layer i is ``seed * 1000 + i``. ``adam``: the experts' optimizer (the replica store's sharded Adam).
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
    if replica_grad == "range" and groups is None:
        groups = RangeGroups()
    top_k = model.config.num_experts_per_tok
    routed_scaling = float(getattr(model.config, "routed_scaling_factor", 1.0))
    swapped = []
    for i, (block_name, block) in enumerate(blocks):
        hf_experts = block.experts
        dtype, device = hf_experts.gate_up_proj.dtype, hf_experts.gate_up_proj.device
        w_gate, w_up, w_down = hf_to_reference(hf_experts.gate_up_proj.detach(), hf_experts.down_proj.detach())
        weights = {"w_router_ED": block.gate.weight.detach(), "bias_E": torch.zeros(E), "w_gate_EDF": w_gate,
                   "w_up_EDF": w_up, "w_down_EFD": w_down}
        policy = spec.make_policy(context) if spec is not None else system
        layer_backward = spec.layer_backward(seed * 1000 + i) if spec is not None else backward
        placement = initial_placement(policy, N, E, pairs_per_rank)
        layer = EPMoELayer(weights, top_k, family.router, policy, placement, groups, routed_scaling=routed_scaling,
                           dtype=dtype, device=device, adam=adam or AdamConfig(), accountant=accountant,
                           kernel_backend=kernel_backend, backward=layer_backward, replica_grad=replica_grad)
        layer.w_router_ED.requires_grad_(False)  # HF's gate routes; the layer's copy never enters the loss
        layer.name = block_name  # errors name the block (e.g. a non-finite input)
        block.experts = EPExperts(layer)  # HF's full expert tensors are released here
        swapped.append(block_name)
    _refuse_ddp(model, swapped, N)
    return HFExpertParallel(model, swapped, [b for _, b in blocks], family, name)


# -- data-parallel wrappers ------------------------------------------------------------------------------------------
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


# -- an optimizer that leaves the experts out ----------------------------------------------------------------------
class ForeignOptimizerError(RuntimeError):
    """An optimizer other than the swapped model's own stepped its dense parameters: the experts would never train."""


FOREIGN_OPTIMIZER = (
    "an optimizer other than lrmoe's stepped this model: its dense parameters were stepped (or changed in place) "
    "between two training forwards while the routed experts' gradients of the backward in between still waited for "
    "their optimizer step. The routed experts of a model swapped onto lrmoe's expert-parallel layer are not among "
    "model.parameters(), so an optimizer built over them (torch.optim.AdamW(model.parameters()), or "
    "transformers.Trainer without optimizers=) never trains the experts. Use the swapped model's optimizer: "
    "opt = ep.optimizer(torch.optim.AdamW, lr=...) in place of yours, in a plain loop (loss.backward(); opt.step(); "
    "opt.zero_grad()) or, on one process, as Trainer(..., optimizers=(ep.optimizer(torch.optim.AdamW, lr=..., "
    "grad_scale=1.0), scheduler)) with max_grad_norm=0 in TrainingArguments (clip with ep.optimizer(..., "
    "max_grad_norm=...)); or, with your own dense optimizer, ep.step(optimizer) in place of optimizer.step() "
    "(README, 'Use it with transformers').")


GRAD_SAMPLE = 8  # values of each dense gradient EPOptimizer keeps after the backward, to see an edit before its step


class GradientEditError(RuntimeError):
    """The dense gradients were changed in place between the backward and the swapped model's optimizer step."""


GRADIENT_EDIT = (
    "{edited} of the swapped model's {total} dense gradients were changed in place after the backward and before "
    "ep.optimizer's step: most likely clipped over model.parameters() (torch.nn.utils.clip_grad_norm_, or "
    "transformers.Trainer with max_grad_norm > 0 in TrainingArguments, its default 1.0). The routed experts are not "
    "among model.parameters(), so that clipping measures and scales the dense part only, and ep.optimizer's own "
    "clipping (max_grad_norm=) would scale the dense part a second time. Clip in the optimizer instead: "
    "ep.optimizer(..., max_grad_norm=1.0), with TrainingArguments(max_grad_norm=0) under Trainer. Gradients that "
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
    optimizer inside an iteration."""

    def __init__(self, model: nn.Module, layer: EPMoELayer, swapped: list[str]):
        self.model, self.layer, self.path = model, layer, path_to_blocks(swapped)
        self.param_ids = {id(p) for p in model.parameters()}
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

    def check(self) -> None:
        wrapped = fsdp_wrapped(self.model, self.path)
        if wrapped is not None:
            raise DataParallelError(FSDP_REFUSAL.format(where=f"module {wrapped!r}" if wrapped else "the root"))
        versions = [p._version for p in self.model.parameters()]
        changed = self.versions is not None and versions != self.versions
        self.versions = versions
        if not self._waiting():
            self.stepped_outside = False
        elif self.stepped_outside or changed:
            self.stepped_outside, self.versions = False, None
            raise ForeignOptimizerError(FOREIGN_OPTIMIZER)


# -- the training-loop contract --------------------------------------------------------------------------------------
class HFExpertParallel:
    """The training-loop contract of a swapped model, in one object (every call collective unless noted):

    * :meth:`dense_parameters`: what the dense optimizer owns: every parameter of the model (the routed experts
      are no longer among them; HF's routers, shared experts, attention, norms and embeddings are);
    * :meth:`sync_dense_grads`: all-reduce their gradients (data parallel), times ``grad_scale``;
    * :meth:`expert_step`: the experts' optimizer step (replica-gradient sum, sharded Adam, redistribution into
      the placement the policy planned for the next iteration);
    * :meth:`update_expert_bias`: GLM's aux-loss-free update of ``e_score_correction_bias`` from the step's global
      counts (identical on every rank);
    * :meth:`step`: all four in order;
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
        """Every trainable parameter of the model (no collective)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def mean_grad_scale(self) -> float:
        """1 / (ranks x micro-batches since the last step): the default ``grad_scale`` of every method (module
        doc). No collective."""
        return self.layers[0].mean_grad_scale()

    def _scale(self, grad_scale: float | None) -> float:
        return self.mean_grad_scale() if grad_scale is None else grad_scale

    def sync_dense_grads(self, grad_scale: float | None = None) -> None:
        """Sum every dense gradient over the ranks (one flat all-reduce per dtype), times ``grad_scale`` (default:
        the gradient of the mean loss over ranks and micro-batches). A missing gradient counts as zeros, so every
        rank reduces the same tensors."""
        scale = self._scale(grad_scale)
        params = self.dense_parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[tuple, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        N, layers = self.num_ranks, self.layers
        for group in by_dtype.values():
            finite = torch.stack([torch.isfinite(p.grad).all() for p in group]).all()
            flags = grad_flags(layers, self.rank, N, finite).to(group[0].grad)  # the gradient check (runtime.layer)
            flat = torch.cat([*(p.grad.reshape(-1) for p in group), flags])
            if N > 1:
                dist.all_reduce(flat)
            raise_on_grad_flags(flat[-N:], layers, self.rank)
            flat = flat[:-N].mul_(scale)
            offset = 0
            for p in group:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()

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
        ``collected``: with the gradient :meth:`clip_grad_norm_` collected and clipped."""
        scale = self._scale(grad_scale)
        for layer in self.layers:
            layer.expert_step(grad_scale=scale, collected=collected)

    @torch.no_grad()
    def update_expert_bias(self, rate: float = DEFAULT_BIAS_RATE) -> None:
        """GLM: nudge each gate's ``e_score_correction_bias`` by ``rate`` towards balance, from the global counts of
        the iteration (its micro-batches summed; after :meth:`expert_step`, of the iteration it ended). No
        collective: the counts are already global. A no-op for Qwen3-MoE."""
        if not self.family.biased or not rate:
            return
        for block, layer in zip(self.blocks, self.layers):
            counts = layer.iteration_counts_NE.sum(0) if layer.iteration_counts_NE is not None else layer.prev_counts_E
            if counts is None:
                raise ValueError("update_expert_bias needs a training forward first")
            bias = block.gate.e_score_correction_bias
            bias.copy_(update_expert_bias(bias, counts.to(bias.device), rate))

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: float | None = None,
             bias_rate: float = DEFAULT_BIAS_RATE, max_grad_norm: float = 0.0) -> torch.Tensor | None:
        """One optimizer step after the backward(s): dense gradients all-reduced, every gradient clipped to a
        global norm of ``max_grad_norm`` when it is positive (:meth:`clip_grad_norm_`), ``optimizer`` stepped, the
        experts stepped and redistributed, GLM's bias updated; then every gradient cleared. ``grad_scale``
        defaults to the gradient of the mean loss over ranks and micro-batches. Returns the norm before clipping
        (None when not clipping)."""
        scale = self._scale(grad_scale)
        self.sync_dense_grads(scale)
        norm = self.clip_grad_norm_(max_grad_norm, scale) if max_grad_norm > 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.expert_step(scale, collected=norm is not None)
        self.update_expert_bias(bias_rate)
        return norm

    def optimizer(self, dense_optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                  grad_scale: float | None = None, bias_rate: float = DEFAULT_BIAS_RATE,
                  max_grad_norm: float = 0.0, allow_grad_edits: bool = False, **kwargs) -> "EPOptimizer":
        """One ``torch.optim.Optimizer`` for the whole swapped model (:class:`EPOptimizer`): ``dense_optimizer(
        self.dense_parameters(), **kwargs)`` for the dense part, the replica store's sharded Adam for the experts
        (its ``lr``, ``betas`` and ``eps`` those of ``kwargs`` when given); ``max_grad_norm`` > 0 clips the global
        norm over both at every step; a dense gradient changed in place between the backward and the step raises
        :class:`GradientEditError` there unless ``allow_grad_edits``. No collective."""
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


class EPOptimizer(torch.optim.Optimizer):
    """A swapped model's optimizer as one ``torch.optim.Optimizer``, so that a loop written for plain PyTorch
    (``loss.backward(); opt.step(); opt.zero_grad()``, any number of micro-batches in between) and torch's LR
    schedulers work unchanged.

    ``max_grad_norm`` > 0 clips at every step, after the dense all-reduce and before both steps, the global L2 norm
    of the dense and the expert gradients (each expert once, after its replicas' gradients are summed) exactly as
    ``torch.nn.utils.clip_grad_norm_`` over all the parameters of the unswapped model on one process would
    (:meth:`HFExpertParallel.clip_grad_norm_`); the norm before clipping is kept as ``last_grad_norm`` (the same
    on every rank; None when not clipping). The systems with a retention budget (ρ < 1) clip the recalibrated
    gradient their experts' Adam applies.

    ``param_groups`` are the dense optimizer's groups (the same dicts) followed by one group of the experts' slots,
    whose ``lr``, ``betas`` and ``eps`` the experts' sharded Adam reads at every step (so a scheduler moves both
    learning rates). :meth:`step` (collective) runs :meth:`HFExpertParallel.step`'s order: dense all-reduce, the
    dense step, the expert step and redistribution, GLM's bias update; gradients scaled by ``grad_scale`` (default:
    the mean loss over ranks and micro-batches, module doc). :meth:`zero_grad` clears both parts;
    :meth:`state_dict` holds the dense optimizer's state and this rank's expert state (per rank, like the
    experts' optimizer shards: save one per rank).

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
    after that optimizer's first step raises :class:`ForeignOptimizerError` (:class:`_ForeignStepGuard`). On more
    than one process Trainer and
    Accelerate wrap the model in DistributedDataParallel, which the swapped model refuses at construction
    (:class:`DataParallelError`, :func:`ddp_refusal`): write the loop by hand (README, "Use it with
    transformers"); micro-batches, gradient checkpointing and LR schedulers all work in it.
    """

    def __init__(self, ep: HFExpertParallel, dense_optimizer: type[torch.optim.Optimizer], *,
                 grad_scale: float | None = None, bias_rate: float = DEFAULT_BIAS_RATE, max_grad_norm: float = 0.0,
                 allow_grad_edits: bool = False, **kwargs):
        if not (isinstance(dense_optimizer, type) and issubclass(dense_optimizer, torch.optim.Optimizer)):
            raise ValueError(f"dense_optimizer must be a torch.optim.Optimizer class (e.g. torch.optim.AdamW), got "
                             f"{dense_optimizer!r}")
        if not max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0: no clipping), got {max_grad_norm}")
        self.ep, self.grad_scale, self.bias_rate, self.max_grad_norm = ep, grad_scale, bias_rate, max_grad_norm
        self.last_grad_norm: torch.Tensor | None = None  # the global norm before clipping, of the last step
        self.dense = dense_optimizer(ep.dense_parameters(), **kwargs)
        adam = ep.layers[0].store.adam
        betas = kwargs.get("betas", (adam.beta1, adam.beta2))
        experts = {"params": [layer.store.slots_SW for layer in ep.layers], "lr": kwargs.get("lr", adam.lr),
                   "betas": tuple(betas), "eps": kwargs.get("eps", adam.eps), "weight_decay": adam.weight_decay,
                   "experts": True}
        super().__init__([*self.dense.param_groups, experts], self.dense.defaults)
        self.param_groups = [*self.dense.param_groups, self.param_groups[-1]]  # the dense groups themselves
        self.state = self.dense.state
        # each dense gradient's version counter and first few values after the backward last accumulated into it:
        # another version with other values at the step means it was changed in place in between (GradientEditError)
        self._grad_versions: dict[int, tuple[int, torch.Tensor]] = {}
        self._grad_hooks = [] if allow_grad_edits else [
            p.register_post_accumulate_grad_hook(self._noter()) for p in ep.dense_parameters()]

    @property
    def expert_group(self) -> dict:
        return self.param_groups[-1]

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
        params = self.ep.dense_parameters()
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grad_edits()
        ep, group = self.ep, self.expert_group
        scale = ep._scale(self.grad_scale)
        ep.sync_dense_grads(scale)
        clip = self.max_grad_norm > 0
        self.last_grad_norm = ep.clip_grad_norm_(self.max_grad_norm, scale) if clip else None
        self.dense.step()
        beta1, beta2 = group["betas"]
        for layer in ep.layers:
            layer.store.adam = replace(layer.store.adam, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                                       eps=group["eps"])
        ep.expert_step(scale, collected=clip)
        ep.update_expert_bias(self.bias_rate)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none=set_to_none)
        for layer in self.ep.layers:
            layer.store.slots_SW.grad = None

    def state_dict(self) -> dict:
        group = {k: v for k, v in self.expert_group.items() if k != "params"}
        return {"dense": self.dense.state_dict(), "expert_group": group, "experts": self.ep.expert_state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"dense", "expert_group", "experts"}:
            raise ValueError(f"not an EPOptimizer state dict: keys {sorted(state_dict)}, expected dense, "
                             f"expert_group and experts")
        expert_group = self.expert_group
        self.dense.load_state_dict(state_dict["dense"])  # torch's load makes new group dicts: share them again
        self.param_groups = [*self.dense.param_groups, expert_group]
        self.state = self.dense.state
        expert_group.update(state_dict["expert_group"])
        self.ep.load_expert_state_dict(state_dict["experts"])


def gather_trace(recorder: RouterRecorder, **meta) -> Trace:
    """Join what every rank's :class:`~lrmoe.integrations.traces.RouterRecorder` recorded (its own tokens) into one
    trace with a
    source-rank dimension of N · the recorder's virtual ranks (collective; every rank gets it)."""
    local = recorder.trace(**meta)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.counts_ILNE)
    return join_ranks([Trace(p, local.meta) for p in parts])
