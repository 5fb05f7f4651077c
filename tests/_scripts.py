"""Import an experiment script (experiments/NAME.py, installed as lrmoe.experiments.NAME), for the tests."""

import importlib


def load_experiment(name: str):
    return importlib.import_module(f"lrmoe.experiments.{name}")
