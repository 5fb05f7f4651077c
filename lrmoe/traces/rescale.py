"""A recorded trace replayed at paper scale (docs/protocols/time_to_quality.md §11.3): the run's own routing, its
per-(step, layer, source rank) shares of the experts kept, scaled to the paper's tokens and spread over the paper's
layers.

    paper = to_paper_scale(run_trace, num_layers=48, tokens_per_rank=2048, micro_batches=8)

Paper layer l replays recorded layer ⌊l · L_run / L⌋. Each row of counts (one step, layer and source rank: the pairs
that rank routed to every expert) is scaled to ``tokens_per_rank · top_k · micro_batches`` pairs by exact integer
apportionment (floor or ceiling of each expert's share, the row's sum exact), so the shares of the experts, the
per-rank imbalance and the drift between steps are the run's. The experts and the source ranks must be the
paper's already: the protocol's model routes over the paper's E = 128 experts from the paper's N = 16 ranks.
"""

from __future__ import annotations

import numpy as np

from lrmoe.checks import apportion_rows_array
from lrmoe.traces.trace import Trace


def layer_map(recorded_layers: int, num_layers: int) -> np.ndarray:
    """The recorded layer each of ``num_layers`` paper layers replays: ⌊l · L_run / L⌋."""
    if recorded_layers < 1 or num_layers < 1:
        raise ValueError(f"layer counts must be positive, got {recorded_layers} recorded and {num_layers} paper")
    return (np.arange(num_layers) * recorded_layers) // num_layers


def to_paper_scale(trace: Trace, num_layers: int, tokens_per_rank: int, micro_batches: int = 1,
                   top_k: int | None = None, num_experts: int | None = None, num_ranks: int | None = None,
                   steps: slice | None = None) -> Trace:
    """``trace`` at paper scale (module doc): a trace of ``num_layers`` layers whose every step sums
    ``micro_batches`` micro-batches of ``tokens_per_rank`` tokens per rank (its metadata says so, so the simulator
    prices it as that many micro-batches). ``top_k`` defaults to the trace's (its metadata, else each row's pairs
    over its tokens); ``num_experts`` / ``num_ranks``, when given, must be the trace's. ``steps``: the recorded steps
    to keep (e.g. after the warm-up)."""
    counts_ILNE = trace.counts_array()
    if steps is not None:
        counts_ILNE = counts_ILNE[steps]
    num_steps, L, N, E = counts_ILNE.shape
    if num_steps == 0:
        raise ValueError("the trace holds no step to rescale")
    if num_experts is not None and num_experts != E:
        raise ValueError(f"the trace routes over {E} experts, the paper's model has {num_experts}: a recorded trace "
                         f"is replayed at its own E (docs/protocols/time_to_quality.md §11.1)")
    if num_ranks is not None and num_ranks != N:
        raise ValueError(f"the trace has {N} source ranks, the paper's scale {num_ranks}")
    for name, value in (("num_layers", num_layers), ("tokens_per_rank", tokens_per_rank),
                        ("micro_batches", micro_batches)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    k = top_k if top_k is not None else trace.meta.get("top_k")
    if k is None:
        raise ValueError("top_k is neither given nor in the trace's metadata")
    rows_RE = counts_ILNE[:, layer_map(L, num_layers)].reshape(-1, E)
    if (rows_RE.sum(1) == 0).any():
        raise ValueError("a (step, layer, rank) row of the trace routes no pair: nothing to scale")
    total_R = np.full(len(rows_RE), tokens_per_rank * int(k) * micro_batches, dtype=np.int64)
    scaled_ILNE = apportion_rows_array(total_R, rows_RE).reshape(num_steps, num_layers, N, E)
    meta = {**{key: v for key, v in trace.meta.items() if key not in ("micro_batches",)},
            "source": "recorded, rescaled", "rescaled_from": {"layers": L, "steps": num_steps,
                                                              "recorded_source": trace.meta.get("source")},
            "top_k": int(k), "tokens_per_rank": tokens_per_rank, "micro_batches": micro_batches}
    return Trace(scaled_ILNE, meta)
