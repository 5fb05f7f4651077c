"""Generate synthetic routing traces over the skew range of DESIGN.md §5, save them, summarise their skew and
plot it. A recorded trace (from training) can be summarised beside them with --recorded.

    python experiments/trace_stats.py --out outputs/trace_stats.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules; torch, pandas and matplotlib load when the traces are made.
from lrmoe.cli import positive_int_arg
from lrmoe.cli import script_parser
from lrmoe.config import model_preset, model_presets
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd

SKEWS = [("zipf", 0.2), ("zipf", 0.4), ("zipf", 0.6), ("zipf", 0.8), ("dirichlet", 4.0), ("dirichlet", 1.0),
         ("dirichlet", 0.5)]


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/trace_stats.jsonl")
    parser.add_argument("--model", default="qwen3-30b-a3b", choices=model_presets(),
                        help="model preset whose experts and top-k the traces have")
    parser.add_argument("--ranks", type=positive_int_arg, default=8, help="expert-parallel ranks of the traces")
    parser.add_argument("--steps", type=positive_int_arg, default=20, help="iterations per trace")
    parser.add_argument("--layers", type=positive_int_arg, default=4, help="MoE layers per trace")
    parser.add_argument("--tokens-per-rank", type=positive_int_arg, default=4096,
                        help="tokens per rank per iteration")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces")
    parser.add_argument("--recorded", nargs="*", default=[], help="recorded trace files (.npz) to summarise too")
    return parser


def main(argv=None) -> pd.DataFrame:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "trace_stats")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import torch
    from tqdm import tqdm

    from lrmoe.integrations.tracking import Tracker
    from lrmoe.traces.synthetic import generate_trace
    from lrmoe.traces.trace import load_trace

    recorded = []
    for path in args.recorded:  # read before anything is written: a bad one leaves no half-written results
        try:
            recorded.append(load_trace(path))
        except (ValueError, OSError) as exc:  # the loader names the file and what is wrong with it
            parser.error(f"--recorded: {exc}")
    model = model_preset(args.model)
    torch.manual_seed(args.seed)
    rows = []
    trace_dir = Path(args.out).with_suffix("")
    with Tracker("trace_stats", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        for skew, param in tqdm(SKEWS, desc="traces", disable=None):
            trace = generate_trace(args.steps, args.layers, args.ranks, model.num_experts, model.top_k,
                                   args.tokens_per_rank, skew=skew, skew_param=param, seed=args.seed,
                                   model=model.name)
            path = trace.save(trace_dir / f"{skew}{param}.npz", overwrite=args.overwrite or args.resume)
            row = {"trace": f"{skew} {param}", **trace.summary(), "path": str(path)}
            run.log(row)
            rows.append(row)
        for path, trace in zip(args.recorded, recorded):
            row = {"trace": f"recorded {Path(path).stem}", **trace.summary(), "path": str(path)}
            run.log(row)
            rows.append(row)
        table = pd.DataFrame(rows)
        from lrmoe.paper_figures.run_figures import skew

        fig, _ = skew(run.results)
        figs = run.log_figure("skew", fig)
        plt.close(fig)
        cols = ["trace", "gini_mean", "max_over_mean_mean", "max_over_mean_max", "source"]
        print(table[cols].to_markdown(index=False, floatfmt=".3f"))
        print(f"results: {args.out}; figure: {figs[0]}; traces in {trace_dir}")
    return table


if __name__ == "__main__":
    main()
