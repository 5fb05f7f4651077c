"""The plan of one MoE layer for one iteration: everything the layer (or the simulator) needs, as plain tensors,
and :class:`Policy`, the one interface of whatever makes it.

N ranks, S slots per rank, G = N·S global slots (slot g lives on rank g // S at local index g % S), E experts.
A policy (:class:`Policy`; those of lrmoe.planner.policies and lrmoe.planner.online) produces a :class:`LayerPlan`
from the routed counts; the layer and the simulator never branch on the policy, they only read the plan.

Pair-level rule every consumer follows. The pairs of (source n, expert e), in token order, minus the dropped
ones (the last by position, or the lowest-gate ones, per ``drop_by``), fill e's slots in increasing g,
fwd_NG[n, g] pairs each. In the backward, group (n, g) keeps its top keep_NG[n, g] pairs by recalibration
score (or a sample, in unbiased mode); the flows out of (n, g) take the lowest-scoring kept pairs of the group,
the lowest ones to the first of its rows in bwd_flows_V4 (rows are sorted by (src, from_slot, to_slot)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

DROP_RULES = ("position", "gate")


def no_flows() -> Tensor:
    """An empty bwd_flows_V4."""
    return torch.zeros(0, 4, dtype=torch.long)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's plan for one iteration. All tensors are LongTensor on CPU.

    placement_NS   [N, S] expert hosted by each slot, -1 = empty.
    fwd_NG         [N, G] forward pairs from source rank n computed on global slot g.
    dropped_NE     [N, E] forward pairs of (source n, expert e) dropped by a capacity (0 for dropless plans).
    keep_NG        [N, G] of fwd_NG, the pairs retained for the backward (== fwd_NG without quotas).
    bwd_flows_V4   [F, 4] rows (src, from_slot, to_slot, count): retained pairs whose backward runs on another
                   replica of the same expert; each brings its input row there (no copy needed when to_slot
                   is on the source rank, which holds the row: see ``carry_NG``). Rows sorted, one per triple.
    floor_excess_N [N]    retained backward pairs above a rank's cap that the per-expert floor forced.
    bwd_cap_N      [N]    the backward cap the quotas enforced (None: no cap).
    policy         short label of the policy that made the plan.
    drop_by        "position" or "gate": which pairs of a (source, expert) group the capacity drops.
    next_placement_NS [N, S] the placement the policy will use in the next iteration, made in the same plan call
                   from this iteration's global counts (policies place from the previous iteration's counts), so
                   the weights can move there at the end of this iteration without planning again. It assumes the
                   next iteration routes as many pairs (only memory-aware placement looks at that). None (the
                   default) means the placement stays: it is filled with placement_NS.
    push_src_G     [G] online replication (lrmoe.planner.online): the global slot whose weights are copied into slot g
    before
                   this iteration's expert compute, -1 where g is not pushed. A pushed slot is empty in the placement
                   the slots hold and holds the source's expert in placement_NS; a source is never pushed itself.
                   None (the default): nothing is pushed.
    """

    placement_NS: Tensor
    fwd_NG: Tensor
    dropped_NE: Tensor
    keep_NG: Tensor
    bwd_flows_V4: Tensor
    floor_excess_N: Tensor
    bwd_cap_N: Tensor | None = None
    policy: str = ""
    drop_by: str = "position"
    next_placement_NS: Tensor | None = None
    push_src_G: Tensor | None = None

    def __post_init__(self) -> None:
        if self.next_placement_NS is None:
            object.__setattr__(self, "next_placement_NS", self.placement_NS)

    @classmethod
    def forward_only(cls, placement_NS: Tensor, fwd_NG: Tensor, dropped_NE: Tensor, *, policy: str = "",
                     drop_by: str = "position", next_placement_NS: Tensor | None = None,
                     push_src_G: Tensor | None = None) -> "LayerPlan":
        """A plan whose backward keeps every computed pair where its forward ran (no quotas, no backward moves), with
        the forward's drops ``dropped_NE`` [N, E] (capacity systems)."""
        n = placement_NS.shape[0]
        return cls(placement_NS=placement_NS, fwd_NG=fwd_NG, dropped_NE=dropped_NE, keep_NG=fwd_NG.clone(),
                   bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(n, dtype=torch.long), policy=policy,
                   drop_by=drop_by, next_placement_NS=next_placement_NS, push_src_G=push_src_G)

    @classmethod
    def dropless(cls, placement_NS: Tensor, fwd_NG: Tensor, num_experts: int, *, policy: str = "",
                 next_placement_NS: Tensor | None = None, push_src_G: Tensor | None = None) -> "LayerPlan":
        """:meth:`forward_only` with nothing dropped: every routed pair computed, and kept for the backward."""
        dropped_NE = torch.zeros(placement_NS.shape[0], num_experts, dtype=torch.long)
        return cls.forward_only(placement_NS, fwd_NG, dropped_NE, policy=policy, next_placement_NS=next_placement_NS,
                                push_src_G=push_src_G)

    # --- shapes ----------------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.placement_NS.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.placement_NS.shape[1]

    @property
    def num_slots(self) -> int:
        return self.placement_NS.numel()

    @property
    def num_experts(self) -> int:
        return self.dropped_NE.shape[1]

    @property
    def slot_expert_G(self) -> Tensor:
        """[G] expert of each global slot, -1 empty."""
        return self.placement_NS.reshape(-1)

    @property
    def slot_rank_G(self) -> Tensor:
        """[G] rank of each global slot."""
        return torch.arange(self.num_slots) // self.slots_per_rank

    @property
    def pushed_G(self) -> Tensor:
        """bool [G] slots whose weights are pushed in before this iteration's expert compute."""
        if self.push_src_G is None:
            return torch.zeros(self.num_slots, dtype=torch.bool)
        return self.push_src_G >= 0

    @property
    def resident_NS(self) -> Tensor:
        """[N, S] the placement the slots must hold before the push: placement_NS with pushed slots empty."""
        return torch.where(self.pushed_G, -1, self.slot_expert_G).view_as(self.placement_NS)

    # --- forward -------------------------------------------------------------------------------------------
    def _per_expert(self, x_NG: Tensor) -> Tensor:
        hosted = self.slot_expert_G >= 0
        out = torch.zeros(self.num_ranks, self.num_experts, dtype=torch.long)
        return out.index_add_(1, self.slot_expert_G[hosted], x_NG[:, hosted])

    def _per_rank(self, x_G: Tensor) -> Tensor:
        return x_G.view(self.num_ranks, self.slots_per_rank).sum(1)

    @property
    def fwd_NE(self) -> Tensor:
        """[N, E] pairs of (source, expert) computed in the forward."""
        return self._per_expert(self.fwd_NG)

    @property
    def routed_NE(self) -> Tensor:
        """[N, E] pairs the router sent: computed + dropped (equals the counts the plan was made from)."""
        return self.fwd_NE + self.dropped_NE

    @property
    def fwd_load_N(self) -> Tensor:
        """[N] forward pairs computed per destination rank."""
        return self._per_rank(self.fwd_NG.sum(0))

    # --- backward ------------------------------------------------------------------------------------------
    def _flow_matrix(self, column: int) -> Tensor:
        out = torch.zeros(self.num_ranks * self.num_slots, dtype=torch.long)
        f = self.bwd_flows_V4
        if len(f):
            out.index_add_(0, f[:, 0] * self.num_slots + f[:, column], f[:, 3])
        return out.view(self.num_ranks, self.num_slots)

    @property
    def moved_out_NG(self) -> Tensor:
        """[N, G] retained pairs of (source, forward slot) whose backward runs on another slot."""
        return self._flow_matrix(1)

    @property
    def moved_NG(self) -> Tensor:
        """[N, G] retained pairs of source n whose backward runs on slot g after moving there from another."""
        return self._flow_matrix(2)

    @property
    def carry_NG(self) -> Tensor:
        """[N, G] moved pairs whose input row must be sent to slot g (its rank is not the source rank)."""
        away_NG = torch.arange(self.num_ranks)[:, None] != self.slot_rank_G[None, :]
        return self.moved_NG * away_NG

    @property
    def bwd_NG(self) -> Tensor:
        """[N, G] retained pairs of source n whose backward runs on slot g."""
        return self.keep_NG - self.moved_out_NG + self.moved_NG

    @property
    def bwd_load_N(self) -> Tensor:
        """[N] backward pairs computed per destination rank."""
        return self._per_rank(self.bwd_NG.sum(0))

    @property
    def quota_NE(self) -> Tensor:
        """[N, E] retained pairs per (source, expert): keep_NG summed over each expert's slots."""
        return self._per_expert(self.keep_NG)

    # --- checks and summaries ------------------------------------------------------------------------------
    def validate(self, counts_NE: Tensor | None = None) -> "LayerPlan":
        """Check every invariant; raise ``ValueError`` naming the first broken one. Returns self.

        With ``counts_NE`` also checks that every routed pair is computed or dropped exactly once.
        """
        P = self.placement_NS
        if not isinstance(P, Tensor) or P.dim() != 2 or P.numel() == 0:
            raise ValueError(f"placement_NS must be a non-empty 2-D tensor, got {getattr(P, 'shape', P)}")
        N, G, E = self.num_ranks, self.num_slots, self.dropped_NE.shape[-1]
        expected = {"placement_NS": P.shape, "fwd_NG": (N, G), "dropped_NE": (N, E), "keep_NG": (N, G),
                    "floor_excess_N": (N,), "next_placement_NS": P.shape}
        if self.bwd_cap_N is not None:
            expected["bwd_cap_N"] = (N,)
        for name, shape in expected.items():
            t = getattr(self, name)
            if not isinstance(t, Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != torch.long:
                raise ValueError(f"LayerPlan.{name} must be a long tensor of shape {tuple(shape)}, got "
                                 f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
        f = self.bwd_flows_V4
        if not isinstance(f, Tensor) or f.dim() != 2 or f.shape[1] != 4 or f.dtype != torch.long:
            raise ValueError(f"LayerPlan.bwd_flows_V4 must be a long tensor of shape (F, 4), got "
                             f"{getattr(f, 'dtype', type(f))} {tuple(getattr(f, 'shape', ()))}")
        if self.drop_by not in DROP_RULES:
            raise ValueError(f"LayerPlan.drop_by={self.drop_by!r} is not one of {DROP_RULES}")
        for name in ("placement_NS", "next_placement_NS"):
            t = getattr(self, name)
            if int(t.min()) < -1 or int(t.max()) >= E:
                raise ValueError(f"LayerPlan.{name} holds ids in [{int(t.min())}, {int(t.max())}], outside "
                                 f"[-1, {E - 1}]")
        for name in ("fwd_NG", "dropped_NE", "floor_excess_N"):
            t = getattr(self, name)
            if t.numel() and int(t.min()) < 0:
                raise ValueError(f"LayerPlan.{name} has a negative entry ({int(t.min())})")
        empty_G = self.slot_expert_G < 0
        if bool((self.fwd_NG[:, empty_G] != 0).any()):
            raise ValueError("LayerPlan.fwd_NG sends pairs to an empty slot")
        if bool(((self.keep_NG < 0) | (self.keep_NG > self.fwd_NG)).any()):
            raise ValueError("LayerPlan.keep_NG must lie in [0, fwd_NG]")
        if len(f):
            src, frm, to, cnt = f.unbind(1)
            if int(src.min()) < 0 or int(src.max()) >= N:
                raise ValueError(f"LayerPlan.bwd_flows_V4 has a source rank outside [0, {N})")
            if int(torch.minimum(frm, to).min()) < 0 or int(torch.maximum(frm, to).max()) >= G:
                raise ValueError(f"LayerPlan.bwd_flows_V4 has a slot outside [0, {G})")
            if bool((cnt <= 0).any()):
                raise ValueError("LayerPlan.bwd_flows_V4 has a non-positive count")
            if bool((frm == to).any()):
                raise ValueError("LayerPlan.bwd_flows_V4 has a flow from a slot to itself")
            ex = self.slot_expert_G
            if bool(((ex[frm] != ex[to]) | (ex[frm] < 0)).any()):
                raise ValueError("LayerPlan.bwd_flows_V4 moves pairs between slots of different experts")
            if bool((self.moved_out_NG > self.keep_NG).any()):
                raise ValueError("LayerPlan.bwd_flows_V4 moves more pairs out of a group than it keeps")
        if self.push_src_G is not None:
            self._validate_push()
        if counts_NE is not None and not torch.equal(self.routed_NE, counts_NE.long()):
            raise ValueError("LayerPlan does not account for every routed pair exactly once "
                             "(fwd_NE + dropped_NE != counts_NE)")
        return self

    def _validate_push(self) -> None:
        p, G = self.push_src_G, self.num_slots
        if not isinstance(p, Tensor) or tuple(p.shape) != (G,) or p.dtype != torch.long:
            raise ValueError(f"LayerPlan.push_src_G must be a long tensor of shape ({G},), got "
                             f"{getattr(p, 'dtype', type(p))} {tuple(getattr(p, 'shape', ()))}")
        if int(p.min()) < -1 or int(p.max()) >= G:
            raise ValueError(f"LayerPlan.push_src_G holds slots outside [-1, {G})")
        pushed = p >= 0
        src, ex = p[pushed], self.slot_expert_G
        if bool((src == torch.arange(G)[pushed]).any()) or bool(pushed[src].any()):
            raise ValueError("LayerPlan.push_src_G pushes from a slot that is itself pushed")
        if bool((ex[pushed] < 0).any()) or bool((ex[src] != ex[pushed]).any()):
            raise ValueError("LayerPlan.push_src_G fills a slot from a slot of another expert (or leaves it empty)")

    def stats(self) -> dict[str, float]:
        """Plain-number summary: loads (max / mean), drops, retention, moves and carried rows."""
        fwd, bwd = self.fwd_load_N.double(), self.bwd_load_N.double()
        routed = float(self.routed_NE.sum())
        computed = float(fwd.sum())
        return {
            "routed_pairs": routed,
            "dropped_frac": float(self.dropped_NE.sum()) / routed if routed else 0.0,
            "fwd_max": float(fwd.max()), "fwd_imbalance": float(fwd.max() / fwd.mean()) if computed else 1.0,
            "bwd_max": float(bwd.max()),
            "bwd_max_over_fwd_mean": float(bwd.max() / fwd.mean()) if computed else 1.0,
            "retained_frac": float(bwd.sum()) / computed if computed else 1.0,
            "moved_pairs": float(self.moved_NG.sum()), "carried_rows": float(self.carry_NG.sum()),
            "floor_excess": float(self.floor_excess_N.sum()),
            "replica_slots": float((self.slot_expert_G >= 0).sum()),
        }


@runtime_checkable
class Policy(Protocol):
    """What the layer (:class:`~lrmoe.runtime.layer.EPMoELayer`), the simulator (:mod:`lrmoe.sim.simulator`) and
    the Hugging Face drop-in need of a placement policy: a short ``name`` (the plans' label) and ``plan``, called
    once per iteration on every rank with the same all-gathered counts.

    counts_NE      [N, E] routed pairs per (source rank, expert) of this iteration.
    prev_counts_E  [E] the previous iteration's global counts (None at the first one): what placement is made from.

    Pure and deterministic: the same counts give the same plan on every rank. A policy that keeps state between
    iterations keeps it in itself (one object per MoE layer)."""

    name: str

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan: ...


@runtime_checkable
class PlacingPolicy(Policy, Protocol):
    """A :class:`Policy` whose placement step can be asked alone (for its first placement, with no history:
    :func:`lrmoe.planner.policies.initial_placement`)."""

    def placement(self, popularity_E: Tensor, num_ranks: int, total_pairs: int) -> Tensor: ...



@runtime_checkable
class SplitPolicy(PlacingPolicy, Protocol):
    """A :class:`PlacingPolicy` whose plan splits into its placement, from the previous iteration's counts (off the
    critical path: :mod:`lrmoe.runtime.placement_ahead`), and ``plan_on``, what needs this iteration's counts.

    ``plan(counts_NE, prev)`` equals ``plan_on(counts_NE, placement(popularity(prev), N, total),
    placement(counts_NE.sum(0), N, total))`` exactly (total = counts_NE.sum()); ``next_placement_NS`` None leaves the
    plan's next placement unfilled (the caller computes it itself)."""

    def plan_on(self, counts_NE: Tensor, placement_NS: Tensor,
                next_placement_NS: Tensor | None = None) -> LayerPlan: ...
