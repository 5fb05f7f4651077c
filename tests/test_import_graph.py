"""The import graph tool (lrmoe/harness/import_graph.py): the installed tree keeps every contract, and an edge that
runs up the layers or between two scripts is reported."""

import subprocess
import sys
from pathlib import Path

from lrmoe.harness import import_graph

ROOT = Path(__file__).resolve().parent.parent


def test_the_tree_keeps_its_contracts_and_every_module_has_a_layer():
    """As `make import-graph` runs it: a process of its own reads the installed tree (scripts included)."""
    run = subprocess.run([sys.executable, str(ROOT / "lrmoe" / "harness" / "import_graph.py")], capture_output=True,
                         text=True)
    report = run.stdout
    assert run.returncode == 0 and "## against the contracts\n\nnone" in report, run.stdout + run.stderr
    assert "modules in no layer" not in report
    assert "lrmoe.planner (" in report and "lrmoe.sim -> lrmoe.planner:" in report


def test_layers_are_read_top_down_with_independent_siblings():
    index = import_graph.layer_index(["lrmoe.experiments", "lrmoe.harness | lrmoe.analysis", "lrmoe.planner"])
    assert import_graph.find_layer("lrmoe.planner.plan", index) == ("lrmoe.planner", 2, False)
    assert import_graph.find_layer("lrmoe.analysis.runs", index) == ("lrmoe.analysis", 1, True)
    assert import_graph.find_layer("lrmoe.nowhere", index) is None
