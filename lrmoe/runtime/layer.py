"""The expert-parallel MoE layer on ``torch.distributed``: every rank routes its own tokens, a policy object plans
the iteration, and the routed pairs travel to the slots that compute them and back.

One forward, on every rank (DESIGN.md §4, the data flows one way):

    route (replicated router) → all-gather counts_NE → plan = policy.plan(counts_NE, prev_counts_E)
    → [weight push into empty slots, if the plan has one: ReplicaStore.push]
    → expert exchange (lrmoe.runtime.exchange: the dispatcher's pack → all-to-all → slot-major → grouped-GEMM SwiGLU →
      all-to-all back) → weighted un-permute (+ shared expert)

Every rank runs the same policy on the same all-gathered counts, so all ranks hold the same plan without further
communication, and each derives its all-to-all split sizes from it. The placement part of a plan needs only the
previous iteration's counts: for a policy that splits (:class:`~lrmoe.planner.plan.SplitPolicy`, every registry
policy) the layer computes it on a background thread while the iteration runs and calls only
``policy.plan_on(counts_NE, placement_NS)`` between the all-gather and the dispatch, the same plan bit for bit
(:mod:`lrmoe.runtime.placement_ahead`; ``placement_ahead=False`` plans inside ``policy.plan`` as before).
The layer never looks at which policy made the plan: static EP, capacity with drops, SYMI or LRMoE placements all
arrive as a :class:`~lrmoe.planner.plan.LayerPlan`.

**Iterations and micro-batches.** An iteration is every training forward (one with gradients) between two
:meth:`EPMoELayer.expert_step` calls: one, or k micro-batches whose gradients accumulate. Within an iteration the
placement is fixed (what SYMI and LRMoE plan from the previous iteration's counts): each micro-batch's forward
routes and plans its own pairs on it (forward routing, capacity, retention quotas; the backward selects its own
pairs), the slots' weight gradients accumulate over the micro-batches, and the replica-gradient sum, the sharded
Adam and the redistribution run once, in :meth:`~EPMoELayer.expert_step`. Every policy plans from
``prev_counts_E``, the previous iteration's global counts summed over its micro-batches, and the next placement
comes from this iteration's summed counts (``iteration_counts_NE``): SYMI's and LRMoE's placements from those
proportions (LRMoE's memory rule sizes its slots for one micro-batch's pairs), static EP and capacity stay put.
Online replication (:mod:`lrmoe.planner.online`) plans its replicas from each micro-batch's own counts, as it does
per forward: before a later micro-batch pushes, the spare slots of the previous one are emptied and their
gradients kept per expert (:meth:`~lrmoe.runtime.distributed.replica.ReplicaStore.unpush`), so they join the
iteration's one replica-gradient sum.

**One gradient convention.** :meth:`~EPMoELayer.sync_dense_grads` and :meth:`~EPMoELayer.expert_step` default to
the gradient of the *mean* loss over the ranks and the iteration's micro-batches: they scale the summed gradients
by 1 / (ranks x micro-batches), the micro-batches counted by the layer. A loop that already divides each
micro-batch's loss by k passes ``grad_scale=1 / ranks``; ``grad_scale=1.0`` gives the plain sum.

**Activation checkpointing.** A training forward records what it decided (the routed experts, the counts, the
plan and the dispatch). When the forward runs again inside the backward (torch's non-reentrant
``torch.utils.checkpoint``, what HF's ``activation_checkpointing_enable`` runs by default), the layer replays that
record instead of planning again: no counts all-gather, no policy call, no push; the router's gates are
recomputed (they are differentiable), the routed experts must be the recorded ones. So the recomputed activations
are those of the original plan, bit for bit.

The layer keeps the routing, the shared expert and the orchestration. The data path is the dispatcher's
(:mod:`lrmoe.runtime.dispatch`); the backward is the expert exchange's (:mod:`lrmoe.runtime.exchange`), one code path
for every
plan: with ``backward=None`` it is the plain backward (plans that trim or move backward pairs are refused), with a
:class:`~lrmoe.runtime.exchange.BackwardConfig` the recalibrated one (metric and selection at home, compacted packets).
The per-pair expert outputs come home as one tensor ``o_MD`` before the weighted un-permute
``y_t = Σ_j g_tj · o_tj``, so the router gradient (through g) is exact for every pair.

Non-finite values fail loudly, on every rank, before any weight moves: each rank's "my input holds a NaN or inf"
rides as one extra entry in the counts all-gather the plan needs anyway, and each rank's "a gradient into my layer
(or my dense gradients) holds one" as one entry per rank in the dense-gradient all-reduce
(:mod:`lrmoe.runtime.dense_sync`). Either raises :class:`NonFiniteError` naming the layer and the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.runtime.exchange import BackwardRecord, ExpertExchange, expert_exchange
from lrmoe.config import ROUTER_FAMILIES
from lrmoe.runtime.dense_sync import NonFiniteError, grad_flags, raise_on_grad_flags, sync_dense_grads_
from lrmoe.runtime.comm import Comm
from lrmoe.runtime.dispatch import Dispatch, TokenDispatcher, assign_pairs, make_dispatch, source_to_slot_major
from lrmoe.runtime.distributed.accounting import Accountant
from lrmoe.runtime.expert_compute import SwiGLUExperts
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, ReplicaStore
from lrmoe.planner.plan import LayerPlan, Policy, SplitPolicy
from lrmoe.planner.policies import initial_placement
from lrmoe.runtime.placement_ahead import PlacementAhead
from lrmoe.runtime.reference import EXPERT_WEIGHTS, SHARED_WEIGHTS, swiglu
from lrmoe.runtime.routing import RouterOutput, route

__all__ = ["Decision", "EPMoELayer", "EPMoEInfo", "RecalibratedPlanError", "NonFiniteError", "grad_flags",
           "raise_on_grad_flags", "check_layer_plan", "initial_placement", "Dispatch", "assign_pairs",
           "recomputing", "source_to_slot_major"]

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
class Decision:
    """What one training forward decided, kept until the iteration's expert step so that a recomputation of the
    forward (activation checkpointing) replays it instead of planning again."""

    idx_TK: torch.Tensor  # the routed experts of the local tokens
    counts_NE: torch.Tensor  # the all-gathered counts the plan was made from
    plan: LayerPlan
    dispatch: Dispatch


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass with gradients on: the recomputation of a non-reentrant
    activation checkpoint (the autograd engine is executing a graph task)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


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
    Every rank must run each forward and a backward through its output (they are collective); any number of
    training forwards (micro-batches) may precede :meth:`expert_step` (with online replication, each one's backward
    before the next forward: the next one pushes other replicas into the slots).
    """

    def __init__(self, weights: dict[str, torch.Tensor], top_k: int, router: str, policy: Policy | None,
                 placement_NS: torch.Tensor,
                 groups: RangeGroups, *, routed_scaling: float = 1.0, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, adam: AdamConfig = AdamConfig(),
                 accountant: Accountant | None = None, kernel_backend: str | None = None,
                 backward: BackwardConfig | None = None, replica_grad: str = "range", placement_ahead: bool = True):
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
        self.comm = Comm(self.store.rank, self.store.num_ranks, accountant, self.store.ep_group)
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
        self.prev_counts_E: torch.Tensor | None = None  # the previous iteration's EP-group counts: every plan's input
        self.global_counts_E: torch.Tensor | None = None  # the same summed over the DP copies (the selection bias's)
        self.iteration_counts_NE: torch.Tensor | None = None  # this iteration's counts, summed over micro-batches
        self.micro_batches = 0  # training forwards since the last expert step
        self.decisions: list[Decision] = []  # this iteration's, for recomputation (module doc)
        self.name = "EPMoELayer"  # how errors name this layer (a model sets e.g. "layer 3")
        self.grad_finite: torch.Tensor | None = None  # whether this iteration's output gradients are finite
        self.dense_synced = False  # the dense gradients were all-reduced since this layer's last backward
        self.last_plan: LayerPlan | None = None
        self.last_dispatch: Dispatch | None = None
        self._iteration_policy = None
        # placements off the critical path (lrmoe.runtime.placement_ahead); False: every plan places itself
        self.placement_ahead = PlacementAhead() if placement_ahead else None

    # -- parameters --------------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        """The ranks of this layer's expert-parallel group: the placements' N."""
        return self.store.num_ranks

    @property
    def world_size(self) -> int:
        """Every rank of the run: the EP group times its data-parallel copies."""
        return self.store.num_ranks * self.store.dp_size

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
        With the recalibrated backward, ``info.record`` says which pairs the backward kept, once it has run.

        A forward with gradients is a micro-batch of the current iteration (module doc): it plans from
        ``prev_counts_E`` and adds its counts to the iteration's; one without gradients plans the same way and
        changes no state. Run inside the backward (activation checkpointing), it replays its recorded decision."""
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

        replay = self._replayed(routed.idx_TK) if recomputing() else None
        training = torch.is_grad_enabled() and replay is None
        if replay is not None:  # a recomputation: the original forward's plan and dispatch, no collective
            counts_NE, plan, dispatch = replay.counts_NE, replay.plan, replay.dispatch
        else:
            with comm.phase("plan"):
                # detached: no autograd node (isfinite's abs would save x_TD, and a recomputation, which skips
                # this check, would then save fewer tensors than the forward it replays)
                bad = (~torch.isfinite(x_TD.detach()).all()).long().view(1)  # rides in the counts' all-gather
                gathered_NE = comm.all_gather_counts(torch.cat([torch.bincount(routed.idx_TK.reshape(-1),
                                                                               minlength=self.num_experts), bad]))
                if gathered_NE[:, -1].any():
                    ranks = ", ".join(f"rank {r}" for r in gathered_NE[:, -1].nonzero().flatten().tolist())
                    raise NonFiniteError(f"{self.name}: non-finite input (NaN or inf) on {ranks}; stopped on every "
                                         f"rank before any weight was updated (this is rank {self.rank})")
                counts_NE = gathered_NE[:, :-1]
                if self.store.pushed:
                    self.store.unpush()  # online replication: the previous micro-batch's replicas make room
                plan = self._plan(policy, counts_NE)
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
        if y_TD.requires_grad:  # the gradient check's local half (grad_flags; no host sync)
            if training and not self.micro_batches:  # an iteration's first micro-batch
                self.grad_finite = None
            y_TD.register_hook(self._note_grad)  # also when recomputed: checkpointing wants the same graph

        if replay is None:
            R = int(dispatch.recv_counts_NS.sum())
            comm.count("pairs_fwd", R)
            # the experts' activations gate, up and h of the R computed rows (held until the backward)
            comm.count("token_buffer_bytes", 3 * R * self.expert_ffn * x_TD.element_size())
            comm.count("pairs_dropped", int((dispatch.slot_P < 0).sum()))
        if replay is None and not training and plan.push_src_G is not None:
            self.store.unpush(keep_grads=False)  # a forward without gradients leaves the slots as it found them
        if training:
            self.iteration_counts_NE = counts_NE if self.iteration_counts_NE is None else \
                self.iteration_counts_NE + counts_NE
            self.micro_batches += 1
            self._iteration_policy = policy
            if self._places_ahead(policy):  # the next placement, while this iteration runs
                self.placement_ahead.submit(policy, self.iteration_counts_NE, int(counts_NE.sum()))
            self.decisions.append(Decision(routed.idx_TK.detach().clone(), counts_NE, plan, dispatch))
            self.last_plan, self.last_dispatch = plan, dispatch
        return y_TD, EPMoEInfo(scores_TE=routed.scores_TE, counts_E=counts_NE.sum(0), gate_TK=gate_TK,
                               dispatch=dispatch, record=record if self.backward_config is not None else None)

    def _places_ahead(self, policy) -> bool:
        return self.placement_ahead is not None and isinstance(policy, SplitPolicy)

    def _plan(self, policy: Policy, counts_NE: torch.Tensor) -> LayerPlan:
        """The plan of this forward: ``policy.plan``, or, for a policy that splits, its critical-path part alone
        on the placement computed ahead (the same plan, with its next placement left to :meth:`next_placement`)."""
        if not self._places_ahead(policy):
            return policy.plan(counts_NE, self.prev_counts_E)
        placement_NS = self.placement_ahead.current_for(policy, self.prev_counts_E, self.num_ranks, self.num_experts,
                                                        int(counts_NE.sum()))
        return policy.plan_on(counts_NE, placement_NS)

    def _replayed(self, idx_TK: torch.Tensor) -> Decision:
        """The recorded decision of the forward being recomputed: the latest of this iteration that routed the
        local tokens to the same experts (backward order is the reverse of forward order); taken off the list."""
        for i in range(len(self.decisions) - 1, -1, -1):
            d = self.decisions[i]
            if d.idx_TK.shape == idx_TK.shape and torch.equal(d.idx_TK, idx_TK.to(d.idx_TK.device)):
                if not torch.equal(d.plan.placement_NS, self.placement_NS):
                    raise RuntimeError("a recomputed forward finds other replicas in the slots than its original "
                                       "forward (online replication pushed again in between): run each micro-batch's "
                                       "backward before the next micro-batch's forward")
                return self.decisions.pop(i)
        raise RuntimeError(f"a forward ran inside the backward (activation checkpointing) but matches none of the "
                           f"{len(self.decisions)} training forwards of this iteration: use torch's non-reentrant "
                           f"checkpoint (use_reentrant=False; the reentrant one runs the first forward without "
                           f"gradients, which plans nothing), and keep the router deterministic")

    def planning_state(self) -> tuple:
        """What a training forward advances (counts, micro-batches, recorded decisions, the last plan): for a side
        forward that must leave no trace, e.g. a benchmark's reference gradient (:meth:`restore_planning_state`)."""
        return (self.prev_counts_E, self.iteration_counts_NE, self.micro_batches, list(self.decisions),
                self.last_plan, self.last_dispatch, self._iteration_policy,
                None if self.placement_ahead is None else self.placement_ahead.job)

    def restore_planning_state(self, state: tuple) -> None:
        """Back to a :meth:`planning_state`, with the replicas a side forward pushed emptied (no gradient kept)."""
        (self.prev_counts_E, self.iteration_counts_NE, self.micro_batches, self.decisions, self.last_plan,
         self.last_dispatch, self._iteration_policy, job) = state
        if self.placement_ahead is not None:
            self.placement_ahead.job = job
        self.store.unpush(keep_grads=False)

    def _note_grad(self, grad_TD: torch.Tensor) -> None:
        finite = torch.isfinite(grad_TD).all()  # over the iteration's micro-batches: all of them finite
        self.grad_finite = finite if self.grad_finite is None else self.grad_finite & finite
        self.dense_synced = False  # a backward accumulated new, unreduced dense gradients

    # -- after the backward --------------------------------------------------------------------------------------
    def mean_grad_scale(self) -> float:
        """1 / (ranks x micro-batches of this iteration), the ranks of the whole world: what turns the summed
        gradients into the gradient of the mean loss (module doc: the default of every method that reduces
        gradients)."""
        return 1.0 / (self.world_size * max(self.micro_batches, 1))

    def sync_dense_grads(self, grad_scale: float | None = None) -> None:
        """All-reduce (sum) the router's and shared expert's gradients over all ranks of the world, times ``grad_scale``
        (default :meth:`mean_grad_scale`: the gradient of the mean loss over ranks and micro-batches), in one flat
        all-reduce that carries the gradient check (NonFiniteError on every rank; :mod:`lrmoe.runtime.dense_sync`)."""
        sync_dense_grads_(self.dense_parameters(), [self], self.mean_grad_scale() if grad_scale is None else grad_scale)

    def next_placement(self) -> torch.Tensor:
        """The placement for the next iteration: one micro-batch's plan carries it; after several, the iteration's
        policy places from their summed counts (for the pairs of one micro-batch, as the plans did). With the
        placement computed ahead, the background job's result (the same function of the same counts)."""
        plan, policy = self.last_plan, self._iteration_policy
        if plan is None:
            return self.placement_NS.clone()
        if self._places_ahead(policy):
            ahead = self.placement_ahead.next_for(policy, self.iteration_counts_NE, int(plan.routed_NE.sum()))
            if ahead is not None:
                return ahead.clone()
            if self.micro_batches == 1:  # no job for these counts (state restored by hand): place now
                return policy.placement(self.iteration_counts_NE.sum(0), self.num_ranks, int(plan.routed_NE.sum()))
        if self.micro_batches > 1 and hasattr(policy, "placement"):
            return policy.placement(self.iteration_counts_NE.sum(0), self.num_ranks, int(plan.routed_NE.sum()))
        return plan.next_placement_NS.clone()

    def collect_expert_grads(self, grad_scale: float | None = None) -> torch.Tensor:
        """Steps 1-2 of the expert step alone (replica-gradient sum, collection): this rank's fp32 shard of every
        expert's gradient, times ``grad_scale`` (default :meth:`mean_grad_scale`), kept by the store for
        ``expert_step(collected=True)``; e.g. to clip it (:mod:`lrmoe.runtime.clip`). Collective."""
        self.store.sync_replica_grads()
        return self.store.collect_grad_shards(self.mean_grad_scale() if grad_scale is None else grad_scale)

    def expert_step(self, next_placement_NS: torch.Tensor | None = None,
                    grad_scale: float | None = None, collected: bool = False) -> torch.Tensor:
        """The experts' optimizer step on the replica substrate, then their weights into the next placement
        (default: :meth:`next_placement`), and the end of the iteration: its summed counts become
        ``prev_counts_E``. ``grad_scale`` defaults to :meth:`mean_grad_scale` (the gradient of the mean loss over
        ranks and micro-batches). ``collected``: Adam applies the shards :meth:`collect_expert_grads` returned (as
        they are now, e.g. clipped; ``grad_scale`` unused). Returns the placement the slots now hold."""
        nxt = self.next_placement() if next_placement_NS is None else next_placement_NS
        self.store.step(nxt, self.mean_grad_scale() if grad_scale is None else grad_scale, collected=collected)
        if self.iteration_counts_NE is not None:
            self.prev_counts_E = self.iteration_counts_NE.sum(0) if self.placement_ahead is None else \
                self.placement_ahead.summed_counts(self.iteration_counts_NE)
            self.global_counts_E = self.prev_counts_E
            if self.store.dp_size > 1:  # the DP copies' counts too: a selection bias the same on every rank
                counts_E = self.prev_counts_E.to(self.store.device, copy=True)  # the backend's (NCCL: the GPU)
                dist.all_reduce(counts_E, group=self.store.dp_group)
                self.global_counts_E = counts_E.cpu()
        self.iteration_counts_NE, self.micro_batches, self.decisions = None, 0, []
        self.dense_synced = False
        return self.placement_NS
