"""The memory-pressure sweep's logic (lrmoe.sim.memory_sweep): the budget grid starts where the home slots just fit
and steps one slot's worth at a time; the binding range, each system's out-of-memory line and the placement table
read hand-made records right."""

import pytest
import torch

from lrmoe.config import cluster_preset, model_preset
from lrmoe.sim.cost import CostModel
from lrmoe.sim.memory_sweep import binding_range, budget_grid, fit_gb, headline, placement_table, slot_gb


@pytest.mark.parametrize("model, tokens", [("qwen3-30b-a3b", 4096), ("glm-4.5-air", 1024)])
def test_grid_starts_where_the_home_slots_fit_and_steps_a_slot_at_a_time(model, tokens):
    m, c = model_preset(model), cluster_preset("a100-40gb-x8").with_nodes(2)
    grid = budget_grid(m, c, tokens, max_gb=80.0)
    assert grid == sorted(grid) and grid[-1] == 80.0 and len(set(grid)) == len(grid)
    mm = CostModel(m, c, mem_budget_bytes=grid[0] * 1e9 / m.num_moe_layers).memory_model()
    pairs = tokens * m.top_k
    assert mm.fits(8, pairs, pairs)  # the home slots and the mean load's buffers fit at the first budget ...
    assert not mm.fits(9, pairs, pairs)  # ... and not one slot more
    below = CostModel(m, c, mem_budget_bytes=(grid[0] - 0.02) * 1e9 / m.num_moe_layers).memory_model()
    assert not below.fits(8, pairs, pairs)
    steps = torch.diff(torch.tensor(grid[:5]))
    assert torch.allclose(steps, torch.full_like(steps, slot_gb(m, c)), atol=0.011)  # one slot per step
    assert fit_gb(m, c, tokens, 8, 2.0) < 80.0 <= grid[-1]
    with pytest.raises(ValueError, match="max_gb"):
        budget_grid(m, c, tokens, max_gb=grid[0] - 1)


def _rec(system, gb, slots, t, fits=True, skew="zipf:0.8"):
    return {"model": "m", "ranks": 16, "skew_label": skew, "system": system, "mem_gb": gb, "slots_per_rank": slots,
            "iter_s": t, "fits": fits}


RECORDS = [
    _rec("symi-dropless", 30, 8, 9.0, fits=False), _rec("symi-dropless", 32, 10, 5.0),
    _rec("symi-dropless", 40, 16, 4.0),
    _rec("lrmoe", 30, 9, 6.0), _rec("lrmoe", 32, 12, 4.5), _rec("lrmoe", 40, 16, 4.2),
    _rec("lrmoe-rho0.75", 30, 9, 5.0), _rec("lrmoe-rho0.75", 32, 12, 4.0), _rec("lrmoe-rho0.75", 40, 16, 3.9),
    _rec("online", 30, 8, 7.0, fits=False), _rec("online", 32, 9, 4.8), _rec("online", 40, 9, 3.0),
    {"cell": 0, "cell_done": True, "mem_gb": 30},  # bookkeeping records are ignored
]


def test_binding_range_and_out_of_memory_lines():
    (row,) = binding_range(RECORDS)
    assert (row["binds_from_gb"], row["binds_to_gb"], row["budgets"]) == (30.0, 32.0, 3)
    assert row["symi-dropless:fits_from_gb"] == 32.0 and row["lrmoe:fits_from_gb"] == 30.0
    assert row["online:fits_from_gb"] == 32.0 and row["online:most_slots_from_gb"] == 32.0
    assert row["lrmoe:most_slots_from_gb"] == 40.0


