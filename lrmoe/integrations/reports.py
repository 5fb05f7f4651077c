"""A results file's Markdown report: beside it (``.md`` for its suffix), marked on its first line as the report of
that file, written atomically and recorded in the file's manifest. A file there that is not this package's report
is never replaced."""

from __future__ import annotations

import os
from pathlib import Path

from lrmoe import results as files

_REPORT_MARK = "<!-- lrmoe report of "  # the first line of every report: the results file it belongs to


def report_path(results: str | os.PathLike) -> Path:
    """Where the Markdown report of a results file goes: beside it, ``.md`` for its suffix."""
    return Path(results).with_suffix(".md")


def report_problem(results: str | os.PathLike, replace: bool, name: str) -> str | None:
    """Why script ``name`` could not write the report of ``results``, or None: it would be the results file itself,
    or a file there is not this script's report (neither marked as a report nor beside a results file of ``name``:
    never replaced, even with --overwrite), or it exists and ``replace`` is false."""
    results = Path(results)
    report = report_path(results)
    if report.resolve() == results.resolve():
        return f"--out {results}: the report would overwrite the results file; give --out a .jsonl name"
    if report.is_file():
        with open(report, encoding="utf-8", errors="replace") as f:
            ours = f.readline().startswith(_REPORT_MARK)
        if not ours and results.is_file():
            try:
                headers = files.read_results(results, "run")
            except ValueError:  # not a results file
                headers = []
            ours = bool(headers) and headers[-1].get("name") == name
        if not ours:
            return f"--out {results}: its report {report} exists and is not a report of this package; move it or " \
                   f"choose another --out"
        if not replace:
            return f"--out {results}: its report {report} exists; pass --overwrite to replace it"
    return None


def write_report(results: str | os.PathLike, text: str) -> Path:
    """Write the Markdown report of ``results`` (atomically, marked as a report of that file); its path."""
    report = report_path(results)
    files.Manifest.of(results).add(report)
    files.atomic_write_text(report, f"{_REPORT_MARK}{Path(results).name} -->\n{text}")
    return report
