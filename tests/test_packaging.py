"""The installed package holds every subpackage of the tree: pyproject's explicit package list names each folder
with an __init__.py (a folder left out installs nowhere, and only a run from the checkout's root still imports it)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {name: ROOT / folder for name, folder in tool["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"package folders missing from pyproject's packages: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject lists packages with no folder: {sorted(listed - found)}"


def test_setup_reinstalls_a_venv_whose_lrmoe_is_another_checkouts(tmp_path):
    """`make setup` with a .venv copied from another checkout (its editable install links to that checkout's files)
    drops the stamp and installs this checkout again; a .venv that runs this checkout's lrmoe is left as it is. The
    .venv here is a stand-in whose python answers where lrmoe lies; make only prints what it would run (-n)."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make")
    for where, reinstalled in (("/elsewhere/checkout/lrmoe/__init__.py", True), (f"{ROOT}/lrmoe/__init__.py", False)):
        venv = tmp_path / ("foreign" if reinstalled else "own")
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").write_text(f"#!/bin/sh\necho {where}\n")
        (venv / "bin" / "python").chmod(0o755)
        stamp = venv / ".lrmoe-installed"
        stamp.touch()
        run = subprocess.run(["make", "-n", "setup", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        assert ("setting up" in run.stdout) is reinstalled and stamp.exists() is not reinstalled, run.stdout
        assert ("not from this checkout" in run.stdout) is reinstalled


def test_every_console_script_names_an_entry_point_that_exists():
    """pyproject's console scripts (lrmoe-train, lrmoe-ablate, lrmoe-tq-sweep, ...) each point at a function of
    the installed package: a renamed or moved entry point fails here, not in a user's shell."""
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"lrmoe-train", "lrmoe-ablate", "lrmoe-tq-sweep", "lrmoe-hf-checkpoint", "lrmoe-reproduce"} <= set(scripts)
    for name, target in scripts.items():
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
