"""Per-rank accounting of the expert-parallel layer: work and bytes per phase, counted as the layer runs, the same
quantities derived in closed form from the plan, and a check that the two agree every iteration.

Notation: N ranks, S slots per rank, E experts, D hidden width, F expert width, P = 3·D·F parameters per expert,
b_a bytes per activation element and b_p per slot-weight / gradient element (both the slots' dtype), shard_n the
length of rank n's shard of an expert (⌈P/N⌉ or ⌊P/N⌋). From the plan: c[src, dst] = Σ_{g on dst} fwd_NG[src, g],
the pairs rank src sends to rank dst (c[n, n] stays local); A_n = Σ_dst c[n, dst] the pairs whose home is n,
R_n = Σ_src c[src, n] the pairs computed on n. From the placement: the hosts of expert e, their rank span
[lo_e, hi_e] of size h_e (= the number of hosting ranks for SYMI's contiguous placements), source(n, e) as in
:func:`lrmoe.distributed.replica.sync_plan`, and X_m = the distinct experts rank m hosts in the next placement.

Bytes are those that leave (or reach) a rank: a rank's exchange with itself is a local copy and counts zero.
Per rank n and iteration:

* ``dispatch_a2a``: sends D·b_a · Σ_{dst≠n} c[n, dst], receives D·b_a · Σ_{src≠n} c[src, n];
* ``combine_a2a``: the reverse (sends what the dispatch received, receives what it sent);
* ``combine_a2a_bwd``: as ``dispatch_a2a`` (output gradients travel home → expert);
* ``dispatch_a2a_bwd``: as ``combine_a2a`` (input gradients travel expert → home; skipped by autograd when the
  layer's input needs no gradient);
* ``replica_sync``: Σ over experts e with lo_e ≤ n ≤ hi_e and h_e > 1 of 2·(h_e−1)/h_e · P·b_p, sent and received
  alike (a ring all-reduce: a model of the wire traffic, which the collective library may organise differently);
* ``grad_collect``: receives b_p · shard_n for every expert whose source(n, e) is another rank; sends
  b_p · shard_m for every (m ≠ n, e) with source(m, e) = n;
* ``redistribute``: receives b_p · |X_n| · (P − shard_n); sends b_p · shard_n · Σ_{m≠n} |X_m|.

Pairs computed: forward R_n, backward R_n (the plain autograd backward recomputes nothing and drops nothing). Token
buffers (one forward, all live at once while autograd holds them, so an upper bound of their peak):
home side the packed send and the combine receive, 2·A_n·D·b_a; expert side the received rows, their slot-major
copy, the expert output and its source-major copy, 4·R_n·D·b_a, plus the experts' activations gate, up and h,
3·R_n·F·b_a (modelled: the grouped-GEMM seam does not expose them).

**The recalibrated backward** (:mod:`lrmoe.backward`, :func:`expected_recalibrated`). From the plan: b[n, g] =
bwd_NG (retained pairs of source n whose backward runs on slot g), m[n, g] = moved_NG (of those, the ones that moved
there), k[n, g] = keep_NG − moved_out_NG (retained pairs that stay on their forward slot). With the compact layout
(when the plan trims or moves pairs), source n sends slot g's rank s[n, g] = b + m rows (gradients, plus the input
rows of moved pairs) and an int32 index for each of its k staying rows; the expert rank returns r[n, g] = b
input-gradient rows. With the forward layout (the padded ablation, and plans that keep everything) s = f + 2m and
r = f + m (f = fwd_NG) and no index. Per rank n, summing s, r, k over the slots of each destination:

* ``combine_a2a_bwd``: sends D·b_a · Σ_{dst≠n} s[n, dst], receives D·b_a · Σ_{src≠n} s[src, n];
* ``bwd_index_a2a``: the same with 4 bytes per staying row (compact layout only);
* ``dispatch_a2a_bwd``: sends D·b_a · Σ_{src≠n} r[src, n], receives D·b_a · Σ_{dst≠n} r[n, dst];
* ``pairs_bwd`` (rows of the backward GEMMs) Σ_src r[src, n]; ``pairs_retained`` Σ_src b[src, n];
  ``pairs_recomputed`` Σ_src m[src, n];
* ``bwd_buffer_bytes`` (the backward's packet buffers, sent and received): D·b_a · (Σ s[n, ·] + Σ s[·, n] +
  Σ r[·, n] + Σ r[n, ·]);
* the forward's ``combine_a2a`` rows carry one more element (‖h‖ of the pair) when metric m2 has to select.

**Against SYMI's accounting.** SYMI counts s·N·W for the weight redistribution: every one of the s·N slots receives
a whole expert (W = P·b_p). Here a rank receives each distinct expert once, without the shard it owns itself:
Σ_m |X_m|·(P − shard_m)·b_p ≤ s·N·W·(N−1)/N (as |X_m| ≤ s and Σ_m shard_m = P), equal when no slot is empty
and no rank hosts two replicas of one expert.
For the gradients SYMI counts s·N·G (G = P·b_p): each slot's gradient leaves its rank once. Our mechanism first
sums the replicas on a rank (free), then all-reduces over the h_e hosting ranks (ring: 2·(h_e−1)·G in total), and
each of the N − h_e non-holding ranks then fetches its 1/N shard: (N − h_e)·G/N. Total per expert
2·(h_e−1)·G + (N − h_e)·G/N. Without replication (h_e = 1, E = s·N experts) this is s·N·G·(N−1)/N, SYMI's figure
less the shard each owner already holds. Replicas on one rank cost nothing extra (SYMI counts each slot). Replicas
on h_e > 1 ranks (one each) exceed SYMI's h_e·G by (h_e − 2)·G + (N − h_e)·G/N: the all-reduce hands every host
the whole reduced gradient, which round-robin collection needs, where a reduce-scatter straight to the N shard
owners would move h_e·G·(N−1)/N (that variant is not implemented here).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from .replica import hosted_experts, ring_allreduce_bytes, shard_sizes, sync_plan

FORWARD_PHASES = ("route", "plan", "permute", "dispatch_a2a", "expert_fwd", "combine_a2a", "unpermute")
BACKWARD_PHASES = ("recalibrate", "combine_a2a_bwd", "bwd_index_a2a", "expert_bwd", "dispatch_a2a_bwd",
                   "unpermute_bwd")
STEP_PHASES = ("replica_sync", "grad_collect", "adam", "redistribute")
PHASES = FORWARD_PHASES + BACKWARD_PHASES + STEP_PHASES
BYTE_PHASES = ("dispatch_a2a", "combine_a2a", "combine_a2a_bwd", "bwd_index_a2a", "dispatch_a2a_bwd",
               "replica_sync", "grad_collect", "redistribute")
INDEX_BYTES = 4  # one int32 per staying row in the compact backward layout
COUNTERS = ("pairs_fwd", "pairs_bwd", "pairs_retained", "pairs_recomputed", "pairs_dropped", "token_buffer_bytes",
            "bwd_buffer_bytes")


@dataclass
class PhaseStats:
    """Time and traffic of one phase on one rank, summed over the calls since the last reset."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    sent_bytes: int = 0
    recv_bytes: int = 0
    calls: int = 0