def test_a_lower_saturation_load_ends_the_fine_steps_sooner():
    """--saturate-load: the fine steps end where E/N spare slots fit beside buffers for that load, so a lower load
    gives a shorter fine stretch that ends past that budget; the start and the top stay."""
    m, c = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8").with_nodes(2)
    full, short = budget_grid(m, c, 4096), budget_grid(m, c, 4096, saturate_load=1.5)
    assert short[0] == full[0] and short[-1] == full[-1] == 80.0 and len(short) < len(full)
    fine = [b for a, b in zip(short, short[1:]) if b - a < 1.0]
    assert fine[-1] >= fit_gb(m, c, 4096, 8, 1.5) > fine[-2]


def test_placement_table_side_by_side():
    rows = {r["mem_gb"]: r for r in placement_table(RECORDS)}
    assert rows[30.0]["LRMoE"] is None and rows[30.0]["LRMoE s"] == 6.0  # SYMI-dropless does not fit: seconds
    assert rows[30.0]["online s"] is None and rows[30.0]["fastest"] == "LRMoE + ρ"
    assert rows[32.0]["LRMoE + ρ"] == pytest.approx(0.8) and rows[32.0]["SYMI"] == 1.0
    assert rows[32.0]["online + ρ"] is None  # not run
    assert rows[40.0]["fastest"] == "online" and rows[40.0]["online"] == pytest.approx(0.75)


def test_headline_is_the_tightest_binding_budget_where_both_references_fit():
    """Memory binds from 30 to 32 GB; at 30 neither SYMI-dropless nor online fits, so the headline is 32 GB, where
    the fastest LRMoE system (rho 0.75, 4.0 s) is 0.8 x SYMI-dropless (5.0 s) and 4.0 / 4.8 x online; its band is
    the record's. A cell where memory never binds has no headline."""
    banded = [dict(r, vs_symi_dropless_lo=0.7, vs_symi_dropless_hi=0.9) if r.get("system") == "lrmoe-rho0.75" else r
              for r in RECORDS]
    roomy = [_rec(s, gb, 16, t, skew="zipf:0.2") for s, t in (("symi-dropless", 4.0), ("online", 3.0), ("lrmoe", 3.5))
             for gb in (30, 40)]
    (h,) = headline(banded + roomy)
    assert (h["skew"], h["mem_gb"], h["best"], h["best_slots"]) == ("zipf:0.8", 32.0, "lrmoe-rho0.75", 12)
    assert h["vs_symi_dropless"] == pytest.approx(0.8) and h["vs_online"] == pytest.approx(4.0 / 4.8)
    assert (h["vs_symi_dropless_lo"], h["vs_symi_dropless_hi"]) == (0.7, 0.9) and h["vs_online_lo"] is None
    assert h["symi-dropless slots"] == 10 and h["online slots"] == 9


def test_placement_table_has_both_early_selection_systems_and_names_the_fastest():
    rows = placement_table(RECORDS + [_rec("lrmoe-rho0.75-early", 32, 16, 3.5),
                                      _rec("lrmoe-rho0.75-early-unbiased", 32, 16, 3.0),
                                      _rec("lrmoe-rho0.75-early-unbiased", 30, 16, 2.0, fits=False)])
    by_gb = {r["mem_gb"]: r for r in rows}
    assert by_gb[32.0]["LRMoE + ρ early"] == pytest.approx(0.7)
    assert by_gb[32.0]["LRMoE + ρ early unbiased"] == pytest.approx(0.6)
    assert by_gb[32.0]["fastest"] == "LRMoE + ρ early unbiased"
    assert by_gb[30.0]["LRMoE + ρ early unbiased s"] is None and by_gb[30.0]["fastest"] == "LRMoE + ρ"
    assert "LRMoE + ρ early" not in by_gb[40.0]  # did not run there


