"""The expert-parallel MoE layer on ``torch.distributed``: every rank routes its own tokens, a policy object plans
the iteration, and the routed pairs travel to the slots that compute them and back.

One forward, on every rank (DESIGN.md §4, STYLE.md "data flows one way"):

    route (replicated router) → all-gather counts_NE → plan = policy.plan(counts_NE, prev_counts_E)
    → permute the local pairs by the plan's pair-level rule (pack by destination rank and local slot)
    → all_to_all → grouped-GEMM SwiGLU on the local slots → all_to_all back → weighted un-permute (+ shared expert)

Every rank runs the same policy on the same all-gathered counts, so all ranks hold the same plan without further
communication, and each derives its all-to-all split sizes from it. The layer never looks at which policy made the
plan: static EP, capacity with drops, SYMI or LRMoE placements all arrive as a :class:`~lrmoe.plan.LayerPlan`.

Pair-level rule (shared with the planner and the simulator): the pairs of (source rank n, expert e), in token
order, minus the ``dropped_NE[n, e]`` the plan drops (the last ones by position, or the lowest-gate ones), fill e's
slots in increasing global-slot order, ``fwd_NG[n, g]`` pairs to slot g.

The per-pair expert outputs come home as one tensor ``o_MD`` (one row per kept pair, in packed order) before the
weighted un-permute ``y_t = Σ_j g_tj · o_tj``, so the router gradient (through g) is exact for every pair.

Two backwards, chosen when the layer is built:

* ``backward=None``: the plain autograd of the forward, exact for dropless plans and for capacity drops. Plans
  that retain fewer pairs for the backward, or move backward pairs between replicas, are refused.
* ``backward=BackwardConfig(...)``: the hand-written backward of :mod:`lrmoe.backward`: the recalibration metric
  and selection at home, compacted variable-size all-to-alls, the expert backward on retained rows only
  (saved activations; moved rows recompute from their carried input). Runs every plan: dropless, capacity,
  SYMI and LRMoE alike, so the policies are compared on one code path.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .backward import BackwardConfig, BackwardRecord, ExpertExchange, expert_exchange
from .distributed.accounting import Accountant
from .distributed.comm import all_gather_rows, all_to_all_rows
from .distributed.replica import AdamConfig, RangeGroups, ReplicaStore
from .config import ROUTER_FAMILIES
from .expert_compute import slot_offsets, swiglu_forward
from .kernels.compact import CompactPlan, compact_plan, pack, unpack
from .plan import DROP_RULES, LayerPlan
from .reference import EXPERT_WEIGHTS, SHARED_WEIGHTS, swiglu
from .routing import RouterOutput, route


# -- pure bookkeeping ------------------------------------------------------------------------------------------
def slot_expert_G(placement_NS: torch.Tensor) -> torch.Tensor:
    """The expert of every global slot g = rank·S + local index (-1: empty)."""
    return placement_NS.reshape(-1)


def assign_pairs(idx_TK: torch.Tensor, gate_TK: torch.Tensor, fwd_G: torch.Tensor, dropped_E: torch.Tensor,
                 slot_expert_G: torch.Tensor, drop_by: str = "position") -> torch.Tensor:
    """The global slot of each local pair p = t·k + j (-1: dropped), by the pair-level rule.

    ``fwd_G`` / ``dropped_E`` are this source rank's row of the plan's ``fwd_NG`` / ``dropped_NE``. Dropped are the
    last ``dropped_E[e]`` pairs of e in token order (``drop_by="position"``) or its lowest-gate ones (``"gate"``,
    ties dropping the later token). The kept pairs of e then fill e's slots in increasing g. Requires
    Σ_{g of e} fwd_G[g] + dropped_E[e] = the pairs routed to e.
    """
    if drop_by not in DROP_RULES:
        raise ValueError(f"drop_by must be one of {DROP_RULES}, got {drop_by!r}")
    E, G = dropped_E.numel(), fwd_G.numel()
    with torch.no_grad():
        idx_P = idx_TK.reshape(-1).long()
        P = idx_P.numel()
        counts_E = torch.bincount(idx_P, minlength=E)
        slot_e = slot_expert_G.long()
        planned_E = torch.zeros(E, dtype=torch.long).index_add_(0, slot_e.clamp_min(0), torch.where(
            slot_e >= 0, fwd_G.long(), 0))
        if bool((fwd_G[slot_e < 0] != 0).any()):
            raise ValueError("the plan sends pairs to an empty slot (fwd_NG > 0 where placement is -1)")
        if not torch.equal(planned_E + dropped_E.long(), counts_E):
            raise ValueError(f"the plan does not account for this rank's pairs: computed + dropped per expert "
                             f"{(planned_E + dropped_E).tolist()} != routed {counts_E.tolist()}")
        # Rank of each pair inside its expert, in token order (stable sort: p increases with the token).
        order = torch.argsort(idx_P, stable=True)
        start_E = torch.cumsum(counts_E, 0) - counts_E
        pos_P = torch.empty(P, dtype=torch.long)
        pos_P[order] = torch.arange(P) - start_E[idx_P[order]]
        if drop_by == "position":
            drop_rank_P = pos_P
        else:  # rank by gate within the expert, highest first; among equal gates the earlier token first
            gate_P = gate_TK.detach().reshape(-1).double()
            by_gate = torch.argsort(-gate_P, stable=True)
            by_gate = by_gate[torch.argsort(idx_P[by_gate], stable=True)]
            drop_rank_P = torch.empty(P, dtype=torch.long)
            drop_rank_P[by_gate] = torch.arange(P) - start_E[idx_P[by_gate]]
        keep_P = drop_rank_P < (counts_E - dropped_E.long())[idx_P]
        # Kept pairs sorted by (expert, token) take consecutive positions q; slots sorted by (expert, g) take
        # consecutive capacity ranges: both orders group by expert with equal totals, so they line up.
        kept_order = order[keep_P[order]]
        slot_order = torch.argsort(slot_e * G + torch.arange(G), stable=True)
        cap_end = torch.cumsum(fwd_G.long()[slot_order], 0)
        q = torch.arange(kept_order.numel())
        slot_P = torch.full((P,), -1, dtype=torch.long)
        slot_P[kept_order] = slot_order[torch.searchsorted(cap_end, q, right=True)]
    return slot_P


def source_to_slot_major(counts_NS: torch.Tensor) -> torch.Tensor:
    """Row permutation from the receive order (source rank, then local slot) to slot-major order (slot, then
    source): ``x_slot = x_recv[index]``. Example, 2 sources and 2 slots with counts [[1, 2], [3, 0]]: received
    rows are s0j0 | s0j1 s0j1 | s1j0 s1j0 s1j0 = rows 0 | 1 2 | 3 4 5, slot-major 0 3 4 5 | 1 2."""
    c = counts_NS.long()
    start_NS = (torch.cumsum(c.reshape(-1), 0) - c.reshape(-1)).view_as(c)
    c_T, start_T = c.T.reshape(-1), start_NS.T.reshape(-1)
    total = int(c_T.sum())
    run_start = torch.repeat_interleave(torch.cumsum(c_T, 0) - c_T, c_T)
    return torch.repeat_interleave(start_T, c_T) + torch.arange(total) - run_start


class NeedsRecalibration(ValueError, NotImplementedError):
    """A plan that trims or moves backward pairs given to a layer built without the recalibrated backward
    (a ``ValueError``; also a ``NotImplementedError``, what the plain backward raised for such plans before)."""


def check_layer_plan(plan: LayerPlan, counts_NE: torch.Tensor, placement_NS: torch.Tensor,
                     recalibrated: bool = False) -> None:
    """Raise unless ``plan`` is valid for these counts and one this layer can run: made for the placement the
    slots hold; with backward retention or backward flows only when the layer has the recalibrated backward."""
    plan.validate(counts_NE)
    if not torch.equal(plan.placement_NS.cpu(), placement_NS):
        raise ValueError(f"plan.placement_NS {plan.placement_NS.tolist()} differs from the placement the slots hold "
                         f"{placement_NS.tolist()}: move the weights first (expert_step(next_placement_NS=...))")
    if not recalibrated and (not torch.equal(plan.keep_NG, plan.fwd_NG) or plan.bwd_flows_F4.numel()):
        raise NeedsRecalibration(f"plan of policy {getattr(plan, 'policy', '?')!r} keeps fewer pairs for the "
                                 f"backward or routes them between replicas; that needs the recalibrated backward "
                                 f"hook: build the layer with backward=BackwardConfig(...)")


def planned_placement(policy, counts_NE: torch.Tensor, prev_counts_E: torch.Tensor | None) -> torch.Tensor:
    """The placement ``policy`` plans for an iteration with these counts after ``prev_counts_E``. Policies place
    from the previous iteration's counts, so the placement of iteration t+1 is known at the end of iteration t
    (assuming t+1 routes as many pairs per rank as t, which only memory-aware placements look at)."""
    return policy.plan(counts_NE, prev_counts_E).placement_NS.clone()


def initial_placement(policy, num_ranks: int, num_experts: int, pairs_per_rank: int | None = None) -> torch.Tensor:
    """The placement ``policy`` chooses with no history (uniform popularity): the slots' first contents.
    ``pairs_per_rank`` (default E) spread evenly over the experts stand in for the first iteration's counts."""
    pairs = num_experts if pairs_per_rank is None else pairs_per_rank
    if pairs < 0:
        raise ValueError(f"pairs_per_rank must be non-negative, got {pairs}")
    base, extra = divmod(pairs, num_experts)
    counts_E = torch.full((num_experts,), base, dtype=torch.long)
    counts_E[:extra] += 1
    return planned_placement(policy, counts_E.expand(num_ranks, -1).contiguous(), None)


