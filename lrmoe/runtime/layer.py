"""The expert-parallel MoE layer on ``torch.distributed``: every rank routes its own tokens, a policy object plans
the iteration, and the routed pairs travel to the slots that compute them and back.

One forward, on every rank (DESIGN.md §4, the data flows one way):

    route (replicated router) → all-gather counts_NE → plan = policy.plan(counts_NE, prev_counts_E)
    → [weight push into empty slots, if the plan has one: ReplicaStore.push]
    → expert exchange (lrmoe.runtime.backward: the dispatcher's pack → all-to-all → slot-major → grouped-GEMM SwiGLU →
      all-to-all back) → weighted un-permute (+ shared expert)

Every rank runs the same policy on the same all-gathered counts, so all ranks hold the same plan without further
communication, and each derives its all-to-all split sizes from it. The layer never looks at which policy made the
plan: static EP, capacity with drops, SYMI or LRMoE placements all arrive as a :class:`~lrmoe.planner.plan.LayerPlan`.
The plan is made once per iteration; :meth:`EPMoELayer.expert_step` moves the weights into the placement it
planned for the next iteration.

The layer keeps the routing, the shared expert and the orchestration. The data path is the dispatcher's
(:mod:`lrmoe.runtime.dispatch`); the backward is the expert exchange's (:mod:`lrmoe.runtime.backward`), one code path
for every
plan: with ``backward=None`` it is the plain backward (plans that trim or move backward pairs are refused), with a
:class:`~lrmoe.runtime.backward.BackwardConfig` the recalibrated one (metric and selection at home, compacted packets).
The per-pair expert outputs come home as one tensor ``o_MD`` before the weighted un-permute
``y_t = Σ_j g_tj · o_tj``, so the router gradient (through g) is exact for every pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.runtime.backward import BackwardRecord, ExpertExchange, expert_exchange
from lrmoe.config import ROUTER_FAMILIES
from lrmoe.runtime.dispatch import Comm, Dispatch, TokenDispatcher, assign_pairs, make_dispatch, source_to_slot_major
from lrmoe.runtime.distributed.accounting import Accountant
from lrmoe.runtime.expert_compute import SwiGLUExperts
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, ReplicaStore
from lrmoe.planner.plan import LayerPlan, Policy
from lrmoe.planner.policies import initial_placement
from lrmoe.runtime.reference import EXPERT_WEIGHTS, SHARED_WEIGHTS, swiglu
from lrmoe.runtime.routing import RouterOutput, route

__all__ = ["EPMoELayer", "EPMoEInfo", "RecalibratedPlanError", "check_layer_plan", "initial_placement", "Dispatch",
           "assign_pairs", "source_to_slot_major"]

PLAIN_BACKWARD = BackwardConfig()  # what a layer built with backward=None runs: plans that select are refused


class RecalibratedPlanError(ValueError):
    """A plan that trims or moves backward pairs given to a layer built without the recalibrated backward."""


def check_layer_plan(plan: LayerPlan, counts_NE: torch.Tensor, placement_NS: torch.Tensor,
                     recalibrated: bool = False) -> None:
    """Raise unless ``plan`` is valid for these counts and one this layer can run: made for the placement the
    slots hold (up to the empty slots its weight push fills, ``plan.push_src_G``); with backward retention or
    backward flows only when the layer has the recalibrated backward."""
    plan.validate(counts_NE)
    if not torch.equal(plan.resident_NS.cpu(), placement_NS):
        raise ValueError(f"plan.placement_NS {plan.placement_NS.tolist()} differs from the placement the slots hold "
                         f"{placement_NS.tolist()}: move the weights first (expert_step(next_placement_NS=...))")
    if not recalibrated and (not torch.equal(plan.keep_NG, plan.fwd_NG) or plan.bwd_flows_V4.numel()):
        raise RecalibratedPlanError(f"plan of policy {getattr(plan, 'policy', '?')!r} keeps fewer pairs for the "
                                    f"backward or routes them between replicas; that needs the recalibrated "
                                    f"backward hook: build the layer with backward=BackwardConfig(...)")


@dataclass(frozen=True)
class EPMoEInfo:
    """What the forward returns beside y (the model's auxiliary loss reads ``scores_TE`` and ``counts_E``)."""

    scores_TE: torch.Tensor  # router scores of the local tokens (differentiable)
    counts_E: torch.Tensor  # long: routed pairs per expert over all ranks
    gate_TK: torch.Tensor
    dispatch: Dispatch
    record: BackwardRecord | None = None  # what the recalibrated backward kept (filled by the backward)


class EPMoELayer(nn.Module):
    """One MoE layer under expert parallelism: a replicated router (and shared expert), the local slots of the
    replica store, and a policy object that plans every iteration.

    Build it on every rank with the same full ``weights`` (the reference layer's layout, e.g.
    ``ReferenceMoE.export_weights()``); each rank keeps only its slots and its shard of the optimizer state.
    The router and shared-expert weights are data-parallel: :meth:`sync_dense_grads` all-reduces their gradients.
    Every rank must run the forward and a backward through its output each iteration (they are collective).
    """

    def __init__(self, weights: dict[str, torch.Tensor], top_k: int, router: str, policy: Policy | None,
                 placement_NS: torch.Tensor,
                 groups: RangeGroups, *, routed_scaling: float = 1.0, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, adam: AdamConfig = AdamConfig(),
                 accountant: Accountant | None = None, kernel_backend: str | None = None,
                 backward: BackwardConfig | None = None, replica_grad: str = "range"):
        super().__init__()
        missing = [k for k in EXPERT_WEIGHTS if k not in weights]
        if missing:
            raise ValueError(f"weights lack {missing}: pass every weight in the reference layout {EXPERT_WEIGHTS}")
        if router not in ROUTER_FAMILIES:
            raise ValueError(f"router={router!r} is not one of {ROUTER_FAMILIES}")
        E, D, F = weights["w_gate_EDF"].shape
        if not 0 < top_k <= E:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={E}]")
        self.num_experts, self.hidden, self.expert_ffn, self.top_k = E, D, F, top_k
        self.router, self.routed_scaling, self.policy = router, routed_scaling, policy
        dtype = dtype or weights["w_gate_EDF"].dtype
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.kernel_backend = kernel_backend if kernel_backend is not None else (
            "torch" if device.type == "cpu" else None)  # Triton's interpreter is for kernel tests, not layers
        self.store = ReplicaStore(weights["w_gate_EDF"], weights["w_up_EDF"], weights["w_down_EFD"], placement_NS,
                                  groups, dtype=dtype, device=device, adam=adam, accountant=accountant,
                                  replica_grad=replica_grad)
        self.comm = Comm(self.store.rank, self.store.num_ranks, accountant)
        self.dispatcher = TokenDispatcher(self.comm, self.kernel_backend)
        self.experts = SwiGLUExperts(D, F, self.kernel_backend)  # the expert-compute seam of the exchange
        self.w_router_ED = nn.Parameter(weights["w_router_ED"].to(device, dtype).clone())
        self.register_buffer("bias_E", weights["bias_E"].to(device, torch.float32).clone())
        self.shared = all(k in weights for k in SHARED_WEIGHTS)
        if self.shared:
            self.w_shared_gate_DF = nn.Parameter(weights["w_shared_gate_DF"].to(device, dtype).clone())
            self.w_shared_up_DF = nn.Parameter(weights["w_shared_up_DF"].to(device, dtype).clone())
            self.w_shared_down_FD = nn.Parameter(weights["w_shared_down_FD"].to(device, dtype).clone())
        if backward is not None and not isinstance(backward, BackwardConfig):
            raise ValueError(f"backward must be a BackwardConfig or None, got {type(backward).__name__}")
        self.backward_config = backward
        self.bwd_generator = backward.generator(self.rank) if backward is not None else None
        self.prev_counts_E: torch.Tensor | None = None
        self.last_plan: LayerPlan | None = None
        self.last_dispatch: Dispatch | None = None

    # -- parameters --------------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.store.num_ranks

    @property
    def rank(self) -> int:
        return self.store.rank

    @property
    def slots_per_rank(self) -> int:
        return self.store.slots_per_rank

    @property
    def placement_NS(self) -> torch.Tensor:
        return self.store.placement_NS

    def dense_parameters(self) -> list[nn.Parameter]:
        """The data-parallel parameters (router, shared expert): optimise them with any torch optimizer."""
        names = ["w_router_ED"] + (["w_shared_gate_DF", "w_shared_up_DF", "w_shared_down_FD"] if self.shared else [])
        return [getattr(self, n) for n in names]

    @property
    def accountant(self) -> Accountant | None:
        return self.comm.accountant

    @accountant.setter
    def accountant(self, value: Accountant | None) -> None:
        self.comm.accountant = value

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, x_TD: torch.Tensor, policy: Policy | None = None, routing: RouterOutput | None = None,
                pair_hook: Callable[[torch.Tensor, Dispatch], torch.Tensor] | None = None):
        """y_TD and an :class:`EPMoEInfo`. ``policy`` overrides the layer's own for this call; ``routing``
        replaces the router's choice (trace replay: its idx_TK and weight_TK are used as given);
        ``pair_hook(o_MD, dispatch)`` sees the per-pair expert outputs at home and must keep their values.
        With the recalibrated backward, ``info.record`` says which pairs the backward kept, once it has run."""
        if x_TD.dim() != 2 or x_TD.shape[1] != self.hidden:
            raise ValueError(f"x_TD must have shape [tokens, {self.hidden}], got {tuple(x_TD.shape)}")
        if x_TD.dtype != self.store.dtype:
            raise ValueError(f"x_TD has dtype {x_TD.dtype}; the layer computes in {self.store.dtype}")
        policy = policy if policy is not None else self.policy
        if policy is None:
            raise ValueError("no policy: pass one to the constructor or to forward()")
        T, K, comm = x_TD.shape[0], self.top_k, self.comm

        with comm.phase("route"):
            logits_TE = x_TD @ self.w_router_ED.T
            routed = route(logits_TE, self.router, K, bias_E=self.bias_E if self.router == "sigmoid_bias" else None,
                           scaling=self.routed_scaling)
            if routing is not None:
                if tuple(routing.idx_TK.shape) != (T, K) or tuple(routing.weight_TK.shape) != (T, K):
                    raise ValueError(f"routing.idx_TK and weight_TK must have shape ({T}, {K}), got "
                                     f"{tuple(routing.idx_TK.shape)} and {tuple(routing.weight_TK.shape)}")
                routed = RouterOutput(routing.idx_TK.to(x_TD.device), routing.weight_TK.to(x_TD.device),
                                      routed.scores_TE)
            gate_TK = routed.weight_TK.to(x_TD.dtype)

        with comm.phase("plan"):
            counts_NE = comm.all_gather_counts(torch.bincount(routed.idx_TK.reshape(-1), minlength=self.num_experts))
            plan = policy.plan(counts_NE, self.prev_counts_E)
            check_layer_plan(plan, counts_NE, self.placement_NS, recalibrated=self.backward_config is not None)
        if plan.push_src_G is not None:  # online replication: weights into the spare slots before the compute
            self.store.push(plan.placement_NS, plan.push_src_G)

        with comm.phase("permute"):
            dispatch = make_dispatch(routed.idx_TK, gate_TK, plan, counts_NE, self.rank, x_TD.device)
        record = BackwardRecord(top_k=K)
        state = ExpertExchange(self.dispatcher, dispatch, gate_TK, self.backward_config or PLAIN_BACKWARD,
                               self.bwd_generator, record, self.experts)
        o_MD = expert_exchange(x_TD, self.store.slots_SW, state)
        y_TD = self.dispatcher.unpermute(o_MD, dispatch, gate_TK, pair_hook)
        if self.shared:
            with comm.phase("shared_fwd"):
                y_TD = y_TD + swiglu(x_TD, self.w_shared_gate_DF, self.w_shared_up_DF, self.w_shared_down_FD)[0]

        R = int(dispatch.recv_counts_NS.sum())
        comm.count("pairs_fwd", R)
        # the experts' activations gate, up and h of the R computed rows (held until the backward)
        comm.count("token_buffer_bytes", 3 * R * self.expert_ffn * x_TD.element_size())
        comm.count("pairs_dropped", int((dispatch.slot_P < 0).sum()))
        self.prev_counts_E = counts_NE.sum(0)
        self.last_plan, self.last_dispatch = plan, dispatch
        return y_TD, EPMoEInfo(scores_TE=routed.scores_TE, counts_E=self.prev_counts_E, gate_TK=gate_TK,
                               dispatch=dispatch, record=record if self.backward_config is not None else None)

    # -- after the backward --------------------------------------------------------------------------------------
    def sync_dense_grads(self, grad_scale: float = 1.0) -> None:
        """All-reduce (sum) the router's and shared expert's gradients over all ranks, times ``grad_scale``."""
        for p in self.dense_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.num_ranks > 1:
                dist.all_reduce(p.grad)
            p.grad.mul_(grad_scale)

    def next_placement(self) -> torch.Tensor:
        """The placement the layer's policy planned for the next iteration, in this iteration's plan."""
        return (self.placement_NS if self.last_plan is None else self.last_plan.next_placement_NS).clone()

    def expert_step(self, next_placement_NS: torch.Tensor | None = None, grad_scale: float = 1.0) -> torch.Tensor:
        """The experts' optimizer step on the replica substrate, then their weights into the next placement
        (default: :meth:`next_placement`). Returns the placement the slots now hold."""
        nxt = self.next_placement() if next_placement_NS is None else next_placement_NS
        self.store.step(nxt, grad_scale)
        return self.placement_NS
