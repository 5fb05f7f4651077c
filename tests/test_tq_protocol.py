"""The time-to-quality protocol as data and its runner (lrmoe.analysis.tq_protocol, experiments/tq_sweep.py;
docs/protocols/time_to_quality.md §11): the train.py arguments of every arm and budget, and a resumed stage skipping
exactly the runs already collected with the protocol's identity."""

import json

import pytest

from lrmoe.analysis import protocol
from lrmoe.analysis import tq_protocol as P
from lrmoe.experiments import tq_sweep, train
from lrmoe.results import append_record


def flags(argv):
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = True
            i += 1
    return out


def test_eleven_runs_per_seed_weak_first():
    runs = P.stage_runs("pilot")
    assert len(runs) == 2 * 4 * 11
    assert [r.regime for r in runs[:44]] == ["weak"] * 44 and runs[44].regime == "production"
    assert [r.seed for r in runs[:44:11]] == [2000, 2001, 2002, 2003]
    seed = runs[:11]
    assert sorted((r.arm, r.steps) for r in seed if r.arm == "static-ep") == [
        ("static-ep", 255), ("static-ep", 270), ("static-ep", 285), ("static-ep", 300)]
    assert {r.arm for r in seed if r.budget == 1.0} == {"static-ep", "symi-dropless", *P.LRMOE_ARMS, *P.CONTROLS}
    assert [r.seed for r in P.stage_runs("sweep", 3, regimes=("production",))[::11]] == [3000, 3001, 3002]
    assert [(r.seed, r.arm) for r in P.stage_runs("model-pilot")] == [(2100, "static-ep"), (2101, "static-ep")]
    with pytest.raises(ValueError, match="1 to 32"):
        P.stage_runs("sweep", 33)
    with pytest.raises(ValueError, match="1 to 32"):
        P.stage_runs("sweep", None)


@pytest.mark.parametrize("arm,budget", [("static-ep", 0.85), ("static-ep", 0.95), ("symi-dropless", 1.0),
                                        ("lrmoe-rho0.75-early-unbiased", 1.0), ("lrmoe", 1.0)])
@pytest.mark.parametrize("regime", ["weak", "production"])
def test_train_arguments(tmp_path, arm, budget, regime):
    """Each run is train.py on the emulated engine at 16 ranks, its own steps (ending on an evaluation), cosine with
    10 warm-up steps, the regime's aux-loss and 2 spare slots of 8 home slots, its own trace; train.py parses it."""
    run = P.TQRun("pilot", regime, 2000, arm, budget)
    argv = run.train_argv(tmp_path)
    f = flags(argv)
    assert f["--engine"] == "emulated" and f["--ranks"] == "16" and f["--preset"] == P.PRESET
    assert f["--policy"] == arm and f["--seed"] == "2000"
    assert int(f["--steps"]) == round(300 * budget) and int(f["--steps"]) % int(f["--eval-every"]) == 0
    assert f["--eval-every"] == "15" and f["--eval-batches"] == "16"
    assert f["--lr-schedule"] == "cosine" and f["--warmup"] == "10"
    assert float(f["--aux-coef"]) == protocol.get_regime(regime).aux_coef
    assert f["--extra-slots"] == "2" and f["--eps"] == "0.1" and f["--gamma"] == "0.1"
    assert f["--trace-out"] == str(run.trace(tmp_path)) and f["--out"] == str(run.results(tmp_path))
    args = train.parse_args(argv)
    assert (args.engine, args.steps, args.ranks, args.policy) == ("emulated", round(300 * budget), 16, arm)
    assert "--resume" in run.train_argv(tmp_path, resume=True)
    assert f["--replica-grad"] == "range"  # the pilot's mode; the sweep's is shard (§11.6 Record 3)
    sweep = P.TQRun("sweep", regime, 3000, arm, budget)
    assert flags(sweep.train_argv(tmp_path))["--replica-grad"] == "shard"
    assert "--replica-grad" not in sweep.identity_argv()


