"""Experiment tracking: one small API used by every experiment script.

A :class:`Tracker` does two things with every record:

* appends it, as one JSON line, to a local results file (flushed and fsynced record by record, so a crash loses at
  most the line being written; readers ignore an unterminated last line). The first line of a run is a header
  holding the config, seed, git commit, package versions and device;
* logs it to W&B at the record's step: online when the user configured W&B (``WANDB_MODE`` or an API key),
  otherwise offline. When it chooses offline it says so once, with where the run lies and how to sync it.
  ``wandb=False`` (or ``WANDB_MODE=disabled``) switches W&B off.

An existing results file is never overwritten: pass ``overwrite=True`` to replace it, or ``resume=True`` to continue
the run it holds. One process writes a results file at a time (a lock beside it, released when the process dies).

**Resuming: a killed run reads as if it had never died.** A results file holds one run; each record is identified
by its ``step``. ``resume=True`` continues that run from a checkpoint at ``resume_step``:

1. every record with ``step > resume_step`` is superseded: before anything is appended, the file is rewritten with
   only the run headers and the records with ``step <= resume_step`` (``resume_step=None``: the script has no
   checkpoint and redoes its work, so no record is kept). Summaries and figures go too: the resumed run writes
   them again when it ends. The rewrite is atomic (a temporary file in the same folder, fsynced, then
   ``os.replace``), so a crash during it leaves the old file whole, and a second resume does the same again;
2. the resumed run keeps the run id (a new header line with the same ``run_id``, its ``attempt`` number and
   ``resumed_from_step``), and continues the same W&B run (``id=run_id``, ``resume="allow"``; offline too, where
   ``wandb sync`` uploads the attempts' folders in order as one run). W&B's history is append-only: steps that an
   earlier attempt already logged there are not sent again (on an exact resume they are the same values).

So every reader sees each step once, with the values of the attempt that completed it, and needs no rule of its
own. ``--resume`` is not a way to add a second run to a file: give that run its own ``--out``.

What a Tracker writes (the results file, its figures, its report, its W&B run) goes into the results file's
manifest (lrmoe.results.Manifest); ``overwrite=True`` removes what the replaced run recorded there, and
``--overwrite`` refuses a results file that this script did not write. The file format, its readers and the lock
live in lrmoe.results, which imports neither W&B nor torch. Beside this module: the header's provenance
(lrmoe.integrations.provenance), W&B's mode and names (lrmoe.integrations.wandb_policy), the flags every script
shares and their checks (lrmoe.integrations.tracking_args) and a results file's Markdown report
(lrmoe.integrations.reports).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from lrmoe import results as files  # the files themselves; this module re-exports none of their names
from lrmoe.integrations.provenance import device_description, git_commit, new_run_id, package_versions, portable_argv
from lrmoe.integrations.wandb_policy import wandb_mode, wandb_names


def _jsonable(value: Any) -> Any:
    """Tensors, numpy values, paths and dataclasses as plain JSON values; non-finite floats as strings."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    return str(value)


def check_resumable(path: Path, name: str, headers: list[dict], has_lines: bool) -> None:
    """Raise ``ValueError`` unless ``--resume`` of script ``name`` may rewrite the results file ``path``: its last
    run header names that script (a resume supersedes records, so it must never touch another script's file, nor a
    file that no Tracker wrote)."""
    if headers and headers[-1].get("name") != name:
        raise ValueError(f"--resume: results file {path} holds a run of {headers[-1].get('name')!r}, not of {name!r}: "
                         f"give this run its own --out")
    if has_lines and not headers:
        raise ValueError(f"--resume: {path} holds no run header (no lrmoe script wrote it): give this run its own "
                         f"--out")