def test_regimes_replace_the_skews_with_each_regimes_matched_zipf(monkeypatch):
    """--regimes: one skew per regime, the Zipf s lrmoe.analysis.skew.regime_zipf matches to the regime's runs,
    labelled with the regime's name; exclusive with --skews."""
    from lrmoe.analysis import skew
    from lrmoe.analysis.skew import Match
    from lrmoe.experiments import memory_sweep

    # the script imports regime_zipf when it parses (so --help loads no analysis): patched where it lives
    monkeypatch.setattr(skew, "regime_zipf",
                        lambda rows, name: Match({"production": 0.140625, "weak": 0.3955}[name], 1.0, {}))
    args = memory_sweep.parse_args(["--regimes", "production", "weak"])
    assert args.skews == ["zipf:0.140625", "zipf:0.3955"]
    assert args.regime_of["zipf:0.3955"] == ("weak", "weak, zipf:0.396")
    with pytest.raises(SystemExit):  # argparse's error (exit 2), "exclusive"
        memory_sweep.parse_args(["--regimes", "weak", "--skews", "zipf:0.2"])


def test_a_group_is_finished_when_its_ablation_run_wrote_its_summary(tmp_path):
    """The sweep reads a (model, skew) group's ablation results again only once that run finished (its summary is
    written last); a killed one is run again."""
    from lrmoe.experiments.memory_sweep import finished
    from lrmoe.integrations.tracking import Tracker

    path = tmp_path / "group.jsonl"
    assert not finished(path)
    with Tracker("ablate", {}, results=path, wandb=False, quiet=True) as run:
        run.log({"system": "x"})
    assert not finished(path)
    with Tracker("ablate", {}, results=path, wandb=False, quiet=True, resume=True) as run:
        run.log({"system": "x"})
        run.log_summary({"headline": ""})
    assert finished(path)


def test_symi_dropless_keeps_no_more_spare_slots_than_its_own_plans_fit():
    """The headroom rule sizes SYMI-dropless from its own plans of the reference iteration: the most spare slots with
    which they fit, and the peak load they plan. Re-applied to every layer alike, that scalar headroom can leave room
    for one slot more than the plans fit (Qwen3, Zipf 0.2, 2 x 8 A100-40GB at 32.56 GB per GPU: its 2-spare plans
    give 1.126 x the mean, and 3 spare slots beside uniform buffers for that load fit), and the 3-spare plans of the
    next iterations then ran out of memory at 32.56 GB though they fit at 31.65 and 33.47 GB. SYMI-dropless keeps
    at most the spare slots its plans fit, so its slots never fall as the budget grows and it fits at every budget."""
    from lrmoe.traces.synthetic import generate_trace
    from lrmoe.sim.cells import Cell, CellRules, build_systems, cost_kwargs, planned_headrooms, system_context
    from lrmoe.sim.simulator import simulate
    from lrmoe.systems import get_system, spare_at

    m, c = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8", 2)
    counts_ILNE = generate_trace(4, 4, c.num_ranks, m.num_experts, m.top_k, 4096, skew="zipf", skew_param=0.2,
                                 seed=0, model=m.name).counts_ILNE
    rules, reference = CellRules(), (counts_ILNE[0], counts_ILNE[1])
    slots, uniform = [], []
    for gb in (31.65, 32.56, 33.47):
        cell = Cell(m, c, ("zipf", 0.2), gb, 4096)
        cm = CostModel(m, c, mem_budget_bytes=cell.layer_budget)
        heads = planned_headrooms(cell, cm, reference, rules)
        ctx = system_context(cell, cm, rules, heads)
        symi = get_system("symi-dropless").make_policy(ctx)
        assert symi.slots_per_rank - ctx.base_slots <= heads["symi_spare"]
        slots.append(symi.slots_per_rank)
        uniform.append(ctx.base_slots + spare_at(ctx, heads["symi"]))
        systems, _, _, _ = build_systems(cell, ["symi-dropless"], rules, reference)
        res = simulate(counts_ILNE[1:], systems["symi-dropless"], m, c, cost_kwargs=cost_kwargs("symi-dropless", cell,
                                                                                               rules))
        assert not res.oom, gb
    assert slots == sorted(slots)
    assert uniform[1] > slots[1]  # the case the bound is for: the uniform reading alone grants one slot more


