"""Every figure a script draws of its own run is a function of its results file alone (lrmoe.paper_figures): drawn
from a small results file, it plots that file's values; a file without the figure's records says so (CannotDraw)
rather than failing; ``draw_all`` redraws each script's figure from every file that script wrote."""

import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from lrmoe.paper_figures import RESULTS_DIR, figures  # noqa: E402 - after the backend is chosen
from lrmoe.paper_figures.reading import CannotDraw  # noqa: E402
from lrmoe.results import read_results  # noqa: E402

# a committed results file each figure draws from, and the column whose first value's records are kept (so that
# the file stays small); None: the whole file
COMMITTED = {
    "ablate.ratio_vs_symi": ("ablate_online.jsonl", None),
    "ablate.time_split": ("ablate_online.jsonl", None),
    "memory_sweep.time_vs_memory": ("memory_pressure_regimes.jsonl", "skew_label"),
    "validate_sim.ratios": ("layer_bench_regimes.jsonl", None),
    "frontier.frontier": ("frontier_protocol_weak_16seeds.jsonl", None),
    "convergence.curves": ("convergence.jsonl", None),
    "bench_scoring.select_time": ("bench_scoring.jsonl", None),
    "bench_step.phases": ("bench_step.jsonl", None),
    "layer_bench.policies": ("layer_bench_constrained.jsonl", None),
    "layer_bench.phases": ("layer_bench_constrained.jsonl", None),
    "metric_fidelity.fidelity": ("metric_fidelity.jsonl", "weights"),
    "trace_stats.skew": ("trace_stats.jsonl", None),
}


def write(path: Path, script: str, config: dict, records: list[dict], summary: dict | None = None) -> Path:
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "run", "run_id": "r", "name": script, "config": config}) + "\n")
        f.writelines(json.dumps({"kind": "record", "run_id": "r", "step": i, **r}) + "\n"
                     for i, r in enumerate(records))
        if summary is not None:
            f.write(json.dumps({"kind": "summary", "run_id": "r", **summary}) + "\n")
    return path


def trimmed(source: Path, out: Path, column: str | None) -> Path:
    """The committed file's header and summary, and its records whose ``column`` holds the first such record's
    value (those without the column kept)."""
    lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    if column is not None:
        first = next(r[column] for r in lines if r["kind"] == "record" and column in r)
        lines = [r for r in lines if r["kind"] != "record" or r.get(column, first) == first]
    out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out


def synthetic(name: str, tmp_path: Path) -> Path:
    """Small files for the figures no committed file draws yet (written before their records were logged)."""
    if name == "bench_planner.planner_time":
        rows = [{"policy": p, "E": E, "N": N, "NE": N * E, "old_ms": 0.01 * N * E ** 0.5 + i,
                 "critical_path_ms": 0.001 * N * E ** 0.5 + i}
                for i, p in enumerate(["lrmoe", "symi-dropless"]) for E in (64, 256) for N in (8, 64)]
        return write(tmp_path / "bench_planner.jsonl", "bench_planner", {}, rows, {"target_ms": 0.3})
    assert name == "validate_sim.predicted_vs_measured"
    phases = ["expert_fwd", "dispatch_a2a"]
    cells = [{"table": "cell", "clock": c, "trace": "t", "policy": p, "phase": ph, "measured_ms": 1.0 + i + j,
              "predicted_ms": 1.1 + i + 0.9 * j, "error": 0.05 * (i - j)}
             for c in ("cpu", "wall") for i, p in enumerate(["lrmoe", "symi-dropless"]) for j, ph in enumerate(phases)]
    table = [{"table": "phase", "clock": "cpu", "phase": ph} for ph in phases]
    shape = {"ranks": 4, "model": "qwen3-30b-a3b-debug", "hidden": 64, "ffn": 32, "tokens_per_rank": 128}
    return write(tmp_path / "validate_sim.jsonl", "validate_sim", {}, cells + table,
                 {"clock": "cpu", "target": 0.2, "bench_shape": shape})


def results_for(name: str, tmp_path: Path) -> Path:
    if name not in COMMITTED:
        return synthetic(name, tmp_path)
    source, column = COMMITTED[name]
    if not (RESULTS_DIR / source).exists():
        pytest.skip(f"{source} is not in this checkout")  # pragma: no cover - a wheel install has no results
    return trimmed(RESULTS_DIR / source, tmp_path / source, column)


def values(rows: list[dict]) -> set[float]:
    found = set()
    for r in rows:
        for v in r.values():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                found.add(round(float(v), 9))
    return found


@pytest.mark.parametrize("name", sorted(figures.RUN_FIGURES))
def test_each_scripts_figure_plots_the_values_of_its_results_file(name, tmp_path):
    path = results_for(name, tmp_path)
    fig, data = figures.RUN_FIGURES[name](path)
    assert fig.axes and len(data)
    # every number it plots is one of the file's (derived values: none; each figure draws the records as logged)
    plotted = {round(float(v), 9) for c in data.columns if data[c].dtype.kind == "f" for v in data[c].dropna()}
    assert plotted and plotted <= values(read_results(path))
    drawn = sum(len(ax.lines) + len(ax.patches) + len(ax.collections) for ax in fig.axes)
    assert drawn > 0
    matplotlib.pyplot.close(fig)


@pytest.mark.parametrize("name", sorted(figures.RUN_FIGURES))
def test_a_file_without_the_figures_records_says_it_cannot_draw(name, tmp_path):
    """A file written before a figure's records were logged (here: its run header alone) is skipped, named."""
    path = write(tmp_path / "old.jsonl", name.split(".")[0], {}, [{"unrelated": 1.0}], {})
    with pytest.raises(CannotDraw):
        figures.RUN_FIGURES[name](path)


def test_draw_all_redraws_each_scripts_figure_from_every_file_it_wrote(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for stem in ("trace_stats", "trace_stats_again"):
        trimmed(RESULTS_DIR / "trace_stats.jsonl", results / f"{stem}.jsonl", None)
    write(results / "trace_stats_old.jsonl", "trace_stats", {}, [{"unrelated": 1.0}])
    skipped = {}
    made = figures.draw_all(results, tmp_path / "figs", only=["trace_stats.skew"], skipped=skipped)
    assert set(made) == {"trace_stats_skew", "trace_stats_again_skew"}
    assert set(skipped) == {"trace_stats_old_skew"}
    assert set(made) | set(skipped) <= set(figures.names(results))  # what a job claims before it draws
    for paths in made.values():
        assert {p.suffix for p in paths} == {".png", ".pdf"} and all(p.stat().st_size > 1000 for p in paths)
