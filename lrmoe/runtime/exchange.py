"""The recalibrated expert exchange of the EP layer: one autograd op from the tokens at home to the per-pair
expert outputs back at home, with a hand-written backward that moves and computes only the retained pairs.

Forward (no autograd inside): the dispatcher's one data path (:class:`lrmoe.runtime.dispatch.TokenDispatcher`: pack →
all-to-all → slot-major), the SwiGLU of every local slot as grouped GEMMs, *saving* its activations (input, gate and
up pre-activations, h), and the dispatcher's combine back home.
The op returns o_MD, one row per computed pair in the forward's packed order; the layer's weighted un-permute
(``y_t = Σ_j g_tj · o_tj``) stays outside, so the router gradient, which only needs ⟨δ, o⟩ at home, is exact for
every pair, whatever this backward keeps.

Backward, on every rank (DESIGN.md §4 steps 4–8):

1. *Select, at home.* grad_o = g·δ arrives for each pair. If the plan trims (keep_NG < fwd_NG) or moves pairs
   (bwd_flows_V4), the recalibration metric scores the pairs and :func:`lrmoe.recal.selection.select` keeps the top
   keep_NG[home, g] of each group (home rank, forward slot g) (or a sample scaled by 1/p, unbiased mode); the
   flows out of (home, g) take the group's lowest-scoring kept pairs (:func:`flow_slots`). Dropped pairs stop
   here: they never cross the network.
2. *Compact and send.* Compact layout: the retained gradient rows, plus the input rows of moved pairs, packed by
   (destination rank, local slot) with the compaction kernel; the expert rank also needs to know which of its
   saved forward rows each staying row is, so a small int32 index per staying row follows in a second
   all-to-all. Forward layout (``compact=False``, the padded ablation, and the fast path of plans that keep
   everything): the gradient rows in the forward's own layout, zeros where a pair was not retained or moved
   away, then the moved pairs' rows; no index needed, more bytes. Split sizes come from the plan: every rank
   knows them without a collective.
3. *Expert backward on retained rows only.* Rows that stay on their forward slot reuse the saved activations;
   moved rows recompute their forward from the carried input. One variable-size grouped GEMM per weight
   (dX, dW), weight gradients into the slots.
4. *Input gradients home.* Only retained rows travel back; they are scatter-added into token order.

*Early selection* (``BackwardConfig.early``, DESIGN.md §4): with a metric the forward already knows (the gate, or
random), step 1 runs in the forward, before the dispatch; one byte per pair (kept or not) rides to the experts
(phase ``early_keep_a2a``), which save the activations of the kept rows alone. The backward then runs steps 2–4 on
that choice, unchanged (the compact layout: a staying row's index points into the kept rows).

A plan that keeps every computed pair and moves none is the plain backward: the forward layout, every row, no
selection (bitwise what autograd through the forward would give). The byte layout of every packet is
:mod:`lrmoe.bytemodel.layout`'s. The ablations of DESIGN.md §4 map onto :class:`BackwardConfig` (metric → ``"random"``,
compaction → padded) and onto the policy (placement, quotas, backward routing). What the backward chose is written
to the forward's :class:`BackwardRecord`. The exchange receives the dispatcher and its
:class:`~lrmoe.runtime.comm.Comm`,
never the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lrmoe.runtime.dispatch import Dispatch, TokenDispatcher
from lrmoe.runtime.expert_compute import Activations, SwiGLUExperts, slot_offsets
from lrmoe.kernels.amp import amp_backward, amp_forward, autocast_dtype
from lrmoe.kernels.compact import CompactPlan, compact_plan, pack, unpack
from lrmoe.bytemodel.layout import CARRY, MOVED, STAY, backward_counts, pair_matrix_NN, plan_selects, receive_layout
from lrmoe.recal.scoring import PairParts, get_metric
from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.recal.selection import group_order, select


@dataclass
class BackwardRecord:
    """What the backward of one forward did on this rank, per local pair p = t·k + j (filled by the backward).

    keep_P      bool: the pair's backward ran (False for pairs trimmed here or dropped by a forward capacity).
    scale_P     float: its gradient multiplier (1, or 1/p in the unbiased mode; 0 when not kept).
    scores_P    float: its recalibration score (nan where no selection ran or the pair was not computed).
    bwd_slot_P  long: the global slot that ran its backward, -1 when not kept.
    selected    whether a selection ran (the plan trims or moves pairs); False: every computed pair is kept.
    """

    top_k: int
    keep_P: Tensor | None = None
    scale_P: Tensor | None = None
    scores_P: Tensor | None = None
    bwd_slot_P: Tensor | None = None
    selected: bool = False
    num_backward: int = field(default=0)

    def _need(self) -> None:
        if self.keep_P is None:
            raise RuntimeError("no backward has run through this forward yet")

    @property
    def keep_TK(self) -> Tensor:
        self._need()
        return self.keep_P.view(-1, self.top_k)

    @property
    def scale_TK(self) -> Tensor:
        self._need()
        return self.scale_P.view(-1, self.top_k)


# -- pure bookkeeping ------------------------------------------------------------------------------------------




def flow_slots(slot_M: Tensor, keep_M: Tensor, scores_M: Tensor, flows_V3: Tensor) -> Tensor:
    """The global slot that runs each row's backward (-1: not kept), by the plan's pair-level rule.

    slot_M: forward slot (the group) of each row of one source rank; keep_M: the selection; flows_V3: that
    source's rows (from_slot, to_slot, count) of bwd_flows_V4, sorted. The flows out of a group take its
    lowest-scoring kept rows, the lowest ones to the first flow row; the rest stay. Kept rows are ranked as
    :func:`lrmoe.recal.selection.select` ranks them (score descending, then row index), so "lowest" is its reverse.
    Example: a group of kept rows scored [.9, .1, .5, .3] with flows (g, a, 1), (g, b, 2): the .1 row goes to
    a, the .3 and .5 rows to b, the .9 row stays.
    """
    bwd_M = torch.full_like(slot_M, -1)
    kept = keep_M.nonzero().squeeze(1)
    bwd_M[kept] = slot_M[kept]
    if not flows_V3.numel() or not kept.numel():
        return bwd_M
    perm = group_order(scores_M[kept], slot_M[kept])
    rows, g = kept[perm], slot_M[kept][perm]
    num_groups = int(torch.maximum(g.max(), flows_V3[:, 0].max())) + 1
    size = torch.bincount(g, minlength=num_groups)
    start = torch.cumsum(size, 0) - size
    low = size[g] - 1 - (torch.arange(g.numel()) - start[g])  # 0 = the group's lowest-scoring kept row
    frm, to, cnt = flows_V3.long().unbind(1)
    cum = torch.cumsum(cnt, 0)
    first = torch.ones_like(frm, dtype=torch.bool)
    first[1:] = frm[1:] != frm[:-1]
    base = torch.cummax(torch.where(first, cum - cnt, 0), 0).values  # pairs of earlier groups' flows
    big = int(cum[-1]) + slot_M.numel() + 1
    at = torch.searchsorted(frm * big + (cum - base), g * big + low, right=True)
    hit = (at < frm.numel()) & (frm[at.clamp(max=frm.numel() - 1)] == g)
    bwd_M[rows[hit]] = to[at[hit]]
    return bwd_M


def rows_only(plan: CompactPlan, dest_P: Tensor) -> CompactPlan:
    """The plan's rows blocks alone, back to back: the layout of what the experts return (no carried rows).
    ``dest_P``: the destination of every pair, as given to :func:`~lrmoe.kernels.compact.compact_plan`."""
    if not plan.num_carried:
        return plan
    carried_N = plan.carry_counts_NE.sum(1)
    before_N = torch.cumsum(carried_N, 0) - carried_N  # carried rows of earlier destinations
    pos_P = torch.where(plan.pos_P >= 0, plan.pos_P - before_N[dest_P.long()], -1)
    keep_M = ~plan.carry_M
    return replace(plan, num_carried=0, has_carry=False, pos_P=pos_P, carry_pos_P=torch.full_like(pos_P, -1),
                   pair_M=plan.pair_M[keep_M], carry_M=plan.carry_M[keep_M],
                   carry_counts_NE=torch.zeros_like(plan.carry_counts_NE))






# -- the exchange ----------------------------------------------------------------------------------------------
@dataclass
class Saved:
    """What the forward leaves for the backward on one rank (held by autograd, freed with the graph)."""

    x_TD: Tensor  # the local tokens: input rows of the pairs the backward moves
    slots_SW: Tensor  # the slot weights the forward used
    act: Activations  # the local slots' activations, slot-major (slot, source, forward order); early: kept rows
    h_norm_M: Tensor | None  # ‖h‖ of each pair at home (metric m2)
    o_MD: Tensor | None  # the pairs' outputs at home (metric m3)


class ExpertExchange:
    """One forward of the recalibrated exchange on one rank: built by the layer, run by :func:`expert_exchange`.

    ``dispatcher`` moves the rows (and its ``comm`` times, counts and exchanges); ``dispatch`` is the plan and this
    rank's forward bookkeeping; ``experts`` computes the local slots
    (:class:`~lrmoe.runtime.expert_compute.SwiGLUExperts`
    or anything with its two calls); ``record`` receives what the backward kept.
    """

    def __init__(self, dispatcher: TokenDispatcher, dispatch: Dispatch, gate_TK: Tensor, config: BackwardConfig,
                 generator: torch.Generator, record: BackwardRecord, experts: SwiGLUExperts):
        self.dispatcher, self.comm, self.dispatch = dispatcher, dispatcher.comm, dispatch
        self.config, self.generator, self.record, self.experts = config, generator, record, experts
        self.backend = dispatcher.kernel_backend
        self.gate_P = gate_TK.detach().reshape(-1)
        self.plan = dispatch.plan
        self.selects = plan_selects(self.plan)
        self.metric = get_metric(config.metric)
        self.compact = config.compact and self.selects  # plans that keep everything use the forward layout
        self.extra_cols = self.metric.combine_cols if self.selects else 0  # e.g. ‖h‖ rides home on the combine
        self.early = config.early and self.selects
        if self.early and (not self.compact or self.plan.bwd_flows_V4.numel()):
            raise ValueError("early selection saves the kept rows' activations alone: it needs the compact backward "
                             "and a plan that moves no pair between replicas")
        self.chosen = None  # early selection: the forward's (keep_M, scale_M, bwd_M)
        self.saved_row_R = None  # early selection: each slot-major row's place among the kept rows (-1: not kept)

    # -- forward -----------------------------------------------------------------------------------------------
    def forward(self, x_TD: Tensor, slots_SW: Tensor) -> tuple[Tensor, Saved]:
        d, comm = self.dispatch, self.comm
        if self.early:
            keep_slot_R = self._select_early(x_TD)
        x_slot_RD, held = self.dispatcher.dispatch(x_TD, d)
        with comm.phase("expert_fwd"):
            offs_S = slot_offsets(d.rows_per_slot_S, x_TD.device)
            y_slot_RD, act = self.experts.forward(x_slot_RD, slots_SW, offs_S)
            extra_RC = None
            if self.extra_cols:  # the metric's per-pair scalars from the expert side (‖h‖)
                extra_RC = torch.linalg.vector_norm(act.h_MF, dim=1)[:, None]
            if self.early:  # the activations of the kept rows alone outlive the forward
                kept_R = keep_slot_R.nonzero().squeeze(1)
                act = Activations(*(t.index_select(0, kept_R) for t in act))
                self.saved_row_R = torch.cumsum(keep_slot_R.long(), 0) - 1
        o_MD, extra_MC, held_back = self.dispatcher.combine(y_slot_RD, d, extra_RC)
        comm.count_bytes("token_buffer_bytes", *held, *held_back)
        keep_o = self.selects and self.metric.save_output
        h_norm_M = extra_MC[:, 0] if extra_MC is not None else None
        return o_MD, Saved(x_TD, slots_SW, act, h_norm_M, o_MD if keep_o else None)

    def _select_early(self, x_TD: Tensor) -> Tensor:
        """Early selection, in the forward: choose at home with the forward's metric, send each pair's keep bit
        with it to its expert; returns the kept mask of this rank's slot-major rows."""
        d, comm = self.dispatch, self.comm
        with comm.phase("recalibrate"):
            self.chosen = self.select(x_TD.new_empty((d.compact.pair_M.numel(), 0)))
        keep_recv = comm.exchange(self.chosen[0].to(torch.uint8)[:, None], d.send_splits, d.recv_splits,
                                  "early_keep_a2a")
        return keep_recv[:, 0].index_select(0, d.to_slot_R).bool()

    # -- backward, at home: the selection ----------------------------------------------------------------------
    def select(self, grad_o_MD: Tensor, saved: Saved | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
        """keep_M, scale_M (None: all ones) and the backward slot of every forward row (-1: not kept), in the
        forward's packed order; the same per local pair into the record. The metric scores on the data's device;
        only the [M] scores go to the host, where the selection's integer work runs."""
        d, plan, cfg, rank, rec = self.dispatch, self.plan, self.config, self.comm.rank, self.record
        pair_M = d.compact.pair_M
        device = grad_o_MD.device
        slot_M = d.slot_P.to(device)[pair_M]
        P = d.slot_P.numel()
        if not self.selects:
            rec.keep_P, rec.scale_P = d.slot_P >= 0, (d.slot_P >= 0).to(grad_o_MD.dtype)
            rec.scores_P, rec.bwd_slot_P, rec.selected = torch.full((P,), float("nan")), d.slot_P.clone(), False
            return torch.ones_like(slot_M, dtype=torch.bool), None, slot_M
        parts = PairParts(grad_o_MD, o_MD=None if saved is None else saved.o_MD,
                          h_norm_M=None if saved is None else saved.h_norm_M,
                          gate_M=self.gate_P.index_select(0, pair_M))
        scores_M = self.metric.score(parts, self.generator, cfg.mode).cpu()
        at = pair_M.cpu()
        group_M = d.slot_P[at]
        selection = select(scores_M, group_M, plan.keep_NG[rank].clone(), cfg.mode, self.generator,
                           uniform_mix=cfg.uniform_mix)
        flows = plan.bwd_flows_V4
        bwd_M = flow_slots(group_M, selection.keep_P, scores_M, flows[flows[:, 0] == rank][:, 1:])
        rec.keep_P = torch.zeros(P, dtype=torch.bool).index_copy_(0, at, selection.keep_P)
        rec.scale_P = torch.zeros(P, dtype=grad_o_MD.dtype).index_copy_(0, at, selection.scale_P.to(grad_o_MD.dtype))
        rec.scores_P = torch.full((P,), float("nan"), dtype=scores_M.dtype).index_copy_(0, at, scores_M)
        rec.bwd_slot_P = torch.full((P,), -1, dtype=torch.long).index_copy_(0, at, bwd_M)
        rec.selected = True
        scale_M = selection.scale_P.to(grad_o_MD) if cfg.mode == "unbiased" else None
        return selection.keep_P.to(device), scale_M, bwd_M.to(device)

    # -- backward ----------------------------------------------------------------------------------------------
    def backward(self, grad_o_MD: Tensor, saved: Saved, input_grad: bool) -> tuple[Tensor | None, Tensor]:
        """(dx_TD or None, the slots' weight gradient [S, P]); collective, like the forward."""
        comm, d, plan = self.comm, self.dispatch, self.plan
        rank, S = comm.rank, plan.slots_per_rank
        with comm.phase("recalibrate"):
            keep_M, scale_M, bwd_M = self.chosen if self.early else self.select(grad_o_MD, saved)
            if scale_M is not None:
                scale_M = scale_M.to(grad_o_MD)
            moved_M = keep_M & (bwd_M != d.slot_P.to(grad_o_MD.device)[d.compact.pair_M])
            send_NN, ret_NN, index_NN = (pair_matrix_NN(x, S) for x in backward_counts(plan, self.compact))
            if self.compact:
                payload, ret_plan, index_send = self._pack_compact(grad_o_MD, saved, keep_M, scale_M, bwd_M, moved_M)
            else:
                payload, ret_plan = self._pack_forward_layout(grad_o_MD, saved, keep_M, scale_M, bwd_M, moved_M)
            if payload.shape[0] != int(send_NN[rank].sum()):
                raise RuntimeError(f"rank {rank}: the backward packet has {payload.shape[0]} rows, the plan says "
                                   f"{int(send_NN[rank].sum())}: the selection disagrees with keep_NG / bwd_flows_V4")
        recv = comm.exchange(payload, send_NN[rank].tolist(), send_NN[:, rank].tolist(), "combine_a2a_bwd")
        index_recv = None
        if self.compact:
            index_recv = comm.exchange(index_send, index_NN[rank].tolist(), index_NN[:, rank].tolist(),
                                       "bwd_index_a2a")
        with comm.phase("expert_bwd"):
            dx_rows, d_slots = self._expert_backward(recv, index_recv, saved, input_grad)
        comm.count("pairs_retained", int(pair_matrix_NN(plan.bwd_NG, S)[:, rank].sum()))
        comm.count("pairs_recomputed", int(pair_matrix_NN(plan.moved_NG, S)[:, rank].sum()))
        comm.count_bytes("bwd_buffer_bytes", payload, recv, dx_rows)
        dx_TD = None
        if input_grad:  # rank as expert → each home, then home ← each expert
            back = comm.exchange(dx_rows, ret_NN[:, rank].tolist(), ret_NN[rank].tolist(), "dispatch_a2a_bwd")
            comm.count_bytes("bwd_buffer_bytes", back)
            with comm.phase("unpermute_bwd"):
                dx_TD = self._unpack_home(back, ret_plan, ret_NN[rank].tolist())
        self.record.num_backward += 1
        return dx_TD, d_slots

    def _pair_rows(self, grad_o_MD: Tensor, scale_M: Tensor | None) -> Tensor:
        """Gradient rows per local pair [P, D] (scaled in the unbiased mode), from the forward's packed order."""
        d = self.dispatch
        if not grad_o_MD.shape[0]:  # nothing computed here: no row is retained either
            return grad_o_MD.new_zeros(d.slot_P.numel(), grad_o_MD.shape[1])
        g = grad_o_MD if scale_M is None else grad_o_MD * scale_M[:, None]
        return g.index_select(0, d.compact.pos_P.clamp_min(0))

    def _per_pair(self, rows_M: Tensor, fill) -> Tensor:
        """A per-row quantity of the forward's packed order, per local pair (``fill`` where no row)."""
        pair_M = self.dispatch.compact.pair_M
        out = torch.full((self.dispatch.slot_P.numel(),), fill, dtype=rows_M.dtype, device=rows_M.device)
        return out.index_copy_(0, pair_M, rows_M)

    def _pack_compact(self, grad_o_MD, saved, keep_M, scale_M, bwd_M, moved_M):
        """Retained rows (and moved pairs' inputs) packed by (destination, slot), plus the index of each staying
        row among its forward group's rows, for the expert rank to find its saved activations."""
        d, plan = self.dispatch, self.plan
        S = plan.slots_per_rank
        keep_P, moved_P = self._per_pair(keep_M, False), self._per_pair(moved_M, False)
        bwd_P = self._per_pair(bwd_M.clamp_min(0), 0)
        dest_P = bwd_P // S
        bplan = compact_plan(dest_P, bwd_P % S, plan.num_ranks, S, keep_P, moved_P, top_k=self.record.top_k)
        payload = pack(self._pair_rows(grad_o_MD, scale_M), bplan,
                       carry_YD=saved.x_TD if bplan.num_carried else None, backend=self.backend)
        # index of each pair within its forward group (home, forward slot): the order the expert saved it in
        fwd_counts = d.compact.counts_NE.reshape(-1)
        group_start = torch.cumsum(fwd_counts, 0) - fwd_counts
        fidx_P = d.compact.pos_P - group_start[d.slot_P.to(grad_o_MD.device).clamp_min(0)]
        staying = ~bplan.carry_M & ~moved_P[bplan.pair_M]
        index_send = fidx_P[bplan.pair_M[staying]].to(torch.int32)
        return payload, rows_only(bplan, dest_P), index_send

    def _pack_forward_layout(self, grad_o_MD, saved, keep_M, scale_M, bwd_M, moved_M):
        """Per destination: the forward's rows (zero unless retained and staying), then the moved pairs' block
        (gradient rows, then input rows)."""
        d, plan = self.dispatch, self.plan
        S = plan.slots_per_rank
        stay_M = keep_M & ~moved_M
        if scale_M is None and bool(stay_M.all()):
            stay_rows = grad_o_MD  # the fast path: the forward's own layout, every row
        else:
            w_M = stay_M.to(grad_o_MD.dtype) if scale_M is None else stay_M.to(grad_o_MD.dtype) * scale_M
            stay_rows = grad_o_MD * w_M[:, None]
        if not bool(moved_M.any()):
            return stay_rows.contiguous(), None
        moved_P = self._per_pair(moved_M, False)
        bwd_P = self._per_pair(bwd_M.clamp_min(0), 0)
        mplan = compact_plan(bwd_P // S, bwd_P % S, plan.num_ranks, S, moved_P, moved_P, top_k=self.record.top_k)
        moved_rows = pack(self._pair_rows(grad_o_MD, scale_M), mplan, carry_YD=saved.x_TD, backend=self.backend)
        parts = []
        for a, b in zip(torch.split(stay_rows, d.send_splits), torch.split(moved_rows, mplan.send_splits())):
            parts += [a, b]
        return torch.cat(parts), (mplan, bwd_P // S)

    def _expert_backward(self, recv: Tensor, index_recv: Tensor | None, saved: Saved, input_grad: bool):
        """dx of every received gradient row (in receive order) and the slots' weight gradient [S, P].

        The batch: the received gradient rows sorted by slot. Staying rows take their saved activations
        (their row in the slot-major saved arrays: the (slot, source) segment's start plus the index that came
        with them, or their position in the forward layout); moved rows recompute from their carried input."""
        d, plan = self.dispatch, self.plan
        N, S, device = plan.num_ranks, plan.slots_per_rank, recv.device
        kind_R, slot_R, src_R = (t.to(device) for t in receive_layout(plan, self.comm.rank, self.compact))
        grad_pos = (kind_R != CARRY).nonzero().squeeze(1)
        order = torch.argsort(slot_R[grad_pos], stable=True)
        at_X = grad_pos[order]  # receive position of each batch row
        kind_X, slot_X = kind_R[at_X], slot_R[at_X]
        B = at_X.numel()
        act_saved = saved.act
        stay_R = kind_R == STAY
        within_R = torch.zeros_like(kind_R)
        if self.compact:
            within_R[stay_R] = index_recv.to(device).long()
        else:  # the staying rows of a (source, slot) segment are all its forward rows, in order
            seg = (src_R * S + slot_R)[stay_R]
            size = torch.bincount(seg, minlength=N * S)
            within_R[stay_R] = torch.arange(seg.numel(), device=device) - (torch.cumsum(size, 0) - size)[seg]
        fwd_SN = d.recv_counts_NS.to(device).T.reshape(-1)  # forward rows per (slot, source), slot-major
        saved_R = (torch.cumsum(fwd_SN, 0) - fwd_SN)[slot_R * N + src_R] + within_R
        if not self.compact and B == act_saved.x_MD.shape[0] and bool((kind_X == STAY).all()):
            act = act_saved  # every forward row in the forward's order: the saved activations as they are
        else:
            st = (kind_X == STAY).nonzero().squeeze(1)
            mv = (kind_X == MOVED).nonzero().squeeze(1)
            parts = [t.new_empty((B,) + t.shape[1:]) for t in act_saved]
            rows = saved_R[at_X[st]]
            if self.saved_row_R is not None:  # early selection: the saved arrays hold the kept rows alone
                rows = self.saved_row_R.index_select(0, rows)
            for dst, src in zip(parts, act_saved):
                dst.index_copy_(0, st, src.index_select(0, rows))
            if mv.numel():  # the k-th moved gradient row (receive order) owns the k-th carried input row
                moved_rank_R = torch.cumsum((kind_R == MOVED).long(), 0) - 1
                carry_R = (kind_R == CARRY).nonzero().squeeze(1)
                x_mv = recv.index_select(0, carry_R[moved_rank_R[at_X[mv]]])
                offs_mv = slot_offsets(torch.bincount(slot_X[mv], minlength=S), device)
                _, redo = self.experts.forward(x_mv, saved.slots_SW, offs_mv)
                for dst, src in zip(parts, redo):
                    dst.index_copy_(0, mv, src)
            act = Activations(*parts)
        offs_S = slot_offsets(torch.bincount(slot_X, minlength=S), device)
        dx_X, d_slots = self.experts.backward(act, recv.index_select(0, at_X), saved.slots_SW, offs_S, input_grad)
        self.comm.count("pairs_bwd", B)
        dx_rows = torch.empty_like(dx_X).index_copy_(0, order, dx_X) if input_grad else None  # receive order
        return dx_rows, d_slots

    def _unpack_home(self, back: Tensor, ret_plan, ret_splits: list[int]) -> Tensor:
        """Scatter-add the returned input-gradient rows into token order."""
        d, backend = self.dispatch, self.backend
        if self.compact:
            return unpack(back, ret_plan, per_token=True, backend=backend)
        if ret_plan is None:  # the forward layout alone
            return unpack(back, d.compact, per_token=True, backend=backend)
        mplan, dest_P = ret_plan
        parts = torch.split(back, ret_splits)
        fwd_rows = torch.cat([p[:n] for p, n in zip(parts, d.send_splits)])
        moved_rows = torch.cat([p[n:] for p, n in zip(parts, d.send_splits)])
        dx_TD = unpack(fwd_rows, d.compact, per_token=True, backend=backend)
        return dx_TD + unpack(moved_rows, rows_only(mplan, dest_P), per_token=True, backend=backend)


class _Exchange(torch.autograd.Function):
    """x_TD, slots_SW → o_MD (see the module doc). The backward is :meth:`ExpertExchange.backward`.

    Under autocast (bf16 mixed precision) the exchange computes in the autocast dtype, as autocast's matmuls do:
    the tokens and the slots' weights are cast to it, the all-to-alls and the grouped GEMMs run in it with autocast
    off (one dtype throughout), and o_MD comes back in x_TD's dtype, so the weighted combine runs in the model's
    dtype (HF's experts accumulate into an fp32 buffer the same way). The gradients return in the inputs' dtypes:
    fp32 slots keep fp32 gradients for the replica store's fp32 master step (DESIGN.md §3.5)."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_TD: Tensor, slots_SW: Tensor, state: ExpertExchange):
        ctx.dtypes = (x_TD.dtype, slots_SW.dtype)
        low = autocast_dtype(x_TD)
        if low is not None:
            x_TD, slots_SW = x_TD.to(low), slots_SW.to(low)
        with torch.autocast(x_TD.device.type, enabled=False):
            o_MD, saved = state.forward(x_TD, slots_SW)
        ctx.state = state
        ctx.save_for_backward(x_TD, slots_SW, *saved.act, saved.h_norm_M, saved.o_MD)
        return o_MD.to(ctx.dtypes[0])

    @staticmethod
    @amp_backward
    @once_differentiable
    def backward(ctx, grad_o_MD: Tensor):
        x_TD, slots_SW, x_MD, gate_MF, up_MF, h_MF, h_norm_M, o_MD = ctx.saved_tensors
        saved = Saved(x_TD, slots_SW, Activations(x_MD, gate_MF, up_MF, h_MF), h_norm_M, o_MD)
        with torch.autocast(x_TD.device.type, enabled=False):
            dx_TD, d_slots = ctx.state.backward(grad_o_MD.to(x_TD.dtype).contiguous(), saved,
                                                ctx.needs_input_grad[0])
        x_dtype, slots_dtype = ctx.dtypes
        return None if dx_TD is None else dx_TD.to(x_dtype), d_slots.to(slots_dtype), None


def expert_exchange(x_TD: Tensor, slots_SW: Tensor, state: ExpertExchange) -> Tensor:
    """o_MD of the recalibrated exchange (see the module doc), differentiable in x_TD and the slot weights."""
    return _Exchange.apply(x_TD, slots_SW, state)
