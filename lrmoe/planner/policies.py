"""Policies: small objects that turn one layer's routed counts into a :class:`~lrmoe.planner.plan.LayerPlan`.

Each has a short ``name``, ``placement(popularity_E, num_ranks, total_pairs) -> placement_NS`` (its placement
step alone) and ``plan(counts_NE, prev_counts_E=None) -> LayerPlan``: counts_NE [N, E] are the routed pairs per
(source rank, expert) of this iteration, prev_counts_E [E] the previous iteration's global counts (SYMI and
LRMoE place replicas from them; with none, popularity is uniform). ``plan`` calls ``placement`` twice: for this
iteration (from prev_counts_E) and for the next one (from this iteration's global counts, the same total), so
the plan carries ``next_placement_NS`` and nobody plans again to learn where the weights go. Pure: no
``torch.distributed``, the same counts give the same plan on every rank.

``plan`` is ``plan_on(counts_NE, placement_NS, next_placement_NS)`` after the two placements: ``plan_on`` is the
part that needs this iteration's counts (forward routing over the replicas, capacities, caps, quotas, backward
routing), the critical path between the counts all-gather and the dispatch; the placements need only the previous
iteration's counts, so the layer computes them while an iteration runs (:mod:`lrmoe.runtime.placement_ahead`)
and calls ``plan_on`` alone: the same plan, bit for bit, but its ``next_placement_NS`` (DESIGN.md §4).

* :class:`StaticEP`  expert parallelism, one replica per expert at home, dropless.
* :class:`Capacity`  static placement with GShard/DeepSpeed capacity ceil(cf · tokens · k / E); overflow dropped.
* :class:`Symi`      SYMI (DESIGN.md §3): Algorithm 1 placement, even split; SYMI-cf1 drops, SYMI-dropless not.
* :class:`LRMoE`     our reconstruction (DESIGN.md §4): memory-aware placement, balanced dropless forward,
                     then retention quotas (``budget`` or ``cap`` mode) and, in ``cap`` mode, backward replica
                     routing of what exceeds a cap before the quotas trim the rest.
* :class:`Trimmed`   any policy's plan with its backward trimmed to the same budget as LRMoE's ``budget`` mode,
                     pairs chosen by the layer's backward config (the random-trim control, e.g. SYMI-dropless
                     trimmed at rho with ``BackwardConfig(metric="random")``).

:func:`initial_placement` is the placement a policy starts from (no history).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from lrmoe.checks import check_cf, check_fraction, non_negative_int, positive_int
from lrmoe.planner.placement import MemoryModel, lrmoe_placement, replica_table, static_placement, symi_placement
from lrmoe.planner.plan import DROP_RULES, LayerPlan, PlacingPolicy, Policy
from lrmoe.planner.quotas import budget_caps, check_rho, rank_caps, retention_quotas
from lrmoe.planner.replica_routing import (apply_capacity, backward_on, check_counts, forward_on, gshard_capacity,
                                   route_forward, symi_capacity)

QUOTA_MODES = ("budget", "cap")
DEFAULT_EPS = 0.1  # LRMoE's balance slack when none is given


def placement_popularity(prev_counts_E: Tensor | None, num_experts: int) -> Tensor:
    """The popularity a plan places from: prev_counts_E validated, or uniform when absent."""
    if prev_counts_E is None:
        return torch.ones(num_experts, dtype=torch.float64)
    prev = torch.as_tensor(prev_counts_E)
    if prev.shape != (num_experts,):
        raise ValueError(f"prev_counts_E has shape {tuple(prev.shape)}, expected ({num_experts},)")
    if bool((prev < 0).any()):
        raise ValueError(f"prev_counts_E must be non-negative, got min {prev.min().item()}")
    return prev


def _placements(policy: PlacingPolicy, counts_NE: Tensor, prev_counts_E: Tensor | None) -> tuple[Tensor, Tensor]:
    """(this iteration's placement, the next one's): from prev_counts_E and from counts_NE's global counts."""
    N, E = counts_NE.shape
    total = int(counts_NE.sum())
    return (policy.placement(placement_popularity(prev_counts_E, E), N, total),
            policy.placement(counts_NE.sum(0), N, total))


