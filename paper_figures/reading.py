"""What a figure reads of a results file: its records, its run's configuration and its summary.

A figure draws from the file alone; a file that lacks what a figure needs (written before the figure's records were
logged, or by another mode of its script) raises :class:`CannotDraw`, which ``make figures`` reports and skips."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from lrmoe.results import read_headers, read_results
from lrmoe.systems import canonical


class CannotDraw(ValueError):
    """The results file does not hold what the figure plots."""


def rows(path: str | Path, table: str | None = None, need: tuple[str, ...] = ()) -> pd.DataFrame:
    """The records of a results file logged under ``table`` (``Tracker.log_table``; None: those logged without a
    table), one row per record, systems by their registry names; CannotDraw unless they hold the columns ``need``."""
    frame = pd.DataFrame([r for r in read_results(path) if r.get("table") == table])
    if frame.empty:
        raise CannotDraw(f"{path} holds no records" + (f" of table {table!r}" if table else ""))
    if missing := [c for c in need if c not in frame]:
        raise CannotDraw(f"{path}: its records have no {', '.join(missing)}")
    for column in ("system", "policy"):  # older results files: the registry's name of each system
        if column in frame:
            frame[column] = frame[column].map(lambda n: canonical(n, strict=False) if isinstance(n, str) else n)
    return frame


def script(path: str | Path) -> str | None:
    """The name of the script whose run wrote the file (its first run header), None if it has none."""
    headers = read_headers(Path(path))
    return headers[0].get("name") if headers else None


def config(path: str | Path, need: tuple[str, ...] = ()) -> dict:
    """The configuration of the file's last run (its arguments, as the script logged them); CannotDraw unless it
    holds the keys ``need``."""
    headers = read_headers(Path(path))
    if not headers:
        raise CannotDraw(f"{path} has no run header")
    found = headers[-1].get("config", {})
    if missing := [k for k in need if k not in found]:
        raise CannotDraw(f"{path}: its run's configuration has no {', '.join(missing)}")
    return found


def summary(path: str | Path, need: tuple[str, ...] = ()) -> dict:
    """The file's run summary (the last one where a resumed run wrote several); CannotDraw unless it holds the keys
    ``need``."""
    found = read_results(path, "summary")
    if not found:
        raise CannotDraw(f"{path} holds no summary")
    if missing := [k for k in need if k not in found[-1]]:
        raise CannotDraw(f"{path}: its summary has no {', '.join(missing)} (written before it was logged)")
    return found[-1]
