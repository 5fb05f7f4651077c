"""Online replication (the MoonEP / Megatron-Core virtual-expert way): replicas planned from the *current* forward.

SYMI and LRMoE place replicas from the previous iteration's counts, so a skew that moves between iterations leaves
them unbalanced. Online replication waits for this forward's router counts (all-gathered anyway), copies the
weights of the hottest experts into spare slots before the expert compute, and routes the forward over the
replicas. The home layout never moves:

* every rank has the E/N home slots of static expert parallelism plus ``spare_slots`` spare slots, empty between
  iterations (:meth:`Online.placement`, the slots' content and the plan's ``next_placement_NS``);
* :func:`online_replicas`, deterministic: while the most loaded rank (loads estimated with each expert's pairs
  split evenly over its replicas) hosts an expert whose extra replica, on the least loaded rank of that expert's
  home node with a free spare slot, lowers the larger of the two ranks' loads by more than ``push_cost_rows``
  pairs, place it (the hottest such expert per replica first); stop when no copy pays for itself. The threshold
  is the push's own cost on its link in pairs of the busiest rank's work (the cost model's
  :meth:`~lrmoe.sim.cost.CostModel.push_cost_rows`): a copy is pushed only when the time it saves on the busiest
  rank exceeds what its push costs (spill only when necessary). ``push_cost_rows=0`` is the greedy rule (any
  relief at all), kept as an ablation (``online-greedy`` in the registry);
* the plan pushes each replica's weights from the expert's home slot (``LayerPlan.push_src_G``; only inside one
  node of ``ranks_per_node`` ranks, the anchor's NVLink domain) and routes the forward ``"balanced"`` over the
  replicas (:func:`lrmoe.planner.replica_routing.route_forward`);
* the backward sums the replicas' gradients into the expert's like any replica's
(:mod:`lrmoe.runtime.distributed.replica`),
  and the step's redistribution into the home placement empties the spare slots again.

Pure: no ``torch.distributed``; the same counts give the same plan on every rank, so the push needs no collective
beyond itself. The retention budget on top (``online-rho…`` in the registry) is :class:`lrmoe.planner.policies.Trimmed`
around this policy: online plans keep every computed pair where it ran.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lrmoe.checks import check_fraction, non_negative_int, positive_int
from lrmoe.planner.placement import replica_table, static_placement
from lrmoe.planner.plan import LayerPlan
from lrmoe.planner.replica_routing import FORWARD_MODES, check_counts, forward_on


def home_placement(num_experts: int, num_ranks: int, spare_slots: int) -> Tensor:
    """[N, E/N + spare] the static home layout followed by ``spare_slots`` empty slots per rank."""
    home = static_placement(num_experts, num_ranks)
    return torch.cat([home, torch.full((num_ranks, spare_slots), -1, dtype=torch.long)], 1)


def online_replicas(counts_E: Tensor, num_ranks: int, spare_slots: int, ranks_per_node: int | None = None,
                    push_cost_rows: float = 0.0) -> Tensor:
    """[N, E/N + spare] the home placement with this forward's replicas in the spare slots (module doc).

    ``counts_E``: this forward's routed pairs per expert (all ranks). A replica of e only goes to a rank of e's
    home node (``ranks_per_node``; None: one node), never to a rank that already hosts e, and fills that rank's
    first free spare slot, and only when it lowers the busiest of the two ranks' loads by more than
    ``push_cost_rows`` pairs (0: by anything, the greedy rule). Ties: the lowest rank, then the lowest expert."""
    push_cost_rows = check_fraction("push_cost_rows", push_cost_rows, None)
    counts = check_counts(torch.as_tensor(counts_E).view(1, -1)).numpy()[0].astype(np.float64)
    E, N = len(counts), num_ranks
    placement = home_placement(E, N, spare_slots)
    base = E // N
    rpn = N if ranks_per_node is None else ranks_per_node
    node_N = np.arange(N) // rpn
    home_E = np.arange(E) // base
    # hosts as floats for the load product (the same BLAS product as on booleans, without the cast each round), and
    # as [E, N] booleans for one expert's hosts; the placement is written through a NumPy view (torch's item
    # assignment costs more than the rest of a round)
    hosts_NE = np.zeros((N, E))
    hosts_NE[home_E, np.arange(E)] = 1.0
    hosted_EN = np.ascontiguousarray(hosts_NE.T > 0)
    hosted_N = [list(range(n * base, (n + 1) * base)) for n in range(N)]
    same_node_NN = node_N[:, None] == node_N[None, :]
    replicas_E = np.ones(E)
    free_N = np.full(N, spare_slots)
    free_ok_N = free_N > 0
    free_total = N * spare_slots
    slots = placement.numpy()
    while free_total:
        share_E = counts / replicas_E
        load_N = hosts_NE @ share_E
        h = int(np.argmax(load_N))
        placed = False
        # hottest per replica first, then lowest id
        for e in sorted((e for e in hosted_N[h] if counts[e] > 0), key=lambda e: (-share_E[e], e)):
            ok_N = same_node_NN[home_E[e]] & free_ok_N & ~hosted_EN[e]
            if not ok_N.any():
                continue
            m = int(np.argmin(np.where(ok_N, load_N, np.inf)))
            new_share = counts[e] / (replicas_E[e] + 1)  # every host of e, the new one too, computes this much
            saving = load_N[h] - max(load_N[h] - share_E[e] + new_share, load_N[m] + new_share)
            if saving > push_cost_rows:
                slots[m, base + spare_slots - free_N[m]] = e
                hosts_NE[m, e], hosted_EN[e, m] = 1.0, True
                hosted_N[m].append(e)
                free_N[m] -= 1
                free_ok_N[m] = free_N[m] > 0
                free_total -= 1
                replicas_E[e] += 1
                placed = True
                break
        if not placed:
            break
    return placement


def push_sources(placement_NS: Tensor, home_NS: Tensor) -> Tensor:
    """[G] ``push_src_G`` of a placement that fills some empty slots of ``home_NS``: each filled slot copies the
    expert's first slot in the home placement; -1 elsewhere."""
    home_G, want_G = home_NS.reshape(-1), placement_NS.reshape(-1)
    first_E = torch.full((int(want_G.max()) + 2,), -1, dtype=torch.long)
    hosted = (home_G >= 0).nonzero().flatten()
    first_E.scatter_reduce_(0, home_G[hosted], hosted, "amin", include_self=False)
    pushed = (home_G < 0) & (want_G >= 0)
    return torch.where(pushed, first_E[want_G.clamp(min=0)], -1)


