"""Figures from results files, importable as lrmoe.paper_figures (python paper_figures/make_all.py draws them all).

``REPO_ROOT`` and ``RESULTS_DIR`` locate the checkout and its committed results from the package itself (through the
links of an editable install), so notebooks and scripts never guess them from the working directory; outside a
checkout (a wheel install) ``RESULTS_DIR`` does not exist and readers of committed results say so."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # paper_figures/ sits at the top of the checkout
RESULTS_DIR = REPO_ROOT / "paper_figures" / "results"  # the committed final results (MANIFEST.md names each one)
