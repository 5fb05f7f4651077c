"""Policies: small objects that turn one layer's routed counts into a :class:`~lrmoe.plan.LayerPlan`.

Each has a short ``name`` and ``plan(counts_NE, prev_counts_E=None) -> LayerPlan``: counts_NE [N, E] are the
routed pairs per (source rank, expert) of this iteration, prev_counts_E [E] the previous iteration's global
counts (SYMI and LRMoE place replicas from them; with none, popularity is uniform). Pure: no
``torch.distributed``, the same counts give the same plan on every rank.

* :class:`StaticEP`  expert parallelism, one replica per expert at home, dropless.
* :class:`Capacity`  static placement with GShard/DeepSpeed capacity ceil(cf · tokens · k / E); overflow dropped.
* :class:`Symi`      SYMI (DESIGN.md §3): Algorithm 1 placement, even split; SYMI-cf1 drops, SYMI-dropless not.
* :class:`LRMoE`     our reconstruction (DESIGN.md §4): memory-aware placement, balanced dropless forward,
                     then caps -> backward replica routing (move what can move) -> quotas (trim the rest).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lrmoe.placement import (MemoryModel, _non_negative_int, _positive_int, lrmoe_placement, replica_table,
                             static_placement, symi_placement)
from lrmoe.plan import DROP_RULES, LayerPlan, no_flows
from lrmoe.quotas import _check_fraction, rank_caps, retention_quotas
from lrmoe.replica_routing import (_check_cf, apply_capacity, backward_on, check_counts, forward_on,
                                   gshard_capacity, route_forward, symi_capacity)


def _check_prev(prev_counts_E: Tensor | None, num_experts: int) -> Tensor:
    """The popularity used for placement: prev_counts_E validated, or uniform when absent."""
    if prev_counts_E is None:
        return torch.ones(num_experts, dtype=torch.float64)
    prev = torch.as_tensor(prev_counts_E)
    if prev.shape != (num_experts,):
        raise ValueError(f"prev_counts_E has shape {tuple(prev.shape)}, expected ({num_experts},)")
    if bool((prev < 0).any()):
        raise ValueError(f"prev_counts_E must be non-negative, got min {prev.min().item()}")
    return prev


def _forward_only(policy: str, placement_NS: Tensor, fwd_NG: Tensor, dropped_NE: Tensor,
                  drop_by: str = "position") -> LayerPlan:
    """A plan that retains every computed pair for the backward, where its forward ran (no quotas, no moves)."""
    N = placement_NS.shape[0]
    return LayerPlan(placement_NS=placement_NS, fwd_NG=fwd_NG, dropped_NE=dropped_NE, keep_NG=fwd_NG.clone(),
                     bwd_flows_F4=no_flows(), floor_excess_N=torch.zeros(N, dtype=torch.long), policy=policy,
                     drop_by=drop_by)


def _dropless(policy: str, placement_NS: Tensor, fwd_NG: Tensor, num_experts: int) -> LayerPlan:
    dropped_NE = torch.zeros(placement_NS.shape[0], num_experts, dtype=torch.long)
    return _forward_only(policy, placement_NS, fwd_NG, dropped_NE)


class StaticEP:
    """Expert parallelism: expert e on rank e // (E/N), every pair computed, nothing trimmed."""

    name = "static-ep"

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        placement_NS = static_placement(E, N)
        return _dropless(self.name, placement_NS, route_forward(counts_NE, placement_NS, "even"), E)


class Capacity:
    """Static placement with a per-expert capacity ceil(cf · tokens · k / E); overflow dropped.

    ``drop_by``: "position" (the last pairs of a (source, expert) group) or "gate" (its lowest-gate pairs).
    """

    def __init__(self, cf: float = 1.0, drop_by: str = "position"):
        if drop_by not in DROP_RULES:
            raise ValueError(f"drop_by={drop_by!r} is not one of {DROP_RULES}")
        self.cf, self.drop_by = _check_cf(cf), drop_by
        self.name = f"capacity-cf{self.cf:g}" + ("-gate" if drop_by == "gate" else "")

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        placement_NS = static_placement(E, N)
        dropped_NE = apply_capacity(counts_NE, gshard_capacity(counts_NE, self.cf))
        fwd_NG = route_forward(counts_NE - dropped_NE, placement_NS, "even")
        return _forward_only(self.name, placement_NS, fwd_NG, dropped_NE, self.drop_by)


class Symi:
    """SYMI: Algorithm 1 placement from the previous counts, each class split evenly over its replicas.

    ``cf`` None: SYMI-dropless; a number: per-expert capacity ceil(cf · tokens · k / (s·N)) · r_e, overflow
    dropped by position (SYMI-cf1 with cf = 1.0, the paper's setting).
    """

    def __init__(self, slots_per_rank: int, cf: float | None = None):
        self.slots_per_rank = _positive_int("slots_per_rank", slots_per_rank)
        self.cf = None if cf is None else _check_cf(cf)
        self.name = "symi-dropless" if cf is None else f"symi-cf{self.cf:g}"

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        placement_NS = symi_placement(_check_prev(prev_counts_E, E), N, self.slots_per_rank)
        if self.cf is None:
            return _dropless(self.name, placement_NS, route_forward(counts_NE, placement_NS, "even"), E)
        dropped_NE = apply_capacity(counts_NE, symi_capacity(counts_NE, placement_NS, self.cf))
        fwd_NG = route_forward(counts_NE - dropped_NE, placement_NS, "even")
        return _forward_only(self.name, placement_NS, fwd_NG, dropped_NE)


