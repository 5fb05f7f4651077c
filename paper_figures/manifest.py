"""The manifest of a results folder: for every file, what produced it and what it backs. A results file (JSON lines)
names its producer in its header (script, arguments, git commit); a report, figure or calibration file is named after
the results file it belongs to (the longest results file name it starts with). What a file backs: the figures
``make figures`` draws from it (FIGURES, and its script's own of RUN_FIGURES) and the pages of the checkout that name
it (README.md, DESIGN.md, docs/, notebooks/), so the manifest goes stale when a page starts or stops naming a file.

    python -m lrmoe.paper_figures.manifest paper_figures/results      # writes paper_figures/results/MANIFEST.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAME = "MANIFEST.md"
# collected files (one line per run, no header) by the prefix of their name -> the script that collects them
COLLECTED = (("tq_protocol_", "`experiments/tq_sweep.py` (docs/protocols/time_to_quality.md §11)"),
             ("", "`experiments/frontier_sweep.py` (docs/protocols/frontier.md §10)"))
KNOWN = {"SUMMARY.md": "the main job's summary (`experiments/reproduce.py`)",
         "explorer.png": "a screenshot of the metric explorer in JupyterLab (`make test-browser`)"}


def header(path: Path) -> dict | None:
    """The first run header of a results file, or None (not a results file of this package)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record.get("kind") == "run":
                    return record
                if "kind" not in record:  # a collected file: one line per run, no header
                    return None
    except (OSError, ValueError, AttributeError):
        return None
    return None


def producer(hdr: dict) -> str:
    argv = " ".join(hdr.get("argv") or [])
    commit = (hdr.get("git_commit") or "unknown")[:10]
    return f"`{hdr.get('name', '?')}`: `{argv}` at commit {commit}"


def pages(root: Path) -> dict[str, str]:
    """The checkout's pages that may name a results file: {path relative to root: text}."""
    found = [root / "README.md", root / "DESIGN.md", *sorted((root / "docs").rglob("*.md")),
             *sorted((root / "notebooks").glob("*.py"))]
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in found if p.is_file()}


def backs(p: Path, texts: dict[str, str], reports: list[str]) -> str:
    """What ``p`` backs: the figures drawn from it (a results file), its reports, what it is (a figure, a report, a
    calibration), and the pages that name it."""
    from lrmoe.paper_figures.figures import FIGURES, RUN_FIGURES
    from lrmoe.paper_figures.reading import script

    what = []
    if p.suffix == ".jsonl":
        what += [f"figure `{name}`" for name, (stem, _) in FIGURES.items() if stem == p.stem]
        writer = script(p)
        what += [f"figure `{p.stem}_{key.split('.')[1]}`" for key in RUN_FIGURES if key.split(".")[0] == writer]
        what += [f"report `{name}`" for name in reports]
    elif p.suffix in (".png", ".pdf"):
        what.append(f"figure `{p.stem}`")
    elif p.suffix == ".md":
        what.append("a report (table)")
    elif p.suffix == ".json":
        what.append("the calibration its run measured and used")
    cited = [page for page, text in texts.items() if p.name in text]
    what += [f"cited in {', '.join(cited)}"] if cited else []
    return "; ".join(what) or "nothing outside this folder"


def manifest(folder: Path) -> str:
    from lrmoe.paper_figures import REPO_ROOT
    from lrmoe.paper_figures.figures import FIGURES  # the figures make_all draws: name -> (results stem, function)

    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != NAME and not p.name.startswith("."))
    stems = sorted((p.stem for p in files if p.suffix == ".jsonl"), key=len, reverse=True)
    texts = pages(REPO_ROOT)
    lines = [f"# What produced each file of {folder.name}/, and what it backs", "",
             "Made by `python -m lrmoe.paper_figures.manifest`; a results file names its producer in its header, "
             "the rest are named after the results file they belong to. *Backs*: the figures `make figures` draws "
             "from the file, and the pages (README.md, DESIGN.md, docs/, notebooks/) that name it; rerun the "
             "command when a page starts or stops naming a file. Superseded files are removed; git keeps them.",
             "", "| file | produced by | backs |", "|---|---|---|"]
    for p in files:
        hdr = header(p) if p.suffix == ".jsonl" else None
        if hdr is not None:
            what = producer(hdr)
        elif p.suffix == ".jsonl":
            script = next(what for prefix, what in COLLECTED if p.name.startswith(prefix))
            what = f"collected runs (one line per run, no header): {script}"
        elif p.stem in FIGURES:
            what = f"`paper_figures/figures.py` `{p.stem}` from `{FIGURES[p.stem][0]}.jsonl` (`make figures`)"
        elif p.name in KNOWN:
            what = KNOWN[p.name]
        else:
            owner = next((s for s in stems if p.stem.startswith(s)), None)
            what = f"from `{owner}.jsonl`" if owner else "a screenshot or figure without a results file"
        reports = [q.name for q in files if q.suffix == ".md" and p.suffix == ".jsonl"
                   and next((st for st in stems if q.stem.startswith(st)), None) == p.stem]
        lines.append(f"| `{p.name}` | {what} | {backs(p, texts, reports)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default="paper_figures/results", help="results folder")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    if not folder.is_dir():
        parser.error(f"{folder} is not a folder")
    target = folder / NAME
    if target.is_file() and not target.read_text(encoding="utf-8").startswith("# What produced each file of "):
        parser.error(f"{target} exists and is not a manifest this command wrote; move it away first")
    (folder / NAME).write_text(manifest(folder), encoding="utf-8")
    print(f"wrote {folder / NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