def test_model_pilot_reads_steps_25_and_300(tmp_path):
    run = P.stage_runs("model-pilot", preset=P.LADDER[2])[0]
    f = flags(run.train_argv(tmp_path))
    assert f["--eval-every"] == "25" and f["--steps"] == "300" and f["--preset"] == P.LADDER[2]
    assert float(f["--aux-coef"]) == 1e-3
    rows = [{"seed": s, "preset": P.LADDER[2], "eval_steps": [25, 300], "val_loss": [3.0, 2.3],
             "gini_first_last": [0.30, 0.33]} for s in (2100, 2101)]
    v = P.model_pilot_verdict(rows)
    assert v["loss_drop"] == pytest.approx(1 - 2.3 / 3.0) and v["gini_move"] == pytest.approx(0.03)
    assert v["learns_to_route"]
    rows[0]["val_loss"] = [3.0, 2.6]
    assert not P.model_pilot_verdict(rows)["learns_to_route"]  # mean drop 18.3 % < 20 %


def collected(run: P.TQRun) -> dict:
    return {**run.key, "argv": run.identity_argv(), "endpoint": 2.0}


class Stop(Exception):
    pass


def test_resume_skips_only_matching_runs(tmp_path):
    """Runs collected with the protocol's identity are skipped; the first one not collected is trained next; a
    collected line of the same key with other arguments is an error before anything trains."""
    out, work = tmp_path / "tq.jsonl", tmp_path / "work"
    argv = ["--stage", "pilot", "--regimes", "weak", "--work", str(work), "--out", str(out)]
    runs = P.stage_runs("pilot", regimes=("weak",))
    for run in runs[:3]:
        append_record(out, collected(run))
    other = P.TQRun("pilot", "weak", 2000, runs[3].arm, runs[3].budget, preset=P.LADDER[1])  # another model
    append_record(out, collected(other))
    asked = []

    def trainer(train_argv):
        asked.append(train_argv)
        raise Stop

    with pytest.raises(Stop):
        tq_sweep.run_stage(tq_sweep.parse_args(argv), trainer=trainer)
    assert asked == [runs[3].train_argv(work)]  # the three collected skipped; the other model's line is no match

    bad = {**collected(runs[4]), "argv": [*runs[4].identity_argv()[:-2], "--gamma", "0.2"]}
    append_record(out, bad)
    with pytest.raises(SystemExit, match="other train.py arguments"):
        tq_sweep.run_stage(tq_sweep.parse_args(argv), trainer=trainer)
    assert len(asked) == 1


def test_per_run_file_of_other_settings_refused(tmp_path):
    """A per-run results file left by a run of other settings (not collected) is refused, not resumed."""
    work = tmp_path / "work"
    run = P.stage_runs("pilot", regimes=("weak",))[0]
    path = run.results(work)
    path.parent.mkdir(parents=True)
    config = vars(train.parse_args(run.train_argv(work)))
    config["aux_coef"] = 0.1
    path.write_text(json.dumps({"kind": "run", "config": config}) + "\n")
    args = tq_sweep.parse_args(["--stage", "pilot", "--regimes", "weak", "--work", str(work), "--out",
                                str(tmp_path / "tq.jsonl")])
    with pytest.raises(SystemExit, match="--aux-coef"):
        tq_sweep.run_stage(args, trainer=lambda argv: None)


def test_shards_partition_the_stage(tmp_path):
    """--shard K/N gives each of N processes every N-th run of the stage's order: together all runs, none twice."""
    base = ["--stage", "pilot", "--work", str(tmp_path), "--out", str(tmp_path / "tq.jsonl")]
    whole = tq_sweep.parse_args(base).shard_runs
    parts = [tq_sweep.parse_args([*base, "--shard", f"{k}/3"]).shard_runs for k in range(3)]
    assert sorted(map(repr, sum(parts, []))) == sorted(map(repr, whole))
    assert parts[1][0] == whole[1] and parts[1][1] == whole[4]


