"""The replica substrate (DESIGN.md §3, shared by SYMI and LRMoE): expert weights in slots, replica gradient
sync, a statically sharded Adam, and point-to-point redistribution of the updated weights into the next placement.

Every rank has S slots; slot j of rank n holds the weights of expert ``placement_NS[n, j]`` (-1: empty). One
expert's parameters are handled as one flat vector of P = 3·D·F numbers, laid out ``[gate (D·F) | up (D·F) |
down (F·D)]``, and split into N contiguous shards (the first P mod N shards one element longer); rank n owns shard
n of every expert: its fp32 master weights and Adam moments, for the whole run, whatever the placement.

One optimizer step (:meth:`ReplicaStore.step`):

1. **replica sync**: each rank sums the gradients of its local slots of an expert; the ranks of the consecutive
   range spanned by the expert's hosts then all-reduce that sum, in the range's process group (all N(N-1)/2 range
   groups are created once, by :class:`RangeGroups`; a single-rank range needs no collective). A placement whose
   hosts of an expert are not consecutive still works: the ranks in between join with zeros (correct, costs
   bytes; SYMI's contiguous placements never need it);
2. **gradient collection**: rank n takes shard n of every expert's reduced gradient from a rank that holds it:
   itself when it can, else the holders in round-robin (the i-th rank needing it asks holder i mod h). The shard is
   multiplied by a placement-independent ``grad_scale`` (never by the replica count);
3. **Adam** on the fp32 shards, element for element the update of ``torch.optim.Adam`` over the full parameters;
4. **redistribution**: rank n sends its updated shard (in the slots' dtype) of each expert to every other rank
   that hosts the expert in the *next* placement, one message per pair of ranks; each rank assembles the full
   experts and copies them into its slots (several slots of one expert on one rank cost one transfer).

The pure helpers (:func:`shard_sizes`, :func:`sync_plan`, :func:`hosted_experts`) say who talks to whom; the
accounting (:mod:`lrmoe.distributed.accounting`) derives the bytes from them.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .comm import exchange_rows


# -- pure planning ---------------------------------------------------------------------------------------------
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


def check_placement(placement_NS: torch.Tensor, num_ranks: int, num_experts: int, name: str = "placement_NS"):
    """Raise ``ValueError`` unless ``placement_NS`` is a long [N, S] tensor of experts in [-1, E)."""
    if not isinstance(placement_NS, torch.Tensor) or placement_NS.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [ranks, slots], got {placement_NS!r}")
    if placement_NS.shape[0] != num_ranks:
        raise ValueError(f"{name} has {placement_NS.shape[0]} rows, expected one per rank ({num_ranks})")
    if placement_NS.dtype != torch.long:
        raise ValueError(f"{name} must be a long tensor, got {placement_NS.dtype}")
    if placement_NS.numel() and (int(placement_NS.min()) < -1 or int(placement_NS.max()) >= num_experts):
        raise ValueError(f"{name} holds experts outside [-1, {num_experts}): "
                         f"min {int(placement_NS.min())}, max {int(placement_NS.max())}")


def hosted_experts(placement_NS: torch.Tensor, rank: int) -> list[int]:
    """The distinct experts hosted by ``rank``, ascending."""
    return sorted(int(e) for e in placement_NS[rank].unique().tolist() if e >= 0)


@dataclass(frozen=True)
class SyncPlan:
    """Who all-reduces and who serves each expert's gradient, for one placement.

    span_E2[e] = (lo, hi): the consecutive rank range spanned by e's hosts (-1, -1 if e is hosted nowhere); every
    rank in it holds e's reduced gradient after the sync. source_NE[n, e]: the rank rank n takes shard n of e's
    gradient from (n itself when it holds it; -1 when e is hosted nowhere: its gradient is zero).
    """

    span_E2: torch.Tensor  # long [E, 2]
    source_NE: torch.Tensor  # long [N, E]

    def span_size(self, e: int) -> int:
        lo, hi = self.span_E2[e].tolist()
        return 0 if lo < 0 else hi - lo + 1


def sync_plan(placement_NS: torch.Tensor, num_experts: int) -> SyncPlan:
    """The :class:`SyncPlan` of a placement (pure; identical on every rank)."""
    N = placement_NS.shape[0]
    check_placement(placement_NS, N, num_experts)
    span_E2 = torch.full((num_experts, 2), -1, dtype=torch.long)
    source_NE = torch.full((N, num_experts), -1, dtype=torch.long)
    for e in range(num_experts):
        hosts = (placement_NS == e).any(dim=1).nonzero().flatten().tolist()
        if not hosts:
            continue
        lo, hi = hosts[0], hosts[-1]
        span_E2[e] = torch.tensor([lo, hi])
        holders = list(range(lo, hi + 1))
        others = [n for n in range(N) if n not in holders]
        for n in holders:
            source_NE[n, e] = n
        for i, n in enumerate(others):  # round-robin over the holders
            source_NE[n, e] = holders[i % len(holders)]
    return SyncPlan(span_E2=span_E2, source_NE=source_NE)


def ring_allreduce_bytes(payload_bytes: int, group_size: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``payload_bytes`` over ``group_size`` ranks:
    2·(h-1)/h of the payload (reduce-scatter then all-gather). The accounting's model of an all-reduce."""
    return 0 if group_size <= 1 else 2 * (group_size - 1) * payload_bytes // group_size