def step_ranges(steps: list[int]) -> str:
    """Sorted steps as runs: [1, 2, 3, 7] -> '1-3, 7'."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


class Tracker:
    """Log an experiment's records to a JSON-lines results file and to W&B. Use as a context manager.

    ``resume=True`` continues the run in an existing results file from ``resume_step`` (the step of the checkpoint
    the script resumed from; ``None``: the script starts its work again): see the module docstring. ``restore``: the
    records of steps 1..``resume_step`` as the script holds them (its checkpoint's, step i's at index i - 1); a step
    among them that the file lost (a row deleted, the file cut short) is written back in its place.
    """

    def __init__(self, name: str, config: dict | None = None, results: str | os.PathLike | None = None,
                 *, seed: int | None = None, overwrite: bool = False, resume: bool = False,
                 resume_step: int | None = None, wandb: bool = True, project: str | None = None,
                 group: str | None = None, quiet: bool = False, run_id: str | None = None,
                 restore: list[dict] | None = None):
        if overwrite and resume:
            raise ValueError("Tracker: overwrite=True and resume=True contradict each other; choose one")
        self.name = name
        self.config = _jsonable(dict(config or {}))
        self.results = Path(results) if results is not None else Path("outputs") / f"{name}.jsonl"
        if self.results.exists() and not (overwrite or resume):
            raise FileExistsError(f"results file {self.results} exists; pass overwrite=True (--overwrite) to "
                                  f"replace it or resume=True (--resume) to continue the run it holds")
        self.results.parent.mkdir(parents=True, exist_ok=True)
        self.quiet = quiet
        self._lock = files.FileLock(self.results)
        self._file = None
        self._overwrite = overwrite
        self.wandb_run = None
        self.wandb_dir: Path | None = None
        try:
            self.manifest = files.Manifest.of(self.results)
            self._adopt_legacy()
            self.run_id = run_id or new_run_id(name)
            self.attempt = 1
            self.resumed_from_step = None
            self._wandb_logged_to = -1  # W&B already holds every step up to this one (an earlier attempt's)
            self._step = 0
            self._last_step = 0
            if resume and self.results.exists():
                self._supersede(resume_step, restore)
            self._mode = "a" if resume else "w"
            self._header = {"kind": "run", "run_id": self.run_id, "name": name, "config": self.config, "seed": seed,
                      "git_commit": git_commit(), "versions": package_versions(), "device": device_description(),
                      "argv": portable_argv(sys.argv), "time": time.time(), "attempt": self.attempt}
            if self.attempt > 1:
                self._header["resumed_from_step"] = self.resumed_from_step
            if wandb:
                self._init_wandb(project, group)
        except BaseException:
            self.finish()
            raise

    def _adopt_legacy(self) -> None:
        """A results file of this script written before manifests existed: it and the figures its records name are
        this script's (its run header says so), so --overwrite may replace them."""
        if not self.results.is_file() or self.manifest.written(self.results):
            return
        headers = files.read_headers(self.results)
        if headers and headers[-1].get("name") == self.name:
            figures = [p for rec in files.read_results(self.results, "figure") for p in rec.get("paths", [])]
            self.manifest.add(self.results, *(p for p in figures if Path(p).is_file()), tag=self.name)

    # -- resuming -----------------------------------------------------------------------------------------
    def _supersede(self, resume_step: int | None, restore: list[dict] | None = None) -> None:
        """Continue the file's run: rewrite it (atomically) without the records past ``resume_step``, and with the
        records of ``restore`` (:class:`Tracker`) that it lost up to ``resume_step``. ValueError naming the steps
        lost that ``restore`` does not hold."""
        lines = files.complete_lines(self.results)
        records = files.parse_lines(self.results, lines)
        headers = [r for r in records if r.get("kind") == "run"]
        check_resumable(self.results, self.name, headers, bool(records))
        if headers:
            self.run_id = headers[-1]["run_id"]
            self.attempt = sum(h.get("run_id") == self.run_id for h in headers) + 1
        else:  # an empty file
            self.attempt = 1

        def kept(rec: dict) -> bool:
            if rec.get("kind") == "run":
                return True
            step = rec.get("step")
            return (rec.get("kind") == "record" and resume_step is not None and isinstance(step, (int, float))
                    and step <= resume_step)

        keep = [line for (_, line), rec in zip(lines, records) if kept(rec)]
        if restore is not None and resume_step:
            keep = self._restored(keep, resume_step, restore)
        steps = [r["step"] for r in records if r.get("kind") == "record" and isinstance(r.get("step"), (int, float))]
        self._wandb_logged_to = int(max(steps)) if steps and self.attempt > 1 else -1
        self.resumed_from_step = resume_step
        self._step = 0 if resume_step is None else resume_step + 1
        self._last_step = max(self._step - 1, 0)
        files.atomic_write_text(self.results, "".join(line + "\n" for line in keep))
        dropped = len(records) - len(keep)
        if not self.quiet and self.attempt > 1:
            where = "the start" if resume_step is None else f"step {resume_step}"
            print(f"resuming run {self.run_id} (attempt {self.attempt}) from {where}: {dropped} superseded "
                  f"line(s) removed from {self.results}", flush=True)

    def _restored(self, keep: list[str], resume_step: int, restore: list[dict]) -> list[str]:
        """``keep`` (the lines kept) with the records of steps 1..``resume_step`` it lacks taken from ``restore``,
        each after the record of the step before it."""
        steps = [rec.get("step") if rec.get("kind") == "record" else None for rec in map(json.loads, keep)]
        lost = sorted(set(range(1, resume_step + 1)) - set(steps))
        if missing := [s for s in lost if s > len(restore) or restore[s - 1].get("step", s) != s]:
            raise ValueError(f"--resume: results file {self.results} lacks the records of steps "
                             f"{step_ranges(missing)}, and the checkpoint of step {resume_step} does not hold them")
        for step in lost:
            before = [i for i, s in enumerate(steps) if s is not None and s < step]
            at = before[-1] + 1 if before else steps.index(None) + 1 if None in steps else 0
            line = json.dumps(_jsonable({"kind": "record", "run_id": self.run_id, "step": step, **restore[step - 1]}))
            keep.insert(at, line)
            steps.insert(at, step)
        if lost and not self.quiet:
            print(f"restored the records of steps {step_ranges(lost)} of run {self.run_id} to {self.results} from its "
                  f"checkpoint", flush=True)
        return keep

    # -- W&B ----------------------------------------------------------------------------------------------
    def _init_wandb(self, project: str | None, group: str | None) -> None:
        mode, why = wandb_mode()
        project, group = wandb_names(self.config, project, group)
        if mode == "disabled":
            return
        import wandb

        self.wandb_dir = Path(os.environ.get("WANDB_DIR", self.results.parent))
        self.wandb_dir.mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb.init(project=project, id=self.run_id, name=self.run_id, group=group, job_type=self.name,
                                    config=self.config, mode=mode, dir=str(self.wandb_dir), reinit="create_new",
                                    resume="allow" if self.attempt > 1 else None,
                                    settings=wandb.Settings(console="off", silent=True))
        if mode == "offline" and not self.quiet:
            where = getattr(self.wandb_run, "dir", None) or str(self.wandb_dir)
            run_folder = Path(where).parent if where else self.wandb_dir
            print(f"W&B: offline ({why}); run saved in {run_folder}; upload it with `wandb sync {run_folder}`",
                  flush=True)
        self.manifest.add_wandb_run(self.run_id, self.wandb_dir / "wandb", tag=self.name)

    def _wandb_log(self, values: dict, step: int) -> None:
        if self.wandb_run is not None and values and step > self._wandb_logged_to:
            self.wandb_run.log(values, step=step)

    # -- records ------------------------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        if self._file is None:  # the first record: the file (and its run header) is written only now, so a run
            # that fails before it has anything to say leaves no header-only file behind (nor replaces the old one)
            if self._overwrite:  # what the replaced run wrote goes with it (its figures, report, W&B runs)
                self.manifest.remove(keep_wandb=[self.run_id])
            self._file = open(self.results, self._mode, encoding="utf-8")
            self.manifest.add(self.results, tag=self.name)
            header, self._header = self._header, None
            self._write(header)
        self._file.write(json.dumps(_jsonable(record), sort_keys=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def log(self, record: dict, step: int | None = None) -> None:
        """Append one record to the results file and log its scalar fields to W&B at ``step`` (default: one past
        the previous record's)."""
        step = self._step if step is None else int(step)
        self._step = step + 1
        self._last_step = step
        self._write({"kind": "record", "run_id": self.run_id, "step": step, **record})
        if self.wandb_run is not None:
            scalars = {k: v for k, v in _jsonable(record).items() if isinstance(v, (int, float)) and
                       not isinstance(v, bool)}
            labels = [str(v) for v in record.values() if isinstance(v, str)]
            if labels:  # a record labelled by strings (policy, metric...) logs under those labels
                scalars = {"/".join(labels) + "/" + k: v for k, v in scalars.items()}
            self._wandb_log(scalars, step)

    def log_table(self, name: str, rows, **extra) -> None:
        """Log every row of a table (a DataFrame or a list of dicts) as a record labelled ``table=name``."""
        for row in rows.to_dict("records") if hasattr(rows, "to_dict") else rows:
            self.log({"table": name, **extra, **row})

    def log_summary(self, summary: dict) -> None:
        self._write({"kind": "summary", "run_id": self.run_id, **summary})
        if self.wandb_run is not None:
            for key, value in _jsonable(summary).items():
                self.wandb_run.summary[key] = value

    def log_figure(self, name: str, fig) -> list[Path]:
        """Save a matplotlib figure as PNG and PDF beside the results file, and log the PNG to W&B."""
        stem = self.results.with_name(f"{self.results.stem}_{name}")
        paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
        if foreign := self.manifest.foreign(paths):
            raise FileExistsError(f"figure {foreign[0]} exists and was not written by this script's runs of "
                                  f"{self.results}; move it away")
        self.manifest.add(*paths, tag=self.name)
        for path in paths:
            fig.savefig(path, dpi=150, bbox_inches="tight")
        self._write({"kind": "figure", "run_id": self.run_id, "name": name, "paths": [str(p) for p in paths]})
        if self.wandb_run is not None:
            import wandb

            # beside the last record, or past what an earlier attempt logged (a redone run's records are not resent)
            step = max(self._last_step, self._wandb_logged_to + 1)
            self._last_step = step
            self._wandb_log({f"figure/{name}": wandb.Image(str(paths[0]))}, step)
        return paths

    def finish(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        self._lock.release()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
