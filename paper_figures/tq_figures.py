"""The time-to-quality protocol's figure (docs/protocols/time_to_quality.md §11), from its results file alone: each
regime's eight claims, the mean q with its 95 % interval over seeds. experiments/tq_sweep.py's report draws it with this
function, and ``make figures`` redraws it from the same file."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from lrmoe.analysis import time_to_quality as tq
from lrmoe.analysis import tq_protocol as P
from lrmoe.analysis import tq_report as R
from lrmoe.paper_figures.reading import CannotDraw


def claim_tables(rows: list[dict]) -> dict[str, pd.DataFrame]:
    """{regime: its claim table} for every regime of ``rows`` with at least one whole seed, in §11's order."""
    tables = {}
    for regime in P.REGIMES:
        mine = R.regime_rows(rows, regime)
        per_seed = tq.per_seed_table(*R.regime_frames(mine, regime)) if mine else pd.DataFrame()
        if not per_seed.empty:
            tables[regime] = tq.tq_table(per_seed)
    return tables


def draw_claims(tables: dict[str, pd.DataFrame]):
    """Each regime's claims: mean q with its 95 % interval, the −δ line and 0. (figure, axes)"""
    fig, axes = plt.subplots(1, max(1, len(tables)), figsize=(6 * max(1, len(tables)), 4), squeeze=False)
    for ax, (regime, table) in zip(axes[0], tables.items()):
        t = table[table["word"] != "too few seeds"] if "word" in table else table
        if "estimate" in t and len(t):
            y = np.arange(len(t))
            ax.errorbar(t["estimate"], y, xerr=[t["estimate"] - t["ci_low"], t["ci_high"] - t["estimate"]],
                        fmt="o", capsize=3)
            ax.set_yticks(y, [f"{c} ({w})" for c, w in zip(t["claim"], t["word"])], fontsize=7)
        ax.axvline(0, color="k", lw=0.8)
        ax.axvline(-tq.DELTA, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("q (%): time to the arm's loss ÷ the dropless system's, − 1")
        ax.set_title(f"regime {regime} ({int(table['seeds'].max()) if 'seeds' in table else 0} seeds)")
    fig.tight_layout()
    return fig, axes


def claims(path: str | Path):
    """The claims of every regime of a protocol results file (tq_protocol_pilot.jsonl, tq_protocol_sweep.jsonl)."""
    rows = [r for r in P.collected_rows(Path(path)) if r.get("stage") in ("pilot", "sweep")]
    tables = claim_tables(rows)
    if not tables:
        raise CannotDraw(f"{path} holds no whole seed of the pilot or the sweep")
    return draw_claims(tables)
