"""The communication object of the expert-parallel layer: every exchange of the layer (the dispatcher's forward,
the expert exchange's backward, the plan's one all-gather) goes through a :class:`Comm`, which knows this rank, its
expert-parallel group and the accountant that times phases and counts bytes, and nothing of the layer."""

from __future__ import annotations

import math
from contextlib import nullcontext

from torch import Tensor

from lrmoe.runtime.distributed.accounting import Accountant
from lrmoe.runtime.distributed.comm import all_gather_rows, all_to_all_rows


class Comm:
    """What an exchange needs from its surroundings: this rank and the size of its expert-parallel ``group`` (None:
    the world), and the accountant (optional) that times phases and counts bytes and work. The layer builds one and
    hands it to the dispatcher and the backward; neither holds the layer."""

    def __init__(self, rank: int, num_ranks: int, accountant: Accountant | None = None, group=None):
        self.rank, self.num_ranks, self.accountant, self.group = rank, num_ranks, accountant, group

    def phase(self, name: str):
        return self.accountant.phase(name) if self.accountant is not None else nullcontext()

    def count(self, name: str, value: int) -> None:
        if self.accountant is not None:
            self.accountant.add(name, value)

    def count_bytes(self, counter: str, *tensors: Tensor | None) -> None:
        """Add the bytes of ``tensors`` to a buffer counter (``token_buffer_bytes``, ``bwd_buffer_bytes``)."""
        self.count(counter, sum(t.numel() * t.element_size() for t in tensors if t is not None))

    def all_gather_counts(self, counts_E: Tensor) -> Tensor:
        """long [N, E] on the host: every rank's routed pairs per expert (the one collective of the plan)."""
        return all_gather_rows(counts_E, self.group).cpu()

    def exchange(self, x: Tensor, send: list[int], recv: list[int], phase: str) -> Tensor:
        """A variable all-to-all over the rows of ``x`` (``send[r]`` rows to rank r, ``recv[r]`` from it), timed
        as ``phase``, with the bytes that leave and reach this rank. Not differentiable."""
        if self.accountant is None:
            return all_to_all_rows(x, send, recv, self.group)
        row = math.prod(x.shape[1:]) * x.element_size()
        with self.accountant.phase(phase):
            out = all_to_all_rows(x, send, recv, self.group)
        away = lambda splits: sum(s for r, s in enumerate(splits) if r != self.rank) * row  # noqa: E731
        self.accountant.add_bytes(phase, away(send), away(recv))
        return out
