"""Every paper figure is drawn from the results file it is given: files exist, are non-empty, and the plotted
values are the file's."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from _tq_rows import rows_for
from matplotlib.colors import to_hex

from lrmoe.paper_figures import figures, style
from lrmoe.systems import ALIASES, SYSTEMS, get_system

ROOT = Path(__file__).resolve().parent.parent


def write_results(path: Path, rows: list[dict]) -> Path:
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "run", "run_id": "r", "config": {}}) + "\n")
        for i, row in enumerate(rows):
            f.write(json.dumps({"kind": "record", "run_id": "r", "step": i, **row}) + "\n")
    return path


SAMPLES = {
    "metric_fidelity": [{"mode": m, "metric": k, "rho": r, "rel_w_all": 0.1 * i + r}
                        for i, (m, k, r) in enumerate([(m, k, r) for m in ("topk", "unbiased") for k in ("m2", "random")
                                                       for r in (0.5, 0.85)])],
    "convergence": [{"policy": p, "step": s, "val_loss": 3.0 - 0.1 * s + (0.05 if p == "lrmoe-m2" else 0),
                     "time_s": 0.001 * s} for p in ("static-ep", "lrmoe-m2") for s in (1, 2, 3)],
    "trace_stats": [{"trace": "zipf 0.4", "gini_mean": 0.22, "max_over_mean_mean": 3.9, "source": "synthetic"},
                    {"trace": "recorded", "gini_mean": 0.35, "max_over_mean_mean": 2.5, "source": "recorded"}],
    "layer_bench_constrained": [{"table": "per_rank_step", "trace": "synthetic zipf 0.8", "policy": policy,
                                 "rank": rank, "pairs_fwd": 100.0 + 10 * rank + i, "pairs_bwd": 90.0 + rank + i}
                    for i, policy in enumerate(["symi-dropless", "lrmoe-m2"]) for rank in range(4)],
    "ablate": [{"model": "qwen3-30b-a3b", "ranks": 8, "mem_gb": 40.0, "skew": skew, "system": system, "fits": True,
                "forward_ms_per_layer": 10.0 + i, "backward_ms_per_layer": 20.0 + i + skew,
                "communication_ms_per_layer": 5.0 + 2 * i, "sync_ms_per_layer": 1.0 + 0.5 * i,
                "time_ms_per_layer": 36.0 + 4.5 * i + skew, "a2a_gb_per_layer": 3.0 + i, "sync_gb_per_layer": 0.5 + i,
                "peak_mem_gb": 20.0 + i}
               for skew in (0.4, 0.8)
               for i, system in enumerate(["ep-dropless", "capacity-cf1", "symi-cf1", "symi-dropless", "lrmoe",
                                           "lrmoe-no-memplace", "lrmoe-no-bwd-routing", "lrmoe-no-quotas",
                                           "lrmoe-padded"])],
    "tq_protocol_pilot": rows_for(seeds=3),
    "tq_protocol_sweep": [r | {"stage": "sweep"} for r in rows_for(seeds=3)],
}


DERIVED = {"ablation_waterfall", "layer_time", "tq_protocol_pilot_claims", "tq_protocol_sweep_claims"}  # own tests


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_figure_plots_the_values_of_its_results_file(name, tmp_path):
    stem, draw = figures.FIGURES[name]
    if stem not in SAMPLES:
        pytest.skip(f"no sample results for {stem}")  # pragma: no cover - every figure has a sample below
    rows = SAMPLES[stem]
    if name in DERIVED:
        pytest.skip("derived values: checked by its own test")
    fig, data = draw(write_results(tmp_path / f"{stem}.jsonl", rows))
    value_cols = [c for c in data.columns if data[c].dtype.kind == "f"]
    plotted = sorted(round(v, 9) for c in value_cols for v in data[c])
    given = sorted(round(float(r[c]), 9) for r in rows for c in value_cols if c in r)
    assert plotted and set(plotted) <= set(given)
    # and they are what the axes hold: every plotted y value appears in some artist of the figure
    ys = set()
    for ax in fig.axes:
        for line in ax.get_lines():
            ys.update(round(float(y), 9) for y in line.get_ydata())
        for patch in ax.patches:
            ys.add(round(float(patch.get_height()), 9))
    assert ys & set(given)


def test_make_all_writes_png_and_pdf_for_every_figure_with_results(tmp_path):
    for stem, rows in SAMPLES.items():
        write_results(tmp_path / f"{stem}.jsonl", rows)
    made = figures.draw_all(tmp_path, tmp_path / "figs")
    assert set(made) == {n for n, (stem, _) in figures.FIGURES.items() if stem in SAMPLES}
    for paths in made.values():
        assert {p.suffix for p in paths} == {".png", ".pdf"} and all(p.stat().st_size > 1000 for p in paths)


def test_waterfall_goes_from_symi_to_lrmoe_by_category_and_shows_components_apart(tmp_path):
    rows = SAMPLES["ablate"]
    fig, table = figures.ablation_waterfall(write_results(tmp_path / "ablate.jsonl", rows))
    at = {r["system"]: r for r in rows if r["skew"] == 0.8}
    steps = table[table.kind != "component"]
    ms = dict(zip(steps.step, steps.ms))
    assert ms["SYMI-dropless"] == at["symi-dropless"]["time_ms_per_layer"]
    assert ms["LRMoE"] == at["lrmoe"]["time_ms_per_layer"]
    # every bar in between is a named category's difference, and they add up exactly: nothing unexplained
    assert ms["backward"] == pytest.approx(at["lrmoe"]["backward_ms_per_layer"]
                                           - at["symi-dropless"]["backward_ms_per_layer"])
    assert sum(steps.ms.iloc[1:-1]) == pytest.approx(ms["LRMoE"] - ms["SYMI-dropless"])
    # each component on its own, not stacked
    parts = dict(zip(table[table.kind == "component"].step, table[table.kind == "component"].ms))
    assert parts["retention quotas"] == pytest.approx(at["lrmoe-no-quotas"]["time_ms_per_layer"]
                                                      - at["lrmoe"]["time_ms_per_layer"])


def test_layer_time_is_each_systems_ratio_to_symi_dropless_with_its_band(tmp_path):
    rows = [dict(r) for r in SAMPLES["ablate"]]
    for r in rows:  # the headline's band on LRMoE's records, as ablate.py writes it
        if r["system"] == "lrmoe":
            r.update(vs_symi_dropless_lo=0.5, vs_symi_dropless_hi=1.5, skew_label=f"zipf:{r['skew']:g}",
                     trace_rank_max_over_mean=1.0 + r["skew"])
    fig, table = figures.layer_time(write_results(tmp_path / "ablate.jsonl", rows))
    at = {(r["system"], r["skew"]): r["time_ms_per_layer"] for r in rows}
    got = table.set_index(["system", "skew_label"])
    assert got.loc[("lrmoe", "zipf:0.8"), "ratio"] == pytest.approx(at["lrmoe", 0.8] / at["symi-dropless", 0.8])
    assert got.loc[("symi-cf1", "zipf:0.4"), "ratio"] == pytest.approx(at["symi-cf1", 0.4] / at["symi-dropless", 0.4])
    assert "symi-dropless" not in set(table.system)  # the reference itself is the dashed line at 1
    assert got.loc[("lrmoe", "zipf:0.4"), "lo"] == 0.5 and got.loc[("lrmoe", "zipf:0.4"), "hi"] == 1.5
    plotted = {round(float(y), 9) for ax in fig.axes for line in ax.get_lines() for y in line.get_ydata()}
    assert {round(v, 9) for v in table.ratio} <= plotted


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_no_legend_lies_over_a_panel(name, tmp_path):
    """Legends sit beside the panels, never on the data: no legend's box overlaps any axes' box."""
    stem, draw = figures.FIGURES[name]
    fig, _ = draw(write_results(tmp_path / f"{stem}.jsonl", SAMPLES[stem]))
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    for legend in legends:
        box = legend.get_window_extent(renderer)
        covered = [ax.get_title() or "untitled" for ax in fig.axes if box.overlaps(ax.get_window_extent(renderer))]
        assert not covered, f"{name}: the legend {legend.get_title().get_text()!r} lies over {covered}"


def test_every_system_has_one_colour_wherever_it_is_drawn():
    """A system's colour is its table entry (an older name: its system's), whatever the other names beside it."""
    names = [*SYSTEMS, *ALIASES]
    alone = {n: to_hex(style.palette([n])[n]) for n in names}
    together = {n: to_hex(c) for n, c in style.palette(["m2", "not-a-system", *names]).items() if n in alone}
    assert alone == together == {n: style.system_color(n) for n in names}


def test_a_system_without_a_style_entry_draws_in_a_colour_derived_from_its_name(monkeypatch):
    """Adding a system is one registry entry: with no style entry it still gets a colour, the same in every figure
    and in every process (not Python's salted hash), and distinct names mostly get distinct colours."""
    monkeypatch.setitem(SYSTEMS, "lrmoe-new", replace(get_system("lrmoe"), name="lrmoe-new"))
    assert "lrmoe-new" not in style.SYSTEM_COLOR_TABLE
    color = style.system_color("lrmoe-new")
    assert to_hex(color) == color
    assert style.palette(["lrmoe-new"])["lrmoe-new"] == style.palette(["m1", "x", "lrmoe-new"])["lrmoe-new"] == color
    # another process, its string hashes salted otherwise than this one's (checked: it prints a hash beside the colour)
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    code = "from lrmoe.paper_figures import style; print(hash('lrmoe-new'), style.system_color('lrmoe-new'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": seed})
    their_hash, their_color = run.stdout.split()
    assert int(their_hash) != hash("lrmoe-new") and their_color == color
    assert len({style.system_color(f"new-system-{i}") for i in range(8)}) >= 4