def initial_placement(policy: Policy, num_ranks: int, num_experts: int, pairs_per_rank: int | None = None) -> Tensor:
    """The placement ``policy`` chooses with no history (uniform popularity): the slots' first contents.

    ``pairs_per_rank`` (default E) stands for the first iteration's pairs per rank (memory-aware placement sizes
    its replica slots from the total). A policy with only ``plan`` is asked to plan evenly spread counts.
    """
    pairs = num_experts if pairs_per_rank is None else pairs_per_rank
    if pairs < 0:
        raise ValueError(f"pairs_per_rank must be non-negative, got {pairs}")
    if isinstance(policy, PlacingPolicy):
        return policy.placement(torch.ones(num_experts, dtype=torch.float64), num_ranks, pairs * num_ranks)
    base, extra = divmod(pairs, num_experts)
    counts_E = torch.full((num_experts,), base, dtype=torch.long)
    counts_E[:extra] += 1
    return policy.plan(counts_E.expand(num_ranks, -1).contiguous(), None).placement_NS.clone()


class _Placing:
    """A policy split in two (the ``SplitPolicy`` of :mod:`lrmoe.planner.plan`): ``placement`` from the previous
    iteration's counts, off the critical path, and ``plan_on`` that placement from this forward's counts. ``plan``
    is the two in a row."""

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        return self.plan_on(counts_NE, *_placements(self, counts_NE, prev_counts_E))


class _StaticHome(_Placing):
    """Expert e stays on rank e // (E/N): the placement never depends on the counts."""

    def placement(self, popularity_E: Tensor, num_ranks: int, total_pairs: int) -> Tensor:
        return static_placement(len(popularity_E), num_ranks)


