"""Experiment tracking: one small API used by every experiment script.

A :class:`Tracker` does two things with every record:

* appends it, as one JSON line, to a local results file (flushed record by record, so a crash loses nothing).
  The first line of a run is a header holding the config, seed, git commit, package versions and device;
* logs it to W&B: online when the user configured W&B (``WANDB_MODE`` or an API key), otherwise offline. When
  it chooses offline it says so once, with where the run lies and how to sync it. ``wandb=False`` (or
  ``WANDB_MODE=disabled``) switches W&B off.

An existing results file is never overwritten: pass ``overwrite=True`` to replace it, or ``resume=True`` to
append to it (how a resumed experiment continues its file).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

_PACKAGES = ("torch", "triton", "numpy", "wandb", "lrmoe")


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """The current commit of the package's checkout, with ``+dirty`` when it has uncommitted changes."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        if sha.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def device_description() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda_count"] = torch.cuda.device_count()
    return info


def wandb_mode() -> tuple[str, str]:
    """The W&B mode to use and why: the user's ``WANDB_MODE``, online with an API key, else offline."""
    explicit = os.environ.get("WANDB_MODE")
    if explicit:
        return explicit, "WANDB_MODE is set"
    if os.environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online", "a W&B login was found in ~/.netrc"
    return "offline", "no W&B login was found"


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


class Tracker:
    """Log an experiment's records to a JSON-lines results file and to W&B. Use as a context manager."""

    def __init__(self, name: str, config: dict | None = None, results: str | os.PathLike | None = None,
                 *, seed: int | None = None, overwrite: bool = False, resume: bool = False,
                 wandb: bool = True, project: str = "lrmoe", group: str | None = None, quiet: bool = False):
        if overwrite and resume:
            raise ValueError("Tracker: overwrite=True and resume=True contradict each other; choose one")
        self.name = name
        self.config = _jsonable(dict(config or {}))
        self.results = Path(results) if results is not None else Path("outputs") / f"{name}.jsonl"
        if self.results.exists() and not (overwrite or resume):
            raise FileExistsError(f"results file {self.results} exists; pass overwrite=True (--overwrite) to "
                                  f"replace it or resume=True (--resume) to append to it")
        self.results.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.quiet = quiet
        self._step = 0
        self._file = open(self.results, "a" if resume else "w", encoding="utf-8")
        self._write({"kind": "run", "run_id": self.run_id, "name": name, "config": self.config, "seed": seed,
                     "git_commit": git_commit(), "versions": package_versions(), "device": device_description(),
                     "argv": sys.argv, "time": time.time()})
        self.wandb_run = None
        self.wandb_dir: Path | None = None
        if wandb:
            self._init_wandb(project, group)

    # -- W&B ----------------------------------------------------------------------------------------------
    def _init_wandb(self, project: str, group: str | None) -> None:
        mode, why = wandb_mode()
        if mode == "disabled":
            return
        import wandb

        self.wandb_dir = Path(os.environ.get("WANDB_DIR", self.results.parent))
        self.wandb_dir.mkdir(parents=True, exist_ok=True)
        self.wandb_run = wandb.init(project=project, name=self.run_id, group=group, config=self.config,
                                    mode=mode, dir=str(self.wandb_dir), reinit="create_new",
                                    settings=wandb.Settings(console="off", silent=True))
        if mode == "offline" and not self.quiet:
            where = getattr(self.wandb_run, "dir", None) or str(self.wandb_dir)
            run_folder = Path(where).parent if where else self.wandb_dir
            print(f"W&B: offline ({why}); run saved in {run_folder}; upload it with `wandb sync {run_folder}`",
                  flush=True)

    # -- records ------------------------------------------------------------------------------------------
    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(_jsonable(record), sort_keys=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def log(self, record: dict, step: int | None = None) -> None:
        """Append one record to the results file and log its scalar fields to W&B."""
        step = self._step if step is None else step
        self._step = step + 1
        self._write({"kind": "record", "run_id": self.run_id, "step": step, **record})
        if self.wandb_run is not None:
            scalars = {k: v for k, v in _jsonable(record).items() if isinstance(v, (int, float)) and
                       not isinstance(v, bool)}
            labels = [str(v) for v in record.values() if isinstance(v, str)]
            if labels:  # a record labelled by strings (policy, metric...) logs under those labels
                scalars = {"/".join(labels) + "/" + k: v for k, v in scalars.items()}
            if scalars:
                self.wandb_run.log(scalars)

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
        for path in paths:
            fig.savefig(path, dpi=150, bbox_inches="tight")
        self._write({"kind": "figure", "run_id": self.run_id, "name": name, "paths": [str(p) for p in paths]})
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({f"figure/{name}": wandb.Image(str(paths[0]))})
        return paths

    def finish(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


def read_results(path: str | os.PathLike, kind: str = "record") -> list[dict]:
    """The records of one kind ("run", "record", "summary", "figure") from a results file."""
    with open(path, encoding="utf-8") as f:
        return [rec for rec in map(json.loads, f) if rec.get("kind") == kind]


def add_tracking_args(parser, default_results: str) -> None:
    """The command-line flags every experiment script shares."""
    parser.add_argument("--out", default=default_results, help="results file (JSON lines)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing results file")
    parser.add_argument("--resume", action="store_true", help="append to an existing results file")
    parser.add_argument("--no-wandb", action="store_true", help="do not log to W&B")
