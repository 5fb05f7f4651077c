"""Regenerate every figure (PNG + PDF) from the results files of a reproduction run.

    python paper_figures/make_all.py                       # from outputs/quick, into outputs/quick/figures
    python paper_figures/make_all.py --results outputs/full --out paper_figures/out

A figure whose results file is missing, or lacks the records it plots (written before they were logged), is skipped
with a note (run its experiment first); the command fails only if a figure that has its input cannot be drawn.
Beside the paper's figures, each script's own figure of every results file that script wrote (``script.name`` in
``--only``), named ``<results stem>_<name>`` as the script names it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lrmoe.cli import one_of, script_parser

HERE = Path(__file__).resolve().parent


def _figure_names() -> list[str]:
    from lrmoe.paper_figures import figures

    return sorted({**figures.FIGURES, **figures.RUN_FIGURES})


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: matplotlib loads when figures are drawn; tests/test_cli.py)."""
    parser = script_parser(__doc__)
    parser.add_argument("--results", default=str(HERE.parent / "outputs" / "quick"), help="folder of results files")
    parser.add_argument("--out", default=None, help="figure folder (default: <results>/figures)")
    parser.add_argument("--only", nargs="*", type=one_of(_figure_names, "figure"),
                        help="figure names to draw (those of lrmoe.paper_figures.figures.FIGURES and RUN_FIGURES; "
                             "default all)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")  # files only; notebooks importing figures keep their inline backend
    from lrmoe.paper_figures import figures
    results = Path(args.results)
    if not results.is_dir():
        sys.exit(f"error: results folder {results} does not exist (run `make reproduce` first)")
    skipped: dict[str, str] = {}
    made = figures.draw_all(results, Path(args.out) if args.out else results / "figures", args.only, skipped)
    print(f"\n{len(made)} figures drawn, {len(skipped)} skipped (their files lack what they plot, or are missing)")
    if not made:
        sys.exit(f"error: no results files for any figure in {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