class StaticEP(_StaticHome):
    """Expert parallelism: expert e on rank e // (E/N), every pair computed, nothing trimmed."""

    name = "static-ep"

    def plan_on(self, counts_NE: Tensor, placement_NS: Tensor, next_placement_NS: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        return LayerPlan.dropless(placement_NS, route_forward(counts_NE, placement_NS, "even"), counts_NE.shape[1],
                                  policy=self.name, next_placement_NS=next_placement_NS)


class Capacity(_StaticHome):
    """Static placement with a per-expert capacity ceil(cf · tokens · k / E); overflow dropped.

    ``drop_by``: "position" (the last pairs of a (source, expert) group) or "gate" (its lowest-gate pairs).
    """

    def __init__(self, cf: float = 1.0, drop_by: str = "position"):
        if drop_by not in DROP_RULES:
            raise ValueError(f"drop_by={drop_by!r} is not one of {DROP_RULES}")
        self.cf, self.drop_by = check_cf(cf), drop_by
        self.name = f"capacity-cf{self.cf:g}" + ("-gate" if drop_by == "gate" else "")

    def plan_on(self, counts_NE: Tensor, placement_NS: Tensor, next_placement_NS: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        dropped_NE = apply_capacity(counts_NE, gshard_capacity(counts_NE, self.cf))
        fwd_NG = route_forward(counts_NE - dropped_NE, placement_NS, "even")
        return LayerPlan.forward_only(placement_NS, fwd_NG, dropped_NE, policy=self.name, drop_by=self.drop_by,
                                      next_placement_NS=next_placement_NS)


class Symi(_Placing):
    """SYMI: Algorithm 1 placement from the previous counts, each class split evenly over its replicas.

    ``cf`` None: SYMI-dropless; a number: per-expert capacity ceil(cf · tokens · k / (s·N)) · r_e, overflow
    dropped by position (SYMI-cf1 with cf = 1.0, the paper's setting).
    """

    def __init__(self, slots_per_rank: int, cf: float | None = None):
        self.slots_per_rank = positive_int("slots_per_rank", slots_per_rank)
        self.cf = None if cf is None else check_cf(cf)
        self.name = "symi-dropless" if cf is None else f"symi-cf{self.cf:g}"

    def placement(self, popularity_E: Tensor, num_ranks: int, total_pairs: int) -> Tensor:
        return symi_placement(popularity_E, num_ranks, self.slots_per_rank)

    def plan_on(self, counts_NE: Tensor, placement_NS: Tensor, next_placement_NS: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        if self.cf is None:
            return LayerPlan.dropless(placement_NS, route_forward(counts_NE, placement_NS, "even"),
                                      counts_NE.shape[1], policy=self.name, next_placement_NS=next_placement_NS)
        dropped_NE = apply_capacity(counts_NE, symi_capacity(counts_NE, placement_NS, self.cf))
        fwd_NG = route_forward(counts_NE - dropped_NE, placement_NS, "even")
        return LayerPlan.forward_only(placement_NS, fwd_NG, dropped_NE, policy=self.name,
                                      next_placement_NS=next_placement_NS)


class LRMoE(_Placing):
    """LRMoE as we reconstruct it (DESIGN.md §4); every knob is ours and documented here.

    quota_mode        how much of the backward each rank retains (:mod:`lrmoe.planner.quotas`):
                      "budget" (the default): every rank keeps B_n = min(L_n, ceil(rho · mean L)) pairs, a balanced
                      level declared in advance; "cap": only ranks above ceil((1 + eps) · mean L) are trimmed, to it
                      (the first reconstruction, inert once replicas balance the forward: an ablation).
                      None picks "cap" when ``eps`` is given and ``rho`` is not (eps is cap mode's knob), else
                      "budget".
    rho               budget level in (0, 1] (budget mode only; default 1.0: trim what exceeds the mean).
    eps               balance slack >= 0 (default 0.1): in cap mode the cap's level; in both modes the slack of
                      the planned forward load, ceil((1 + eps) · mean L), whose buffers memory-aware placement
                      reserves (the forward is dropless and saves every pair's activations, so trimming the
                      backward frees no memory for replicas).
    gamma             per-expert floor: keep at least ceil(gamma · C_e) pairs of every expert (in [0, 1]).
    extra_slots       replica slots per rank beside the E/N home slots; with ``memory`` the most allowed.
    memory            a :class:`~lrmoe.planner.placement.MemoryModel`: extra slots = as many as fit beside the buffers
                      of the planned load, and the memory cap Q^mem = pairs whose buffers fit beside the slots.
                      None: ``extra_slots`` as given, no memory cap from it.
    mem_cap_pairs_N   an explicit memory cap (int or [N]) on retained pairs per rank, combined by min.
    quotas            trim each rank's retained pairs to its cap (off: keep every pair).
    backward_routing  move pairs above a rank's cap to replicas on ranks below theirs before trimming (off:
                      trim). None (default): on in cap mode, off in budget mode (see below).
    forward           "balanced" (dropless, min-max) or "even" forward routing.
    balance_iters, backward_rounds: effort of the balanced forward split and of the backward routing.

    Backward routing in budget mode (our choice). Every rank is capped at the same level, so the only ranks
    with room are those whose whole forward load is below rho · mean. Moving pairs there would retain more than
    the declared budget overall (by an amount that depends on the forward's imbalance), cost carried input rows
    and the expert's recomputation on the receiving replica, and blur the comparison with the random-trim
    control (:class:`Trimmed`), which moves nothing. So by default nothing moves: every rank keeps exactly
    min(L_n, B_n) of its own pairs (plus the floor's excess, reported in ``floor_excess_N``).
    ``backward_routing=True`` turns the moves on as an ablation (room = B_n - L_n).

    Order within ``plan``: placement (from prev counts) -> forward routing -> caps from the exact forward loads
    -> backward routing of what exceeds a cap (if on) -> quotas trim what still exceeds it (floor permitting).
    """

    def __init__(self, eps: float | None = None, gamma: float = 0.1, extra_slots: int = 1,
                 memory: MemoryModel | None = None, mem_cap_pairs_N=None, quotas: bool = True,
                 backward_routing: bool | None = None, forward: str = "balanced", balance_iters: int = 8,
                 backward_rounds: int = 2, quota_mode: str | None = None, rho: float | None = None):
        if quota_mode is None:
            quota_mode = "cap" if eps is not None and rho is None else "budget"
        if quota_mode not in QUOTA_MODES:
            raise ValueError(f"quota_mode={quota_mode!r} is not one of {QUOTA_MODES}")
        if quota_mode == "cap" and rho is not None:
            raise ValueError(f"rho={rho!r} sets the budget mode's level; quota_mode='cap' uses eps")
        self.quota_mode = quota_mode
        self.rho = check_rho(1.0 if rho is None else rho) if quota_mode == "budget" else None
        self.eps = check_fraction("eps", DEFAULT_EPS if eps is None else eps, None)
        self.gamma = check_fraction("gamma", gamma, 1.0)
        non_negative_int("extra_slots", extra_slots)
        if memory is not None and not isinstance(memory, MemoryModel):
            raise ValueError(f"memory must be a MemoryModel or None, got {type(memory).__name__}")
        if forward not in ("balanced", "even"):
            raise ValueError(f"forward={forward!r} is not 'balanced' or 'even'")
        if mem_cap_pairs_N is not None and bool((torch.as_tensor(mem_cap_pairs_N) < 0).any()):
            raise ValueError(f"mem_cap_pairs_N must be non-negative, got {mem_cap_pairs_N!r}")
        if backward_routing is None:
            backward_routing = quota_mode == "cap"
        early = None if memory is None else memory.early_rho
        if early is not None and (quota_mode != "budget" or early != self.rho or backward_routing or not quotas):
            raise ValueError(f"a memory model with early selection at rho={early} needs the budget mode at that rho, "
                             f"its quotas and no backward routing (got quota_mode={quota_mode!r}, rho={self.rho!r}, "
                             f"backward_routing={backward_routing}, quotas={quotas})")
        self.extra_slots, self.memory, self.mem_cap_pairs_N = extra_slots, memory, mem_cap_pairs_N
        self.quotas, self.backward_routing, self.forward = bool(quotas), bool(backward_routing), forward
        self.balance_iters, self.backward_rounds = int(balance_iters), int(backward_rounds)
        self.name = "lrmoe" if quota_mode == "cap" else f"lrmoe-rho{self.rho:g}"

    def _extra_slots(self, total_pairs: int, num_ranks: int, base_slots: int) -> int:
        """Extra slots per rank: as given, or as many as fit beside the buffers of the planned load (the balanced
        forward's ceil((1 + eps) · mean) of this iteration's total, tokens · k, known before the placement). If
        even the planned load does not fit beside the home slots, no extra slot; the memory cap then trims
        harder."""
        if self.memory is None:
            return self.extra_slots
        m = self.memory
        if m.budget_bytes < m.num_layers * base_slots * m.slot_bytes:
            raise ValueError(f"MemoryModel.budget_bytes={m.budget_bytes} cannot hold the {base_slots} home slots "
                             f"of {m.slot_bytes} bytes in each of its {m.num_layers} layers")
        planned = math.ceil((1.0 + self.eps) * total_pairs / num_ranks - 1e-9)
        try:  # the rank's own tokens' pairs: the mean
            return m.extra_slots(planned, base_slots, self.extra_slots, total_pairs / num_ranks)
        except ValueError:  # not even the planned load beside the home slots
            return 0

    def _mem_cap(self, fwd_load_N: Tensor, slots_per_rank: int, home_pairs_N: Tensor | None):
        num_ranks = fwd_load_N.numel()
        caps = []
        if self.memory is not None:
            home = fwd_load_N if home_pairs_N is None else home_pairs_N
            caps.append(self.memory.pair_cap(slots_per_rank, fwd_load_N, home).expand(num_ranks))
        if self.mem_cap_pairs_N is not None:
            caps.append(torch.as_tensor(self.mem_cap_pairs_N, dtype=torch.long).expand(num_ranks))
        if not caps:
            return None
        return caps[0] if len(caps) == 1 else torch.minimum(caps[0], caps[1])

    def caps(self, fwd_load_N: Tensor, slots_per_rank: int, home_pairs_N: Tensor | None = None) -> Tensor:
        """[N] backward cap per rank from the exact forward loads: the budget or the balance cap, and the
        memory cap (which also needs each rank's own tokens' computed pairs, ``home_pairs_N``; default: the
        forward loads)."""
        mem = self._mem_cap(fwd_load_N, slots_per_rank, home_pairs_N)
        if self.quota_mode == "budget":
            return budget_caps(fwd_load_N, self.rho, mem)
        return rank_caps(fwd_load_N, self.eps, mem)

    def placement(self, popularity_E: Tensor, num_ranks: int, total_pairs: int) -> Tensor:
        E = len(popularity_E)
        if E % num_ranks:
            raise ValueError(f"LRMoE keeps the static home layout: num_experts={E} must be divisible by "
                             f"num_ranks={num_ranks}")
        base = E // num_ranks
        return lrmoe_placement(popularity_E, num_ranks, base, self._extra_slots(total_pairs, num_ranks, base))

    def plan_on(self, counts_NE: Tensor, placement_NS: Tensor, next_placement_NS: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        table = replica_table(placement_NS, E)
        fwd_NG = forward_on(counts_NE, table, self.forward, self.balance_iters)
        plan = LayerPlan.dropless(placement_NS, fwd_NG, E, policy=self.name, next_placement_NS=next_placement_NS)
        if not (self.quotas or self.backward_routing):
            return plan
        cap_N = self.caps(plan.fwd_load_N, placement_NS.shape[1], fwd_NG.sum(1))
        flows_V4 = backward_on(fwd_NG, table, cap_N, self.backward_rounds) if self.backward_routing else \
            plan.bwd_flows_V4
        if self.quotas:
            keep_NG, floor_excess_N = retention_quotas(fwd_NG, placement_NS.reshape(-1), cap_N, self.gamma,
                                                       flows_V4)
        else:
            keep_NG, floor_excess_N = fwd_NG.clone(), torch.zeros(N, dtype=torch.long)
        return dataclasses.replace(plan, keep_NG=keep_NG, bwd_flows_V4=flows_V4, floor_excess_N=floor_excess_N,
                                   bwd_cap_N=cap_N)


class Trimmed:
    """Another policy's plan with its backward trimmed to the retention budget of LRMoE's ``budget`` mode.

    Every rank keeps B_n = min(L_n, ceil(rho · mean L)) of the pairs it computed (plus the floor's excess),
    each (source, slot) group in proportion to its pairs (:func:`~lrmoe.planner.quotas.retention_quotas`); which pairs
    of a group is the layer's backward config (``BackwardConfig(metric="random")``: the random-trim control that
    separates "less work" from "the right work"). Same placement and forward as the wrapped policy, nothing
    moves between replicas. ``gamma`` is the per-expert floor (default 0: a plain trim; LRMoE's floor is its own
    knob). The wrapped plan must keep every computed pair where it ran.
    """

    def __init__(self, policy: PlacingPolicy, rho: float, gamma: float = 0.0):
        self.policy, self.rho, self.gamma = policy, check_rho(rho), check_fraction("gamma", gamma, 1.0)
        self.name = f"{policy.name}-rho{self.rho:g}"

    def placement(self, popularity_E: Tensor, num_ranks: int, total_pairs: int) -> Tensor:
        return self.policy.placement(popularity_E, num_ranks, total_pairs)

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
        return self._trim(self.policy.plan(counts_NE, prev_counts_E))

    def plan_on(self, counts_NE: Tensor, placement_NS: Tensor, next_placement_NS: Tensor | None = None) -> LayerPlan:
        """The wrapped policy's ``plan_on``, trimmed (the wrapped policy must have one)."""
        return self._trim(self.policy.plan_on(counts_NE, placement_NS, next_placement_NS))

    def _trim(self, plan: LayerPlan) -> LayerPlan:
        if len(plan.bwd_flows_V4) or not torch.equal(plan.keep_NG, plan.fwd_NG):
            raise ValueError(f"Trimmed wraps plans that keep every computed pair where it ran; policy "
                             f"{plan.policy!r} already trims or moves its backward")
        cap_N = budget_caps(plan.fwd_load_N, self.rho)
        keep_NG, floor_excess_N = retention_quotas(plan.fwd_NG, plan.slot_expert_G, cap_N, self.gamma)
        return dataclasses.replace(plan, keep_NG=keep_NG, floor_excess_N=floor_excess_N, bwd_cap_N=cap_N,
                                   policy=self.name)