# -- Adam ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdamConfig:
    """Hyper-parameters of ``torch.optim.Adam`` (L2 ``weight_decay`` added to the gradient, as torch does)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"AdamConfig.lr must be positive, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"AdamConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(f"AdamConfig.eps must be positive, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"AdamConfig.weight_decay must be non-negative, got {self.weight_decay}")


def adam_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 step: int, cfg: AdamConfig) -> None:
    """One in-place Adam update at ``step`` (1-based), the arithmetic of torch's single-tensor Adam. Elementwise,
    so applying it shard by shard gives exactly the update of the full tensor."""
    if cfg.weight_decay:
        grad = grad.add(param, alpha=cfg.weight_decay)
    exp_avg.lerp_(grad, 1 - cfg.beta1)
    exp_avg_sq.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
    bias_correction1 = 1 - cfg.beta1**step
    bias_correction2_sqrt = (1 - cfg.beta2**step) ** 0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(cfg.eps)
    param.addcdiv_(exp_avg, denom, value=-cfg.lr / bias_correction1)


# -- process groups --------------------------------------------------------------------------------------------
class RangeGroups:
    """The process groups of every consecutive rank range [lo, hi], lo < hi: N(N-1)/2 groups, created once at
    start by every rank together (``new_group`` is collective), never during training. Share one instance
    between all layers."""

    def __init__(self):
        if not dist.is_initialized():
            raise ValueError("RangeGroups needs an initialised default process group")
        self.world_size = dist.get_world_size()
        self._groups = {}
        for lo in range(self.world_size):
            for hi in range(lo + 1, self.world_size):
                self._groups[(lo, hi)] = dist.new_group(list(range(lo, hi + 1)))

    def __len__(self) -> int:
        return len(self._groups)

    def get(self, lo: int, hi: int):
        if not 0 <= lo < hi < self.world_size:
            raise ValueError(f"no range group [{lo}, {hi}] in a world of {self.world_size} ranks")
        return self._groups[(lo, hi)]


# -- the store -------------------------------------------------------------------------------------------------
def flatten_experts(w_gate_EDF: torch.Tensor, w_up_EDF: torch.Tensor, w_down_EFD: torch.Tensor) -> torch.Tensor:
    """[E, P] with P = 3·D·F: each expert's parameters as one flat vector ``[gate | up | down]``."""
    E = w_gate_EDF.shape[0]
    return torch.cat([w_gate_EDF.reshape(E, -1), w_up_EDF.reshape(E, -1), w_down_EFD.reshape(E, -1)], dim=1)


def unflatten_experts(flat_XP: torch.Tensor, hidden: int, ffn: int):
    """Views (w_gate_XDF, w_up_XDF, w_down_XFD) of a flat [X, P] buffer (X experts or slots)."""
    X, DF = flat_XP.shape[0], hidden * ffn
    return (flat_XP[:, :DF].view(X, hidden, ffn), flat_XP[:, DF:2 * DF].view(X, hidden, ffn),
            flat_XP[:, 2 * DF:].view(X, ffn, hidden))


