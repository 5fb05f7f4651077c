"""Regenerate every figure (PNG + PDF) from the results files of a reproduction run.

    python paper_figures/make_all.py                       # from outputs/quick, into outputs/quick/figures
    python paper_figures/make_all.py --results outputs/full --out paper_figures/out

A figure whose results file is missing is skipped with a note (run its experiment first); the command fails
only if a figure that has its input cannot be drawn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; notebooks importing figures keep their inline backend
from lrmoe.paper_figures import figures  # noqa: E402 - after the backend is chosen

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(HERE.parent / "outputs" / "quick"), help="folder of results files")
    parser.add_argument("--out", default=None, help="figure folder (default: <results>/figures)")
    parser.add_argument("--only", nargs="*", help="figure names", choices=sorted(figures.FIGURES))
    args = parser.parse_args(argv)
    results = Path(args.results)
    if not results.is_dir():
        sys.exit(f"error: results folder {results} does not exist (run `make reproduce` first)")
    made = figures.draw_all(results, Path(args.out) if args.out else results / "figures", args.only)
    if not made:
        sys.exit(f"error: no results files for any figure in {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
