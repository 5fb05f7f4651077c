"""The main job's stages (``experiments/reproduce.py``): what a stage is, the names it writes in the job's folder and
their accounting in the folder's manifest, its identity (what decides its results, for ``--resume``), and the
Markdown tables of its output that go into the summary. Their scheduling is :mod:`lrmoe.harness.job_schedule`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.results import Manifest, read_headers


@dataclass
class Stage:
    """One stage of the main job: the script it runs, its arguments in each mode, and how the job schedules it."""

    name: str
    # the script the stage runs: its name in lrmoe.experiments (the job's ``entry_point`` imports it), or the entry
    # point itself (a function of the command line: a script's cli or main)
    entry: str | Callable[[list[str]], object]
    quick: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)
    # which Markdown table of the stage's output goes into the summary (its headline): its index, or the title of
    # the section ("## <title>") whose first table it is, where the stage prints other tables before it
    table: int | str = -1
    # runs beside the stages after it (a deterministic stage on one thread: the simulator), until a measured stage
    background: bool = False
    # times something on this machine: waits for every background stage, so that nothing runs beside it
    measured: bool = False


def markdown_tables(text: str, which: int | str = -1) -> str:
    """The ``which``-th Markdown table a stage printed (default the last: experiments print the headline last), or,
    for a string, the first table of the last section titled ``## <which>...`` ("" when there is none)."""
    blocks, current, sections = [], [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
            continue
        if current:
            blocks.append(current)
            current = []
        if line.startswith("## "):
            sections.append((line[3:], len(blocks)))  # the title, and the index its first table will have
    if current:
        blocks.append(current)
    if isinstance(which, str):
        starts = [start for title, start in sections if title.startswith(which) and start < len(blocks)]
        return "\n".join(blocks[starts[-1]]) if starts else ""
    return "\n".join(blocks[which]) if len(blocks) >= abs(which) else ""


def stage_outputs(out: Path, name: str, names: list[str]) -> list[Path]:
    """What stage ``name`` (of the stages ``names``) writes in ``out``: its results file (and lock, marker,
    captured output), the files named after it (figures, report, checkpoints, cached models) and its work folder;
    not those of another stage whose name starts with this one's."""
    longer = [other for other in names if other != name and other.startswith(name)]
    named = [p for p in (*out.glob(f"{name}.*"), *out.glob(f"{name}_*"))
             if not any(p.name.startswith((f"{other}.", f"{other}_")) or p.name == other for other in longer)]
    hidden = [out / f".{name}.jsonl.{what}" for what in ("lock", "manifest.json")]
    return [*named, *hidden, out / f".{name}.stdout", out / name]


def account(manifest: Manifest, out: Path, stage: str, names: list[str]) -> None:
    """Record in ``manifest`` what stage ``stage`` wrote: every file under its names (the job refused to start
    where one was not its own, so any there now is the stage's) and its W&B runs (the run ids of its results
    file's headers)."""
    manifest.add(*(p for p in stage_outputs(out, stage, names) if p.exists() or p.is_symlink()), tag=stage,
                 save=False)
    for header in read_headers(out / f"{stage}.jsonl"):
        if header.get("run_id"):
            manifest.wandb_runs[header["run_id"]] = [stage, "wandb"]
    if stage in manifest.open:
        manifest.open.remove(stage)
    manifest.save()


def stage_argv(stage: Stage, mode: str, out: Path) -> list[str]:
    """The stage's own arguments in this mode."""
    return [a.format(out=out) for a in stage_identity(stage, mode)[2:]]


def stage_identity(stage: Stage, mode: str) -> list[str]:
    """What decides a stage's results: the mode and its arguments (before the folder is filled in, so that a moved
    folder is the same run). What a stage wrote is reused only for the same identity."""
    return ["--mode", mode, *(stage.quick if mode == "quick" else stage.full)]


def argv_difference(old: list[str], new: list[str]) -> str:
    """The arguments that differ between two command lines, as 'was ... ; now ...'."""
    return f"was `{' '.join(old) or '(none)'}`, now `{' '.join(new) or '(none)'}`"


def stage_label(stage: Stage) -> str:
    """The stage's script as its messages name it (``ablate.py``)."""
    return f"{stage.entry}.py" if isinstance(stage.entry, str) else getattr(stage.entry, "__name__", stage.name)


def stage_complete(out: Path, stage: Stage) -> bool:
    """A stage is complete when its end marker and its results file both exist."""
    return (out / f"{stage.name}.done").is_file() and (out / f"{stage.name}.jsonl").is_file()


