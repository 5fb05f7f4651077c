"""How robust the frontier protocol's decided claims are (docs/protocols/frontier.md §10.8): every claim of a regime
re-decided with one of the protocol's choices changed (the endpoint, the reference, the test, the family), and what the
1 % loss margin is worth in training steps. Reads the protocol's collected runs; writes one record per (regime,
variant, claim), one per (regime, seed) of the margin's worth, and a Markdown report beside the results file.

    python experiments/frontier_robustness.py --runs paper_figures/results/frontier_protocol_sweep.jsonl \
        --out paper_figures/results/frontier_protocol_robustness.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lrmoe.analysis.protocol import REGIMES
from lrmoe.results import read_records
from lrmoe.cli import script_parser
from lrmoe.integrations.reports import write_report
from lrmoe.integrations.tracking import Tracker
from lrmoe.integrations.tracking_args import check_tracking_args


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__.split("\n\n")[0], "outputs/frontier_robustness.jsonl")
    parser.add_argument("--runs", default="paper_figures/results/frontier_protocol_sweep.jsonl",
                        help="the protocol's collected runs (experiments/frontier_sweep.py)")
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES),
                        help="the regimes to re-decide")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.runs).is_file():
        parser.error(f"--runs {args.runs} is not a file")
    check_tracking_args(parser, args, "frontier_robustness", report=True)
    return args


def report(tables: dict, worth: dict) -> str:
    from lrmoe.analysis.robustness import VARIANTS  # pandas and SciPy: loaded for the work, not for --help

    lines = ["# The frontier protocol's claims under changed choices (docs/protocols/frontier.md §10.8)", "",
             "Holm-adjusted p and the decision word of every claim, per variant (one choice of §10.3-10.4 changed "
             "at a time; `protocol` is the decided table).", ""]
    for regime, table in tables.items():
        lines += [f"## {regime}", "", "| claim | " + " | ".join(VARIANTS) + " |",
                  "|---|" + "---|" * len(VARIANTS)]
        for claim, group in table.groupby("claim", sort=False):
            cells = {r.variant: f"{r.p_holm:.3f} {r.word}" for r in group.itertuples()}
            lines.append(f"| {claim} | " + " | ".join(cells.get(v, "") for v in VARIANTS) + " |")
        w = worth[regime]
        lines += ["", f"The reference curve reaches its endpoint × 1.01 at step {w.step_at_margin.median():.0f} "
                      f"(median over {len(w)} seeds; range {w.step_at_margin.min():.0f}-{w.step_at_margin.max():.0f})"
                      f" against the endpoint's centre at step {w.endpoint_centre.iloc[0]:.0f}: a 1 % loss margin is "
                      f"worth {100 * w.steps_share.median():.1f} % of the training steps (median; "
                      f"{100 * w.steps_share.min():.1f}-{100 * w.steps_share.max():.1f} %).", ""]
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    from lrmoe.analysis.robustness import robustness_table, steps_per_loss_margin

    try:
        rows = read_records(args.runs)
    except ValueError as exc:
        raise SystemExit(f"frontier_robustness.py: error: {exc}")
    tables = {r: robustness_table(rows, r) for r in args.regimes}
    worth = {r: steps_per_loss_margin(rows, r) for r in args.regimes}
    with Tracker("frontier_robustness", vars(args), results=args.out, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb, quiet=True) as tracker:
        for regime in args.regimes:
            tracker.log_table("robustness", tables[regime].to_dict("records"))
            tracker.log_table("margin_worth", worth[regime].to_dict("records"))
    path = write_report(args.out, report(tables, worth))
    print(f"wrote {args.out} and {path}")
    return tables


def main(argv=None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
