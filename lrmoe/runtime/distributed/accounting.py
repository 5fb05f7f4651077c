"""Per-rank accounting of the expert-parallel layer: work and bytes per phase, counted as the layer runs, the same
quantities derived in closed form from the plan, and a check that the two agree every iteration.

Notation: N ranks, S slots per rank, E experts, D hidden width, F expert width, P = 3·D·F parameters per expert,
b_a bytes per activation element and b_p per slot-weight / gradient element (both the slots' dtype), shard_n the
length of rank n's shard of an expert (⌈P/N⌉ or ⌊P/N⌋). From the plan: c[src, dst] = Σ_{g on dst} fwd_NG[src, g],
the pairs rank src sends to rank dst (c[n, n] stays local); A_n = Σ_dst c[n, dst] the pairs whose home is n,
R_n = Σ_src c[src, n] the pairs computed on n. From the placement: the hosts of expert e, their rank span
[lo_e, hi_e] of size h_e (= the number of hosting ranks for SYMI's contiguous placements), source(n, e) as in
:func:`lrmoe.runtime.distributed.replica.sync_plan`, and X_m = the distinct experts rank m hosts in the next placement.

Bytes are those that leave (or reach) a rank: a rank's exchange with itself is a local copy and counts zero.
The layer's all-to-alls, pairs and buffers follow the plan's byte model, :mod:`lrmoe.bytemodel.layout` (the runtime
lays its
packets out by the same rules, and the cost model prices them): :func:`expected_layer`. The optimizer step, per rank n
and iteration (:func:`expected_step`):

* ``replica_sync``: Σ over experts e with lo_e ≤ n ≤ hi_e and h_e > 1 of 2·(h_e−1)/h_e · P·b_p, sent and received
  alike (a ring all-reduce: a model of the wire traffic, which the collective library may organise differently);
* ``grad_collect``: receives b_p · shard_n for every expert whose source(n, e) is another rank; sends
  b_p · shard_m for every (m ≠ n, e) with source(m, e) = n;
* ``redistribute``: receives b_p · |X_n| · (P − shard_n); sends b_p · shard_n · Σ_{m≠n} |X_m|.

A plan of online replication also pushes weights before its expert compute (:func:`expected_push`,
``weight_push``): rank n sends P·b_p to rank m for every distinct expert m's pushed slots take from n's slots.

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

from lrmoe.bytemodel.layout import (BYTE_PHASES, COUNTERS, PHASES, layer_counts, pair_matrix_NN)  # noqa: F401 - re-exported
from lrmoe.recal.scoring import get_metric
from lrmoe.bytemodel.sync_model import push_bytes, step_bytes


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


# -- the formulas ---------------------------------------------------------------------------------------------
def expected_layer(plan, hidden: int, ffn: int, act_bytes: int, metric: str | None = None, compact: bool = True,
                   input_grad: bool = True, param_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """What every rank of a layer running ``plan`` counts in one forward and backward ([N] each): the bytes of the
    all-to-alls, the pairs and the buffers, by the plan's byte model (:func:`lrmoe.bytemodel.layout.layer_counts`), and
    the
    bytes of the plan's weight push (:func:`expected_push`; only for plans that carry one).
    ``metric``: the recalibration metric's name (its extra combine columns ride along when the plan selects; None:
    the plain backward); ``compact``: the backward's compaction switch; ``input_grad=False``: no input gradients;
    ``param_bytes``: bytes per slot-weight element (default ``act_bytes``: the layer computes in the slots' dtype)."""
    cols = get_metric(metric).combine_cols if metric is not None else 0
    out = layer_counts(plan, hidden, ffn, act_bytes, compact=compact, combine_cols=cols, input_grad=input_grad)
    if getattr(plan, "push_src_G", None) is not None:
        out.update(expected_push(plan, hidden, ffn, act_bytes if param_bytes is None else param_bytes))
    return out


def expected_push(plan, hidden: int, ffn: int, param_bytes: int) -> dict[str, torch.Tensor]:
    """``weight_push.sent_bytes`` / ``.recv_bytes`` ([N] each) of the plan's weight push: the closed form of
    :func:`lrmoe.bytemodel.sync_model.push_bytes` (a whole expert, 3·D·F·b_p, per distinct expert a rank sends
    another)."""
    push_NM = push_bytes(plan.placement_NS, plan.push_src_G, 3 * hidden * ffn, param_bytes)
    return {"weight_push.sent_bytes": push_NM.sum(1), "weight_push.recv_bytes": push_NM.sum(0)}


def expected_step(placement_NS: torch.Tensor, next_placement_NS: torch.Tensor, num_experts: int, hidden: int,
                  ffn: int, param_bytes: int, replica_grad: str = "range") -> dict[str, torch.Tensor]:
    """The optimizer-step bytes of every rank ([N] each): replica sync, gradient collection, redistribution, in
    ``replica_grad`` mode: the closed form of :func:`lrmoe.bytemodel.sync_model.step_bytes` (the byte model the cost
    model
    prices too)."""
    return step_bytes(placement_NS, next_placement_NS, num_experts, 3 * hidden * ffn, param_bytes,
                      replica_grad=replica_grad).per_rank()


def symi_step_bytes(slots_per_rank: int, num_ranks: int, hidden: int, ffn: int, param_bytes: int) -> dict[str, int]:
    """SYMI's totals over all ranks, for comparison: s·N·W redistribution and s·N·G gradient bytes."""
    W = 3 * hidden * ffn * param_bytes
    return {"redistribute": slots_per_rank * num_ranks * W, "gradient": slots_per_rank * num_ranks * W}


def check_accounting(record: dict, expected: dict[str, torch.Tensor], rank: int) -> None:
    """Raise ``RuntimeError`` naming every quantity whose counted value on ``rank`` differs from the formula."""
    bad = []
    for key, values in expected.items():
        want = int(values[rank])
        got = int(record.get(key, 0))
        if got != want:
            bad.append(f"{key}: counted {got}, formula {want}")
    if bad:
        raise RuntimeError(f"rank {rank}: accounting disagrees with the formulas: " + "; ".join(bad))
