"""Swapping a model's sparse MoE blocks onto the expert-parallel layer (:func:`swap_moe_blocks`), and joining the
ranks' router recordings of a swapped model (:func:`gather_trace`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lrmoe.integrations.hf.data_parallel import ignore_experts_in_ddp
from lrmoe.integrations.hf.experts import EPExperts
from lrmoe.integrations.hf.expert_parallel import HFExpertParallel
from lrmoe.integrations.hf.families import _family, hf_to_reference, moe_blocks
from lrmoe.integrations.traces import RouterRecorder
from lrmoe.traces.trace import Trace, join_ranks
from lrmoe.planner.plan import Policy
from lrmoe.planner.policies import initial_placement
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