def test_the_figures_legend_lies_beside_the_panels(tmp_path):
    """The time-against-memory figure, drawn from the results file, shows every system that fits, and its legend
    overlaps no panel."""
    import json

    from lrmoe.experiments import memory_sweep

    class Run:
        def log_figure(self, name, fig):
            renderer = fig.canvas.get_renderer()
            fig.canvas.draw()
            (legend,) = [ax.get_legend() for ax in fig.axes if ax.get_legend()]
            box = legend.get_window_extent(renderer)
            assert not [ax for ax in fig.axes if box.overlaps(ax.get_window_extent(renderer))]
            self.labels = {t.get_text() for t in legend.get_texts()}
            return [name]

    run = Run()
    run.results = tmp_path / "memory_sweep.jsonl"
    with open(run.results, "w") as f:
        f.write(json.dumps({"kind": "run", "run_id": "r", "name": "memory_sweep", "config": {}}) + "\n")
        f.writelines(json.dumps({"kind": "record", "run_id": "r", "step": i, **r}) + "\n"
                     for i, r in enumerate(RECORDS[:-1]))
    assert memory_sweep.plot(run) == ["time_vs_memory"]
    assert run.labels == {"symi-dropless", "lrmoe", "lrmoe-rho0.75", "online"}


def test_the_headline_names_the_fastest_arm_whose_gap_claim_holds_and_says_when_none_does():
    """The report's headline has a third row per cell: the fastest protocol arm whose gap claim holds in the cell's
    regime (time at equal quality), each row's quality column from that regime's claims; a regime where no claim
    holds says so instead of naming a system."""
    import argparse

    from lrmoe.analysis.memory_sweep_report import report

    def cell(label, arm_times):
        recs = [_rec("symi-dropless", 30, 8, 9.0, fits=False, skew=label),
                _rec("symi-dropless", 32, 10, 5.0, skew=label), _rec("symi-dropless", 40, 16, 4.0, skew=label),
                _rec("online", 32, 9, 4.8, skew=label), _rec("online", 40, 9, 3.0, skew=label)]
        return recs + [_rec(arm, gb, 12, t * (gb == 32) + 3.5 * (gb == 40) + 9 * (gb == 30), skew=label)
                       for arm, t in arm_times.items() for gb in (30, 32, 40)]

    held = {"claim": "C4 cap", "word": "holds", "estimate": -0.1, "ci_low": -0.4, "ci_high": 0.2, "seeds": 16,
            "final": True}
    quality = {"production, zipf:0.146": {"lrmoe": held, "lrmoe-rho0.75-unbiased": {**held, "claim": "C4 ρ0.75",
                                                                                   "word": "undecided"}},
               "weak, zipf:0.419": {"lrmoe": {**held, "word": "undecided"}}}
    times = {"lrmoe": 4.5, "lrmoe-rho0.75-unbiased": 4.0}
    records = [dict(r, model=model) for model in ("qwen3-30b-a3b", "glm-4.5-air")
               for r in cell("production, zipf:0.146", times) + cell("weak, zipf:0.419", times)]

    class Run:
        def log_summary(self, summary):
            self.summary = summary

    args = argparse.Namespace(quality=quality, no_band=True, models=[], cluster="a100-40gb-x8", nodes=2)
    run = Run()
    text = report(records, run, args).splitlines()
    rows = [line for line in text if line.startswith("| qwen3-30b-a3b |")]
    prod = [r for r in rows if "production" in r and " 32 | " in r]
    assert any("| arms | lrmoe-rho0.75-unbiased (12) | 0.800 (10)" in r and "C4 ρ0.75 undecided" in r for r in prod)
    assert any("| holds | lrmoe (12) | 0.900 (10)" in r and "C4 cap holds (-0.10 %" in r for r in prod)
    assert any("| weak, zipf:0.419 | — | holds | no arm's gap claim holds in this regime |" in r for r in rows)
    assert [h["best"] for h in run.summary["headline_holds"]] == ["lrmoe"]
    # another model than the one the protocol trains: its rows carry no quality and no "holds" row names a system
    other = [line for line in text if line.startswith("| glm-4.5-air |") and ("| arms |" in line
                                                                           or "| holds |" in line)]
    assert other and all("not measured: the protocol trains qwen3-30b-a3b's shape only" in r for r in other)


