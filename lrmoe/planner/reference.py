"""The planner's critical path as it was before its NumPy rewrite (slot-major fill, no transposed copies, candidates
at once): the reference the rewrite is checked against (tests/test_batched_planner.py: equal tensor for tensor) and
the benchmark times beside it (experiments/bench_planner.py, ``reference_*`` fields), so a speed-up is always
measured in the same run on the same machine.

Only the routines the rewrite replaced live here, unchanged: the north-west corner fill of the balanced forward
(:func:`fill_local_first`: [N, G] writes in (expert, source) order and a sort of both cumulative sums), the
retention quotas (:func:`retention_quotas`: transposed copies of [N, G]; the over-cap ranks they start from
are the planner's own :func:`~lrmoe.planner.quotas.over_cap`) and online replication's greedy placement
(:func:`online_replicas`: one candidate expert at a time, on a boolean host matrix). :func:`plan_on` and
:func:`plan` are a policy's ``plan_on`` and ``plan`` made with them (LRMoE, online replication and the trimmed
controls; any other policy's own methods). Not for production use: the policies' methods give the same plans faster.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from lrmoe.checks import apportion_array, apportion_rows_array, check_fraction, long_array
from lrmoe.planner.online import Online, home_placement, push_sources
from lrmoe.planner.placement import ReplicaTable, replica_table
from lrmoe.planner.plan import LayerPlan
from lrmoe.planner.policies import LRMoE, Trimmed, _placements
from lrmoe.planner.quotas import _expert_floor, budget_caps, over_cap
from lrmoe.planner.replica_routing import (_balance_units, _check_hosted, _route_even, _split_units, backward_on,
                                           check_counts)


def forward_on(counts_NE: Tensor, table: ReplicaTable, mode: str, iters: int = 8) -> Tensor:
    """:func:`lrmoe.planner.replica_routing.forward_on` with the previous balanced fill."""
    _check_hosted(counts_NE.sum(0), table)
    if mode == "even":
        return _route_even(counts_NE, table)
    counts = counts_NE.numpy()
    expert_U, rank_U, slots_U = table.expert_U.numpy(), table.rank_U.numpy(), table.slots_U.numpy()
    pairs_U = _balance_units(counts.sum(0), expert_U, rank_U, slots_U, table.replicas_E.numpy(), table.num_ranks,
                             iters)
    room_R = _split_units(pairs_U, table.unit_G[table.hosted_R].numpy(), slots_U)
    return torch.from_numpy(fill_local_first(counts, table, room_R))


def fill_local_first(counts_NE: np.ndarray, table: ReplicaTable, room_R: np.ndarray) -> np.ndarray:
    """fwd_NG from per-slot totals: each source fills its own rank's slots of e first (in slot order), then the
    remaining demand meets the remaining slot room in (expert, source) × (expert, slot) order, north-west
    corner rule, computed for all experts at once from two cumulative sums. Experts with one slot skip it."""
    N, E = counts_NE.shape
    G = table.expert_G.numel()
    hosted_R, replicas_E = table.hosted_R.numpy(), table.replicas_E.numpy()
    fwd_NG = np.zeros((N, G), dtype=np.int64)
    single_E = replicas_E == 1
    if single_E.any():
        fwd_NG[:, hosted_R[table.start_E.numpy()[single_E]]] = counts_NE[:, single_E]
    multi_E = replicas_E > 1
    if not multi_E.any():
        return fwd_NG
    expert_R = table.expert_G.numpy()[hosted_R]
    multi_R = multi_E[expert_R]
    hosted_R, e_R, room_R = hosted_R[multi_R], expert_R[multi_R], room_R[multi_R]
    rank_R = hosted_R // table.slots_per_rank
    unit_R = table.unit_G.numpy()[hosted_R]
    # room before each slot inside its unit (a unit is a run of hosted_R)
    first_R = np.ones(len(unit_R), dtype=bool)
    first_R[1:] = unit_R[1:] != unit_R[:-1]
    before_R = np.cumsum(room_R) - room_R
    before_R -= before_R[first_R][np.cumsum(first_R) - 1]
    local_R = np.minimum(np.maximum(counts_NE[rank_R, e_R] - before_R, 0), room_R)
    fwd_NG[rank_R, hosted_R] = local_R
    row_E = np.cumsum(multi_E) - 1  # row of each multi-replica expert in the demand matrix
    demand = counts_NE[:, multi_E].T.ravel()  # expert-major (expert, source)
    demand = demand - np.bincount(row_E[e_R] * N + rank_R, weights=local_R, minlength=len(demand)).astype(np.int64)
    room_R = room_R - local_R
    # north-west corner: both sequences are expert-major and sum to the same total per expert
    demand_cum, room_cum = np.cumsum(demand), np.cumsum(room_R)
    cuts = np.sort(np.concatenate([demand_cum, room_cum]))
    starts = np.concatenate([[0], cuts[:-1]])
    piece = cuts > starts
    starts, length = starts[piece], (cuts - starts)[piece]
    src = np.searchsorted(demand_cum, starts, side="right") % N
    slot = hosted_R[np.searchsorted(room_cum, starts, side="right")]
    fwd_NG.ravel()[src * G + slot] += length  # (source, slot) pieces are distinct
    return fwd_NG


def retention_quotas(fwd_NG: Tensor, expert_G: Tensor, cap_N: Tensor, gamma: float,
                     bwd_flows_V4: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`lrmoe.planner.quotas.retention_quotas` as it was (same arguments, same result)."""
    gamma = check_fraction("gamma", gamma, 1.0)
    flows = None if bwd_flows_V4 is None or not len(bwd_flows_V4) else long_array(bwd_flows_V4)
    keep, excess = _retention_quotas(long_array(fwd_NG), long_array(expert_G), long_array(cap_N), gamma, flows)
    return torch.from_numpy(keep), torch.from_numpy(excess)


