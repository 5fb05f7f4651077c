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
