"""The replica substrate (DESIGN.md §3, shared by SYMI and LRMoE): expert weights in slots, replica gradient
sync, a statically sharded Adam, and redistribution of the updated weights into the next placement.

The N ranks are those of one expert-parallel (EP) group (:class:`RangeGroups`; the world by default). Every rank
has S slots; slot j of rank n holds the weights of expert ``placement_NS[n, j]`` (-1: empty). One
expert's parameters are handled as one flat vector of P = 3·D·F numbers, laid out ``[gate (D·F) | up (D·F) |
down (F·D)]``, and split into N contiguous shards (the first P mod N shards one element longer); rank n owns shard
n of every expert: its fp32 master weights and Adam moments, for the whole run, whatever the placement.

One optimizer step (:meth:`ReplicaStore.step`), with the replica-gradient path chosen by ``replica_grad``
(DESIGN.md §3.4; both modes give bit-identical fp32 results):

1. **replica sync**: each rank sums the gradients of its local slots of an expert (in fp32, sent in the slots'
   dtype). Then, in ``"range"`` mode (SYMI's), the ranks of the consecutive range spanned by the expert's hosts
   all-reduce that sum inside the EP group (no process group per range: a group per range would make N(N-1)/2 of
   them; a single-rank range needs no exchange), every expert's in the same two exchanges. Ranks inside
   the range that host nothing join with zeros (correct, costs bytes; SYMI's contiguous placements never need it).
   In ``"shard"`` mode (ours) each host sends shard q of each of its sums straight to rank q, the shard's
   optimizer owner, for all hosted experts in one variable all-to-all; no groups;
2. **gradient collection**: rank n ends with shard n of every expert's summed gradient. ``"range"``: it takes it
   from a rank that holds the reduced gradient: itself when it can, else the holders in round-robin (the i-th
   rank needing it asks holder i mod h). ``"shard"``: it adds what the hosts sent. The shard is multiplied by a
   placement-independent ``grad_scale`` (never by the replica count). With data parallelism over several EP
   groups (:mod:`lrmoe.runtime.distributed.mesh`), the shard is first summed over the DP group: rank n of every
   EP group owns the same shard, so this holds whatever each EP group's placement;
3. **Adam** on the fp32 shards, element for element the update of ``torch.optim.Adam`` over the full parameters;
4. **redistribution**: rank n sends its updated shard (in the slots' dtype) of each expert to every other rank
   that hosts the expert in the *next* placement, every pair of ranks in one exchange; each rank assembles the full
   experts and copies them into its slots (several slots of one expert on one rank cost one transfer).

**One summation order.** Every expert's gradient is the fp32 left fold of its hosts' local sums in ascending rank
order (``((g_h0 + g_h1) + g_h2) + ...``, each g cast to the slots' dtype as sent). The range all-reduce is
therefore a direct reduce-scatter (member i sums chunk i of every member's vector in that order) and an
all-gather, not the backend's all-reduce, whose order is its own; the shard owner folds in the same order. So the
two modes agree bit for bit in fp32. (In a lower slot dtype the range mode rounds the reduced gradient to it for
the all-gather, the shard mode keeps the fp32 sum: they differ by that one rounding.)

Online replication (:mod:`lrmoe.planner.online`) adds a step 0 before the forward, :meth:`ReplicaStore.push`: copies of
resident slots fill empty ones (the plan's ``push_src_G``), the replicas' gradients join steps 1-2 like any other,
and the redistribution into a next placement without them empties them again. With several micro-batches per
step, each pushes its own replicas: :meth:`ReplicaStore.unpush` first empties the previous micro-batch's, adding
their slots' gradients to a per-expert sum that the rank's local sum of step 1 includes; the ranks that held a
replica of an expert at any micro-batch of the step are its hosts in steps 1-2.

The gradient is scaled by the ``grad_scale`` given, 1 by default: this substrate has no convention of its own
(the layer's methods default to the mean loss over ranks and micro-batches, :mod:`lrmoe.runtime.layer`).

The pure helpers (who talks to whom, and how many bytes) live in :mod:`lrmoe.bytemodel.sync_model` and are re-exported
here;
the accounting (:mod:`lrmoe.runtime.distributed.accounting`) and the cost model take their bytes from there.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lrmoe.checks import check_placement
from lrmoe.bytemodel.sync_model import (SyncPlan, check_replica_grad, hosted_experts, hosts_mask,
                                        push_rows, ring_allreduce_bytes, shard_bounds, shard_sizes, sync_plan)
from lrmoe.runtime.distributed.comm import all_to_all_rows, exchange_flat

__all__ = ["AdamConfig", "RangeGroups", "ReplicaStore", "SyncPlan", "adam_update_", "check_placement",
           "flatten_experts", "hosted_experts", "ring_allreduce_bytes", "shard_bounds", "shard_sizes", "sync_plan",
           "unflatten_experts"]


# -- Adam ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdamConfig:
    """Hyper-parameters of ``torch.optim.Adam`` (``weight_decay`` added to the gradient, L2, as torch's Adam does)
    or, with ``decoupled``, of ``torch.optim.AdamW`` (the weights shrunk by lr · weight_decay before the update)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False  # AdamW's decoupled weight decay instead of Adam's L2 term

    def __post_init__(self) -> None:
        if not self.lr >= 0:  # 0 as torch's Adam allows it: a warm-up schedule's first step
            raise ValueError(f"AdamConfig.lr must be non-negative, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"AdamConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"AdamConfig.eps must be positive, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"AdamConfig.weight_decay must be non-negative, got {self.weight_decay}")


def adam_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: int, cfg: AdamConfig) -> None:
    """One in-place Adam (or AdamW, ``cfg.decoupled``) update at ``step`` (1-based), the arithmetic of torch's
    single-tensor Adam. Elementwise, so applying it shard by shard gives exactly the update of the full tensor."""
    if cfg.weight_decay and cfg.decoupled:
        param.mul_(1 - cfg.lr * cfg.weight_decay)
    elif cfg.weight_decay:
        grad = grad.add(param, alpha=cfg.weight_decay)
    exp_avg.lerp_(grad, 1 - cfg.beta1)
    exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
    bias_correction1 = 1 - cfg.beta1**step
    bias_correction2_sqrt = (1 - cfg.beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-cfg.lr / bias_correction1)


def owner_runs(bounds: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(vector start, vector end, owners) of each run of consecutive non-empty shards of equal width (the first
    P mod N shards are one longer than the rest): the strided copies :func:`pack_owner_major_` makes."""
    runs, q = [], 0
    while q < len(bounds):
        width, q1 = bounds[q][1] - bounds[q][0], q + 1
        while q1 < len(bounds) and bounds[q1][1] - bounds[q1][0] == width:
            q1 += 1
        if width:
            runs.append((bounds[q][0], bounds[q1 - 1][1], q1 - q))
        q = q1
    return runs


def pack_owner_major_(send: torch.Tensor, src: torch.Tensor, h: int, num_h: int,
                      runs: list[tuple[int, int, int]]) -> None:
    """Write ``src`` (one class's summed gradient, [P]) as class ``h`` of ``num_h`` into the owner-major send buffer
    ``send`` ([owner q: num_h × shard_q], flat): one strided copy per run of equal-width shards."""
    for a, b, owners in runs:
        width = (b - a) // owners
        send[num_h * a:num_h * b].view(owners, num_h, width)[:, h].copy_(src[a:b].view(owners, width))


# -- process groups --------------------------------------------------------------------------------------------
class RangeGroups:
    """The process groups the expert-parallel layers of one model share (one instance for all layers): the
    expert-parallel (EP) group whose ranks hold the experts, slots and optimizer shards (default: the world), and
    the data-parallel (DP) group joining this rank with the ranks that hold the same shards in the other EP groups
    (None: one EP group). :mod:`lrmoe.runtime.distributed.mesh` builds both from a device mesh.

    Range-mode replica sync needs no process group per range: it exchanges inside the EP group
    (DESIGN.md §3.4), so none is created. ``all_ranges=True`` creates the groups of every range of consecutive EP
    ranks [lo, hi], lo < hi, up front (N(N-1)/2 of them; collective over the world, every rank taking part), for
    code that times the backend's own all-reduce over a range (:meth:`get`)."""

    def __init__(self, ep_group=None, dp_group=None, *, all_ranges: bool = False):
        if not dist.is_initialized():
            raise ValueError("RangeGroups needs an initialised default process group")
        self.ep_group, self.dp_group = ep_group, dp_group
        self.world_size = dist.get_world_size(ep_group)  # the EP group's size: the placements' N
        ranks = dist.get_process_group_ranks(dist.group.WORLD if ep_group is None else ep_group)
        self._groups = {}
        if all_ranges:
            if ep_group is not None:
                raise ValueError("all_ranges=True builds the range groups of the world: pass no ep_group")
            for lo in range(self.world_size):
                for hi in range(lo + 1, self.world_size):
                    self._groups[(lo, hi)] = dist.new_group(ranks[lo:hi + 1])

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    def __len__(self) -> int:
        """The range groups created (``all_ranges``)."""
        return len(self._groups)

    def get(self, lo: int, hi: int):
        """The process group of EP ranks [lo, hi] (created by ``all_ranges=True``)."""
        if not 0 <= lo < hi < self.world_size:
            raise ValueError(f"no range group [{lo}, {hi}] in an EP group of {self.world_size} ranks")
        if (lo, hi) not in self._groups:
            raise ValueError(f"range group [{lo}, {hi}] was not created: build RangeGroups(all_ranges=True)")
        return self._groups[(lo, hi)]


# -- the store -------------------------------------------------------------------------------------------------
def flatten_experts(w_gate_EDF: torch.Tensor, w_up_EDF: torch.Tensor, w_down_EFD: torch.Tensor) -> torch.Tensor:
    """[E, P] with P = 3·D·F: each expert's parameters as one flat vector ``[gate | up | down]``."""
    E = w_gate_EDF.shape[0]
    return torch.cat([w_gate_EDF.reshape(E, -1), w_up_EDF.reshape(E, -1), w_down_EFD.reshape(E, -1)], dim=1)


def unflatten_experts(flat_XW: torch.Tensor, hidden: int, ffn: int):
    """Views (w_gate_XDF, w_up_XDF, w_down_XFD) of a flat [X, P] buffer (X experts or slots)."""
    X, DF = flat_XW.shape[0], hidden * ffn
    return (flat_XW[:, :DF].view(X, hidden, ffn), flat_XW[:, DF:2 * DF].view(X, hidden, ffn),
            flat_XW[:, 2 * DF:].view(X, ffn, hidden))


class ReplicaStore(nn.Module):
    """One rank's part of the replica substrate of one MoE layer: its S slots (a parameter [S, P] in the compute
    dtype, whose gradient the layer's backward fills) and its fp32 shard of every expert's master weights and Adam
    moments. ``replica_grad`` picks the replica-gradient path. ``groups`` (the shared :class:`RangeGroups`; None:
    the world is the EP group) names the EP group, whose ranks are this store's N ranks (placement rows, shard
    owners, every exchange), and the DP group over which the collected gradient shards are summed. Construction
    is not collective.
    """

    def __init__(self, w_gate_EDF: torch.Tensor, w_up_EDF: torch.Tensor, w_down_EFD: torch.Tensor,
                 placement_NS: torch.Tensor, groups: RangeGroups | None, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, adam: AdamConfig = AdamConfig(), accountant=None,
                 replica_grad: str = "range"):
        super().__init__()
        if w_gate_EDF.dim() != 3 or w_up_EDF.shape != w_gate_EDF.shape:
            raise ValueError(f"w_gate_EDF and w_up_EDF must both be [E, D, F], got {tuple(w_gate_EDF.shape)} and "
                             f"{tuple(w_up_EDF.shape)}")
        E, D, F = w_gate_EDF.shape
        if tuple(w_down_EFD.shape) != (E, F, D):
            raise ValueError(f"w_down_EFD must be [{E}, {F}, {D}], got {tuple(w_down_EFD.shape)}")
        self.replica_grad = check_replica_grad(replica_grad)
        self.ep_group = None if groups is None else groups.ep_group
        self.dp_group = None if groups is None else groups.dp_group
        self.rank, self.num_ranks = dist.get_rank(self.ep_group), dist.get_world_size(self.ep_group)
        self.dp_size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        check_placement(placement_NS, E, self.num_ranks)
        self.num_experts, self.hidden, self.ffn = E, D, F
        self.numel = 3 * D * F
        self.slots_per_rank = placement_NS.shape[1]
        self.groups, self.adam, self.accountant = groups, adam, accountant
        self.dtype = dtype or w_gate_EDF.dtype
        device = torch.device(device) if device is not None else w_gate_EDF.device
        self.bounds = shard_bounds(self.numel, self.num_ranks)
        lo, hi = self.bounds[self.rank]
        with torch.no_grad():
            if w_gate_EDF.is_meta:  # shapes only (a model built on the meta device): zeros, no whole copy made
                flat_EW = None
                self.register_buffer("master_EW", torch.zeros(E, hi - lo, dtype=torch.float32, device=device))
            else:
                flat_EW = flatten_experts(w_gate_EDF, w_up_EDF, w_down_EFD).to(device)
                self.register_buffer("master_EW", flat_EW[:, lo:hi].to(torch.float32).clone())  # [E, P_n] fp32
            self.register_buffer("exp_avg_EW", torch.zeros_like(self.master_EW))
            self.register_buffer("exp_avg_sq_EW", torch.zeros_like(self.master_EW))
            self.slots_SW = nn.Parameter(torch.zeros(self.slots_per_rank, self.numel, dtype=self.dtype,
                                                     device=device))
            self.placement_NS = placement_NS.clone().cpu()
            for j, e in enumerate(self.placement_NS[self.rank].tolist()):
                if e >= 0 and flat_EW is not None:
                    self.slots_SW[j].copy_(flat_EW[e].to(self.dtype))
        self.adam_steps = 0
        self.resident_NS: torch.Tensor | None = None  # while replicas are pushed: the placement without them
        self.unpushed_grads: dict[int, torch.Tensor] = {}  # e -> gradient of this step's emptied replicas of e
        self.unpushed_hosts_NE: torch.Tensor | None = None  # bool [N, E]: hosts of this step's emptied replicas
        self.grad_shards_EW: torch.Tensor | None = None  # the last collected gradient shards (fp32, scaled)
        self._fresh_shards = False  # whether grad_shards_EW was collected since the last Adam step
        self._reduced: dict[int, torch.Tensor] = {}  # range mode: e -> reduced gradient, between sync and collect
        self._received: list[tuple[list[int], torch.Tensor]] | None = None  # shard mode: per host, its parts
        self._sync_plan: SyncPlan | None = None  # range mode: the plan of the last sync, for its collection

    # -- views -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.slots_SW.device

    @property
    def shard_numel(self) -> int:
        lo, hi = self.bounds[self.rank]
        return hi - lo

    def local_slot_expert(self) -> list[int]:
        return self.placement_NS[self.rank].tolist()

    @property
    def pushed(self) -> bool:
        """Whether some slots hold pushed replicas (online replication) beside the resident placement."""
        return self.resident_NS is not None

    def sync_placement(self) -> torch.Tensor:
        """The placement whose hosts steps 1-2 sum over: the slots' placement, or, after :meth:`unpush` in this
        step, [N, E] with expert e in column e of every rank that held e at some micro-batch."""
        if self.unpushed_hosts_NE is None:
            return self.placement_NS
        hosts_NE = self.unpushed_hosts_NE | hosts_mask(self.placement_NS, self.num_experts)
        return torch.where(hosts_NE, torch.arange(self.num_experts), -1)

    def _phase(self, name: str):
        return self.accountant.phase(name) if self.accountant is not None else nullcontext()

    def _bytes(self, name: str, sent: int, recv: int) -> None:
        if self.accountant is not None:
            self.accountant.add_bytes(name, sent, recv)

    def _exchange(self, phase: str, x: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        """A variable all-to-all of flat ``x`` over the EP group (not differentiable), counting the bytes that
        leave and reach this rank (its own split is a copy)."""
        me = self.rank
        with torch.no_grad():
            out = all_to_all_rows(x, in_splits, out_splits, self.ep_group)
        elem = x.element_size()
        self._bytes(phase, (sum(in_splits) - in_splits[me]) * elem, (sum(out_splits) - out_splits[me]) * elem)
        return out

    def _exchange_peers(self, phase: str, send: dict[int, torch.Tensor],
                        recv_numel: dict[int, int]) -> dict[int, torch.Tensor]:
        """:func:`exchange_flat` inside the EP group (one collective; every rank of the group calls it), counting
        the bytes that leave and reach this rank."""
        got = exchange_flat(send, recv_numel, self.dtype, self.device, self.ep_group)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        self._bytes(phase, sum(b.numel() for b in send.values()) * elem, sum(recv_numel.values()) * elem)
        return got

    def _local_sum(self, e: int) -> torch.Tensor:
        """The sum of this rank's slots of ``e`` (in at least fp32, in slot order), in the slots' dtype: the
        contribution this rank sends. Zeros if it hosts none or no backward ran. A single slot's gradient is
        returned as it is (a view, read-only by contract): the sum of one row, exactly, without a copy."""
        slots = (self.placement_NS[self.rank] == e).nonzero().flatten().tolist()
        grad_SW = self.slots_SW.grad
        if grad_SW is None:
            slots = []
        parts = ([self.unpushed_grads[e]] if e in self.unpushed_grads else []) + [grad_SW[j] for j in slots]
        if not parts:
            return torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        if len(parts) == 1:
            return parts[0]
        acc = torch.promote_types(self.dtype, torch.float32)
        return torch.stack(parts).to(acc).sum(0).to(self.dtype)

    # -- 1. replica gradient sync ------------------------------------------------------------------------------
    def sync_replica_grads(self) -> None:
        """Sum the local replicas of each expert, then ``"range"``: all-reduce over the rank range its hosts span
        (afterwards every rank of e's span holds e's full gradient, unscaled, in the slot dtype); ``"shard"``:
        send shard q of every local sum to rank q in one all-to-all (kept for :meth:`collect_grad_shards`)."""
        with self._phase("replica_sync"), torch.no_grad():
            if self.replica_grad == "range":
                self._sync_range()
            else:
                self._sync_shard()

    def _sync_range(self) -> None:
        """Every expert's range all-reduce at once: a direct reduce-scatter (member i of e's range [lo, hi] folds
        chunk i of the hosting members' sums, in ascending rank, in fp32) and an all-gather, each one exchange over
        the EP group carrying every expert's messages (per pair of ranks, the experts in ascending order)."""
        placement = self.sync_placement()
        plan = self._sync_plan = sync_plan(placement, self.num_experts)
        hosts_NE = hosts_mask(placement, self.num_experts)
        me = self.rank
        span_E2 = plan.span_E2
        mine = ((span_E2[:, 0] <= me) & (me <= span_E2[:, 1])).nonzero().flatten().tolist()
        self._reduced = {e: self._local_sum(e) for e in mine}
        if not bool((span_E2[:, 1] > span_E2[:, 0]).any()):  # every expert on one rank (the same on every rank):
            return  # nothing to all-reduce, no exchange
        spans = {e: tuple(span_E2[e].tolist()) for e in mine if span_E2[e, 1] > span_E2[e, 0]}
        chunks = {e: shard_sizes(self.numel, hi - lo + 1) for e, (lo, hi) in spans.items()}
        pieces = {e: self._reduced[e].split(chunks[e]) for e in spans}
        # 1. reduce-scatter: chunk k of my sum of e to member k; from every other member, its chunk of mine
        parts = self._exchange_chunks([(lo + k, e, pieces[e][k], chunks[e][me - lo]) for e, (lo, hi) in spans.items()
                                       for k in range(hi - lo + 1) if lo + k != me])
        reduced = {}
        for e, (lo, hi) in spans.items():
            hosting = (lo + hosts_NE[lo:hi + 1, e].nonzero().flatten()).tolist()
            acc = (pieces[e][me - lo] if hosting[0] == me else parts[hosting[0], e]).to(torch.float32, copy=True)
            for q in hosting[1:]:
                acc += (pieces[e][me - lo] if q == me else parts[q, e]).to(torch.float32)
            reduced[e] = acc.to(self.dtype)
        # 2. all-gather: my reduced chunk of e to every other member; theirs back
        parts = self._exchange_chunks([(lo + k, e, reduced[e], chunks[e][k]) for e, (lo, hi) in spans.items()
                                       for k in range(hi - lo + 1) if lo + k != me])
        for e, (lo, hi) in spans.items():
            self._reduced[e] = torch.cat([reduced[e] if lo + k == me else parts[lo + k, e] for k in range(hi - lo + 1)])

    def _exchange_chunks(self, messages: list[tuple[int, int, torch.Tensor, int]]
                         ) -> dict[tuple[int, int], torch.Tensor]:
        """One exchange of the range sync: ``messages`` (peer, expert, the chunk sent to the peer, the elements
        received from it) in ascending expert order, the same order on both sides of every pair; (peer, expert) ->
        the chunk received."""
        send, recv = {}, {}
        for q, e, chunk, n in messages:
            send.setdefault(q, []).append(chunk)
            recv.setdefault(q, []).append((e, n))
        got = self._exchange_peers("replica_sync", {q: torch.cat(b) for q, b in send.items()},
                                   {q: sum(n for _, n in r) for q, r in recv.items()})
        return {(q, e): part for q, r in recv.items() for (e, _), part in zip(r, got[q].split([n for _, n in r]))}

    def _sync_shard(self) -> None:
        hosted = [hosted_experts(self.sync_placement(), n) for n in range(self.num_ranks)]
        mine = hosted[self.rank]
        # owner-major [owner q: H × shard_q]: each local sum written straight into its place, one strided copy per
        # run of equal-width shards (the first P mod N shards are one longer), no stacking and no repacking
        num_h, runs = len(mine), owner_runs(self.bounds)
        send = torch.empty(num_h * self.numel, dtype=self.dtype, device=self.device)
        for h, e in enumerate(mine):
            pack_owner_major_(send, self._local_sum(e), h, num_h, runs)
        c = self.shard_numel
        got = self._exchange("replica_sync", send, [len(mine) * (hi - lo) for lo, hi in self.bounds],
                             [len(es) * c for es in hosted])
        self._received = list(zip(hosted, got.split([len(es) * c for es in hosted])))

    # -- 2. gradient collection --------------------------------------------------------------------------------
    def collect_grad_shards(self, grad_scale: float = 1.0) -> torch.Tensor:
        """Shard ``rank`` of every expert's summed gradient, scaled by the constant ``grad_scale``, as fp32
        [E, P_n] (also kept as ``grad_shards_EW``). ``"range"``: fetched from a holder of the reduced gradient
        (round-robin over holders); ``"shard"``: the hosts' parts added in ascending host rank."""
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}")
        with self._phase("grad_collect"), torch.no_grad():
            shards_EW = self._collect_range() if self.replica_grad == "range" else self._collect_shard()
            if self.dp_size > 1:  # the other EP groups' sums of this shard: the gradient over the whole world
                dist.all_reduce(shards_EW, group=self.dp_group)
            shards_EW.mul_(grad_scale)
        self.grad_shards_EW, self._fresh_shards = shards_EW, True
        self._reduced, self._received, self._sync_plan = {}, None, None
        return shards_EW

    def _collect_range(self) -> torch.Tensor:
        plan = self._sync_plan if self._sync_plan is not None else sync_plan(self.sync_placement(), self.num_experts)
        src_NE = plan.source_NE
        send, recv_numel, recv_experts = {}, {}, {}
        for peer in range(self.num_ranks):
            if peer == self.rank:
                continue
            plo, phi = self.bounds[peer]
            serve = (src_NE[peer] == self.rank).nonzero().flatten().tolist()
            if serve:
                send[peer] = torch.cat([self._reduced[e][plo:phi] for e in serve])
            need = (src_NE[self.rank] == peer).nonzero().flatten().tolist()
            if need:
                recv_numel[peer] = len(need) * self.shard_numel
                recv_experts[peer] = need
        got = self._exchange_peers("grad_collect", send, recv_numel)
        lo, hi = self.bounds[self.rank]
        shards_EW = torch.zeros(self.num_experts, hi - lo, dtype=torch.float32, device=self.device)
        for e in (src_NE[self.rank] == self.rank).nonzero().flatten().tolist():
            shards_EW[e] = self._reduced[e][lo:hi].to(torch.float32)
        for peer, need in recv_experts.items():
            shards_EW[need] = got[peer].view(len(need), hi - lo).to(torch.float32)
        return shards_EW

    def _collect_shard(self) -> torch.Tensor:
        if self._received is None:
            raise ValueError("collect_grad_shards in shard mode needs sync_replica_grads first")
        c = self.shard_numel
        shards_EW = torch.zeros(self.num_experts, c, dtype=torch.float32, device=self.device)
        started_E = torch.zeros(self.num_experts, dtype=torch.bool)
        for experts, part in self._received:  # hosts in ascending rank: the fold order of the range mode
            if not experts:
                continue
            idx = torch.tensor(experts)
            part_HC = part.view(len(experts), c).to(torch.float32)
            first = ~started_E[idx]
            shards_EW[idx[first]] = part_HC[first]  # a copy, not 0 + x: the fold starts at the first host
            shards_EW[idx[~first]] += part_HC[~first]
            started_E[idx] = True
        self._bytes("grad_collect", 0, 0)
        return shards_EW

    # -- 3. Adam -----------------------------------------------------------------------------------------------
    def adam_step(self, grad_shards_EW: torch.Tensor | None = None) -> None:
        """Adam on this rank's fp32 shards (all experts at once: the update is elementwise)."""
        grad = self.grad_shards_EW if grad_shards_EW is None else grad_shards_EW
        if grad is None or grad.shape != self.master_EW.shape:
            raise ValueError(f"adam_step needs gradient shards of shape {tuple(self.master_EW.shape)}, got "
                             f"{None if grad is None else tuple(grad.shape)}")
        with self._phase("adam"), torch.no_grad():
            self.adam_steps += 1
            self._fresh_shards = False
            adam_update_(self.master_EW, grad.to(torch.float32), self.exp_avg_EW, self.exp_avg_sq_EW,
                         self.adam_steps, self.adam)

    # -- 4. redistribution -------------------------------------------------------------------------------------
    def redistribute(self, next_placement_NS: torch.Tensor | None = None) -> None:
        """Fill the slots with the current master weights of the experts of ``next_placement_NS`` (default: the
        current placement), the shards in one exchange over the EP group. Clears the slot gradients."""
        nxt = self.placement_NS if next_placement_NS is None else next_placement_NS.clone().cpu()
        check_placement(nxt, self.num_experts, self.num_ranks, "next_placement_NS")
        if nxt.shape[1] != self.slots_per_rank:
            raise ValueError(f"next_placement_NS has {nxt.shape[1]} slots per rank; the store has "
                             f"{self.slots_per_rank}")
        with self._phase("redistribute"), torch.no_grad():
            wanted = {m: hosted_experts(nxt, m) for m in range(self.num_ranks)}
            mine = wanted[self.rank]
            send = {m: self.master_EW[es].to(self.dtype).flatten() for m, es in wanted.items()
                    if m != self.rank and es}
            recv_numel = {q: len(mine) * (hi - lo) for q, (lo, hi) in enumerate(self.bounds)
                          if q != self.rank and mine and hi > lo}
            got = self._exchange_peers("redistribute", send, recv_numel)
            full = torch.empty(len(mine), self.numel, dtype=self.dtype, device=self.device)
            for q, (lo, hi) in enumerate(self.bounds):
                if q == self.rank:
                    full[:, lo:hi] = self.master_EW[mine].to(self.dtype)
                elif hi > lo and mine:
                    full[:, lo:hi] = got[q].view(len(mine), hi - lo)
            row = {e: i for i, e in enumerate(mine)}
            for j, e in enumerate(nxt[self.rank].tolist()):
                if e >= 0:
                    self.slots_SW[j].copy_(full[row[e]])
                else:
                    self.slots_SW[j].zero_()
        self.placement_NS, self.resident_NS = nxt, None
        self.unpushed_grads, self.unpushed_hosts_NE = {}, None
        self.slots_SW.grad = None

    # -- 0. weight push (online replication) ------------------------------------------------------------------
    def push(self, placement_NS: torch.Tensor, push_src_G: torch.Tensor) -> None:
        """Fill empty slots with copies of resident slots before the forward (a plan's ``push_src_G``: the global
        slot each pushed slot copies, -1 for the others), then hold ``placement_NS``. Every rank sends each peer one
        message with the distinct experts that peer takes from its slots (:func:`lrmoe.bytemodel.sync_model.push_rows`);
        copies within a rank are local. Timed and counted as ``weight_push`` (collective).

        The pushed slots then take part in the replica-gradient sum like any replica, and the redistribution of
        :meth:`step` into a next placement without them empties them again: the optimizer shards never move."""
        tgt = placement_NS.clone().cpu()
        src_G = push_src_G.cpu().long()
        check_placement(tgt, self.num_experts, self.num_ranks, "placement_NS")
        S, G = self.slots_per_rank, self.num_ranks * self.slots_per_rank
        if tgt.shape[1] != S or tuple(src_G.shape) != (G,):
            raise ValueError(f"push needs a placement with {S} slots per rank and push_src_G of shape ({G},), got "
                             f"{tuple(tgt.shape)} and {tuple(src_G.shape)}")
        held_G, want_G, pushed_G = self.placement_NS.reshape(-1), tgt.reshape(-1), src_G >= 0
        if not torch.equal(torch.where(pushed_G, -1, want_G), held_G):
            raise ValueError(f"a push fills empty slots only: the slots hold {self.placement_NS.tolist()}, the "
                             f"plan's placement {tgt.tolist()} with pushed slots "
                             f"{pushed_G.nonzero().flatten().tolist()} (run expert_step between two forwards)")
        if bool((held_G[src_G[pushed_G]] != want_G[pushed_G]).any()):
            raise ValueError("a push copies a slot that does not hold the pushed expert")
        rows = push_rows(tgt, src_G)
        me = self.rank
        local = self.local_slot_expert()
        with self._phase("weight_push"), torch.no_grad():
            send, recv_numel = {}, {}
            for m in range(self.num_ranks):
                out = rows[(rows[:, 0] == me) & (rows[:, 1] == m), 2].tolist()  # ascending experts
                if out:
                    send[m] = torch.cat([self.slots_SW[local.index(e)] for e in out])
                got = rows[(rows[:, 0] == m) & (rows[:, 1] == me), 2]
                if len(got):
                    recv_numel[m] = len(got) * self.numel
            got = self._exchange_peers("weight_push", send, recv_numel)
            for j in range(S):
                g = me * S + j
                if not bool(pushed_G[g]):
                    continue
                q, e = int(src_G[g]) // S, int(want_G[g])
                if q == me:
                    self.slots_SW[j].copy_(self.slots_SW[int(src_G[g]) % S])
                else:
                    experts = rows[(rows[:, 0] == q) & (rows[:, 1] == me), 2].tolist()
                    i = experts.index(e)
                    self.slots_SW[j].copy_(got[q][i * self.numel:(i + 1) * self.numel])
        if self.resident_NS is None:
            self.resident_NS = self.placement_NS
        self.placement_NS = tgt

    @torch.no_grad()
    def unpush(self, keep_grads: bool = True) -> None:
        """Empty the pushed slots (back to the resident placement) between two micro-batches of one step, keeping
        their gradients: each emptied slot's gradient is added to its expert's ``unpushed_grads`` (in fp32 or
        wider, then the slots' dtype), which the replica-gradient sum of :meth:`step` includes. No collective:
        every rank knows every rank's pushed slots from the plans. ``keep_grads=False``: after a forward without
        gradients, whose replicas hold none."""
        if self.resident_NS is None:
            return
        if not keep_grads:
            self.placement_NS, self.resident_NS = self.resident_NS, None
            return
        emptied_G = (self.placement_NS != self.resident_NS).reshape(-1)
        hosts_NE = hosts_mask(torch.where(emptied_G.view_as(self.placement_NS), self.placement_NS, -1),
                              self.num_experts)
        self.unpushed_hosts_NE = hosts_NE if self.unpushed_hosts_NE is None else self.unpushed_hosts_NE | hosts_NE
        grad_SW = self.slots_SW.grad
        acc = torch.promote_types(self.dtype, torch.float32)
        for j, e in enumerate(self.placement_NS[self.rank].tolist()):
            if not bool(emptied_G[self.rank * self.slots_per_rank + j]) or grad_SW is None:
                continue
            held = self.unpushed_grads.get(e)
            total = grad_SW[j].to(acc, copy=True) if held is None else held.to(acc) + grad_SW[j].to(acc)
            self.unpushed_grads[e] = total.to(self.dtype)  # a copy: the slot's gradient is zeroed next
            grad_SW[j].zero_()
        self.placement_NS, self.resident_NS = self.resident_NS, None

    def step(self, next_placement_NS: torch.Tensor | None = None, grad_scale: float = 1.0,
             collected: bool = False) -> None:
        """The whole optimizer step of the experts: sync, collect, Adam, redistribute. ``collected``: steps 1-2 ran
        already and ``grad_shards_EW`` holds the (scaled, e.g. clipped) gradient shards to apply; ``grad_scale`` is
        then unused."""
        if not collected:
            self.sync_replica_grads()
            self.collect_grad_shards(grad_scale)
        elif not self._fresh_shards:
            raise ValueError("step(collected=True) needs collect_grad_shards since the last Adam step")
        self.adam_step()
        self.redistribute(next_placement_NS)

    # -- inspection (collective; for tests and checkpoints) ----------------------------------------------------
    def gather_full(self, shards_EW: torch.Tensor) -> torch.Tensor:
        """All ranks' shards of a per-expert fp32 quantity, joined into [E, P] (collective)."""
        width = max(hi - lo for lo, hi in self.bounds)  # gloo's all_gather needs equal sizes: pad to the longest
        padded = torch.zeros(self.num_experts, width, dtype=shards_EW.dtype, device=shards_EW.device)
        padded[:, :shards_EW.shape[1]] = shards_EW
        parts = [torch.empty_like(padded) for _ in self.bounds]
        dist.all_gather(parts, padded, group=self.ep_group)
        return torch.cat([part[:, :hi - lo] for part, (lo, hi) in zip(parts, self.bounds)], dim=1)

    def full_master(self) -> torch.Tensor:
        """The fp32 master weights of every expert, [E, P] (collective)."""
        return self.gather_full(self.master_EW)