class ReplicaStore(nn.Module):
    """One rank's part of the replica substrate of one MoE layer: its S slots (a parameter [S, P] in the compute
    dtype, whose gradient the layer's backward fills) and its fp32 shard of every expert's master weights and Adam
    moments. Construction is collective only through the shared :class:`RangeGroups`.
    """

    def __init__(self, w_gate_EDF: torch.Tensor, w_up_EDF: torch.Tensor, w_down_EFD: torch.Tensor,
                 placement_NS: torch.Tensor, groups: RangeGroups, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, adam: AdamConfig = AdamConfig(), accountant=None):
        super().__init__()
        if w_gate_EDF.dim() != 3 or w_up_EDF.shape != w_gate_EDF.shape:
            raise ValueError(f"w_gate_EDF and w_up_EDF must both be [E, D, F], got {tuple(w_gate_EDF.shape)} and "
                             f"{tuple(w_up_EDF.shape)}")
        E, D, F = w_gate_EDF.shape
        if tuple(w_down_EFD.shape) != (E, F, D):
            raise ValueError(f"w_down_EFD must be [{E}, {F}, {D}], got {tuple(w_down_EFD.shape)}")
        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()
        check_placement(placement_NS, self.num_ranks, E)
        self.num_experts, self.hidden, self.ffn = E, D, F
        self.numel = 3 * D * F
        self.slots_per_rank = placement_NS.shape[1]
        self.groups, self.adam, self.accountant = groups, adam, accountant
        self.dtype = dtype or w_gate_EDF.dtype
        device = torch.device(device) if device is not None else w_gate_EDF.device
        self.bounds = shard_bounds(self.numel, self.num_ranks)
        lo, hi = self.bounds[self.rank]
        with torch.no_grad():
            flat_EP = flatten_experts(w_gate_EDF, w_up_EDF, w_down_EFD).to(device)
            self.register_buffer("master_EP", flat_EP[:, lo:hi].to(torch.float32).clone())  # [E, P_n] fp32
            self.register_buffer("exp_avg_EP", torch.zeros_like(self.master_EP))
            self.register_buffer("exp_avg_sq_EP", torch.zeros_like(self.master_EP))
            self.slots_SP = nn.Parameter(torch.zeros(self.slots_per_rank, self.numel, dtype=self.dtype,
                                                     device=device))
            self.placement_NS = placement_NS.clone().cpu()
            for j, e in enumerate(self.placement_NS[self.rank].tolist()):
                if e >= 0:
                    self.slots_SP[j].copy_(flat_EP[e].to(self.dtype))
        self.adam_steps = 0
        self.grad_shards_EP: torch.Tensor | None = None  # the last collected gradient shards (fp32, scaled)
        self._reduced: dict[int, torch.Tensor] = {}

    # -- views -------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.slots_SP.device

    @property
    def shard_numel(self) -> int:
        lo, hi = self.bounds[self.rank]
        return hi - lo

    def slot_weights(self):
        """(w_gate_SDF, w_up_SDF, w_down_SFD): differentiable views of the local slots."""
        return unflatten_experts(self.slots_SP, self.hidden, self.ffn)

    def local_slot_expert(self) -> list[int]:
        return self.placement_NS[self.rank].tolist()

    def _phase(self, name: str):
        return self.accountant.phase(name) if self.accountant is not None else nullcontext()

    def _bytes(self, name: str, sent: int, recv: int) -> None:
        if self.accountant is not None:
            self.accountant.add_bytes(name, sent, recv)

    # -- 1. replica gradient sync ------------------------------------------------------------------------------
    def sync_replica_grads(self) -> None:
        """Sum the local replicas of each expert, then all-reduce over the rank range its hosts span. Afterwards
        every rank of e's span holds e's full gradient (unscaled, in the slot dtype)."""
        plan = sync_plan(self.placement_NS, self.num_experts)
        grad_SP = self.slots_SP.grad
        mine = self.placement_NS[self.rank]
        self._reduced = {}
        with self._phase("replica_sync"):
            for e in range(self.num_experts):  # the same order on every rank: collectives never cross
                lo, hi = plan.span_E2[e].tolist()
                if not lo <= self.rank <= hi:
                    continue
                slots = (mine == e).nonzero().flatten().tolist()
                if slots and grad_SP is not None:  # summed in at least fp32, sent in the slots' dtype
                    buf = grad_SP[slots].to(torch.promote_types(self.dtype, torch.float32)).sum(0).to(self.dtype)
                else:  # a rank inside the span that does not host e, or no backward ran
                    buf = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
                if hi > lo:
                    dist.all_reduce(buf, group=self.groups.get(lo, hi))
                    moved = ring_allreduce_bytes(buf.numel() * buf.element_size(), hi - lo + 1)
                    self._bytes("replica_sync", moved, moved)
                self._reduced[e] = buf

    # -- 2. gradient collection --------------------------------------------------------------------------------
    def collect_grad_shards(self, grad_scale: float = 1.0) -> torch.Tensor:
        """Fetch shard ``rank`` of every expert's reduced gradient (round-robin over holders), scale it by the
        constant ``grad_scale`` and return it as fp32 [E, P_n] (also kept as ``grad_shards_EP``)."""
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}")
        plan = sync_plan(self.placement_NS, self.num_experts)
        src_NE = plan.source_NE
        elem = torch.tensor([], dtype=self.dtype).element_size()
        with self._phase("grad_collect"):
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
            got = exchange_rows(send, recv_numel, self.dtype, self.device)
            lo, hi = self.bounds[self.rank]
            shards_EP = torch.zeros(self.num_experts, hi - lo, dtype=torch.float32, device=self.device)
            for e in (src_NE[self.rank] == self.rank).nonzero().flatten().tolist():
                shards_EP[e] = self._reduced[e][lo:hi].to(torch.float32)
            for peer, need in recv_experts.items():
                shards_EP[need] = got[peer].view(len(need), hi - lo).to(torch.float32)
            shards_EP.mul_(grad_scale)
            self._bytes("grad_collect", sum(b.numel() for b in send.values()) * elem,
                        sum(recv_numel.values()) * elem)
        self.grad_shards_EP = shards_EP
        self._reduced = {}
        return shards_EP

    # -- 3. Adam -----------------------------------------------------------------------------------------------
    def adam_step(self, grad_shards_EP: torch.Tensor | None = None) -> None:
        """Adam on this rank's fp32 shards (all experts at once: the update is elementwise)."""
        grad = self.grad_shards_EP if grad_shards_EP is None else grad_shards_EP
        if grad is None or grad.shape != self.master_EP.shape:
            raise ValueError(f"adam_step needs gradient shards of shape {tuple(self.master_EP.shape)}, got "
                             f"{None if grad is None else tuple(grad.shape)}")
        with self._phase("adam"), torch.no_grad():
            self.adam_steps += 1
            adam_update_(self.master_EP, grad.to(torch.float32), self.exp_avg_EP, self.exp_avg_sq_EP,
                         self.adam_steps, self.adam)

    # -- 4. redistribution -------------------------------------------------------------------------------------
    def redistribute(self, next_placement_NS: torch.Tensor | None = None) -> None:
        """Fill the slots with the current master weights of the experts of ``next_placement_NS`` (default: the
        current placement), by point-to-point transfer of the shards. Clears the slot gradients."""
        nxt = self.placement_NS if next_placement_NS is None else next_placement_NS.clone().cpu()
        check_placement(nxt, self.num_ranks, self.num_experts, "next_placement_NS")
        if nxt.shape[1] != self.slots_per_rank:
            raise ValueError(f"next_placement_NS has {nxt.shape[1]} slots per rank; the store has "
                             f"{self.slots_per_rank}")
        elem = torch.tensor([], dtype=self.dtype).element_size()
        with self._phase("redistribute"), torch.no_grad():
            wanted = {m: hosted_experts(nxt, m) for m in range(self.num_ranks)}
            mine = wanted[self.rank]
            send = {m: self.master_EP[es].to(self.dtype).flatten() for m, es in wanted.items()
                    if m != self.rank and es}
            recv_numel = {q: len(mine) * (hi - lo) for q, (lo, hi) in enumerate(self.bounds)
                          if q != self.rank and mine and hi > lo}
            got = exchange_rows(send, recv_numel, self.dtype, self.device)
            full = torch.empty(len(mine), self.numel, dtype=self.dtype, device=self.device)
            for q, (lo, hi) in enumerate(self.bounds):
                if q == self.rank:
                    full[:, lo:hi] = self.master_EP[mine].to(self.dtype)
                elif hi > lo and mine:
                    full[:, lo:hi] = got[q].view(len(mine), hi - lo)
            row = {e: i for i, e in enumerate(mine)}
            for j, e in enumerate(nxt[self.rank].tolist()):
                if e >= 0:
                    self.slots_SP[j].copy_(full[row[e]])
                else:
                    self.slots_SP[j].zero_()
            self._bytes("redistribute", sum(b.numel() for b in send.values()) * elem,
                        sum(recv_numel.values()) * elem)
        self.placement_NS = nxt
        self.slots_SP.grad = None

    def step(self, next_placement_NS: torch.Tensor | None = None, grad_scale: float = 1.0) -> None:
        """The whole optimizer step of the experts: sync, collect, Adam, redistribute."""
        self.sync_replica_grads()
        self.collect_grad_shards(grad_scale)
        self.adam_step()
        self.redistribute(next_placement_NS)

    # -- inspection (collective; for tests and checkpoints) ----------------------------------------------------
    def gather_full(self, shards_EP: torch.Tensor) -> torch.Tensor:
        """All ranks' shards of a per-expert fp32 quantity, joined into [E, P] (collective)."""
        width = max(hi - lo for lo, hi in self.bounds)  # gloo's all_gather needs equal sizes: pad to the longest
        padded = torch.zeros(self.num_experts, width, dtype=shards_EP.dtype, device=shards_EP.device)
        padded[:, :shards_EP.shape[1]] = shards_EP
        parts = [torch.empty_like(padded) for _ in self.bounds]
        dist.all_gather(parts, padded)
        return torch.cat([part[:, :hi - lo] for part, (lo, hi) in zip(parts, self.bounds)], dim=1)

    def full_master(self) -> torch.Tensor:
        """The fp32 master weights of every expert, [E, P] (collective)."""
        return self.gather_full(self.master_EP)
