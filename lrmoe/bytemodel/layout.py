"""The byte model of one plan: which rows every all-to-all of an MoE layer-iteration carries, from the plan alone.

One set of rules, read by everything that counts or prices traffic: the runtime (:mod:`lrmoe.runtime.dispatch`,
:mod:`lrmoe.runtime.exchange`) lays its packets out by them, :mod:`lrmoe.runtime.distributed.accounting` turns them
into the bytes a
rank must have counted, and the cost model (:mod:`lrmoe.sim.cost`) into seconds. Pure: no ``torch.distributed``.

Notation (DESIGN.md §8, shape letters): N ranks, S slots per rank, G = N·S global slots, E experts, D hidden width,
F expert FFN width. From the plan: f = fwd_NG (forward pairs of source n on slot g), b = bwd_NG (retained pairs
whose backward runs on g), m = moved_NG (of those, the ones that moved to g from another replica), k = keep_NG −
moved_out_NG (retained pairs that stay on their forward slot).

Per (source n, slot g), the layer moves:

* ``dispatch_a2a`` f input rows home → expert; ``combine_a2a`` f output rows back (plus the metric's extra combine
  columns, e.g. ‖h‖ for m2, when the plan selects);
* the backward, in the *compact* layout (the plan trims or moves pairs and compaction is on): ``combine_a2a_bwd``
  b + m rows (retained output gradients, then the moved pairs' input rows), ``bwd_index_a2a`` one int32 per staying
  row (k), ``dispatch_a2a_bwd`` b input-gradient rows back; in the *forward* layout (padded ablation, or a plan that
  keeps everything): f + 2m rows out (every forward row, zero where not retained, plus moved gradient and input
  rows), f + m back, no index.

Rows a rank exchanges with itself are local copies and count zero bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# -- the phase vocabulary, shared by the accountant, the layer bench and the cost model ---------------------------
FORWARD_PHASES = ("route", "plan", "weight_push", "permute", "early_keep_a2a", "dispatch_a2a", "expert_fwd",
                  "shared_fwd", "combine_a2a", "unpermute")
BACKWARD_PHASES = ("recalibrate", "combine_a2a_bwd", "bwd_index_a2a", "expert_bwd", "shared_bwd",
                   "dispatch_a2a_bwd", "unpermute_bwd")
STEP_PHASES = ("replica_sync", "grad_collect", "adam", "redistribute")
PHASES = FORWARD_PHASES + BACKWARD_PHASES + STEP_PHASES
A2A_PHASES = ("dispatch_a2a", "combine_a2a", "combine_a2a_bwd", "bwd_index_a2a", "dispatch_a2a_bwd")
# weight_push: online replication copies expert weights into spare slots before the expert compute
# (lrmoe.planner.online;
# its bytes are lrmoe.bytemodel.sync_model.push_bytes)
BYTE_PHASES = A2A_PHASES + ("weight_push", "replica_sync", "grad_collect", "redistribute", "early_keep_a2a")
# early_keep_a2a: early selection's keep bit, one byte per pair sent (lrmoe.runtime.exchange), in an all-to-all of
# its own beside the dispatch: the cost model prices its bytes and, the part that counts, its latency
COUNTERS = ("pairs_fwd", "pairs_bwd", "pairs_retained", "pairs_recomputed", "pairs_dropped", "token_buffer_bytes",
            "bwd_buffer_bytes")

INDEX_BYTES = 4  # one int32 per staying row in the compact backward layout
KEEP_BYTES = 1  # early selection's keep bit: one uint8 per pair, sent along the dispatch's splits
STAY, MOVED, CARRY = 0, 1, 2  # kinds of the rows an expert rank receives in the backward


# -- the plan's backward layout ------------------------------------------------------------------------------------
def pair_matrix_NN(x_NG: Tensor, slots_per_rank: int) -> Tensor:
    """c[src, dst]: ``x_NG`` (per source rank and global slot) summed over the slots of each destination rank."""
    N = x_NG.shape[0]
    return x_NG.reshape(N, N, slots_per_rank).sum(2)


def plan_selects(plan) -> bool:
    """Whether the plan's backward needs scores: it keeps fewer pairs than it computes, or moves some."""
    return bool(plan.bwd_flows_V4.numel()) or not torch.equal(plan.keep_NG, plan.fwd_NG)


def uses_compact(plan, compact: bool) -> bool:
    """Whether the backward runs in the compact layout: compaction on and something to compact."""
    return compact and plan_selects(plan)


def stay_NG(plan) -> Tensor:
    """[N, G] retained pairs of source n whose backward runs on their forward slot g."""
    return plan.keep_NG - plan.moved_out_NG