def test_bad_arguments_exit_2(tmp_path, capsys):
    for argv in (["--stage", "pilot", "--shard", "2/2"], ["--stage", "pilot", "--shard", "x"],
                 ["--stage", "sweep"], ["--stage", "sweep", "--seeds-count", "40"], ["--stage", "pilot",
                 "--time-axis"], ["--stage", "pilot", "--preset", "qwen3-30b-a3b-debug"]):
        with pytest.raises(SystemExit) as exc:
            tq_sweep.parse_args(argv)
        assert exc.value.code == 2
    (tmp_path / "r.md").write_text("x")
    with pytest.raises(SystemExit):
        tq_sweep.parse_args(["--stage", "pilot", "--report", str(tmp_path / "r.md")])


def test_a_slice_starts_only_runs_that_fit(tmp_path):
    """--stop-after: a run whose measured cost (the largest collected wall time of its arm) does not fit in the
    time left is not started, nor is any after it; each started run gets --timeout from its cost."""
    out, work = tmp_path / "tq_protocol_pilot.jsonl", tmp_path / "work"
    runs = P.stage_runs("pilot", regimes=("weak",))
    for run in runs[:2]:  # static EP at 0.85 and 0.90, measured at 100 s and 300 s
        append_record(out, {**collected(run), "wall_s": 100.0 if run.budget == 0.85 else 300.0})
    now = [0.0]
    asked = []

    def trainer(train_argv):
        asked.append(train_argv)
        now[0] += 250.0  # each run takes 250 s on the fake clock; none finishes (the stage stops at the check)
        raise Stop

    args = tq_sweep.parse_args(["--stage", "pilot", "--regimes", "weak", "--work", str(work), "--out", str(out),
                                "--stop-after", "4"])
    assert tq_sweep.run_stage(args, trainer=trainer, clock=lambda: now[0]) == 0  # 240 s left < 300 s: none
    assert asked == []
    args.stop_after = 6  # 360 s: static EP 0.95 costs the arm's largest, 300 s, and fits
    with pytest.raises(Stop):
        tq_sweep.run_stage(args, trainer=trainer, clock=lambda: now[0])
    f = flags(asked[0])
    assert f["--steps"] == "285" and float(f["--timeout"]) == max(P.TIMEOUT_FACTOR * 300.0, P.MIN_TIMEOUT_S)
    text = P.progress_table([collected(r) for r in runs[:2]], runs)
    assert "| static-ep-r0.85 | 1 of 4 |" in text and "**2 of 44**" in text


def test_a_repeated_collected_line_counts_once_and_two_versions_of_a_run_are_refused(tmp_path):
    """A copy of a collected line appended again is one run to the report (its counts and verdict), the figure and
    the runner (lrmoe.analysis.tq_protocol.unique_rows); two different lines of one run are refused, naming the run
    and the fields they differ in."""
    out = tmp_path / "tq.jsonl"
    runs = P.stage_runs("model-pilot")
    rows = [{**collected(run), "eval_steps": [25, P.STEPS], "val_loss": [3.0, 2.0], "gini_first_last": [0.3, 0.2]}
            for run in runs]
    for row in [*rows, rows[0]]:  # the first line appended again
        append_record(out, row)
    argv = ["--stage", "model-pilot", "--out", str(out), "--report", str(tmp_path / "r.md")]
    text = tq_sweep.report(tq_sweep.parse_args(argv))
    assert f"{len(runs)} of {len(runs)} runs collected" in text and f"{len(runs)} seeds" in text, text
    assert P.collected_rows(out) == rows

    append_record(out, {**rows[1], "endpoint": 2.5})  # another version of the second run
    with pytest.raises(SystemExit, match=f"'seed': {runs[1].seed}.*differ in endpoint"):
        tq_sweep.report(tq_sweep.parse_args(argv))
    from lrmoe.paper_figures import tq_figures

    with pytest.raises(ValueError, match="differ in endpoint"):
        tq_figures.claims(out)
