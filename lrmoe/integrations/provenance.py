"""Where a run came from, as its results file's header records it: the commit, the package versions, the device,
the command line (with no machine's folders in it) and a fresh run id."""

from __future__ import annotations

import os
import platform
import subprocess
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


def portable_argv(argv: list[str]) -> list[str]:
    """``argv`` with absolute paths under the working folder written relative to it, so that a results file names
    no machine's folders (``python -m`` puts the script's absolute path first)."""
    cwd = Path.cwd()
    out = []
    for arg in argv:
        path = Path(arg)
        if path.is_absolute() and path.is_relative_to(cwd):
            arg = str(path.relative_to(cwd))
        out.append(arg)
    return out


def new_run_id(name: str) -> str:
    """A fresh run id: the script's name, the time and a random suffix."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