def _retention_quotas(fwd_NG: np.ndarray, expert_G: np.ndarray, cap_N: np.ndarray, gamma: float,
                      flows_V4: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    N, G = fwd_NG.shape
    S = G // N
    stay_NG, excess_N = over_cap(fwd_NG, cap_N, flows_V4)
    over = np.flatnonzero(excess_N)
    if not len(over):
        return fwd_NG.copy(), np.zeros(N, dtype=np.int64)
    hosted_G = expert_G >= 0
    E = int(expert_G.max()) + 1 if hosted_G.any() else 0
    # trimmable groups: [over-cap rank, its S slots × N sources], slot-major (empty slots hold 0 pairs)
    stay_RK = np.ascontiguousarray(stay_NG.T).reshape(N, S * N)[over]
    slots_X = (over[:, None] * S + np.arange(S)).ravel()  # the slots of those rows, in order
    stay_XN = stay_RK.reshape(-1, N)
    e_X = expert_G[slots_X]
    # floor: what each expert still needs beyond its sure pairs, reserved over its trimmable groups
    fwd_E = np.bincount(expert_G[hosted_G], weights=fwd_NG.sum(0)[hosted_G], minlength=E).astype(np.int64)
    stay_X = stay_XN.sum(1)
    hosted_X = e_X >= 0
    sure_E = fwd_E - np.bincount(e_X[hosted_X], weights=stay_X[hosted_X], minlength=E).astype(np.int64)
    floor_E = _expert_floor(fwd_E, gamma)
    # first try: trim each over-cap rank in proportion to its groups' staying pairs
    cut_R = np.minimum(excess_N[over], stay_RK.sum(1))
    cut_RK = apportion_rows_array(cut_R, stay_RK)
    kept_X = stay_X - cut_RK.reshape(-1, N).sum(1)
    if (sure_E + np.bincount(e_X[hosted_X], weights=kept_X[hosted_X], minlength=E) < floor_E).any():
        # an expert fell below its floor: reserve what each expert needs beyond its sure pairs and trim only
        # what its groups hold above their reservation
        reserve_E = np.maximum(floor_E - sure_E, 0)
        reserve_X = np.zeros_like(stay_X)
        reserve_X[hosted_X] = apportion_array(reserve_E, stay_X[hosted_X], e_X[hosted_X])
        spare_RK = stay_RK - apportion_rows_array(reserve_X, stay_XN).reshape(stay_RK.shape)
        cut_R = np.minimum(excess_N[over], spare_RK.sum(1))
        cut_RK = apportion_rows_array(cut_R, spare_RK)
    keep_GN = fwd_NG.T.copy()
    keep_GN[slots_X] -= cut_RK.reshape(-1, N)
    floor_excess_N = excess_N.copy()
    floor_excess_N[over] -= cut_R
    return np.ascontiguousarray(keep_GN.T), floor_excess_N


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
    hosts_NE = np.zeros((N, E), dtype=bool)
    hosts_NE[home_E, np.arange(E)] = True
    replicas_E = np.ones(E)
    free_N = np.full(N, spare_slots)
    while free_N.any():
        share_E = counts / replicas_E
        load_N = hosts_NE @ share_E
        h = int(np.argmax(load_N))
        placed = False
        mine = np.flatnonzero(hosts_NE[h] & (counts > 0))
        for e in mine[np.lexsort((mine, -share_E[mine]))]:  # hottest per replica first, then lowest id
            ok_N = (node_N == node_N[home_E[e]]) & (free_N > 0) & ~hosts_NE[:, e]
            if not ok_N.any():
                continue
            m = int(np.argmin(np.where(ok_N, load_N, np.inf)))
            new_share = counts[e] / (replicas_E[e] + 1)  # every host of e, the new one too, computes this much
            saving = load_N[h] - max(load_N[h] - share_E[e] + new_share, load_N[m] + new_share)
            if saving > push_cost_rows:
                placement[m, base + spare_slots - free_N[m]] = int(e)
                hosts_NE[m, e], free_N[m] = True, free_N[m] - 1
                replicas_E[e] += 1
                placed = True
                break
        if not placed:
            break
    return placement


def plan_on(policy, counts_NE: Tensor, placement_NS: Tensor, next_placement_NS: Tensor | None = None) -> LayerPlan:
    """``policy.plan_on(counts_NE, placement_NS, next_placement_NS)`` made with the routines above."""
    if isinstance(policy, Trimmed):
        plan = plan_on(policy.policy, counts_NE, placement_NS, next_placement_NS)
        if len(plan.bwd_flows_V4) or not torch.equal(plan.keep_NG, plan.fwd_NG):
            return policy.plan_on(counts_NE, placement_NS, next_placement_NS)  # raises as the policy does
        cap_N = budget_caps(plan.fwd_load_N, policy.rho)
        keep_NG, floor_excess_N = retention_quotas(plan.fwd_NG, plan.slot_expert_G, cap_N, policy.gamma)
        return dataclasses.replace(plan, keep_NG=keep_NG, floor_excess_N=floor_excess_N, bwd_cap_N=cap_N,
                                   policy=policy.name)
    if isinstance(policy, Online):
        counts_NE = check_counts(counts_NE)
        N, E = counts_NE.shape
        policy._check_ranks(E, N)
        if tuple(placement_NS.shape) != (N, E // N + policy.spare_slots):
            return policy.plan_on(counts_NE, placement_NS, next_placement_NS)  # raises as the policy does
        placed_NS = online_replicas(counts_NE.sum(0), N, policy.spare_slots, policy.ranks_per_node,
                                    policy.push_cost_rows)
        fwd_NG = forward_on(counts_NE, replica_table(placed_NS, E), policy.forward, policy.balance_iters)
        nxt = placement_NS if next_placement_NS is None else next_placement_NS
        return LayerPlan.dropless(placed_NS, fwd_NG, E, policy=policy.name, next_placement_NS=nxt,
                                  push_src_G=push_sources(placed_NS, placement_NS))
    if not isinstance(policy, LRMoE):
        return policy.plan_on(counts_NE, placement_NS, next_placement_NS)
    counts_NE = check_counts(counts_NE)
    N, E = counts_NE.shape
    table = replica_table(placement_NS, E)
    fwd_NG = forward_on(counts_NE, table, policy.forward, policy.balance_iters)
    plan = LayerPlan.dropless(placement_NS, fwd_NG, E, policy=policy.name, next_placement_NS=next_placement_NS)
    if not (policy.quotas or policy.backward_routing):
        return plan
    cap_N = policy.caps(plan.fwd_load_N, placement_NS.shape[1], fwd_NG.sum(1))
    flows_V4 = backward_on(fwd_NG, table, cap_N, policy.backward_rounds) if policy.backward_routing else \
        plan.bwd_flows_V4
    if policy.quotas:
        keep_NG, floor_excess_N = retention_quotas(fwd_NG, placement_NS.reshape(-1), cap_N, policy.gamma, flows_V4)
    else:
        keep_NG, floor_excess_N = fwd_NG.clone(), torch.zeros(N, dtype=torch.long)
    return dataclasses.replace(plan, keep_NG=keep_NG, bwd_flows_V4=flows_V4, floor_excess_N=floor_excess_N,
                               bwd_cap_N=cap_N)


def plan(policy, counts_NE: Tensor, prev_counts_E: Tensor | None = None) -> LayerPlan:
    """``policy.plan(counts_NE, prev_counts_E)`` made with the routines above: the two placements and
    :func:`plan_on` (online replication, bare or trimmed: on its home placement)."""
    counts_NE = check_counts(counts_NE)
    inner = policy.policy if isinstance(policy, Trimmed) else policy
    if isinstance(inner, Online):
        N, E = counts_NE.shape
        inner._check_ranks(E, N)
        return plan_on(policy, counts_NE, home_placement(E, N, inner.spare_slots))
    if not hasattr(policy, "plan_on"):
        return policy.plan(counts_NE, prev_counts_E)
    return plan_on(policy, counts_NE, *_placements(policy, counts_NE, prev_counts_E))
