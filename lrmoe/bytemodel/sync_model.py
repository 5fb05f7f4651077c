"""The byte model of the replica substrate's optimizer step (DESIGN.md §3.4-3.5): who sends how many bytes to
whom in the replica-gradient sync, the gradient collection and the weight redistribution, for both
replica-gradient modes.

Pure: placements in, integer byte matrices out; no ``torch.distributed``. The same functions serve the layer's
accounting (:func:`lrmoe.runtime.distributed.accounting.expected_step`, checked against the counted bytes every
iteration) and the cost model (:meth:`lrmoe.sim.cost.CostModel._sync`, which only turns them into time).

Notation: N ranks, E experts, P parameters per expert, split into N contiguous optimizer shards (``shard_q``
elements owned by rank q, the first P mod N one longer); b_g bytes per gradient element, b_w per weight element
(both the slots' dtype in the layer). H_n: the distinct experts rank n hosts, X_m: those rank m hosts in the
*next* placement. Bytes are those that leave (or reach) a rank: its exchange with itself is a copy and costs zero.

Replica-gradient modes (one switch, ``replica_grad``, for every system):

* ``"range"`` (SYMI's): every rank of e's all-reduce group (``groups="range"``: the consecutive rank range
  [lo_e, hi_e] its hosts span, as the layer runs it; ``"hosts"``: only the hosts, a variant the cost model
  offers) all-reduces the sum of its local slots of e. The all-reduce is a direct reduce-scatter (member i gets
  chunk i of every member's vector, chunks as :func:`shard_sizes` of P over the h_e members) and an all-gather of
  the reduced chunks, so member i sends and receives (P + (h_e − 2)·c_i)·b_g: 2·(h_e − 1)/h_e of the gradient when
  h_e divides P, the ring all-reduce's figure. Then rank q takes shard q of e from a group member (itself if it is
  one, else the members in round-robin: the i-th rank outside the group asks member i mod h_e).
* ``"shard"`` (ours): host n sends shard q of its local sum of e straight to owner q ≠ n, for all of H_n at once:
  n → q carries |H_n|·shard_q·b_g. No groups, no collection: per host and hosted class (N − 1)/N of the gradient,
  wherever the other replicas sit.

Redistribution (both modes): owner q sends its updated shard of each expert to every other rank hosting it next,
q → m carries shard_q·|X_m|·b_w.

Local memory traffic (the host-side passes around each exchange, as the store runs them: bytes read + written per
rank; the cost model prices them at memory bandwidth, the counters do not count them). k_ne: the slots of e on n;
a = max(b_g, 4) (the sums run in at least fp32); c_n: rank n's shard; S'_n the occupied slots of the next placement:

* the local sum of a hosted class (both modes): nothing for one slot (its gradient is the sum); for k > 1 slots,
  gathered (2k·P·b_g), widened to fp32 when b_g < 4 (k·P·(b_g + 4)), summed (k·P·a + P·a) and narrowed back when
  b_g < 4 (P·(4 + b_g));
* replica sync, ``range``: the local sums (a member of a range that hosts nothing writes zeros, P·b_g), then per
  multi-member group the fold of the chunks and the all-gather's repeat, ≈ 4·P·b_g;
  ``shard``: the local sums, each written straight into the owner-major send buffer (2·|H_n|·P·b_g);
* gradient collection, ``range``: the served slices gathered (2 × sent), the received copied in (received), the
  [E, c_n] fp32 shards zeroed, filled and scaled (16·E·c_n); ``shard``: every received part widened when b_g < 4,
  masked and put in place by index (R_n·c_n·16, R_n the parts: Σ_q |H_q|; a class's later hosts add in place, a few
  passes more, not counted) and the shards zeroed and scaled (12·E·c_n);
* redistribution: the sent shards gathered (2 × sent), the received placed (2 × received), the own shard cast
  (2·|X_n|·c_n·b_w), the full weights copied into the slots (2·S'_n·P·b_w).

Weight push (online replication, :mod:`lrmoe.planner.online`; before the expert compute, not in the optimizer step): a
plan's
``push_src_G`` fills empty slots with copies of resident ones. Rank q sends rank m ≠ q each distinct expert that
m's pushed slots take from q's slots once, whole: q → m carries |{e pushed from q to m}|·P·b_w. A push from a slot
of the same rank is a local copy (zero bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.checks import check_placement
from lrmoe.config import REPLICA_GRAD_MODES  # defined with the presets, so a parser names the modes without torch

SYNC_GROUPS = ("range", "hosts")


def check_replica_grad(mode: str) -> str:
    """``mode`` if it is a replica-gradient mode, else ``ValueError``."""
    if mode not in REPLICA_GRAD_MODES:
        raise ValueError(f"replica_grad={mode!r} is not one of {REPLICA_GRAD_MODES}")
    return mode


# -- shards and placements -------------------------------------------------------------------------------------
def shard_sizes(numel: int, num_ranks: int) -> list[int]:
    """Sizes of the N contiguous shards of a flat vector of ``numel`` elements (as ``torch.tensor_split``)."""
    if numel < 0 or num_ranks < 1:
        raise ValueError(f"shard_sizes: need numel >= 0 and num_ranks >= 1, got {numel}, {num_ranks}")
    base, extra = divmod(numel, num_ranks)
    return [base + (1 if r < extra else 0) for r in range(num_ranks)]


def shard_bounds(numel: int, num_ranks: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each rank's shard."""
    sizes = shard_sizes(numel, num_ranks)
    starts = [sum(sizes[:r]) for r in range(num_ranks)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def hosted_experts(placement_NS: torch.Tensor, rank: int) -> list[int]:
    """The distinct experts hosted by ``rank``, ascending."""
    return sorted(int(e) for e in placement_NS[rank].unique().tolist() if e >= 0)


def hosts_mask(placement_NS: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool [N, E]: rank n hosts at least one slot of expert e."""
    n = placement_NS.shape[0]
    hosts_NE = torch.zeros(n, num_experts + 1, dtype=torch.bool)
    hosts_NE.scatter_(1, torch.where(placement_NS >= 0, placement_NS, num_experts).cpu(), True)
    return hosts_NE[:, :num_experts]


# -- range mode: groups and sources ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SyncPlan:
    """Who all-reduces and who serves each expert's gradient in ``range`` mode, for one placement.

    span_E2[e] = (lo, hi): the consecutive rank range spanned by e's hosts (-1, -1 if e is hosted nowhere).
    group_NE[n, e]: rank n is a member of e's all-reduce group (holds e's reduced gradient afterwards; a
    one-member group runs no collective). source_NE[n, e]: the rank rank n takes shard n of e's gradient from
    (n itself when it is a member; -1 when e is hosted nowhere: its gradient is zero).
    """

    span_E2: torch.Tensor  # long [E, 2]
    source_NE: torch.Tensor  # long [N, E]
    group_NE: torch.Tensor  # bool [N, E]



def sync_plan(placement_NS: torch.Tensor, num_experts: int, groups: str = "range") -> SyncPlan:
    """The :class:`SyncPlan` of a placement (pure; identical on every rank). ``groups="range"``: e's group is
    the range [lo_e, hi_e] (what the layer runs); ``"hosts"``: only e's hosts."""
    if groups not in SYNC_GROUPS:
        raise ValueError(f"groups={groups!r} is not one of {SYNC_GROUPS}")
    n = placement_NS.shape[0]
    check_placement(placement_NS, num_experts, n)
    e = num_experts
    hosts_NE = hosts_mask(placement_NS, e)
    rank_N = torch.arange(n)
    hosted_E = hosts_NE.any(0)
    lo_E = torch.where(hosts_NE, rank_N[:, None], n).min(0).values
    hi_E = torch.where(hosts_NE, rank_N[:, None], -1).max(0).values
    span_E2 = torch.where(hosted_E[:, None], torch.stack([lo_E, hi_E], 1), -1)
    if groups == "range":
        group_NE = (rank_N[:, None] >= lo_E) & (rank_N[:, None] <= hi_E) & hosted_E
    else:
        group_NE = hosts_NE
    h_E = group_NE.sum(0)
    members_NE = torch.where(group_NE, rank_N[:, None], n).sort(dim=0).values  # member i of e: row i
    outside_NE = ~group_NE & hosted_E
    idx_NE = ((~group_NE).long().cumsum(0) - 1).clamp(min=0)  # index of each outside rank among the outside ranks
    src_NE = members_NE.gather(0, idx_NE % h_E.clamp(min=1))
    source_NE = torch.where(group_NE, rank_N[:, None], torch.where(outside_NE, src_NE, -1))
    return SyncPlan(span_E2=span_E2, source_NE=source_NE, group_NE=group_NE)


def ring_allreduce_bytes(payload_bytes: int, group_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``payload_bytes`` over ``group_size`` ranks:
    2·(h-1)/h of the payload (reduce-scatter then all-gather). The textbook figure; :func:`allreduce_bytes` is
    the exact count of the layer's all-reduce, equal to it when h divides the vector."""
    return 0 if group_size <= 1 else 2 * (group_size - 1) * payload_bytes // group_size


def allreduce_bytes(numel: int, group_size: int, index: int, elem_bytes: int) -> int:
    """Bytes member ``index`` sends (and receives) in the layer's all-reduce of ``numel`` elements over
    ``group_size`` members: a direct reduce-scatter (it sends every other member its chunk, receives its own
    chunk from each) then an all-gather of the reduced chunks: (numel + (h − 2)·c_index)·b."""
    if group_size <= 1:
        return 0
    return (numel + (group_size - 2) * shard_sizes(numel, group_size)[index]) * elem_bytes


# -- the bytes of one step -------------------------------------------------------------------------------------
def _off_diagonal(x_NN: torch.Tensor) -> torch.Tensor:
    return x_NN - torch.diag(torch.diag(x_NN))


@dataclass(frozen=True)
class StepBytes:
    """Bytes of one optimizer step, per rank pair (long; diagonals zero). ``allreduce_NE[n, e]``: bytes rank n
    sends and receives in e's group all-reduce (``range`` mode; its members ``group_NE``, groups of one member
    left out). ``sync_NM[n, m]``: bytes n sends m in the ``shard`` mode exchange. ``collect_NM``: gradient
    collection (``range`` mode). ``redistribute_NM``: weight redistribution (both modes)."""

    replica_grad: str
    allreduce_NE: torch.Tensor  # long [N, E]
    group_NE: torch.Tensor  # bool [N, E]
    sync_NM: torch.Tensor  # long [N, N]
    collect_NM: torch.Tensor  # long [N, N]
    redistribute_NM: torch.Tensor  # long [N, N]
    local_N3: torch.Tensor  # long [N, 3]: local memory traffic of replica_sync, grad_collect, redistribute

    def per_rank(self) -> dict[str, torch.Tensor]:
        """``<phase>.sent_bytes`` / ``.recv_bytes`` ([N] each) of ``replica_sync``, ``grad_collect`` and
        ``redistribute``: the accounting's keys."""
        ring_N = self.allreduce_NE.sum(1)
        return {"replica_sync.sent_bytes": ring_N + self.sync_NM.sum(1),
                "replica_sync.recv_bytes": ring_N + self.sync_NM.sum(0),
                "grad_collect.sent_bytes": self.collect_NM.sum(1),
                "grad_collect.recv_bytes": self.collect_NM.sum(0),
                "redistribute.sent_bytes": self.redistribute_NM.sum(1),
                "redistribute.recv_bytes": self.redistribute_NM.sum(0)}


def step_bytes(placement_NS: torch.Tensor, next_placement_NS: torch.Tensor, num_experts: int,
               params_per_expert: int, grad_bytes: int, weight_bytes: int | None = None,
               replica_grad: str = "range", groups: str = "range") -> StepBytes:
    """The :class:`StepBytes` of one optimizer step from ``placement_NS`` (whose slots hold the gradients) into
    ``next_placement_NS``. ``weight_bytes`` defaults to ``grad_bytes``; ``groups`` applies to ``range`` mode."""
    check_replica_grad(replica_grad)
    n = placement_NS.shape[0]
    e, p = num_experts, int(params_per_expert)
    check_placement(next_placement_NS, e, n, "next_placement_NS")
    weight_bytes = grad_bytes if weight_bytes is None else weight_bytes
    shard_N = torch.tensor(shard_sizes(p, n), dtype=torch.long)
    hosts_NE = hosts_mask(placement_NS, e)
    zeros_NN = torch.zeros(n, n, dtype=torch.long)
    if replica_grad == "range":
        plan = sync_plan(placement_NS, e, groups)
        group_NE = plan.group_NE & (plan.group_NE.sum(0) > 1)  # a one-member group runs no collective
        h_NE = group_NE.sum(0).expand(n, e)
        index_NE = group_NE.long().cumsum(0) - 1  # position among the members
        hc_NE = h_NE.clamp(min=1)
        chunk_NE = p // hc_NE + (index_NE < p % hc_NE).long()  # member i's chunk: shard_sizes(P, h)[i]
        allreduce_NE = torch.where(group_NE, (p + (h_NE - 2) * chunk_NE) * grad_bytes, 0)
        src_NE = plan.source_NE
        remote_NE = (src_NE >= 0) & (src_NE != torch.arange(n)[:, None])  # rank q fetches e's shard elsewhere
        dst_NE = torch.arange(n)[:, None].expand(n, e)
        collect_NM = torch.zeros(n * n, dtype=torch.long).index_add_(
            0, (src_NE * n + dst_NE)[remote_NE], (shard_N[:, None] * grad_bytes).expand(n, e)[remote_NE]).view(n, n)
        sync_NM = zeros_NN
    else:
        group_NE = torch.zeros(n, e, dtype=torch.bool)
        allreduce_NE = torch.zeros(n, e, dtype=torch.long)
        sync_NM = _off_diagonal(hosts_NE.sum(1)[:, None] * shard_N[None, :] * grad_bytes)
        collect_NM = zeros_NN
    distinct_next_N = hosts_mask(next_placement_NS, e).sum(1)
    redistribute_NM = _off_diagonal(shard_N[:, None] * distinct_next_N[None, :] * weight_bytes)
    local_N3 = local_bytes(placement_NS, next_placement_NS, e, p, grad_bytes, weight_bytes, replica_grad,
                           group_NE, collect_NM, redistribute_NM)
    return StepBytes(replica_grad=replica_grad, allreduce_NE=allreduce_NE, group_NE=group_NE, sync_NM=sync_NM,
                     collect_NM=collect_NM, redistribute_NM=redistribute_NM, local_N3=local_N3)


LOCAL_PHASES = ("replica_sync", "grad_collect", "redistribute")  # the columns of StepBytes.local_N3


def local_bytes(placement_NS: torch.Tensor, next_placement_NS: torch.Tensor, num_experts: int, params: int,
                grad_bytes: int, weight_bytes: int, replica_grad: str, group_NE: torch.Tensor,
                collect_NM: torch.Tensor, redistribute_NM: torch.Tensor) -> torch.Tensor:
    """[N, 3] long: each rank's local memory traffic (bytes read + written) in the optimizer step's three exchange
    phases (:data:`LOCAL_PHASES`), by the rules of the module doc."""
    n, e, p, bg, bw = placement_NS.shape[0], num_experts, int(params), int(grad_bytes), int(weight_bytes)
    shard_N = torch.tensor(shard_sizes(p, n), dtype=torch.long)
    acc = max(bg, 4)
    widen = bg < 4
    k_NE = torch.zeros(n, e, dtype=torch.long).scatter_add_(  # slots of each class per rank
        1, placement_NS.clamp(min=0), (placement_NS >= 0).long())
    hosts_NE = k_NE > 0
    hosted_N = hosts_NE.sum(1)
    multi_NE = k_NE > 1
    summed_slots_N, summed_N = (k_NE * multi_NE).sum(1), multi_NE.sum(1)
    sums_N = p * (summed_slots_N * (2 * bg + acc + widen * (bg + 4)) + summed_N * (acc + widen * (4 + bg)))
    if replica_grad == "range":
        idle_N = (group_NE & ~hosts_NE).sum(1)  # members of a range that host nothing write zeros
        sync_N = sums_N + idle_N * p * bg + 4 * group_NE.sum(1) * p * bg
        sent_N, recv_N = collect_NM.sum(1), collect_NM.sum(0)
        collect_N = 2 * sent_N + recv_N + 16 * e * shard_N
    else:
        sync_N = sums_N + 2 * hosted_N * p * bg
        parts = int(hosted_N.sum())  # owner q folds shard q of every host's every hosted class
        collect_N = parts * shard_N * (16 + widen * (bg + 4)) + 12 * e * shard_N
    next_slots_N, next_hosted_N = (next_placement_NS >= 0).sum(1), hosts_mask(next_placement_NS, e).sum(1)
    redistribute_N = (2 * redistribute_NM.sum(1) + 2 * redistribute_NM.sum(0) + 2 * next_hosted_N * shard_N * bw
                      + 2 * next_slots_N * p * bw)
    return torch.stack([sync_N, collect_N, redistribute_N], dim=1)


# -- the weight push of online replication -----------------------------------------------------------------------
def push_rows(placement_NS: torch.Tensor, push_src_G: torch.Tensor | None) -> torch.Tensor:
    """long [X, 3] rows (source rank, destination rank, expert): the messages of a weight push, one per distinct
    expert a rank sends another, sorted; pushes within one rank are local copies and have no row."""
    if push_src_G is None:
        return torch.zeros(0, 3, dtype=torch.long)
    s = placement_NS.shape[1]
    g = torch.arange(placement_NS.numel())
    pushed = push_src_G >= 0
    src, dst = push_src_G[pushed] // s, g[pushed] // s
    rows = torch.stack([src, dst, placement_NS.reshape(-1)[pushed]], 1)
    rows = rows[src != dst]
    return torch.unique(rows, dim=0) if len(rows) else rows


def push_bytes(placement_NS: torch.Tensor, push_src_G: torch.Tensor | None, params_per_expert: int,
               weight_bytes: int) -> torch.Tensor:
    """long [N, N] bytes rank n sends rank m in the weight push of a plan (``placement_NS`` the plan's, after the
    push): one whole expert, P·b_w, per row of :func:`push_rows`."""
    n = placement_NS.shape[0]
    rows = push_rows(placement_NS, push_src_G)
    out = torch.zeros(n * n, dtype=torch.long)
    out.index_add_(0, rows[:, 0] * n + rows[:, 1], torch.full((len(rows),), int(params_per_expert) * weight_bytes))
    return out.view(n, n)
