"""A layer's next placement, computed on a background thread while the iteration runs (DESIGN.md §4).

SYMI and LRMoE place replicas from the previous iteration's counts, and online replication plans on a fixed home
layout, so no placement needs the counts of the forward being planned. The layer submits
``policy.placement(iteration counts, N, pairs)`` as soon as a training forward has planned (the iteration's counts
so far: a later micro-batch submits again with the new sum); the expert step takes the result as the placement the
weights move to, and the next iteration's forward, planning from exactly those counts (``prev_counts_E``), takes
it again as its placement instead of placing on the critical path. What the layer computes is the same function of
the same tensors, so every plan is bit for bit the one ``policy.plan`` makes (tests/test_placement_ahead.py).

A job is used only for the inputs it was made from: the same policy object, the same counts tensor (by identity),
the same ranks and the same pairs per micro-batch; anything else (the first iteration, counts set from a
checkpoint, a micro-batch routing another number of pairs) is placed on the spot, as before. One worker thread per
layer, started on first use (and again in a forked process, which does not inherit it); an error in the
placement is raised where its result is taken.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lrmoe.planner.plan import PlacingPolicy
from lrmoe.planner.policies import placement_popularity


@dataclass(frozen=True)
class PlacementJob:
    """One submitted placement: its inputs (the key it answers for) and its future result."""

    policy: PlacingPolicy
    source_NE: torch.Tensor  # the iteration counts it was made from (identity is the key)
    counts_E: torch.Tensor  # their global sum: the next iteration's prev_counts_E
    num_ranks: int
    total_pairs: int
    future: Future

    def answers(self, policy, counts_E: torch.Tensor | None, num_ranks: int, total_pairs: int) -> bool:
        return (self.policy is policy and self.counts_E is counts_E and self.num_ranks == num_ranks
                and self.total_pairs == total_pairs)


class PlacementAhead:
    """The background placement of one layer: :meth:`submit` after a training forward, :meth:`next_for` at the
    expert step, :meth:`current_for` at every forward of the next iteration. ``hits`` counts the placements taken
    from a background job (``current``: forwards, ``next``: expert steps)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1
        self.job: PlacementJob | None = None  # the next placement, from this iteration's counts so far
        self.current: PlacementJob | None = None  # this iteration's, once a forward has taken it
        self.hits = {"current": 0, "next": 0}

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():  # a forked child does not inherit the worker thread
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lrmoe-placement")
            self._pid = os.getpid()
        return self._pool

    def submit(self, policy: PlacingPolicy, iteration_counts_NE: torch.Tensor, total_pairs: int) -> None:
        """Start placing from ``iteration_counts_NE`` (this iteration's counts so far); replaces the last job."""
        counts_E = iteration_counts_NE.sum(0)
        num_ranks = iteration_counts_NE.shape[0]
        future = self._executor().submit(policy.placement, counts_E, num_ranks, total_pairs)
        self.job = PlacementJob(policy, iteration_counts_NE, counts_E, num_ranks, total_pairs, future)

    def next_for(self, policy, iteration_counts_NE: torch.Tensor | None, total_pairs: int) -> torch.Tensor | None:
        """The placement after an iteration with these counts (None: no job made from them)."""
        job = self.job
        if job is None or job.source_NE is not iteration_counts_NE or job.policy is not policy \
                or job.total_pairs != total_pairs:
            return None
        self.hits["next"] += 1
        return job.future.result()

    def summed_counts(self, iteration_counts_NE: torch.Tensor) -> torch.Tensor:
        """The iteration's global counts: the job's own tensor when it was made from these counts (so that the next
        forward finds its job by identity), else their sum."""
        job = self.job
        return job.counts_E if job is not None and job.source_NE is iteration_counts_NE else \
            iteration_counts_NE.sum(0)

    def current_for(self, policy: PlacingPolicy, prev_counts_E: torch.Tensor | None, num_ranks: int,
                    num_experts: int, total_pairs: int) -> torch.Tensor:
        """This iteration's placement: the background result made from ``prev_counts_E`` with these ranks and
        pairs, else placed now (what ``policy.plan`` does)."""
        for job in (self.current, self.job):
            if job is not None and prev_counts_E is not None and job.answers(policy, prev_counts_E, num_ranks,
                                                                             total_pairs):
                self.current = job
                self.hits["current"] += 1
                return job.future.result()
        return policy.placement(placement_popularity(prev_counts_E, num_experts), num_ranks, total_pairs)
