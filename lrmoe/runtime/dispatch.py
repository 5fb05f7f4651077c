"""The token dispatcher of the expert-parallel layer: the one forward data path from the tokens at home to the
per-pair expert outputs back home. Every exchange goes through a :class:`~lrmoe.runtime.comm.Comm`.

    assign pairs (plan's pair-level rule) → pack by (destination rank, local slot) → variable all-to-all
    → slot-major → [expert compute: the caller's] → source-major → all-to-all back → (weighted un-permute)

:func:`make_dispatch` turns one rank's routing and the plan into integer bookkeeping (:class:`Dispatch`, no data
moves, no gradients); :class:`TokenDispatcher` moves rows by it. Nothing here is differentiable: the expert exchange
(:mod:`lrmoe.runtime.exchange`) wraps the whole path in one autograd op with a hand-written backward, which moves its
packets through the same :class:`~lrmoe.runtime.comm.Comm`.

Pair-level rule (shared with the planner and the simulator): the pairs of (source rank n, expert e), in token
order, minus the ``dropped_NE[n, e]`` the plan drops (the last ones by position, or the lowest-gate ones), fill e's
slots in increasing global-slot order, ``fwd_NG[n, g]`` pairs to slot g.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from lrmoe.kernels.compact import CompactPlan, compact_plan, pack, unpack
from lrmoe.planner.plan import DROP_RULES, LayerPlan
from lrmoe.runtime.comm import Comm


# -- pure bookkeeping ----------------------------------------------------------------------------------------------
def assign_pairs(idx_TK: Tensor, gate_TK: Tensor, fwd_G: Tensor, dropped_E: Tensor, slot_expert_G: Tensor,
                 drop_by: str = "position") -> Tensor:
    """The global slot of each local pair p = t·k + j (-1: dropped), by the pair-level rule.

    ``fwd_G`` / ``dropped_E`` are this source rank's row of the plan's ``fwd_NG`` / ``dropped_NE``. Dropped are the
    last ``dropped_E[e]`` pairs of e in token order (``drop_by="position"``) or its lowest-gate ones (``"gate"``,
    ties dropping the later token). The kept pairs of e then fill e's slots in increasing g. Requires
    Σ_{g of e} fwd_G[g] + dropped_E[e] = the pairs routed to e.
    """
    if drop_by not in DROP_RULES:
        raise ValueError(f"drop_by must be one of {DROP_RULES}, got {drop_by!r}")
    E, G = dropped_E.numel(), fwd_G.numel()
    with torch.no_grad():
        idx_P = idx_TK.reshape(-1).long()
        P = idx_P.numel()
        counts_E = torch.bincount(idx_P, minlength=E)
        slot_e = slot_expert_G.long()
        planned_E = torch.zeros(E, dtype=torch.long).index_add_(0, slot_e.clamp_min(0), torch.where(
            slot_e >= 0, fwd_G.long(), 0))
        if bool((fwd_G[slot_e < 0] != 0).any()):
            raise ValueError("the plan sends pairs to an empty slot (fwd_NG > 0 where placement is -1)")
        if not torch.equal(planned_E + dropped_E.long(), counts_E):
            raise ValueError(f"the plan does not account for this rank's pairs: computed + dropped per expert "
                             f"{(planned_E + dropped_E).tolist()} != routed {counts_E.tolist()}")
        # Rank of each pair inside its expert, in token order (stable sort: p increases with the token).
        order = torch.argsort(idx_P, stable=True)
        start_E = torch.cumsum(counts_E, 0) - counts_E
        pos_P = torch.empty(P, dtype=torch.long)
        pos_P[order] = torch.arange(P) - start_E[idx_P[order]]
        if drop_by == "position":
            drop_rank_P = pos_P
        else:  # rank by gate within the expert, highest first; among equal gates the earlier token first
            gate_P = gate_TK.detach().reshape(-1).double()
            by_gate = torch.argsort(-gate_P, stable=True)
            by_gate = by_gate[torch.argsort(idx_P[by_gate], stable=True)]
            drop_rank_P = torch.empty(P, dtype=torch.long)
            drop_rank_P[by_gate] = torch.arange(P) - start_E[idx_P[by_gate]]
        keep_P = drop_rank_P < (counts_E - dropped_E.long())[idx_P]
        # Kept pairs sorted by (expert, token) take consecutive positions q; slots sorted by (expert, g) take
        # consecutive capacity ranges: both orders group by expert with equal totals, so they line up.
        kept_order = order[keep_P[order]]
        slot_order = torch.argsort(slot_e * G + torch.arange(G), stable=True)
        cap_end = torch.cumsum(fwd_G.long()[slot_order], 0)
        q = torch.arange(kept_order.numel())
        slot_P = torch.full((P,), -1, dtype=torch.long)
        slot_P[kept_order] = slot_order[torch.searchsorted(cap_end, q, right=True)]
    return slot_P


def source_to_slot_major(counts_NS: Tensor) -> Tensor:
    """Row permutation from the receive order (source rank, then local slot) to slot-major order (slot, then
    source): ``x_slot = x_recv[index]``. Example, 2 sources and 2 slots with counts [[1, 2], [3, 0]]: received
    rows are s0j0 | s0j1 s0j1 | s1j0 s1j0 s1j0 = rows 0 | 1 2 | 3 4 5, slot-major 0 3 4 5 | 1 2."""
    c = counts_NS.long()
    start_NS = (torch.cumsum(c.reshape(-1), 0) - c.reshape(-1)).view_as(c)
    c_T, start_T = c.T.reshape(-1), start_NS.T.reshape(-1)
    total = int(c_T.sum())
    run_start = torch.repeat_interleave(torch.cumsum(c_T, 0) - c_T, c_T)
    return torch.repeat_interleave(start_T, c_T) + torch.arange(total) - run_start


@dataclass(frozen=True)
class Dispatch:
    """The integer bookkeeping of one forward on one rank (no gradients): what the backward needs too."""

    plan: LayerPlan
    counts_NE: Tensor  # long [N, E]: routed pairs per (source rank, expert), all-gathered
    idx_TK: Tensor  # long: local routing
    slot_P: Tensor  # long [T·k] on the host: global slot computing each local pair, -1 if dropped
    compact: CompactPlan  # the home-side packing; compact.pair_M maps o_MD's rows to pairs
    send_splits: list[int]  # rows sent to each rank (and received back in the combine)
    recv_splits: list[int]  # rows received from each rank
    recv_counts_NS: Tensor  # long [N, S]: rows received per (source, local slot)
    to_slot_R: Tensor  # long [R]: x_slot = x_recv[to_slot_R] (source_to_slot_major, on the data's device)
    from_slot_R: Tensor  # long [R]: its inverse, x_recv = x_slot[from_slot_R]

    @property
    def rows_per_slot_S(self) -> Tensor:
        """long [S]: rows each local slot computes (the grouped GEMM's group sizes)."""
        return self.recv_counts_NS.sum(0)


def make_dispatch(idx_TK: Tensor, gate_TK: Tensor, plan: LayerPlan, counts_NE: Tensor, rank: int,
                  device: torch.device) -> Dispatch:
    """Each local pair's slot by the plan's pair-level rule, the packing by (destination rank, local slot) and the
    all-to-all split sizes. No data moves; the routing goes to the host once (the split sizes are host integers)."""
    N, S = plan.num_ranks, plan.slots_per_rank
    K = idx_TK.shape[1]
    fwd_NG = plan.fwd_NG.cpu().long()
    slot_P = assign_pairs(idx_TK.cpu(), gate_TK.cpu(), fwd_NG[rank], plan.dropped_NE[rank].cpu(),
                          plan.slot_expert_G, plan.drop_by)
    keep_P = slot_P >= 0
    slot_dev = slot_P.clamp_min(0).to(device)
    cplan = compact_plan(slot_dev // S, slot_dev % S, N, S, keep_P.to(device), top_k=K)
    recv_counts_NS = fwd_NG[:, rank * S:(rank + 1) * S]
    to_slot_R = source_to_slot_major(recv_counts_NS).to(device)
    from_slot_R = torch.empty_like(to_slot_R).scatter_(0, to_slot_R, torch.arange(to_slot_R.numel(), device=device))
    return Dispatch(plan=plan, counts_NE=counts_NE, idx_TK=idx_TK, slot_P=slot_P, compact=cplan,
                    send_splits=cplan.send_splits(), recv_splits=recv_counts_NS.sum(1).tolist(),
                    recv_counts_NS=recv_counts_NS, to_slot_R=to_slot_R, from_slot_R=from_slot_R)


# -- moving rows ---------------------------------------------------------------------------------------------------
class TokenDispatcher:
    """Moves rows along one :class:`Dispatch`: the forward's dispatch and combine and the home-side un-permute.

    ``comm`` times, counts and exchanges; ``kernel_backend`` picks the compaction kernels (None: Triton on a GPU).
    """

    def __init__(self, comm: Comm, kernel_backend: str | None = None):
        self.comm, self.kernel_backend = comm, kernel_backend

    def dispatch(self, x_TD: Tensor, d: Dispatch) -> tuple[Tensor, list[Tensor]]:
        """The local pairs' input rows at the slots that compute them, slot-major: (x_slot_RD, buffers held)."""
        with self.comm.phase("permute"):
            x_send_MD = pack(x_TD, d.compact, backend=self.kernel_backend)
        x_recv_RD = self.comm.exchange(x_send_MD, d.send_splits, d.recv_splits, "dispatch_a2a")
        with self.comm.phase("expert_fwd"):
            x_slot_RD = x_recv_RD.index_select(0, d.to_slot_R)
        return x_slot_RD, [x_send_MD, x_recv_RD, x_slot_RD]

    def combine(self, y_slot_RD: Tensor, d: Dispatch, extra_slot_RC: Tensor | None = None
                ) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """The inverse of :meth:`dispatch`: the slots' output rows home, in the packed order of ``d.compact``.
        ``extra_slot_RC`` are per-row scalars that ride along (a metric's extra combine columns). Returns
        (o_MD, extra_MC or None, buffers held)."""
        with self.comm.phase("expert_fwd"):
            y_recv_RD = y_slot_RD.index_select(0, d.from_slot_R)
            if extra_slot_RC is not None:
                extra = extra_slot_RC.index_select(0, d.from_slot_R).to(y_recv_RD.dtype)
                y_recv_RD = torch.cat([y_recv_RD, extra], 1)
        o_recv_MD = self.comm.exchange(y_recv_RD, d.recv_splits, d.send_splits, "combine_a2a")
        buffers = [y_slot_RD, y_recv_RD, o_recv_MD]
        if extra_slot_RC is None:
            return o_recv_MD, None, buffers
        C = extra_slot_RC.shape[1]
        return o_recv_MD[:, :-C].contiguous(), o_recv_MD[:, -C:].contiguous(), buffers

    def unpermute(self, o_MD: Tensor, d: Dispatch, gate_TK: Tensor,
                  pair_hook: Callable[[Tensor, Dispatch], Tensor] | None = None) -> Tensor:
        """y_t = Σ_j gate_tj · o_tj from the per-pair outputs at home (packed order), after ``pair_hook``.
        Differentiable in o_MD and gate_TK (the router gradient sees every computed pair)."""
        with self.comm.phase("unpermute"):
            if pair_hook is not None:
                o_MD = pair_hook(o_MD, d)
            return unpack(o_MD, d.compact, weight_P=gate_TK.reshape(-1).to(o_MD.dtype), per_token=True,
                          backend=self.kernel_backend)