class Online:
    """Online replication (module doc): spare slots filled from this forward's counts, weights pushed in within
    a node, balanced dropless forward, home placement unchanged.

    spare_slots     replica slots per rank beside the E/N home slots (empty between iterations).
    ranks_per_node  the push stays inside nodes of this many consecutive ranks (None: all ranks are one node).
    forward         "balanced" (min-max, as LRMoE's) or "even" routing over the replicas.
    push_cost_rows  a copy is pushed only when it relieves the busiest rank by more than this many pairs (the
                    push's cost in the busiest rank's work; 0: the greedy rule, any relief).
    """

    def __init__(self, spare_slots: int = 1, ranks_per_node: int | None = None, forward: str = "balanced",
                 balance_iters: int = 8, push_cost_rows: float = 0.0):
        self.spare_slots = non_negative_int("spare_slots", spare_slots)
        self.push_cost_rows = check_fraction("push_cost_rows", push_cost_rows, None)
        self.ranks_per_node = None if ranks_per_node is None else positive_int("ranks_per_node", ranks_per_node)
        if forward not in FORWARD_MODES:
            raise ValueError(f"forward={forward!r} is not one of {FORWARD_MODES}")
        self.forward, self.balance_iters = forward, int(balance_iters)
        self.name = "online"

    def _check_ranks(self, num_experts: int, num_ranks: int) -> None:
        if num_experts % num_ranks:
            raise ValueError(f"online replication keeps the static home layout: num_experts={num_experts} must be "
                             f"divisible by num_ranks={num_ranks}")
        if self.ranks_per_node is not None and num_ranks % self.ranks_per_node:
            raise ValueError(f"num_ranks={num_ranks} is not a whole number of nodes of "
                             f"ranks_per_node={self.ranks_per_node}")

    def placement(self, popularity_E: Tensor, num_ranks: int, total_pairs: int) -> Tensor:
        """The home placement with empty spare slots: what the slots hold between iterations."""
        self._check_ranks(len(popularity_E), num_ranks)
        return home_placement(len(popularity_E), num_ranks, self.spare_slots)

    def plan(self, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
        """This forward's plan from this forward's counts (``prev_counts_E`` is not used)."""
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        self._check_ranks(E, N)
        return self.plan_on(counts_NE, home_placement(E, N, self.spare_slots))

    def plan_on(self, counts_NE: Tensor, placement_NS: Tensor, next_placement_NS: Tensor | None = None) -> LayerPlan:
        """This forward's plan on the base placement the slots hold (:meth:`placement`, the home layout with empty
        spare slots), which is also the next iteration's: the replicas come from this forward's counts."""
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        self._check_ranks(E, N)
        home_NS = placement_NS
        if tuple(home_NS.shape) != (N, E // N + self.spare_slots):
            raise ValueError(f"online replication plans on its home placement [{N}, {E // N + self.spare_slots}], "
                             f"got shape {tuple(home_NS.shape)}")
        placement_NS = online_replicas(counts_NE.sum(0), N, self.spare_slots, self.ranks_per_node,
                                       self.push_cost_rows)
        fwd_NG = forward_on(counts_NE, replica_table(placement_NS, E), self.forward, self.balance_iters)
        nxt = home_NS if next_placement_NS is None else next_placement_NS
        return LayerPlan.dropless(placement_NS, fwd_NG, E, policy=self.name, next_placement_NS=nxt,
                                  push_src_G=push_sources(placement_NS, home_NS))
