"""Time recalibration scoring plus pair selection on one CPU thread, at the issue's size: 8,192 tokens × top-8
= 65,536 pairs in 16 source ranks × 128 experts = 2,048 groups (routing from a synthetic Zipf popularity).

Three timings per (metric, mode):

* ``select_ms``: scores from per-pair scalars (:func:`lrmoe.scoring.scores_from_parts`: gate, per-token ‖δ‖,
  ‖h‖, ⟨δ, o⟩, what the home rank holds before the backward dispatch) plus :func:`lrmoe.selection.select`.
  This is the number the ≤ 10 ms target is about;
* ``token_norm_ms``: the per-token reductions those scalars need at the model width D (‖δ_t‖ for T tokens;
  ⟨δ, o⟩ is shared with the router gradient and not counted);
* ``hook_ms`` (with --hook-width): the backward hook's own path, scores from per-pair output gradients
  grad_o [P, D'] (one pass over rows the backward dispatch sends anyway) plus selection.

    python experiments/bench_scoring.py --out outputs/bench_scoring.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from lrmoe.harness.timing import time_ms
from lrmoe.recalibrate import pair_groups, proportional_quotas
from lrmoe.scoring import METRICS, pair_scores, scores_from_parts
from lrmoe.selection import MODES, select
from lrmoe.tracking import Tracker, add_tracking_args
from lrmoe.traces import sample_topk, zipf_popularity


def make_problem(tokens: int, top_k: int, experts: int, sources: int, width: int, rho: float, zipf: float,
                 seed: int) -> dict:
    """Routing, per-pair scalars and quotas of one layer-iteration (synthetic, labelled as such)."""
    gen = torch.Generator().manual_seed(seed)
    idx_TK = sample_topk(torch.log(zipf_popularity(experts, zipf, gen)), tokens, top_k, gen)
    group_P, counts_Q = pair_groups(idx_TK, experts, sources)
    num_pairs = tokens * top_k
    return {
        "group_P": group_P, "quota_Q": proportional_quotas(counts_Q, rho),
        "gate_P": torch.rand(num_pairs, generator=gen), "h_norm_P": torch.rand(num_pairs, generator=gen) * 4,
        "delta_dot_o_P": torch.randn(num_pairs, generator=gen),
        "delta_TD": torch.randn(tokens, width, generator=gen), "top_k": top_k, "gen": gen,
    }


def bench(args) -> list[dict]:
    torch.set_num_threads(args.threads)
    prob = make_problem(args.tokens, args.top_k, args.experts, args.sources, args.width, args.rho, args.zipf,
                        args.seed)
    group_P, quota_Q, gen, K = prob["group_P"], prob["quota_Q"], prob["gen"], prob["top_k"]
    delta_norm_P = prob["delta_TD"].norm(dim=1).repeat_interleave(K)
    token_norm = time_ms(lambda: prob["delta_TD"].norm(dim=1), args.reps, warmup=3)
    grad_o_PD = o_PD = None
    if args.hook_width:
        grad_o_PD = torch.randn(group_P.numel(), args.hook_width, generator=gen)
        o_PD = torch.randn(group_P.numel(), args.hook_width, generator=gen)
    rows = []
    for metric in METRICS:
        for mode in MODES:
            def run_parts():
                scores = scores_from_parts(metric, prob["gate_P"], delta_norm_P=delta_norm_P,
                                           h_norm_P=prob["h_norm_P"], delta_dot_o_P=prob["delta_dot_o_P"],
                                           generator=gen)
                return select(scores, group_P, quota_Q, mode, gen)

            times = time_ms(run_parts, args.reps, warmup=3)
            row = {"metric": metric, "mode": mode, "pairs": group_P.numel(), "groups": quota_Q.numel(),
                   "threads": args.threads, "select_ms": statistics.median(times),
                   "select_p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
                   "token_norm_ms": statistics.median(token_norm), "width": args.width}
            if grad_o_PD is not None:
                def run_hook():
                    scores = pair_scores(metric, grad_o_PD, o_PD=o_PD, h_norm_P=prob["h_norm_P"],
                                         gate_P=prob["gate_P"], generator=gen)
                    return select(scores, group_P, quota_Q, mode, gen)

                row.update(hook_ms=statistics.median(time_ms(run_hook, max(3, args.reps // 4), warmup=3)),
                           hook_width=args.hook_width)
            rows.append(row)
    return rows


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--sources", type=int, default=16, help="source ranks: groups = sources × experts")
    parser.add_argument("--width", type=int, default=2048,
                        help="model width D for the per-token ‖δ‖ (Qwen3: 2048)")
    parser.add_argument("--hook-width", type=int, default=64, help="row width of grad_o for the hook path (0: skip)")
    parser.add_argument("--rho", type=float, default=0.7, help="retention ratio of the quotas")
    parser.add_argument("--zipf", type=float, default=0.6, help="Zipf exponent of the synthetic expert popularity")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (tests)")
    add_tracking_args(parser, "outputs/bench_scoring.jsonl")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.sources, args.experts, args.width, args.hook_width, args.reps = 512, 4, 16, 64, 16, 3
    with Tracker("bench_scoring", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        rows = bench(args)
        for row in rows:
            run.log(row)
        table = pd.DataFrame(rows)
        worst = float(table["select_ms"].max())
        run.log_summary({"worst_select_ms": worst, "target_ms": 10.0, "meets_target": worst <= 10.0})
        sns.set_theme(style="whitegrid", context="paper")
        fig, ax = plt.subplots(figsize=(6, 3))
        sns.barplot(table, x="metric", y="select_ms", hue="mode", ax=ax)
        ax.axhline(10.0, color="k", ls="--", lw=0.8, label="target")
        ax.set(ylabel="scoring + selection (ms)", title=f"{table['pairs'][0]:,} pairs, {table['groups'][0]:,} "
               f"groups, {args.threads} CPU thread(s)")
        fig.tight_layout()
        figs = run.log_figure("select_time", fig)
        cols = ["metric", "mode", "pairs", "groups", "select_ms", "select_p90_ms", "token_norm_ms"] + (
            ["hook_ms"] if "hook_ms" in table else [])
        print(table[cols].to_markdown(index=False, floatfmt=".2f"))
        print(f"worst scoring + selection: {worst:.2f} ms (target ≤ 10 ms); per-token ‖δ‖ at D={args.width}: "
              f"{table['token_norm_ms'][0]:.2f} ms")
        print(f"results: {args.out}; figure: {figs[0]}")
    return table


if __name__ == "__main__":
    main()
