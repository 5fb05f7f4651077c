"""Load an experiment script (experiments/NAME.py) as a fresh module, for the tests."""

import importlib.util
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def load_experiment(name: str):
    key = f"experiments_{name}"
    spec = importlib.util.spec_from_file_location(key, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module