class Accountant:
    """Counters of one rank, filled by the layer and the replica store as they run; ``reset()`` per iteration.

    ``phase(name)`` times a block; ``begin``/``end`` time an interval whose ends lie in different places (the
    backward phases, timed from autograd callbacks). CPU time is the process's (all its threads). ``sync`` is
    called at every phase boundary (pass ``torch.cuda.synchronize`` on a GPU, where kernels run asynchronously).
    """

    def __init__(self, sync: Callable[[], None] | None = None):
        self.sync = sync
        self.reset()

    def reset(self) -> None:
        self.phases: dict[str, PhaseStats] = {}
        self.counters: dict[str, int] = {}
        self._open: dict[str, tuple[float, float]] = {}

    def stats(self, name: str) -> PhaseStats:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; known: {PHASES}")
        return self.phases.setdefault(name, PhaseStats())

    @contextmanager
    def phase(self, name: str):
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def begin(self, name: str) -> None:
        self.stats(name)
        if self.sync is not None:
            self.sync()
        self._open[name] = (time.perf_counter(), time.process_time())

    def is_open(self, name: str) -> bool:
        return name in self._open

    def end(self, name: str) -> None:
        if name not in self._open:
            raise ValueError(f"phase {name!r} ended without a begin")
        if self.sync is not None:
            self.sync()
        wall0, cpu0 = self._open.pop(name)
        s = self.stats(name)
        s.wall_s += time.perf_counter() - wall0
        s.cpu_s += time.process_time() - cpu0
        s.calls += 1

    def add_bytes(self, name: str, sent: int, recv: int) -> None:
        s = self.stats(name)
        s.sent_bytes += int(sent)
        s.recv_bytes += int(recv)

    def add(self, name: str, value: int) -> None:
        if name not in COUNTERS:
            raise ValueError(f"unknown counter {name!r}; known: {COUNTERS}")
        self.counters[name] = self.counters.get(name, 0) + int(value)

    def record(self) -> dict:
        """A flat dict: ``<phase>.wall_ms``, ``.cpu_ms``, ``.sent_bytes``, ``.recv_bytes`` and the counters."""
        out: dict = dict(self.counters)
        for name in PHASES:
            s = self.phases.get(name)
            if s is None:
                continue
            out[f"{name}.wall_ms"] = s.wall_s * 1e3
            out[f"{name}.cpu_ms"] = s.cpu_s * 1e3
            if name in BYTE_PHASES:
                out[f"{name}.sent_bytes"] = s.sent_bytes
                out[f"{name}.recv_bytes"] = s.recv_bytes
        return out


