"""Time the recalibrated backward's decision as the layer runs it, at the size of target 2 in DESIGN.md §5.8:
8,192 tokens × top-8 = 65,536 pairs at one home rank, in 16 source ranks × 128 experts = 2,048 groups (routing
from a synthetic Zipf popularity), on one CPU thread by default.

The layer scores its pairs on the device with the metric object (:meth:`lrmoe.recal.scoring.Metric.score` on a
:class:`lrmoe.recal.scoring.PairParts` of grad_o [M, D], o [M, D], ‖h‖ [M] and g [M]), moves the [M] scores to the
host and selects there (:func:`lrmoe.recal.selection.select`). Two timings per (metric, mode):

* ``score_ms``: the metric alone. m1, m2 and m3 read every pair's row of width D (model width, Qwen3: 2048),
  so on a CPU they are bound by memory bandwidth;
* ``select_ms``: scoring, the scores' move to the host and the selection: the number the ≤ 10 ms target is
  about (``select_p90_ms``: its 90th percentile).

    python experiments/bench_scoring.py --out outputs/bench_scoring.jsonl
    python experiments/bench_scoring.py --device cuda --dtype bfloat16   # scoring on a GPU, selection on the host
"""

from __future__ import annotations

import argparse
import statistics

from typing import TYPE_CHECKING

# The parser needs only these light modules; torch, the metric and pandas load in the functions that measure.
from lrmoe.cli import script_parser
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd
    import torch

DTYPES = ("float32", "bfloat16")  # names of torch dtypes


def make_problem(tokens: int, top_k: int, experts: int, sources: int, width: int, rho: float, zipf: float,
                 seed: int, device: str = "cpu", dtype: torch.dtype | None = None) -> dict:
    """One layer-iteration at a home rank (synthetic, labelled as such): groups and quotas on the host, the
    pairs' parts on ``device`` in ``dtype`` (default float32). Pair p = t·k + j; grad_o = g·δ_t."""
    import torch

    from lrmoe.recal.recalibrate import pair_groups, proportional_quotas
    from lrmoe.recal.scoring import PairParts
    from lrmoe.traces.synthetic import sample_topk, zipf_popularity

    dtype = dtype or torch.float32
    gen = torch.Generator().manual_seed(seed)
    idx_TK = sample_topk(torch.log(zipf_popularity(experts, zipf, gen)), tokens, top_k, gen)
    group_P, counts_Q = pair_groups(idx_TK, experts, sources)
    num_pairs = tokens * top_k
    gate_M = torch.rand(num_pairs, generator=gen)
    delta_TD = torch.randn(tokens, width, generator=gen)
    parts = PairParts(
        grad_o_MD=(gate_M[:, None] * delta_TD.repeat_interleave(top_k, dim=0)).to(device, dtype),
        o_MD=torch.randn(num_pairs, width, generator=gen).to(device, dtype),
        h_norm_M=(torch.rand(num_pairs, generator=gen) * 4).to(device, dtype),
        gate_M=gate_M.to(device, dtype),
    )
    return {"group_P": group_P, "quota_Q": proportional_quotas(counts_Q, rho), "parts": parts, "gen": gen}


def bench(args) -> list[dict]:
    import torch

    from lrmoe.harness.timing import time_ms
    from lrmoe.recal.scoring import METRIC_REGISTRY
    from lrmoe.recal.selection import MODES, select

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    prob = make_problem(args.tokens, args.top_k, args.experts, args.sources, args.width, args.rho, args.zipf,
                        args.seed, args.device, getattr(torch, args.dtype))
    group_P, quota_Q, parts, gen = prob["group_P"], prob["quota_Q"], prob["parts"], prob["gen"]
    rows = []
    for name, metric in METRIC_REGISTRY.items():
        for mode in MODES:
            def score():
                return metric.score(parts, gen, mode)

            def score_and_select():  # what the layer runs: scores on the device, the selection on the host
                return select(metric.score(parts, gen, mode).cpu(), group_P, quota_Q, mode, gen)

            score_times = time_ms(score, args.reps, warmup=3, cuda=cuda)
            times = time_ms(score_and_select, args.reps, warmup=3, cuda=cuda)
            rows.append({"metric": name, "mode": mode, "pairs": group_P.numel(), "groups": quota_Q.numel(),
                         "threads": args.threads, "width": args.width, "device": args.device, "dtype": args.dtype,
                         "score_ms": statistics.median(score_times), "select_ms": statistics.median(times),
                         "select_p90_ms": sorted(times)[int(0.9 * (len(times) - 1))]})
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/bench_scoring.jsonl")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the layer-iteration at the home rank")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token")
    parser.add_argument("--experts", type=int, default=128, help="experts of the layer")
    parser.add_argument("--sources", type=int, default=16, help="source ranks: groups = sources × experts")
    parser.add_argument("--width", type=int, default=2048, help="model width D of the grad_o and o rows (Qwen3: 2048)")
    parser.add_argument("--rho", type=float, default=0.7, help="retention ratio of the quotas")
    parser.add_argument("--zipf", type=float, default=0.6, help="Zipf exponent of the synthetic expert popularity")
    parser.add_argument("--device", default="cpu", help="where the pairs' parts lie and the metric scores (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the pairs' parts")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per measurement (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (tests)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "bench_scoring")
    if args.quick:
        args.tokens, args.sources, args.experts, args.width, args.reps = 512, 4, 16, 64, 3
    for flag in ("tokens", "top_k", "experts", "sources", "width", "threads", "reps"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if not 0.0 <= args.rho <= 1.0:
        parser.error(f"--rho must lie in [0, 1], got {args.rho}")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        parser.error(f"--device {args.device!r}: {err}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")
    return args


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from lrmoe.integrations.tracking import Tracker
    from lrmoe.paper_figures.run_figures import select_time

    with Tracker("bench_scoring", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        rows = bench(args)
        for row in rows:
            run.log(row)
        table = pd.DataFrame(rows)
        worst = float(table["select_ms"].max())
        run.log_summary({"worst_select_ms": worst, "worst_score_ms": float(table["score_ms"].max()),
                         "target_ms": 10.0, "meets_target": worst <= 10.0})
        fig, _ = select_time(run.results)
        figs = run.log_figure("select_time", fig)
        plt.close(fig)
        cols = ["metric", "mode", "pairs", "groups", "score_ms", "select_ms", "select_p90_ms"]
        print(table[cols].to_markdown(index=False, floatfmt=".2f"))
        print(f"worst scoring + selection: {worst:.2f} ms (target ≤ 10 ms), grad_o rows of width D={args.width} "
              f"({args.dtype}) on {args.device}")
        print(f"results: {args.out}; figure: {figs[0]}")
    return table


if __name__ == "__main__":
    main()
