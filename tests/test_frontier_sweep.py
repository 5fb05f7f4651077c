"""experiments/frontier_sweep.py without training: finished per-run files are collected once each (append-only, a
second sitting adds nothing twice), an unfinished run is left out, and the report says what the runs can say."""

import json
import sys
import time

import pytest

from _scripts import load_experiment

from lrmoe.analysis import protocol
from lrmoe.integrations.tracking import Tracker

sweep = load_experiment("frontier_sweep")


def fake_run(path, endpoint: float, steps: int = protocol.STEPS, config: dict | None = None):
    """A per-run results file as train.py writes it: every step's pairs, an evaluation every EVAL_EVERY steps."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with Tracker("train", config or {}, results=path, wandb=False, quiet=True) as run:
        for step in range(1, steps + 1):
            rec = {"step": step, "loss": 2.0, "fwd_pairs_max": 12.0, "fwd_pairs_mean": 10.0, "bwd_pairs_max": 9.0,
                   "dropped_frac": 0.0}
            if step % protocol.EVAL_EVERY == 0:
                rec.update({"val_loss": endpoint, "load/rank_max_over_mean_mean": 1.2, "load/gini_mean": 0.2,
                            "load/expert_max_over_mean_mean": 1.5})
            run.log(rec, step=step)


def test_collect_is_append_only_and_skips_unfinished_runs(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "collected.jsonl"
    seed = protocol.PILOT_SEEDS[0]
    folder = work / "production" / f"seed{seed}"
    for arm, loss in zip(protocol.PILOT_ARMS, (2.0, 2.0, 2.02, 2.04)):
        fake_run(folder / f"{arm}.jsonl", loss)
    fake_run(work / "production" / f"seed{protocol.PILOT_SEEDS[1]}" / "static-ep.jsonl", 2.0, steps=100)  # stopped
    argv = ["--stage", "pilot", "--regimes", "production", "--work", str(work), "--out", str(out), "--collect-only"]
    sweep.main(argv)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["arm"] for r in rows) == sorted(protocol.PILOT_ARMS) and {r["seed"] for r in rows} == {seed}
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm["lrmoe-rho0.75-unbiased"]["endpoint"] == 2.02
    assert by_arm["static-ep"]["fwd_max_over_mean"] == pytest.approx(1.2)
    assert by_arm["static-ep"]["bwd_max_over_mean_fwd"] == pytest.approx(0.9)
    sweep.main(argv)  # a second sitting: nothing collected twice
    assert len(out.read_text().splitlines()) == len(protocol.PILOT_ARMS)
    text = capsys.readouterr().out
    assert "1 whole seeds" in text and "slowest rank ÷ mean 1.200" in text



def test_regimes_side_by_side_collect_each_run_once(tmp_path, capsys):
    """--jobs 2: each regime in a process of its own, both appending to the one results file; the report covers
    both."""
    work, out = tmp_path / "work", tmp_path / "collected.jsonl"
    seed = protocol.PILOT_SEEDS[0]
    for regime in protocol.REGIMES:
        for arm, loss in zip(protocol.PILOT_ARMS, (2.0, 2.0, 2.02, 2.04)):
            fake_run(work / regime / f"seed{seed}" / f"{arm}.jsonl", loss)
    sweep.main(["--stage", "pilot", "--work", str(work), "--out", str(out), "--collect-only", "--jobs", "2"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["regime"], r["arm"]) for r in rows) == sorted(
        (regime, arm) for regime in protocol.REGIMES for arm in protocol.PILOT_ARMS)
    text = capsys.readouterr().out
    assert all(f"## Regime {regime}" in text for regime in protocol.REGIMES)


def test_a_regime_that_fails_stops_the_others_at_once():
    """The first regime's process that exits non-zero ends the sweep with an error naming it; the one still running
    is stopped, not waited for."""
    args = sweep.parse_args(["--stage", "sweep", "--jobs", "2"])
    commands = {"production": [sys.executable, "-c", "import time; time.sleep(60)"],
                "weak": [sys.executable, "-c", "import sys; sys.exit(3)"]}
    start = time.monotonic()
    with pytest.raises(SystemExit, match="the weak regime's sweep exited with 3; the others were stopped"):
        sweep.run_side_by_side(args, commands.get)
    assert time.monotonic() - start < 20


def test_a_per_run_file_of_other_settings_is_refused_not_collected(tmp_path, capsys):
    """Issue 38 (3): the sweep collected (and convergence.py resumed) any finished per-run file, whatever settings
    ran it; now the stored configuration is compared with the protocol's, and a difference is named."""
    work, out = tmp_path / "work", tmp_path / "collected.jsonl"
    seed = protocol.PILOT_SEEDS[0]
    folder = work / "production" / f"seed{seed}"
    for arm in protocol.PILOT_ARMS:
        aux = 0.5 if arm == "static-ep" else protocol.get_regime("production").aux_coef
        fake_run(folder / f"{arm}.jsonl", 2.0, config={"policy": arm, "seed": seed, "aux_coef": aux,
                                                        "steps": protocol.STEPS, "preset": protocol.PRESET})
    argv = ["--stage", "pilot", "--regimes", "production", "--work", str(work), "--out", str(out), "--collect-only"]
    with pytest.raises(SystemExit, match=r"static-ep.jsonl holds a run of other settings.*--aux-coef: was 0.5"):
        sweep.main(argv)
    assert not out.exists()