# -- the formulas ----------------------------------------------------------------------------------------------
def pair_matrix_NN(fwd_NG: torch.Tensor, slots_per_rank: int) -> torch.Tensor:
    """c[src, dst]: pairs of source rank src computed on rank dst."""
    N = fwd_NG.shape[0]
    return fwd_NG.view(N, N, slots_per_rank).sum(2)


def expected_layer(fwd_NG: torch.Tensor, slots_per_rank: int, hidden: int, ffn: int, act_bytes: int,
                   dropped_N: torch.Tensor | None = None, input_grad: bool = True) -> dict[str, torch.Tensor]:
    """The forward/backward quantities of every rank from the plan: ``<phase>.sent_bytes`` / ``.recv_bytes`` of
    the four all-to-alls, ``pairs_fwd``, ``pairs_bwd``, ``pairs_dropped`` and ``token_buffer_bytes`` ([N] each).
    ``input_grad=False``: the layer's input needs no gradient, so autograd skips the backward dispatch."""
    c = pair_matrix_NN(fwd_NG, slots_per_rank).long()
    off = c - torch.diag(torch.diag(c))
    row = hidden * act_bytes
    A, R = c.sum(1), c.sum(0)
    out = {"dispatch_a2a.sent_bytes": off.sum(1) * row, "dispatch_a2a.recv_bytes": off.sum(0) * row}
    out["combine_a2a.sent_bytes"] = out["dispatch_a2a.recv_bytes"]
    out["combine_a2a.recv_bytes"] = out["dispatch_a2a.sent_bytes"]
    out["combine_a2a_bwd.sent_bytes"] = out["dispatch_a2a.sent_bytes"]
    out["combine_a2a_bwd.recv_bytes"] = out["dispatch_a2a.recv_bytes"]
    out["dispatch_a2a_bwd.sent_bytes"] = out["combine_a2a.sent_bytes"] * int(input_grad)
    out["dispatch_a2a_bwd.recv_bytes"] = out["combine_a2a.recv_bytes"] * int(input_grad)
    out["pairs_fwd"] = R
    out["pairs_bwd"] = R
    out["pairs_retained"] = R
    out["pairs_dropped"] = torch.zeros_like(R) if dropped_N is None else dropped_N.long()
    out["token_buffer_bytes"] = (2 * A + 4 * R) * row + 3 * R * ffn * act_bytes
    return out


