"""The time axis's skew matched to the training runs' routing (docs/protocols/frontier.md §10.1).

The statistic matched is static expert parallelism's per-rank load, slowest rank ÷ mean, per layer and iteration,
averaged (``load_stats``' ``rank_max_over_mean``): the straggler ratio I_S of DESIGN.md §5.5. The runs measure it
at their scale (the static-EP arm's evaluation records); :func:`match_zipf` finds the Zipf exponent at which the
synthetic generator (:func:`lrmoe.traces.synthetic.generate_trace`) gives the same ratio at the simulated
scale, by bisection (the ratio rises with s). Beside it, both sides' per-expert Gini and hottest ÷ mean are
reported: they are not matched (the scales differ in experts, ranks and tokens), only shown.

    runs = runs_imbalance(rows)                        # rows of the static-EP arm (protocol.collect_run)
    match = match_zipf(runs["rank_max_over_mean"], scale)
    check_matched(runs, match.simulated)               # ValueError when they are more than 5 % apart
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lrmoe.analysis import protocol
from lrmoe.config import cluster_preset, model_preset
from lrmoe.integrations.load_stats import load_stats
from lrmoe.traces.synthetic import generate_trace

STATS = ("rank_max_over_mean", "gini", "expert_max_over_mean")
RUN_KEYS = {"rank_max_over_mean": "load/rank_max_over_mean_mean", "gini": "load/gini_mean",
            "expert_max_over_mean": "load/expert_max_over_mean_mean"}
TOLERANCE = 0.05  # the largest relative distance between the two axes' slowest ÷ mean that still counts as matched


@dataclass(frozen=True)
class Scale:
    """The simulated scale a skew is matched at (a subset of layers and iterations suffices: every layer's
    popularity is drawn alike). ``exact``: every token's top-k drawn (the layer benchmark's traces), not the
    counts' multinomial approximation; with ``layers=1`` and a benchmark's steps and seed, the very trace it
    replays."""

    num_ranks: int
    num_experts: int
    top_k: int
    tokens_per_rank: int
    layers: int = 8
    steps: int = 4
    seed: int = 0
    exact: bool = False


@dataclass(frozen=True)
class Match:
    zipf_s: float
    target: float
    simulated: dict  # the synthetic trace's STATS at zipf_s


def trace_imbalance(counts_ILNE) -> dict:
    """STATS of a trace [iterations, layers, N, E] under static EP, averaged over layers and iterations."""
    per_iter = [load_stats(counts_LNE, percentiles=())["summary"] for counts_LNE in counts_ILNE]
    return {k: float(np.mean([s[f"{k}_mean"] for s in per_iter])) for k in STATS}


def synthetic_imbalance(zipf_s: float, scale: Scale) -> dict:
    """STATS of a synthetic Zipf trace at ``scale``."""
    trace = generate_trace(scale.steps, scale.layers, scale.num_ranks, scale.num_experts, scale.top_k,
                           scale.tokens_per_rank, skew="zipf", skew_param=zipf_s, seed=scale.seed, exact=scale.exact)
    return trace_imbalance(trace.counts_ILNE)


def runs_imbalance(rows) -> dict:
    """STATS of the training runs (collected rows of the static-EP arm: its plans are static EP's), mean over the
    runs, with their number."""
    rows = [r for r in rows if r.get("arm", "static-ep") == "static-ep"]
    if not rows:
        raise ValueError("no static-EP run to measure the routing's imbalance on")
    out = {}
    for stat, key in RUN_KEYS.items():
        values = [r[key] for r in rows if key in r]
        if not values:
            raise ValueError(f"the runs carry no {key!r} (collected without their load statistics?)")
        out[stat] = float(np.mean(values))
    return {**out, "runs": len(rows)}


def match_zipf(target: float, scale: Scale, s_max: float = 1.5, tol: float = 0.002) -> Match:
    """The Zipf s in [0, s_max] whose synthetic static-EP slowest rank ÷ mean at ``scale`` is ``target``, by
    bisection to ``tol`` in the ratio. A target below the unskewed trace's ratio (sampling noise alone) maps to 0;
    one above s_max's is an error."""
    if not target >= 1:
        raise ValueError(f"a slowest ÷ mean rank load is at least 1, got {target!r}")
    lo, hi = 0.0, s_max
    at_lo, at_hi = synthetic_imbalance(lo, scale), synthetic_imbalance(hi, scale)
    if target <= at_lo["rank_max_over_mean"]:
        return Match(0.0, target, at_lo)
    if target > at_hi["rank_max_over_mean"]:
        raise ValueError(f"slowest ÷ mean {target:.3f} is beyond Zipf {s_max:g}'s "
                         f"{at_hi['rank_max_over_mean']:.3f} at this scale")
    best = at_hi
    for _ in range(40):
        mid = (lo + hi) / 2
        best = synthetic_imbalance(mid, scale)
        gap = best["rank_max_over_mean"] - target
        if abs(gap) <= tol:
            return Match(mid, target, best)
        lo, hi = (mid, hi) if gap < 0 else (lo, mid)
    return Match((lo + hi) / 2, target, best)


def check_matched(runs: dict, simulated: dict, tolerance: float = TOLERANCE) -> None:
    """ValueError unless the simulated slowest ÷ mean is within ``tolerance`` (relative) of the runs'."""
    a, b = runs["rank_max_over_mean"], simulated["rank_max_over_mean"]
    if abs(b / a - 1) > tolerance:
        raise ValueError(f"the time axis is simulated at static-EP slowest ÷ mean {b:.3f}, the runs measured "
                         f"{a:.3f}: more than {tolerance:.0%} apart, the two axes describe different systems")


def side_by_side(runs: dict, simulated: dict) -> list[dict]:
    """Rows (statistic, runs, simulated, matched?) for the report."""
    return [{"statistic": k, "runs": runs[k], "simulated": simulated[k], "matched": k == "rank_max_over_mean"}
            for k in STATS]


def protocol_scale() -> Scale:
    """The frontier's time axis (docs/protocols/frontier.md §10.1): its model's experts and top-k on its cluster's
    ranks, its tokens per rank."""
    m = model_preset(protocol.SIM_MODEL)
    c = cluster_preset(protocol.SIM_CLUSTER, protocol.SIM_NODES)
    return Scale(c.num_ranks, m.num_experts, m.top_k, protocol.SIM_TOKENS_PER_RANK)


def regime_zipf(rows, regime: str, scale: Scale | None = None) -> Match:
    """The Zipf s matched to one regime's static-EP runs (collected rows carrying ``regime``, as the protocol's
    results files hold them) at the frontier's time-axis scale (default :func:`protocol_scale`): the skew every
    paper-scale simulation of that regime runs at."""
    rows = [r for r in rows if r.get("regime") == regime]
    if not rows:
        raise ValueError(f"no run of regime {regime!r} to match a skew to")
    return match_zipf(runs_imbalance(rows)["rank_max_over_mean"], scale or protocol_scale())