# -- the layer -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dispatch:
    """The integer bookkeeping of one forward on one rank (no gradients): what a backward hook needs."""

    plan: LayerPlan
    counts_NE: torch.Tensor  # long [N, E]: routed pairs per (source rank, expert), all-gathered
    idx_TK: torch.Tensor  # long: local routing
    slot_P: torch.Tensor  # long [T·k]: global slot computing each local pair, -1 if dropped
    compact: CompactPlan  # the home-side packing; compact.pair_M maps o_MD's rows to pairs
    send_splits: list[int]  # rows sent to each rank (and received back in the combine)
    recv_splits: list[int]  # rows received from each rank
    recv_counts_NS: torch.Tensor  # long [N, S]: rows received per (source, local slot)
    to_slot_R: torch.Tensor  # long [R]: x_slot = x_recv[to_slot_R] (source_to_slot_major, on the data's device)
    from_slot_R: torch.Tensor  # long [R]: its inverse, x_recv = x_slot[from_slot_R]


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

    def __init__(self, weights: dict[str, torch.Tensor], top_k: int, router: str, policy, placement_NS: torch.Tensor,
                 groups: RangeGroups, *, routed_scaling: float = 1.0, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, adam: AdamConfig = AdamConfig(),
                 accountant: Accountant | None = None, kernel_backend: str | None = None,
                 backward: BackwardConfig | None = None):
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
        self.accountant = accountant
        dtype = dtype or weights["w_gate_EDF"].dtype
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.kernel_backend = kernel_backend if kernel_backend is not None else (
            "torch" if device.type == "cpu" else None)  # Triton's interpreter is for kernel tests, not layers
        self.store = ReplicaStore(weights["w_gate_EDF"], weights["w_up_EDF"], weights["w_down_EFD"], placement_NS,
                                  groups, dtype=dtype, device=device, adam=adam, accountant=accountant)
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

    def _phase(self, name: str):
        return self.accountant.phase(name) if self.accountant is not None else nullcontext()

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, x_TD: torch.Tensor, policy=None, routing: RouterOutput | None = None,
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
        T, K = x_TD.shape[0], self.top_k

        with self._phase("route"):
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

        with self._phase("plan"):
            counts_NE = all_gather_rows(torch.bincount(routed.idx_TK.reshape(-1), minlength=self.num_experts)).cpu()
            plan = policy.plan(counts_NE, self.prev_counts_E)
            check_layer_plan(plan, counts_NE, self.placement_NS, recalibrated=self.backward_config is not None)
            self.prev_counts_E = counts_NE.sum(0)

        record = None
        if self.backward_config is None:
            x_slot_RD, dispatch = self.dispatch(x_TD, routed.idx_TK, gate_TK, plan, counts_NE)
            with self._phase("expert_fwd"):
                offs_S = slot_offsets(dispatch.recv_counts_NS.sum(0), x_TD.device)
                y_slot_RD, _ = swiglu_forward(x_slot_RD, self.store.slot_weights(), offs_S, self.kernel_backend)
            y_TD = self.combine(y_slot_RD, dispatch, gate_TK, pair_hook)
            R = x_slot_RD.shape[0]
            self._count("pairs_bwd", R)
            self._count("pairs_retained", R)
        else:
            dispatch = self.make_dispatch(routed.idx_TK, gate_TK, plan, counts_NE, x_TD.device)
            record = BackwardRecord(top_k=K)
            state = ExpertExchange(self, dispatch, gate_TK, self.backward_config, self.bwd_generator, record)
            o_MD = expert_exchange(x_TD, self.store.slots_SP, state)
            R = int(dispatch.recv_counts_NS.sum())
            y_TD = self.unpermute(o_MD, dispatch, gate_TK, pair_hook)
        if self.shared:
            y_TD = y_TD + swiglu(x_TD, self.w_shared_gate_DF, self.w_shared_up_DF, self.w_shared_down_FD)[0]

        self._count("pairs_fwd", R)
        # the experts' activations gate, up and h of the R computed rows (held until the backward)
        self._count("token_buffer_bytes", 3 * R * self.expert_ffn * x_TD.element_size())
        self._count("pairs_dropped", int((dispatch.slot_P < 0).sum()))
        self.last_dispatch = dispatch
        return y_TD, EPMoEInfo(scores_TE=routed.scores_TE, counts_E=self.prev_counts_E, gate_TK=gate_TK,
                               dispatch=dispatch, record=record)

    def make_dispatch(self, idx_TK: torch.Tensor, gate_TK: torch.Tensor, plan, counts_NE: torch.Tensor,
                      device: torch.device) -> Dispatch:
        """The integer bookkeeping of one forward: each local pair's slot by the plan's pair-level rule, the
        packing by (destination rank, local slot) and the all-to-all split sizes. No data moves."""
        N, S, K = self.num_ranks, self.slots_per_rank, self.top_k
        with self._phase("permute"):
            fwd_NG = plan.fwd_NG.cpu().long()
            slot_P = assign_pairs(idx_TK.cpu(), gate_TK.cpu(), fwd_NG[self.rank], plan.dropped_NE[self.rank].cpu(),
                                  slot_expert_G(self.placement_NS), plan.drop_by)
            keep_P = slot_P >= 0
            cplan = compact_plan((slot_P.clamp_min(0) // S).to(device), (slot_P.clamp_min(0) % S).to(device), N, S,
                                 keep_P.to(device), top_k=K)
            recv_counts_NS = fwd_NG[:, self.rank * S:(self.rank + 1) * S]
            to_slot_R = source_to_slot_major(recv_counts_NS).to(device)
            from_slot_R = torch.empty_like(to_slot_R).scatter_(0, to_slot_R, torch.arange(to_slot_R.numel(),
                                                                                         device=device))
        return Dispatch(plan=plan, counts_NE=counts_NE, idx_TK=idx_TK, slot_P=slot_P, compact=cplan,
                        send_splits=cplan.send_splits(), recv_splits=recv_counts_NS.sum(1).tolist(),
                        recv_counts_NS=recv_counts_NS, to_slot_R=to_slot_R, from_slot_R=from_slot_R)

    def dispatch(self, x_TD: torch.Tensor, idx_TK: torch.Tensor, gate_TK: torch.Tensor, plan, counts_NE: torch.Tensor):
        """Permute the local pairs by the plan, send them to their slots, and sort the received rows by local
        slot: returns (x_slot_RD, dispatch), R the rows this rank computes, slot-major (offsets from
        ``dispatch.recv_counts_NS.sum(0)``). Differentiable in x_TD."""
        dispatch = self.make_dispatch(idx_TK, gate_TK, plan, counts_NE, x_TD.device)
        with self._phase("permute"):
            x_send_MD = pack(x_TD, dispatch.compact, backend=self.kernel_backend)
        x_recv_RD = self._all_to_all(x_send_MD, dispatch.send_splits, dispatch.recv_splits, "dispatch_a2a",
                                     "dispatch_a2a_bwd")
        with self._phase("expert_fwd"):
            x_slot_RD = x_recv_RD.index_select(0, dispatch.to_slot_R)
        self._count_buffers(x_send_MD, x_recv_RD, x_slot_RD)
        return x_slot_RD, dispatch

    def combine(self, y_slot_RD: torch.Tensor, dispatch: Dispatch, gate_TK: torch.Tensor,
                pair_hook: Callable[[torch.Tensor, Dispatch], torch.Tensor] | None = None) -> torch.Tensor:
        """The inverse of :meth:`dispatch`: rows back to source-major order, home by all-to-all, then
        y_t = Σ_j gate_tj · o_tj over the token's kept pairs. Differentiable in y_slot_RD and gate_TK."""
        with self._phase("expert_fwd"):
            y_recv_RD = y_slot_RD.index_select(0, dispatch.from_slot_R)
        o_MD = self._all_to_all(y_recv_RD, dispatch.recv_splits, dispatch.send_splits, "combine_a2a",
                                "combine_a2a_bwd")
        y_TD = self.unpermute(o_MD, dispatch, gate_TK, pair_hook)
        self._count_buffers(y_slot_RD, y_recv_RD, o_MD)
        return y_TD

    def unpermute(self, o_MD: torch.Tensor, dispatch: Dispatch, gate_TK: torch.Tensor,
                  pair_hook: Callable[[torch.Tensor, Dispatch], torch.Tensor] | None = None) -> torch.Tensor:
        """y_t = Σ_j gate_tj · o_tj from the per-pair outputs at home (packed order), after ``pair_hook``."""
        with self._phase("unpermute"):
            if pair_hook is not None:
                o_MD = pair_hook(o_MD, dispatch)
            return unpack(o_MD, dispatch.compact, weight_P=gate_TK.reshape(-1).to(o_MD.dtype), per_token=True,
                          backend=self.kernel_backend)

    def _count(self, name: str, value: int) -> None:
        if self.accountant is not None:
            self.accountant.add(name, value)

    def _count_buffers(self, *tensors: torch.Tensor) -> None:
        self._count("token_buffer_bytes", sum(t.numel() * t.element_size() for t in tensors))

    def _count_bwd_buffers(self, *tensors: torch.Tensor | None) -> None:
        self._count("bwd_buffer_bytes", sum(t.numel() * t.element_size() for t in tensors if t is not None))

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int], phase: str) -> torch.Tensor:
        """A non-differentiable all-to-all over the rows of ``x`` (the recalibrated exchange runs its own
        backward), timed as ``phase``, with the bytes that leave and reach this rank."""
        if self.accountant is None:
            return all_to_all_rows(x, send, recv)
        row = math.prod(x.shape[1:]) * x.element_size()
        with self.accountant.phase(phase):
            out = all_to_all_rows(x, send, recv)
        away = lambda splits: sum(s for r, s in enumerate(splits) if r != self.rank) * row  # noqa: E731
        self.accountant.add_bytes(phase, away(send), away(recv))
        return out

    def _all_to_all(self, x_MD: torch.Tensor, send: list[int], recv: list[int], phase: str, bwd_phase: str):
        """The differentiable all-to-all, with its bytes and times in both directions in the accountant."""
        acc = self.accountant
        if acc is None:
            return all_to_all_rows(x_MD, send, recv)
        row = x_MD.shape[1] * x_MD.element_size()
        away = lambda splits: sum(s for r, s in enumerate(splits) if r != self.rank) * row  # noqa: E731

        def on_backward(stage: str) -> None:
            # backward order: combine_a2a_bwd → expert backward → dispatch_a2a_bwd
            if stage == "start":
                if bwd_phase == "dispatch_a2a_bwd" and acc.is_open("expert_bwd"):
                    acc.end("expert_bwd")
                acc.begin(bwd_phase)
                acc.add_bytes(bwd_phase, away(recv), away(send))
            else:
                acc.end(bwd_phase)
                if bwd_phase == "combine_a2a_bwd":
                    acc.begin("expert_bwd")

        with acc.phase(phase):
            out = all_to_all_rows(x_MD, send, recv, on_backward=on_backward)
        acc.add_bytes(phase, away(send), away(recv))
        return out

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
        """The placement the layer's policy plans for the next iteration (from this iteration's counts)."""
        if self.last_dispatch is None:
            return self.placement_NS.clone()
        return planned_placement(self.policy, self.last_dispatch.counts_NE, self.prev_counts_E)

    def expert_step(self, next_placement_NS: torch.Tensor | None = None, grad_scale: float = 1.0) -> torch.Tensor:
        """The experts' optimizer step on the replica substrate, then their weights into the next placement
        (default: :meth:`next_placement`). Returns the placement the slots now hold."""
        nxt = self.next_placement() if next_placement_NS is None else next_placement_NS
        self.store.step(nxt, grad_scale)
        return self.placement_NS