def expected_recalibrated(plan, hidden: int, ffn: int, act_bytes: int, metric: str = "m1", compact: bool = True,
                          input_grad: bool = True) -> dict[str, torch.Tensor]:
    """:func:`expected_layer` for a layer with the recalibrated backward (``lrmoe.backward``): the same forward
    (plus the ‖h‖ column metric m2 adds to the combine when the plan selects), and the backward exchange of the
    module doc, from the plan alone. ``plan`` is a :class:`~lrmoe.plan.LayerPlan`."""
    from ..backward import backward_counts, plan_selects  # the layout's own rule, so the two cannot drift apart

    S = plan.slots_per_rank
    out = expected_layer(plan.fwd_NG, S, hidden, ffn, act_bytes, plan.dropped_NE.sum(1), input_grad)
    row = hidden * act_bytes
    if metric == "m2" and plan_selects(plan):  # one more element per combine row
        c = pair_matrix_NN(plan.fwd_NG, S).long()
        off = c - torch.diag(torch.diag(c))
        out["combine_a2a.sent_bytes"] = off.sum(0) * (row + act_bytes)
        out["combine_a2a.recv_bytes"] = off.sum(1) * (row + act_bytes)
        out["token_buffer_bytes"] = out["token_buffer_bytes"] + (c.sum(0) + c.sum(1)) * act_bytes
    send_NG, ret_NG, index_NG = backward_counts(plan, compact)
    s, r, k = (pair_matrix_NN(x, S).long() for x in (send_NG, ret_NG, index_NG))
    off = lambda x: x - torch.diag(torch.diag(x))  # noqa: E731 - a rank's exchange with itself moves no bytes
    ig = int(input_grad)
    out["combine_a2a_bwd.sent_bytes"] = off(s).sum(1) * row
    out["combine_a2a_bwd.recv_bytes"] = off(s).sum(0) * row
    out["bwd_index_a2a.sent_bytes"] = off(k).sum(1) * INDEX_BYTES
    out["bwd_index_a2a.recv_bytes"] = off(k).sum(0) * INDEX_BYTES
    out["dispatch_a2a_bwd.sent_bytes"] = off(r).sum(0) * row * ig
    out["dispatch_a2a_bwd.recv_bytes"] = off(r).sum(1) * row * ig
    out["pairs_bwd"] = r.sum(0)
    out["pairs_retained"] = pair_matrix_NN(plan.bwd_NG, S).long().sum(0)
    out["pairs_recomputed"] = pair_matrix_NN(plan.moved_NG, S).long().sum(0)
    out["bwd_buffer_bytes"] = (s.sum(1) + s.sum(0) + ig * (r.sum(0) + r.sum(1))) * row
    return out


def expected_step(placement_NS: torch.Tensor, next_placement_NS: torch.Tensor, num_experts: int, hidden: int,
                  ffn: int, param_bytes: int) -> dict[str, torch.Tensor]:
    """The optimizer-step bytes of every rank ([N] each): replica sync, gradient collection, redistribution."""
    N = placement_NS.shape[0]
    P = 3 * hidden * ffn
    shard = torch.tensor(shard_sizes(P, N), dtype=torch.long)
    plan = sync_plan(placement_NS, num_experts)
    sync = torch.zeros(N, dtype=torch.long)
    for e in range(num_experts):
        lo, hi = plan.span_E2[e].tolist()
        if hi > lo:
            sync[lo:hi + 1] += ring_allreduce_bytes(P * param_bytes, hi - lo + 1)
    src = plan.source_NE
    remote = (src >= 0) & (src != torch.arange(N)[:, None])  # [N, E]: rank n fetches e's shard from elsewhere
    collect_recv = remote.sum(1) * shard * param_bytes
    collect_sent = torch.zeros(N, dtype=torch.long)
    for n in range(N):
        collect_sent[n] = ((src == n) & remote).sum(1).mul(shard).sum() * param_bytes
    X = torch.tensor([len(hosted_experts(next_placement_NS, m)) for m in range(N)], dtype=torch.long)
    redist_sent = shard * (X.sum() - X) * param_bytes
    redist_recv = X * (P - shard) * param_bytes
    return {"replica_sync.sent_bytes": sync, "replica_sync.recv_bytes": sync.clone(),
            "grad_collect.sent_bytes": collect_sent, "grad_collect.recv_bytes": collect_recv,
            "redistribute.sent_bytes": redist_sent, "redistribute.recv_bytes": redist_recv}


def symi_step_bytes(slots_per_rank: int, num_ranks: int, hidden: int, ffn: int, param_bytes: int) -> dict[str, int]:
    """SYMI's totals over all ranks, for comparison: s·N·W redistribution and s·N·G gradient bytes."""
    W = 3 * hidden * ffn * param_bytes
    return {"redistribute": slots_per_rank * num_ranks * W, "gradient": slots_per_rank * num_ranks * W}


def check_counts(record: dict, expected: dict[str, torch.Tensor], rank: int) -> None:
    """Raise ``RuntimeError`` naming every quantity whose counted value on ``rank`` differs from the formula."""
    bad = []
    for key, values in expected.items():
        want = int(values[rank])
        got = int(record.get(key, 0))
        if got != want:
            bad.append(f"{key}: counted {got}, formula {want}")
    if bad:
        raise RuntimeError(f"rank {rank}: accounting disagrees with the formulas: " + "; ".join(bad))
