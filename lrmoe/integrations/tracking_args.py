"""The command-line flags every experiment script shares (results file, --overwrite / --resume, W&B) and their check
before any work starts: the results file and the script's other outputs can be written, are this script's to
replace or resume, and no live writer holds them; an online W&B has a key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lrmoe import results as files
from lrmoe.integrations.reports import report_problem
from lrmoe.integrations.tracking import check_resumable
from lrmoe.integrations.wandb_policy import DEFAULT_PROJECT, wandb_login, wandb_mode


def add_tracking_args(parser, default_results: str) -> None:
    """The command-line flags every experiment script shares."""
    parser.add_argument("--out", default=default_results, help="results file (JSON lines)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing results file")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in an existing results file: records past the point it resumes "
                             "from (its checkpoint, else the start) are replaced, never duplicated")
    parser.add_argument("--no-wandb", action="store_true", help="do not log to W&B")
    parser.add_argument("--wandb-project", default=None,
                        help=f"W&B project (default: $WANDB_PROJECT, else {DEFAULT_PROJECT!r})")
    parser.add_argument("--wandb-group", default=None,
                        help="W&B run group (default: $WANDB_RUN_GROUP, else the script's own grouping)")


def output_problem(flag: str, path: str | os.PathLike, replace: bool) -> str | None:
    """Why the script could not write a file at ``path`` (given as ``flag``), or None: it is a folder, it exists and
    ``replace`` is false, or no writable folder would hold it."""
    path = Path(path)
    if path.is_dir():
        return f"{flag} {path} is a folder, not a file"
    if path.exists() and not replace:
        return f"{flag} {path} exists; pass --overwrite to replace it"
    return folder_problem(flag, path, path.parent)


def folder_problem(flag: str, given: Path, folder: Path) -> str | None:
    """Why ``folder`` (or the nearest of its parents that exists) cannot be written into, named after the flag's
    value ``given`` (None: it can)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{flag} {given}: {folder} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag} {given}: the folder {folder} is not writable"
    return None


def foreign_results(out: Path, name: str) -> str | None:
    """Why ``--overwrite`` may not replace ``out``: neither its manifest nor its run header says script ``name``
    wrote it (None: it may)."""
    try:
        if files.Manifest.of(out).tag_of(out) == name:
            return None
    except ValueError as exc:
        return str(exc)
    headers = files.read_headers(out)
    if headers and headers[-1].get("name") == name:
        return None
    whose = f"a run of {headers[-1].get('name')!r}" if headers else "no run of any lrmoe script"
    return (f"--overwrite: {out} holds {whose}, not a results file of {name}: --overwrite replaces only what "
            f"this script wrote; choose another --out")


def check_tracking_args(parser, args, name: str, outputs: dict[str, Any] | None = None, report: bool = False) -> None:
    """Check the flags of :func:`add_tracking_args` and the script's other output files (``outputs``: flag ->
    path or None) before any work starts, with ``parser.error`` (argparse's message and exit status 2): the results
    file is new unless --overwrite / --resume, its folder writable, not another script's file when resuming, not
    locked by a live writer; with ``report``, its report (:func:`report_problem`) can be written; an online W&B has
    a key."""
    if args.overwrite and args.resume:
        parser.error("--overwrite and --resume contradict each other; choose one")
    replace = args.overwrite or args.resume
    if args.out:
        out = Path(args.out)
        if out.is_file() and not replace:
            parser.error(f"results file {out} exists; pass --overwrite to replace it or --resume to continue the run "
                         f"it holds")
        if problem := output_problem("--out", out, replace=True):
            parser.error(problem)
        if args.overwrite and out.is_file() and (problem := foreign_results(out, name)):
            parser.error(problem)
        if args.resume and out.is_file():
            try:
                records = files.parse_lines(out, files.complete_lines(out))
                check_resumable(out, name, [r for r in records if r.get("kind") == "run"], bool(records))
            except ValueError as exc:
                parser.error(str(exc))
        if out.with_name(f".{out.name}.lock").is_file():  # none: no live writer; a check must not leave one behind
            try:
                files.FileLock(out).release()
            except (RuntimeError, OSError) as exc:
                parser.error(str(exc))
    for flag, path in (outputs or {}).items():
        if path and (problem := output_problem(flag, path, replace)):
            parser.error(problem)
    if report and args.out and (problem := report_problem(args.out, replace, name)):
        parser.error(problem)
    if not args.no_wandb and wandb_mode()[0] == "online" and not wandb_login():
        parser.error("W&B is online (WANDB_MODE=online) but has no API key: set WANDB_API_KEY or run `wandb login`, "
                     "or set WANDB_MODE=offline, or pass --no-wandb")