class LRMoE:
    """LRMoE as we reconstruct it (DESIGN.md §4); every knob is ours and documented here.

    eps               balance slack: backward cap ceil((1 + eps) · mean forward load) per rank (>= 0).
    gamma             per-expert floor: keep at least ceil(gamma · C_e) pairs of every expert (in [0, 1]).
    extra_slots       replica slots per rank beside the E/N home slots; with ``memory`` the most allowed.
    memory            a :class:`~lrmoe.placement.MemoryModel`: extra slots = as many as fit beside the buffers
                      of the planned (cap-bounded) load, and the memory cap Q^mem = pairs whose buffers fit
                      beside the slots. None: ``extra_slots`` as given, no memory cap from it.
    mem_cap_pairs_N   an explicit memory cap (int or [N]) on retained pairs per rank, combined by min.
    quotas            trim each rank's retained pairs to its cap (off: keep every pair).
    backward_routing  move pairs above a rank's cap to replicas with spare room before trimming (off: trim).
    forward           "balanced" (dropless, min-max) or "even" forward routing.
    balance_iters, backward_rounds: effort of the balanced forward split and of the backward routing.

    Order within ``plan``: placement (from prev counts) -> forward routing -> caps from the exact forward loads
    -> backward routing of what exceeds a cap -> quotas trim what still exceeds it (floor permitting).
    """

    def __init__(self, eps: float = 0.1, gamma: float = 0.1, extra_slots: int = 1,
                 memory: MemoryModel | None = None, mem_cap_pairs_N=None, quotas: bool = True,
                 backward_routing: bool = True, forward: str = "balanced", balance_iters: int = 8,
                 backward_rounds: int = 2):
        self.eps = _check_fraction("eps", eps, None)
        self.gamma = _check_fraction("gamma", gamma, 1.0)
        _non_negative_int("extra_slots", extra_slots)
        if memory is not None and not isinstance(memory, MemoryModel):
            raise ValueError(f"memory must be a MemoryModel or None, got {type(memory).__name__}")
        if forward not in ("balanced", "even"):
            raise ValueError(f"forward={forward!r} is not 'balanced' or 'even'")
        if mem_cap_pairs_N is not None and bool((torch.as_tensor(mem_cap_pairs_N) < 0).any()):
            raise ValueError(f"mem_cap_pairs_N must be non-negative, got {mem_cap_pairs_N!r}")
        self.extra_slots, self.memory, self.mem_cap_pairs_N = extra_slots, memory, mem_cap_pairs_N
        self.quotas, self.backward_routing, self.forward = bool(quotas), bool(backward_routing), forward
        self.balance_iters, self.backward_rounds = int(balance_iters), int(backward_rounds)
        self.name = "lrmoe"

    def _extra_slots(self, total_pairs: int, num_ranks: int, base_slots: int) -> int:
        """Extra slots per rank: as given, or as many as fit beside the buffers of the planned load (the balance
        cap of this iteration's total, which is known before the placement: tokens · k). If even the planned
        load does not fit beside the home slots, no extra slot; the memory cap then trims harder."""
        if self.memory is None:
            return self.extra_slots
        m = self.memory
        if m.budget_bytes < base_slots * m.slot_bytes:
            raise ValueError(f"MemoryModel.budget_bytes={m.budget_bytes} cannot hold the {base_slots} home slots "
                             f"of {m.slot_bytes} bytes")
        planned = math.ceil((1.0 + self.eps) * total_pairs / num_ranks - 1e-9)
        if m.budget_bytes < base_slots * m.slot_bytes + planned * m.pair_bytes:
            return 0
        return m.extra_slots(planned, base_slots, self.extra_slots)

    def _mem_cap(self, num_ranks: int, slots_per_rank: int):
        caps = []
        if self.memory is not None:
            caps.append(torch.full((num_ranks,), self.memory.pair_cap(slots_per_rank), dtype=torch.long))
        if self.mem_cap_pairs_N is not None:
            caps.append(torch.as_tensor(self.mem_cap_pairs_N, dtype=torch.long).expand(num_ranks))
        if not caps:
            return None
        return caps[0] if len(caps) == 1 else torch.minimum(caps[0], caps[1])

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        if E % N:
            raise ValueError(f"LRMoE keeps the static home layout: num_experts={E} must be divisible by "
                             f"num_ranks={N}")
        base = E // N
        extra = self._extra_slots(int(counts_NE.sum()), N, base)
        placement_NS = lrmoe_placement(_check_prev(prev_counts_E, E), N, base, extra)
        table = replica_table(placement_NS, E)
        fwd_NG = forward_on(counts_NE, table, self.forward, self.balance_iters)
        plan = _dropless(self.name, placement_NS, fwd_NG, E)
        if not (self.quotas or self.backward_routing):
            return plan
        fwd_load_N = fwd_NG.sum(0).view(N, -1).sum(1)
        cap_N = rank_caps(fwd_load_N, self.eps, self._mem_cap(N, base + extra))
        flows_F4 = backward_on(fwd_NG, table, cap_N, self.backward_rounds) if self.backward_routing else no_flows()
        if self.quotas:
            keep_NG, floor_excess_N = retention_quotas(fwd_NG, placement_NS.reshape(-1), cap_N, self.gamma,
                                                       flows_F4)
        else:
            keep_NG, floor_excess_N = fwd_NG.clone(), torch.zeros(N, dtype=torch.long)
        return LayerPlan(placement_NS=placement_NS, fwd_NG=fwd_NG, dropped_NE=plan.dropped_NE, keep_NG=keep_NG,
                         bwd_flows_F4=flows_F4, floor_excess_N=floor_excess_N, bwd_cap_N=cap_N, policy=self.name)