def refuses(capsys, argv) -> str:
    """memory_sweep's ``parse_args(argv)`` exits with argparse's status 2 before any work; its message."""
    from lrmoe.experiments import memory_sweep

    with pytest.raises(SystemExit) as exc:
        memory_sweep.parse_args(argv)
    assert exc.value.code == 2, exc.value.code
    return capsys.readouterr().err


def test_the_report_never_replaces_the_results_nor_a_user_s_notes(tmp_path, capsys):
    """Issue 38 (2): ``--out r.md`` wrote the Markdown report over the JSON-lines results; ``--out notes.jsonl``
    replaced a user's notes.md."""
    work = ["--work-dir", str(tmp_path / "work"), "--skews", "zipf:0.2", "--no-wandb"]
    assert "overwrite the results file" in refuses(capsys, ["--out", str(tmp_path / "r.md"), *work])
    notes = tmp_path / "notes.md"
    notes.write_text("mine")
    err = refuses(capsys, ["--out", str(tmp_path / "notes.jsonl"), "--overwrite", *work])
    assert "not a report" in err and notes.read_text() == "mine"
    (tmp_path / "mine.jsonl").write_text('{"mine": 1}\n')
    assert "not a results file of memory_sweep" in refuses(capsys, ["--out", str(tmp_path / "mine.jsonl"),
                                                                    "--overwrite", *work])
    group = tmp_path / "work" / "s_qwen3-30b-a3b_zipf0.2.jsonl"
    group.parent.mkdir()
    group.write_text('{"not": "an ablation"}\n')
    err = refuses(capsys, ["--out", str(tmp_path / "s.jsonl"), "--overwrite", "--models", "qwen3-30b-a3b", *work])
    assert "not a results file of ablate" in err and group.read_text() == '{"not": "an ablation"}\n'


@pytest.mark.parametrize("bad, word", [(["--nodes", "0"], "--nodes"), (["--steps", "1"], "--steps"),
                                       (["--models", "gpt-5"], "--models"), (["--skews", "zipf:x"], "--skews"),
                                       (["--max-gb", "nan"], "--max-gb"), (["--saturate-load", "0.5"], "--saturate")])
def test_bad_arguments_are_argparse_errors(tmp_path, capsys, bad, word):
    """Issue 38 (16): memory_sweep's arguments raised tracebacks (or failed in the first ablation run)."""
    err = refuses(capsys, ["--out", str(tmp_path / "s.jsonl"), "--work-dir", str(tmp_path / "w"), "--no-wandb",
                           *(["--skews", "zipf:0.2"] if "--skews" not in bad else []), *bad])
    assert word in err


def test_a_bad_collected_file_is_named_by_file_and_line(tmp_path, capsys):
    """Issue 38 (14): a bad line of --runs was a bare JSONDecodeError."""
    runs = tmp_path / "runs.jsonl"
    runs.write_text('{"regime": "weak"}\n{"regime": \n{"regime": "weak"}\n')
    err = refuses(capsys, ["--out", str(tmp_path / "s.jsonl"), "--runs", str(runs), "--regimes", "weak",
                           "--no-wandb", "--work-dir", str(tmp_path / "w")])
    assert "runs.jsonl, line 2" in err


def group_args(tmp_path):
    from lrmoe.experiments import memory_sweep

    return memory_sweep.parse_args(["--out", str(tmp_path / "s.jsonl"), "--work-dir", str(tmp_path / "w"),
                                    "--skews", "zipf:0.2", "--models", "qwen3-30b-a3b", "--mem-gb", "40",
                                    "--steps", "2", "--layers", "1", "--systems", "static-ep", "symi-dropless",
                                    "--no-band", "--no-wandb"])


