"""Expert placement: which expert each slot of each rank hosts, for one layer and one iteration.

A placement is a LongTensor ``placement_NS`` [N ranks, S slots per rank]; global slot g = rank g // S, local index
g % S; ``-1`` marks an empty slot. Three layouts:

* :func:`static_placement`: expert parallelism, expert e on rank e // (E/N), one replica each;
* :func:`symi_placement`: SYMI's Algorithm 1 (DESIGN.md §3), proportional replica counts laid out contiguously;
* :func:`lrmoe_placement`: the static home layout plus extra slots that hold replicas of the hottest experts,
  with :func:`slots_that_fit` choosing how many extra slots the memory budget allows.

:class:`ReplicaTable` is the slot → expert / rank lookup the routers and quotas share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lrmoe.checks import check_placement, non_negative_int, positive_int
from lrmoe.bytemodel.layout import plan_selects
from lrmoe.bytemodel.memory import (Footprint, LayerLoads, layer_memory, model_peak, plan_loads, plan_memory,
                                    slot_capacity, uniform_peak)
from lrmoe.planner.quotas import memory_cap_pairs


def _popularity(popularity_E: Tensor) -> Tensor:
    """Validated float64 copy of a popularity vector: 1-D, finite, non-negative, not empty."""
    if not isinstance(popularity_E, Tensor):
        popularity_E = torch.as_tensor(popularity_E)
    if popularity_E.dim() != 1 or popularity_E.numel() == 0:
        raise ValueError(f"popularity_E must be a non-empty 1-D tensor, got shape {tuple(popularity_E.shape)}")
    pop_E = popularity_E.detach().cpu().to(torch.float64)
    if not torch.isfinite(pop_E).all():
        raise ValueError("popularity_E holds a non-finite value")
    if (pop_E < 0).any():
        raise ValueError(f"popularity_E must be non-negative, got min {pop_E.min().item()}")
    return pop_E


# --- static expert parallelism ---------------------------------------------------------------------------------

def static_placement(num_experts: int, num_ranks: int) -> Tensor:
    """Home layout of expert parallelism: rank n hosts experts n·E/N ... (n+1)·E/N - 1, in order. [N, E/N]"""
    positive_int("num_experts", num_experts)
    positive_int("num_ranks", num_ranks)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by num_ranks={num_ranks}")
    return torch.arange(num_experts, dtype=torch.long).view(num_ranks, num_experts // num_ranks)


# --- SYMI (DESIGN.md §3, Algorithm 1) -------------------------------------------------------------------------

def _algorithm1(pop_E: np.ndarray, factors: tuple[int, ...]) -> np.ndarray:
    """SYMI's replica counts, bit-for-bit the pseudo-code of DESIGN.md §3, with its two while loops vectorised.

    ``goal = pop / sum(pop) * factors[0] * factors[1] ...`` (the multiplication order of the pseudo-code matters
    for the last bit). The first loop picks argmax(diff) and decrements diff by 1 each time, so its picks are
    the items (e, j) with value diff_e - 1 - 1 ... (j times) taken in decreasing value, ties to the lowest e;
    pick (e, j) decrements cnt_e iff cnt_e > 1 still, i.e. iff j <= cnt_e - 2; the loop stops once
    sum(cnt) = N·s. The second loop is the mirror image with argmin and +1. We generate J levels per expert
    (by repeated ±1, as the loop computes them), sort once, and double J until no missing level could have
    been picked before the stopping point. float64 in, int64 out.
    """
    total = math.prod(factors)
    if pop_E.sum() == 0:  # nothing routed yet: uniform popularity (the pseudo-code would divide by zero)
        pop_E = np.ones_like(pop_E)
    goal_E = pop_E / pop_E.sum()
    for f in factors:
        goal_E = goal_E * f
    cnt_E = np.floor(np.maximum(goal_E, 1.0))
    diff_E = cnt_E - goal_E
    cnt_E = cnt_E.astype(np.int64)
    surplus = int(cnt_E.sum()) - total
    if surplus == 0:
        return cnt_E
    E = len(pop_E)
    sign = -1.0 if surplus > 0 else 1.0  # loop 1 walks diff down, loop 2 walks it up
    need = abs(surplus)
    levels = 2
    while True:
        value_EJ = np.empty((E, levels))
        value_EJ[:, 0] = diff_E
        for j in range(1, levels):
            value_EJ[:, j] = value_EJ[:, j - 1] + sign  # repeated ±1, exactly as the loop updates diff
        # order of picks: loop 1 takes the largest value first, loop 2 the smallest; ties to the lowest expert,
        # which a stable sort of the expert-major flattening gives for free (equal values never share an expert)
        key = value_EJ.ravel() * sign
        order = np.argsort(key, kind="stable")
        expert_P, level_P = np.divmod(order, levels)
        if surplus > 0:
            effective_P = level_P <= cnt_E[expert_P] - 2  # this pick lowers cnt (cnt was still > 1)
        else:
            effective_P = np.ones(len(order), dtype=bool)
        stop = int(np.searchsorted(np.cumsum(effective_P), need))  # the pick that ends the loop
        if stop < len(order):
            # every level we did not generate, (e, levels), must sort after the stopping pick
            stop_key, stop_e = key[order[stop]], expert_P[stop]
            missing_key_E = (value_EJ[:, -1] + sign) * sign
            after = (missing_key_E > stop_key) | ((missing_key_E == stop_key) & (np.arange(E) > stop_e))
            if after.all():
                picked_E = np.bincount(expert_P[:stop + 1][effective_P[:stop + 1]], minlength=E)
                return cnt_E - picked_E if surplus > 0 else cnt_E + picked_E
        levels *= 2


def symi_replica_counts(popularity_E: Tensor, total_slots: int) -> Tensor:
    """SYMI's replica count per expert (DESIGN.md §3 Algorithm 1 with N·s = total_slots). LongTensor[E].

    Σ r_e = total_slots and r_e >= 1. All-zero popularity is treated as uniform. Computed in float64.
    """
    pop_E = _popularity(popularity_E)
    positive_int("total_slots", total_slots)
    if total_slots < pop_E.numel():
        raise ValueError(f"total_slots={total_slots} is fewer than num_experts={pop_E.numel()}: every expert "
                         f"needs at least one slot")
    return torch.from_numpy(_algorithm1(pop_E.numpy(), (total_slots,)))


def symi_placement(popularity_E: Tensor, num_ranks: int, slots_per_rank: int) -> Tensor:
    """SYMI's placement: Algorithm 1's counts laid out contiguously, slot j of rank n = the (n·s + j)-th entry.

    A class fills a rank's slots before spilling to the next, so each class's hosts are a consecutive rank range.
    LongTensor[num_ranks, slots_per_rank]; no empty slots.
    """
    pop_E = _popularity(popularity_E)
    positive_int("num_ranks", num_ranks)
    positive_int("slots_per_rank", slots_per_rank)
    if num_ranks * slots_per_rank < pop_E.numel():
        raise ValueError(f"num_ranks*slots_per_rank={num_ranks * slots_per_rank} is fewer than num_experts="
                         f"{pop_E.numel()}: every expert needs at least one slot")
    cnt_E = _algorithm1(pop_E.numpy(), (num_ranks, slots_per_rank))
    return torch.from_numpy(np.repeat(np.arange(pop_E.numel()), cnt_E).reshape(num_ranks, slots_per_rank))


# --- LRMoE memory-aware placement ------------------------------------------------------------------------------

def slots_that_fit(mem_budget_bytes, slot_bytes: float, pair_buffer_bytes: float, planned_pairs_per_rank,
                   base_slots: int, max_extra: int) -> int:
    """How many extra slots per rank fit beside the base slots and the buffers of the planned load.

    Rank n needs (base + extra)·slot_bytes + planned_n·pair_buffer_bytes <= budget_n. ``mem_budget_bytes`` and
    ``planned_pairs_per_rank`` are scalars or per-rank tensors; every rank has the same slot count, so the
    tightest rank decides. The result is capped at ``max_extra``. Raises ``ValueError`` when even the base
    slots and the planned buffers do not fit.
    """
    if not slot_bytes > 0:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes!r}")
    if pair_buffer_bytes < 0:
        raise ValueError(f"pair_buffer_bytes must be non-negative, got {pair_buffer_bytes!r}")
    non_negative_int("base_slots", base_slots)
    non_negative_int("max_extra", max_extra)
    budget = torch.as_tensor(mem_budget_bytes, dtype=torch.float64)
    planned = torch.as_tensor(planned_pairs_per_rank, dtype=torch.float64)
    if (planned < 0).any():
        raise ValueError(f"planned_pairs_per_rank must be non-negative, got {planned_pairs_per_rank!r}")
    free = budget - base_slots * slot_bytes - planned * pair_buffer_bytes
    tightest = float(free.min())
    if tightest < 0:
        raise ValueError(f"mem_budget_bytes={mem_budget_bytes!r} cannot hold base_slots={base_slots} slots of "
                         f"{slot_bytes} bytes plus planned_pairs_per_rank={planned_pairs_per_rank!r} pairs of "
                         f"{pair_buffer_bytes} bytes (short by {-tightest:.0f} bytes)")
    return min(max_extra, int(tightest // slot_bytes))


@dataclass(frozen=True)
class MemoryModel:
    """Per-rank memory of the MoE layers as the planner sees it (DESIGN.md §4 step 1, §5.4): the one model of
    :mod:`lrmoe.bytemodel.memory`, shared with the simulator's accounting.

    budget_bytes   memory a rank gives its ``num_layers`` MoE layers together (``num_layers=1``: one layer's);
    slot_bytes     one replica slot (weights + gradients), ``footprint.slot``;
    pair_bytes     resident bytes per pair a rank computes, ``footprint.expert_pair`` (with a two-number footprint: the
                   backward buffers of one retained pair);
    footprint      every buffer's bytes (:func:`lrmoe.bytemodel.memory.footprint`); None: the two-number model
                   ``Footprint.slot_and_pair(slot_bytes, pair_bytes)``;
    num_layers     MoE layers sharing the budget; the planner assumes they all look like the layer it plans;
    fixed_bytes    bytes outside the layers that count against the budget (the optimizer shard, when it does).
    early_rho      early selection at the retention budget rho (DESIGN.md §4): the forward saves activations only for
                   the pairs the backward keeps, min(load, ceil(rho · mean)) per rank, so more slots fit (None: the
                   forward saves every computed pair's).

    Build it from a model with :meth:`for_model`; :meth:`peak_bytes` is the whole model's peak that the simulator
    checks, so "the planner says it fits" and "the simulator reports no OOM" are one statement (tests/test_memory.py).
    """

    budget_bytes: float
    slot_bytes: float
    pair_bytes: float
    footprint: Footprint | None = None
    num_layers: int = 1
    fixed_bytes: float = 0.0
    early_rho: float | None = None

    def __post_init__(self) -> None:
        if self.early_rho is not None and not 0 < self.early_rho <= 1:
            raise ValueError(f"MemoryModel.early_rho must be in (0, 1], got {self.early_rho!r}")
        for name in ("budget_bytes", "slot_bytes", "pair_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MemoryModel.{name} must be positive, got {getattr(self, name)!r}")
        positive_int("num_layers", self.num_layers)
        if not self.fixed_bytes >= 0:
            raise ValueError(f"MemoryModel.fixed_bytes must be non-negative, got {self.fixed_bytes!r}")
        if self.footprint is None:
            object.__setattr__(self, "footprint", Footprint.slot_and_pair(self.slot_bytes, self.pair_bytes))
        elif ((self.footprint.slot, self.footprint.expert_pair) != (self.slot_bytes, self.pair_bytes)
              and self.footprint != Footprint.slot_and_pair(self.slot_bytes, self.pair_bytes)):  # replace() of one
            raise ValueError(f"MemoryModel.slot_bytes / pair_bytes ({self.slot_bytes}, {self.pair_bytes}) disagree "
                             f"with its footprint ({self.footprint.slot}, {self.footprint.expert_pair}); build it "
                             f"with MemoryModel.for_model")

    @classmethod
    def for_model(cls, footprint: Footprint, budget_bytes: float, num_layers: int = 1,
                  fixed_bytes: float = 0.0) -> "MemoryModel":
        """The full model: ``footprint`` (:func:`lrmoe.bytemodel.memory.footprint`) over ``num_layers`` layers."""
        return cls(budget_bytes=float(budget_bytes), slot_bytes=footprint.slot, pair_bytes=footprint.expert_pair,
                   footprint=footprint, num_layers=num_layers, fixed_bytes=float(fixed_bytes))

    def peak_bytes(self, slots_per_rank, expert_rows, home_rows=None) -> Tensor:
        """float64, like the inputs: the model's peak on a rank with ``slots_per_rank`` slots, ``expert_rows`` pairs
        computed and ``home_rows`` pairs of its own tokens (default ``expert_rows``) in every layer, all retained."""
        home = expert_rows if home_rows is None else home_rows
        loads = LayerLoads.planned(slots_per_rank, expert_rows, home, early_rho=self.early_rho)
        return uniform_peak(layer_memory(self.footprint, loads),
                            self.num_layers, self.fixed_bytes)

    def plan_peak_bytes(self, plan, compact: bool = True, slot_capacity_rows: int | None = None) -> Tensor:
        """float64 [N]: the model's peak if every layer ran ``plan`` (the simulator's accounting of it)."""
        early = self.early_rho is not None
        return uniform_peak(plan_memory(self.footprint, plan, compact, slot_capacity_rows, early), self.num_layers,
                            self.fixed_bytes)

    def spare_slots_for(self, plans_with: Callable[[int], object], base_slots: int, max_spare: int, *,
                        compact: bool = True, capacity_cf: float | None = None,
                        load_margin: float = 0.0) -> tuple[int, float]:
        """The headroom rule every system follows (DESIGN.md §5.4): the most spare slots (at most ``max_spare``)
        with which the system's own plans fit, with ``load_margin`` more rows in every buffer.

        ``plans_with(spare)`` is the system's plan (or one plan per layer) of reference counts with
        ``base_slots + spare`` slots per rank; fewer plans than ``num_layers`` stand for the rest by their mean.
        ``capacity_cf``: fixed-size capacity buffers. Returns (spare slots, the planned headroom: the busiest
        rank's forward load summed over the plans, over the mean); (0, ...) when not even the base slots fit.
        """
        non_negative_int("max_spare", max_spare)
        if not load_margin >= 0:
            raise ValueError(f"load_margin must be non-negative, got {load_margin!r}")
        for spare in range(max_spare, -1, -1):
            plans = plans_with(spare)
            plans = list(plans) if isinstance(plans, (list, tuple)) else [plans]
            resident, inflight, expert = [], [], []
            for plan in plans:
                cap = None if capacity_cf is None else slot_capacity(plan, capacity_cf)
                loads = plan_loads(plan, compact, cap, early=self.early_rho is not None).scaled(1.0 + load_margin)
                mem = layer_memory(self.footprint, loads, plan_selects(plan))
                resident.append(mem.resident_N)
                inflight.append(mem.inflight_N)
                expert.append(loads.expert_N)
            peak_N = model_peak(torch.stack(resident), torch.stack(inflight), self.fixed_bytes, self.num_layers)
            if spare == 0 or bool((peak_N <= self.budget_bytes).all()):
                load_N = torch.stack(expert).sum(0)
                return spare, float(load_N.max() / load_N.mean().clamp(min=1e-12))
        raise AssertionError("unreachable")

    def fits(self, slots_per_rank, expert_rows, home_rows=None) -> bool:
        """Whether every rank's :meth:`peak_bytes` is within the budget."""
        return bool((self.peak_bytes(slots_per_rank, expert_rows, home_rows) <= self.budget_bytes).all())

    def extra_slots(self, planned_pairs_per_rank, base_slots: int, max_extra: int, home_pairs_per_rank=None) -> int:
        """How many slots beyond ``base_slots`` fit beside the buffers of the planned load, at most ``max_extra``.

        ``planned_pairs_per_rank``: the pairs the tightest rank is planned to compute (scalar or [N]);
        ``home_pairs_per_rank``: its own tokens' pairs (default: the planned pairs). Every rank has the same slot
        count, so the tightest rank decides. Raises ``ValueError`` when not even the base slots fit.
        """
        non_negative_int("base_slots", base_slots)
        non_negative_int("max_extra", max_extra)
        planned = torch.as_tensor(planned_pairs_per_rank, dtype=torch.float64)
        if (planned < 0).any():
            raise ValueError(f"planned_pairs_per_rank must be non-negative, got {planned_pairs_per_rank!r}")
        free = float((self.budget_bytes - self.peak_bytes(base_slots, planned, home_pairs_per_rank)).min())
        if free < 0:
            raise ValueError(f"the budget of {self.budget_bytes:.6g} bytes cannot hold {base_slots} slots of "
                             f"{self.slot_bytes:.6g} bytes beside the buffers of {planned_pairs_per_rank!r} planned "
                             f"pairs per rank (short by {-free:.6g} bytes)")
        return min(max_extra, int(free // (self.num_layers * self.slot_bytes)))

    def pair_cap(self, slots_per_rank: int, fwd_load_N=None, home_pairs_N=None) -> Tensor | int:
        """Q^mem of DESIGN.md §4 step 3: retained pairs whose backward buffers fit on a rank beside its slots and
        saved activations (``fwd_load_N`` pairs computed, ``home_pairs_N`` of its own tokens, every layer alike;
        both default 0) and its home side's backward buffers. An int without loads, else a LongTensor [N]."""
        fp, n_l = self.footprint, self.num_layers
        load = torch.as_tensor(0.0 if fwd_load_N is None else fwd_load_N, dtype=torch.float64)
        home = torch.as_tensor(0.0 if home_pairs_N is None else home_pairs_N, dtype=torch.float64)
        # budget left beside the activations every layer saves and the home side's backward buffers; the slots of
        # every layer and the expert side's backward buffers (grad row in, dX row out, gate / up gradients, index)
        # per retained pair are memory_cap_pairs's two terms
        # early selection: a retained pair also holds its saved activations in every layer, a trimmed one none
        saved = 0.0 if self.early_rho is not None else 1.0
        besides = n_l * (saved * load * fp.expert_pair + home * fp.home_pair) + home * (2 * fp.row + fp.index)
        cap = memory_cap_pairs(self.budget_bytes - self.fixed_bytes - besides, slots_per_rank, n_l * fp.slot,
                               2 * fp.row + fp.bwd_act + fp.index + (1.0 - saved) * n_l * fp.expert_pair)
        return int(cap) if fwd_load_N is None and home_pairs_N is None else cap


def lrmoe_placement(popularity_E: Tensor, num_ranks: int, base_slots: int, extra_slots: int) -> Tensor:
    """LRMoE's placement: the static home layout plus ``extra_slots`` slots per rank of hot-expert replicas.

    [N, base + extra]. Columns 0..base-1 are the home layout (base_slots must be E / N), so every expert keeps
    one replica where static expert parallelism puts it. How many replicas each expert gets is SYMI's
    proportional rule (Algorithm 1 over all N·(base + extra) slots, so r_e >= 1 is the home slot and the
    extra slots go to the hottest experts in proportion to demand), capped at one replica per rank (a second
    copy on a rank adds no capacity) with the freed slots handed out by D'Hondt. Where they go is a greedy
    that prefers lightly loaded hosts: in round t (one per extra column) the N hottest remaining replicas,
    by expected load per replica pop_e / r_e (ties to the lower expert), are paired with the ranks sorted by
    expected load (ties to the lower rank), hottest with lightest. A replica paired with a rank that already
    hosts its expert adds no capacity there, so it swaps rank with another pair of the round (one that clears
    both, else a colder one); if no swap helps, its slot stays empty (-1). Deterministic.
    """
    pop_E = _popularity(popularity_E)
    E = pop_E.numel()
    positive_int("num_ranks", num_ranks)
    positive_int("base_slots", base_slots)
    non_negative_int("extra_slots", extra_slots)
    if E % num_ranks or base_slots != E // num_ranks:
        raise ValueError(f"base_slots={base_slots} must equal num_experts/num_ranks for the home layout "
                         f"(num_experts={E}, num_ranks={num_ranks})")
    home_NB = static_placement(E, num_ranks)
    if extra_slots == 0:
        return home_NB
    N = num_ranks
    pop = pop_E.numpy()
    if pop.sum() == 0:
        pop = np.ones_like(pop)
    replicas_E = _cap_replicas(_algorithm1(pop, (N * (base_slots + extra_slots),)), pop, N)
    per_replica_E = pop / replicas_E
    # extra replicas, hottest first (stable sort keeps the lower expert first among equals)
    by_heat = np.argsort(-per_replica_E, kind="stable")
    queue_X = np.repeat(by_heat, (replicas_E - 1)[by_heat])
    load_N = per_replica_E.reshape(N, base_slots).sum(1)
    hosts_NE = np.zeros((N, E), dtype=bool)
    hosts_NE[np.repeat(np.arange(N), base_slots), home_NB.numpy().ravel()] = True
    extra_NX = np.full((N, extra_slots), -1, dtype=np.int64)
    for t in range(extra_slots):
        batch = queue_X[t * N:(t + 1) * N]  # shorter than N only when capping left slots nobody can use
        ranks = np.argsort(load_N, kind="stable")[:len(batch)]
        if hosts_NE[ranks, batch].any():
            ranks, keep = _swap_clashes(batch.tolist(), ranks.tolist(), hosts_NE)
            ranks, batch = np.array(ranks, dtype=np.int64), batch[np.array(keep, dtype=bool)]
        extra_NX[ranks, t] = batch
        hosts_NE[ranks, batch] = True
        load_N[ranks] += per_replica_E[batch]  # ranks are distinct within a round
    return torch.cat([home_NB, torch.from_numpy(extra_NX)], dim=1)


def _cap_replicas(replicas_E: np.ndarray, pop_E: np.ndarray, num_ranks: int) -> np.ndarray:
    """At most one replica per rank is useful: cap r_e at N and give the freed slots, one at a time, to the
    expert with the largest load per replica after the gift, pop_e / (r_e + 1) (D'Hondt; ties to the lower
    expert). Slots nobody can use (every expert on every rank) are dropped, leaving empty slots."""
    freed = int(np.maximum(replicas_E - num_ranks, 0).sum())
    if freed == 0:
        return replicas_E
    capped_E = np.minimum(replicas_E, num_ranks)
    room_E = num_ranks - capped_E
    expert_C = np.repeat(np.arange(len(pop_E)), room_E)
    nth_C = np.arange(len(expert_C)) - np.repeat(np.cumsum(room_E) - room_E, room_E)
    value_C = pop_E[expert_C] / (capped_E[expert_C] + nth_C + 1)
    chosen = np.argsort(-value_C, kind="stable")[:freed]
    return capped_E + np.bincount(expert_C[chosen], minlength=len(pop_E))


def _swap_clashes(experts: list[int], ranks: list[int], hosts_NE: np.ndarray) -> tuple[list[int], list[bool]]:
    """Pairs (experts[i], ranks[i]) of one round, hottest first; swap ranks between pairs to clear clashes (a
    rank that already hosts the expert). For each clash, hottest first: a swap that clears both pairs, the
    nearest partner first; else a swap with a colder pair that clears this one (the colder pair is handled in
    its turn). Returns the kept pairs' ranks and a keep mask (False: nothing cleared it, the slot stays empty).
    """
    hosts = hosts_NE.tolist()
    n = len(experts)

    def clash(i: int) -> bool:
        return hosts[ranks[i]][experts[i]]

    for i in range(n):
        if not clash(i):
            continue
        partner = next((j for d in range(1, n) for j in (i + d, i - d) if 0 <= j < n and
                        not hosts[ranks[j]][experts[i]] and not hosts[ranks[i]][experts[j]]), None)
        if partner is None:
            partner = next((j for j in range(i + 1, n) if not hosts[ranks[j]][experts[i]]), None)
        if partner is not None:
            ranks[i], ranks[partner] = ranks[partner], ranks[i]
    keep = [not clash(i) for i in range(n)]
    return [r for r, k in zip(ranks, keep) if k], keep


# --- slot lookups ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReplicaTable:
    """Slot → expert / rank lookups of one placement, computed once and shared by routers and quotas.

    expert_G [G]: expert hosted by global slot g (-1 empty); rank_G [G]: g // S.
    replicas_E [E]: slots hosting each expert; replica_G [G]: index of slot g among its expert's slots in
    increasing g (-1 empty).
    hosted_R [R]: the non-empty slots sorted by (expert, g); start_E [E]: where expert e's run begins in it.
    A *unit* is the set of slots of one expert on one rank (several when a rank holds duplicates):
    unit_G [G] (-1 empty), expert_U / rank_U / first_slot_U / slots_U [U], units sorted by (expert, rank).
    """

    num_ranks: int
    slots_per_rank: int
    num_experts: int
    expert_G: Tensor
    rank_G: Tensor
    replicas_E: Tensor
    replica_G: Tensor
    hosted_R: Tensor
    start_E: Tensor
    unit_G: Tensor
    expert_U: Tensor
    rank_U: Tensor
    first_slot_U: Tensor
    slots_U: Tensor


def replica_table(placement_NS: Tensor, num_experts: int) -> ReplicaTable:
    """Build the :class:`ReplicaTable` of a placement (validated: 2-D long, ids in [-1, E))."""
    check_placement(placement_NS, num_experts)
    N, S = placement_NS.shape
    E = num_experts
    expert_G = placement_NS.detach().cpu().numpy().ravel()
    G = len(expert_G)
    slot_G = np.arange(G)
    hosted = expert_G >= 0
    # order (expert, g): the key expert·G + g sorts by expert, then slot; empty slots go last
    order = np.argsort(np.where(hosted, expert_G, E) * G + slot_G, kind="stable")
    hosted_R = order[:int(hosted.sum())]
    expert_R = expert_G[hosted_R]
    replicas_E = np.bincount(expert_R, minlength=E)
    start_E = np.cumsum(replicas_E) - replicas_E
    replica_G = np.full(G, -1, dtype=np.int64)
    replica_G[hosted_R] = np.arange(len(hosted_R)) - start_E[expert_R]
    # units: runs of equal (expert, rank) in hosted_R order
    rank_R = hosted_R // S
    new_unit_R = np.ones(len(hosted_R), dtype=bool)
    new_unit_R[1:] = (expert_R[1:] != expert_R[:-1]) | (rank_R[1:] != rank_R[:-1])
    unit_R = np.cumsum(new_unit_R) - 1
    unit_G = np.full(G, -1, dtype=np.int64)
    unit_G[hosted_R] = unit_R
    t = torch.from_numpy
    return ReplicaTable(num_ranks=N, slots_per_rank=S, num_experts=E, expert_G=t(expert_G), rank_G=t(slot_G // S),
                        replicas_E=t(replicas_E), replica_G=t(replica_G), hosted_R=t(hosted_R), start_E=t(start_E),
                        unit_G=t(unit_G), expert_U=t(expert_R[new_unit_R]), rank_U=t(rank_R[new_unit_R]),
                        first_slot_U=t(hosted_R[new_unit_R]),
                        slots_U=t(np.bincount(unit_R, minlength=int(new_unit_R.sum()))))
