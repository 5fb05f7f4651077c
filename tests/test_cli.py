"""Every script's command line: help on every flag, and ``--help`` that imports neither torch nor the other heavy
modules (they load inside the function that runs the work; lrmoe.cli)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALL_SCRIPTS = sorted(f"experiments/{p.name}" for p in (ROOT / "experiments").glob("*.py") if p.name != "__init__.py")
ALL_SCRIPTS.append("paper_figures/make_all.py")
HEAVY = ("torch", "pandas", "matplotlib", "wandb", "scipy", "triton")


def _module(script: str) -> str:
    return "lrmoe." + script.removesuffix(".py").replace("/", ".")


@pytest.mark.parametrize("script", ALL_SCRIPTS)
def test_every_flag_has_help(script):
    """Each flag says what it does: a non-empty help on every action but -h."""
    parser = importlib.import_module(_module(script)).build_parser()
    missing = [a.option_strings or [a.dest] for a in parser._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, f"{script}: flags without help: {missing}"


_CHILD = """
import contextlib, io, json, runpy, sys
heavy, out = {heavy!r}, {{}}
for script in {scripts!r}:
    before = {{m for m in heavy if m in sys.modules}}
    sys.argv = [script, "--help"]
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            runpy.run_path(script, run_name="__main__")
        code = None
    except SystemExit as exc:
        code = exc.code
    out[script] = {{"code": code, "usage": text.getvalue().startswith("usage:"),
                   "heavy": sorted({{m for m in heavy if m in sys.modules}} - before)}}
    if out[script]["heavy"]:
        break  # a heavy module stays loaded: the scripts after this one could not be judged
print(json.dumps(out))
"""


def test_help_imports_no_heavy_module():
    """``python <script> --help`` prints the usage and exits 0 without importing torch, pandas, matplotlib, W&B,
    SciPy or Triton: one fresh interpreter runs each script's --help in turn and stops at the first that does."""
    scripts = ALL_SCRIPTS
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(heavy=HEAVY, scripts=scripts)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for script in scripts:
        assert script in results, f"not reached: {script} (an earlier script imported a heavy module)"
        got = results[script]
        assert got["code"] == 0 and got["usage"], f"{script} --help: exit {got['code']}, usage printed {got['usage']}"
        assert not got["heavy"], f"{script} --help imports {got['heavy']}"


def test_run_entry_names_the_failed_stage_and_passes_a_result_through():
    """lrmoe.cli.run_entry, the one way a script runs another in-process: a non-zero exit status or SystemExit is
    the caller's SystemExit naming the stage and its arguments; another exception propagates, itself, with a note
    naming the stage; a main's result comes back."""
    from lrmoe.cli import run_entry

    assert run_entry("a.py", "b.py", lambda argv: {"argv": argv}, ("--x", "1")) == {"argv": ["--x", "1"]}
    assert run_entry("a.py", "b.py", lambda argv: 0, []) == 0
    for entry, why in ((lambda argv: 3, "exited with 3"), (lambda argv: sys.exit(2), "exited with 2"),
                       (lambda argv: sys.exit("b.py: error: no corpus"), "b.py: error: no corpus")):
        with pytest.raises(SystemExit) as exc:
            run_entry("a.py", "b.py", entry, ["--x", "1"])
        assert exc.value.code == f"a.py: error: b.py --x 1 failed: {why}"
        assert exc.value.status == (1 if why.startswith("b.py") else int(why[-1]))  # the stage's own status

    def broken(argv):
        raise RuntimeError("rank 1 diverged")

    with pytest.raises(RuntimeError, match="rank 1 diverged") as exc:
        run_entry("a.py", "b.py", broken, ["--x", "1"])
    assert exc.value.__notes__ == ["a.py: in the stage b.py --x 1"]
    assert run_entry("a.py", "b.py", lambda argv: list(sys.argv), ["--x"]) == ["b.py", "--x"]  # its own name
    assert sys.argv[0] != "b.py"


_FRESH_HELP = """
import contextlib, io, json, runpy, sys
sys.argv = [{script!r}, "--help"]
text = io.StringIO()
try:
    with contextlib.redirect_stdout(text):
        runpy.run_path({script!r}, run_name="__main__")
    code = None
except SystemExit as exc:
    code = exc.code
print(json.dumps({{"code": code, "help": text.getvalue(), "torch": "torch" in sys.modules}}))
"""


@pytest.mark.parametrize("script, flag, default", [
    ("experiments/train.py", "--steps", "100"), ("experiments/train.py", "--lr-schedule", "constant"),
    ("experiments/train.py", "--replica-grad", "range"),
    ("experiments/layer_bench.py", "--steps", "8"), ("experiments/layer_bench.py", "--dtype", "float32"),
    ("experiments/tq_sweep.py", "--work", "outputs/tq_protocol"),
    ("experiments/tq_sweep.py", "--regimes", "weak production"),
])
def test_help_of_the_training_scripts_loads_no_torch_and_shows_defaults(script, flag, default):
    """train.py, layer_bench.py and tq_sweep.py, whose work is all torch: ``--help`` in a fresh interpreter exits 0
    with torch never imported, and a flag's line names its default (lrmoe.cli.HelpFormatter)."""
    proc = subprocess.run([sys.executable, "-c", _FRESH_HELP.format(script=script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "2000"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["code"] == 0 and got["help"].startswith("usage:"), got["code"]
    assert not got["torch"], f"{script} --help imports torch"
    entry = re.search(rf"^  {flag} .*?(?=^  -|\Z)", got["help"], re.M | re.S)  # the flag's usage and help
    assert entry and f"(default: {default})" in entry.group(0), f"{script} {flag}: {entry and entry.group(0)}"