def backward_counts(plan, compact: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Rows per (source n, global slot g) of the backward exchange: (sent to g's rank, returned from it, index
    entries sent). See the module doc for the two layouts."""
    moved = plan.moved_NG
    if uses_compact(plan, compact):
        return plan.bwd_NG + moved, plan.bwd_NG, stay_NG(plan)
    return plan.fwd_NG + 2 * moved, plan.fwd_NG + moved, torch.zeros_like(plan.fwd_NG)


def receive_layout(plan, rank: int, compact: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Kind (STAY, MOVED, CARRY), local slot and source rank of every row ``rank`` receives in the backward.

    Per source, in rank order. Compact: for each local slot its moved rows then its staying rows (the
    compaction puts carried pairs first in a group), then the carried input rows slot by slot. Forward layout: the
    forward rows slot by slot (all "staying"; zeros where nothing was retained), the moved rows, their inputs.
    """
    N, S = plan.num_ranks, plan.slots_per_rank
    mine = slice(rank * S, (rank + 1) * S)
    moved_NS = plan.moved_NG[:, mine]
    if uses_compact(plan, compact):
        counts = torch.stack([moved_NS, stay_NG(plan)[:, mine]], 2).reshape(N, 2 * S)
        kinds = torch.tensor([MOVED, STAY]).repeat(S)
        slots = torch.arange(S).repeat_interleave(2)
    else:
        counts = torch.cat([plan.fwd_NG[:, mine], moved_NS], 1)
        kinds = torch.tensor([STAY, MOVED]).repeat_interleave(S)
        slots = torch.arange(S).repeat(2)
    counts = torch.cat([counts, moved_NS], 1)  # [N, L] segments per source
    kinds = torch.cat([kinds, torch.full((S,), CARRY)])
    slots = torch.cat([slots, torch.arange(S)])
    L = kinds.numel()
    flat = counts.reshape(-1)
    return (kinds.repeat(N).repeat_interleave(flat), slots.repeat(N).repeat_interleave(flat),
            torch.arange(N).repeat_interleave(L).repeat_interleave(flat))


# -- traffic of one layer-iteration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """One all-to-all: ``rows_NN[src, dst]`` rows of ``row_bytes`` bytes each go from rank src to rank dst."""

    rows_NN: Tensor  # long [N, N]
    row_bytes: int

    @property
    def bytes_NN(self) -> Tensor:
        """long [N, N] bytes from src to dst, the diagonal (a rank's exchange with itself) zeroed."""
        off = self.rows_NN - torch.diag(torch.diag(self.rows_NN))
        return off.long() * self.row_bytes

    @property
    def sent_N(self) -> Tensor:
        return self.bytes_NN.sum(1)

    @property
    def recv_N(self) -> Tensor:
        return self.bytes_NN.sum(0)


def layer_traffic(plan, hidden: int, act_bytes: int, *, compact: bool = True, combine_cols: int = 0,
                  input_grad: bool = True) -> dict[str, Traffic]:
    """Every all-to-all of one layer-iteration executing ``plan``, by phase (:data:`A2A_PHASES`).

    ``compact``: the backward's compaction switch (the layout is compact only where the plan selects);
    ``combine_cols``: the extra elements per combine row the recalibration metric needs home when the plan selects
    (m2: 1); ``input_grad=False``: the layer's input needs no gradient, so no input gradients travel back.
    """
    S = plan.slots_per_rank
    row = hidden * act_bytes
    c = pair_matrix_NN(plan.fwd_NG, S).long()
    extra = combine_cols if plan_selects(plan) else 0
    send_NG, ret_NG, index_NG = backward_counts(plan, compact)
    s, r, k = (pair_matrix_NN(x, S).long() for x in (send_NG, ret_NG, index_NG))
    return {
        "dispatch_a2a": Traffic(c, row),
        "combine_a2a": Traffic(c.T, row + extra * act_bytes),
        "combine_a2a_bwd": Traffic(s, row),
        "bwd_index_a2a": Traffic(k, INDEX_BYTES),
        "dispatch_a2a_bwd": Traffic(r.T * int(input_grad), row),
    }


def layer_counts(plan, hidden: int, ffn: int, act_bytes: int, *, compact: bool = True, combine_cols: int = 0,
                 input_grad: bool = True) -> dict[str, Tensor]:
    """What one rank of the layer counts in one iteration ([N] each): ``<phase>.sent_bytes`` / ``.recv_bytes`` of
    every all-to-all, the pairs computed forward and backward, retained, recomputed and dropped, and the token and
    backward buffer bytes.

    Buffers (all live at once while autograd holds them: an upper bound of their peak). Forward: home side the packed
    send and the combine receive, 2·A_n rows; expert side the received rows, their slot-major copy, the expert output
    and its source-major copy, 4·R_n rows (rows of D elements, the combine's plus its extra columns), plus the experts'
    activations gate, up and h, 3·R_n·F. Backward: the packets sent and received each way.
    """
    S = plan.slots_per_rank
    traffic = layer_traffic(plan, hidden, act_bytes, compact=compact, combine_cols=combine_cols,
                            input_grad=input_grad)
    out: dict[str, Tensor] = {}
    for phase, t in traffic.items():
        out[f"{phase}.sent_bytes"], out[f"{phase}.recv_bytes"] = t.sent_N, t.recv_N
    c = traffic["dispatch_a2a"].rows_NN
    A, R = c.sum(1), c.sum(0)
    row, comb_row = hidden * act_bytes, traffic["combine_a2a"].row_bytes
    s = traffic["combine_a2a_bwd"].rows_NN
    r = pair_matrix_NN(backward_counts(plan, compact)[1], S).long()  # [home, expert rank] rows returned
    ig = int(input_grad)
    out["pairs_fwd"] = R
    out["pairs_bwd"] = r.sum(0)
    out["pairs_retained"] = pair_matrix_NN(plan.bwd_NG, S).long().sum(0)
    out["pairs_recomputed"] = pair_matrix_NN(plan.moved_NG, S).long().sum(0)
    out["pairs_dropped"] = plan.dropped_NE.sum(1).long()
    out["token_buffer_bytes"] = (A + 3 * R) * row + (A + R) * comb_row + 3 * R * ffn * act_bytes
    out["bwd_buffer_bytes"] = (s.sum(1) + s.sum(0) + ig * (r.sum(0) + r.sum(1))) * row
    return out