def test_a_torn_collected_line_is_skipped_and_never_glued_onto_and_a_bad_one_is_named(tmp_path, capsys):
    """Issue 38 (14): a truncated last line made --report-only / --collect-only fail with a bare JSONDecodeError,
    and the next append glued onto it."""
    work, out = tmp_path / "work", tmp_path / "collected.jsonl"
    seed = protocol.PILOT_SEEDS[0]
    for arm in protocol.PILOT_ARMS:
        fake_run(work / "production" / f"seed{seed}" / f"{arm}.jsonl", 2.0)
    argv = ["--stage", "pilot", "--regimes", "production", "--work", str(work), "--out", str(out)]
    sweep.main([*argv, "--collect-only"])
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:40])  # the last append killed half-way
    sweep.main([*argv, "--report-only"])
    assert "line 4: a torn last record" in capsys.readouterr().err
    sweep.main([*argv, "--collect-only"])  # collects the torn run again, on a line of its own
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["arm"] for r in rows) == sorted(protocol.PILOT_ARMS)
    out.write_text(lines[0] + "\n" + lines[1][:40] + "\n" + "\n".join(lines[2:]) + "\n")  # a bad line inside
    for mode in ("--report-only", "--collect-only"):
        with pytest.raises(SystemExit, match=r"collected.jsonl, line 2: not a JSON record"):
            sweep.main([*argv, mode])


def test_convergence_runs_in_this_process_and_its_failure_names_it(tmp_path, capsys):
    """frontier_sweep.py runs convergence.py through its entry point, in this process (no script by its path):
    convergence.py's own error (a per-run file of other settings) reaches this process's stderr, and the sweep stops
    with an error naming convergence.py and its arguments; nothing is collected."""
    work, out = tmp_path / "work", tmp_path / "collected.jsonl"
    seed = protocol.PILOT_SEEDS[0]
    fake_run(work / "production" / f"seed{seed}" / "static-ep.jsonl", 2.0, steps=10,
             config={"policy": "static-ep", "seed": seed, "aux_coef": 0.5})  # unfinished: convergence would resume
    args = sweep.parse_args(["--stage", "pilot", "--regimes", "production", "--work", str(work), "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        sweep.train_and_collect(args)
    assert str(exc.value.code).startswith("frontier_sweep.py: error: convergence.py --preset ")
    assert exc.value.code.endswith("failed: exited with 2")
    err = capsys.readouterr().err
    assert "convergence.py: error:" in err and "--aux-coef: was 0.5" in err
    assert not out.exists()