def test_a_group_runs_ablate_in_this_process_and_a_failed_one_names_it(tmp_path, capsys):
    """memory_sweep.py runs ablate.py through its entry point (its cli), in this process (no script by its path):
    the ablation's tables reach this process's stdout and its records come back; an ablation that fails (here its
    own argument check) stops the sweep with an error naming ablate.py and its arguments, its error on this
    process's stderr."""
    from lrmoe.experiments import memory_sweep

    args = group_args(tmp_path)
    out = tmp_path / "w" / "group.jsonl"
    rows = memory_sweep.simulate_group(args, "qwen3-30b-a3b", "zipf:0.2", out)
    assert [r["system"] for r in rows] == ["static-ep", "symi-dropless"] and all(r["iter_s"] > 0 for r in rows)
    assert "## Headline" in capsys.readouterr().out and memory_sweep.finished(out)
    args.steps = 1  # past memory_sweep's own check: ablate.py's refuses it
    with pytest.raises(SystemExit) as exc:
        memory_sweep.simulate_group(args, "qwen3-30b-a3b", "zipf:0.2", tmp_path / "w" / "other.jsonl")
    assert str(exc.value.code).startswith("memory_sweep.py: error: ablate.py --models qwen3-30b-a3b ")
    assert exc.value.code.endswith("failed: exited with 2")
    assert "ablate.py: error:" in capsys.readouterr().err and not (tmp_path / "w" / "other.jsonl").exists()


def test_the_runs_and_the_work_folder_come_from_the_flags_or_the_package_not_the_script_s_folder(tmp_path, monkeypatch,
                                                                                                capsys):
    """Issue 36: without --runs the sweep fell back to a path beside its own file (inside site-packages in an
    installed package). From an unrelated working directory: the default runs are the checkout's committed sweep,
    found from the package; --runs is relative to the working directory; a missing file is argparse's error naming
    it; the work folder lies beside --out in the working directory."""
    from pathlib import Path

    import lrmoe.paper_figures as paper_figures
    from lrmoe.analysis import skew
    from lrmoe.analysis.skew import Match
    from lrmoe.experiments import memory_sweep
    from lrmoe.results import read_records

    committed = Path(__file__).resolve().parent.parent / "paper_figures" / "results" / "frontier_protocol_sweep.jsonl"
    monkeypatch.chdir(tmp_path)
    assert memory_sweep.runs_file(None).resolve() == committed.resolve()
    seen = []
    monkeypatch.setattr(skew, "regime_zipf", lambda rows, name: seen.append(rows) or Match(0.4, 1.0, {}))
    args = memory_sweep.parse_args(["--regimes", "weak", "--no-wandb"])
    assert seen == [read_records(committed)] and args.skews == ["zipf:0.4"]
    assert Path(args.work_dir) == Path("outputs/memory_sweep")  # beside the default --out, in the working directory
    assert memory_sweep.group_path(args, "qwen3-30b-a3b", "zipf:0.4").parent == Path("outputs/memory_sweep")
    assert memory_sweep.parse_args(["--skews", "zipf:0.2", "--out", "r/s.jsonl", "--no-wandb"]).work_dir == "r/s"
    (tmp_path / "mine.jsonl").write_text(committed.read_text())
    assert memory_sweep.runs_file("mine.jsonl") == Path("mine.jsonl")
    assert "--runs: 'gone.jsonl' is not a file" in refuses(capsys, ["--regimes", "weak", "--runs", "gone.jsonl",
                                                                  "--no-wandb"])
    monkeypatch.setattr(paper_figures, "RESULTS_DIR", tmp_path / "not-a-checkout")  # an installed package
    err = refuses(capsys, ["--regimes", "weak", "--no-wandb"])
    assert "not-a-checkout/frontier_protocol_sweep.jsonl are not there" in err and "pass --runs" in err
