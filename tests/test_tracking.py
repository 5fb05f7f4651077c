"""Tracking: an offline W&B run is created, the results file is appended record by record, never overwritten, and
a resumed run supersedes what its killed attempt left (each step once, one run id, one W&B run)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import matplotlib.pyplot as plt
import pytest

from lrmoe import results as results_module
from lrmoe.integrations.tracking import Tracker
from lrmoe.integrations.wandb_policy import wandb_mode
from lrmoe.results import atomic_write_text, read_results


def test_offline_run_results_file_and_no_overwrite(tmp_path, capsys):
    results = tmp_path / "exp.jsonl"
    with Tracker("exp", {"lr": 0.1}, results=results, seed=5) as run:
        run.log({"policy": "lrmoe", "time_ms": 1.5})
        # written record by record: the record is on disk before the run ends
        assert len(read_results(results)) == 1
        fig, ax = plt.subplots()
        ax.plot([0, 1])
        pngs = run.log_figure("curve", fig)
        wandb_dir = run.wandb_dir
    assert all(p.stat().st_size > 0 for p in pngs)
    header = read_results(results, kind="run")[0]
    assert header["config"] == {"lr": 0.1} and header["seed"] == 5 and header["attempt"] == 1
    assert {"git_commit", "versions", "device"} <= set(header) and header["versions"]["torch"]
    assert "W&B: offline" in capsys.readouterr().out
    assert any(p.name.startswith("offline-run-") for p in (wandb_dir / "wandb").iterdir())

    with pytest.raises(FileExistsError, match="--overwrite"):
        Tracker("exp", results=results, wandb=False)
    with Tracker("exp", results=results, overwrite=True, wandb=False) as run:
        run.log({"x": float("nan")})
    records = read_results(results)
    assert len(records) == 1 and records[0]["x"] == "nan"
    json.loads(results.read_text().splitlines()[0])
    with pytest.raises(ValueError, match="contradict"):
        Tracker("exp", results=results, overwrite=True, resume=True, wandb=False)


def test_wandb_mode_prefers_user_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode()[0] == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", os.fspath(tmp_path))  # no ~/.netrc login there
    assert wandb_mode()[0] == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password key\n")
    assert wandb_mode()[0] == "online"
    monkeypatch.setenv("WANDB_API_KEY", "key")
    assert wandb_mode() == ("online", "WANDB_API_KEY is set")


def test_log_table_labels_every_row(tmp_path):
    import pandas as pd

    with Tracker("t", results=tmp_path / "t.jsonl", wandb=False) as run:
        run.log_table("phase", pd.DataFrame({"ms": [1.0, 2.0]}), clock="cpu")
        run.log_table("other", [{"ms": 3.0, "clock": "wall"}], clock="cpu")
    records = read_results(tmp_path / "t.jsonl")
    assert [(r["table"], r["ms"], r["clock"]) for r in records] == [("phase", 1.0, "cpu"), ("phase", 2.0, "cpu"),
                                                                    ("other", 3.0, "wall")]


# -- resuming ------------------------------------------------------------------------------------------------------
def killed_run(results, steps, value=lambda s: float(s), torn=True, name="exp") -> str:
    """A run that logged ``steps`` (and a figure and summary record, as a finished run would) and then died while
    writing its next record: the file ends in an unterminated line. Returns its run id."""
    run = Tracker(name, {"lr": 0.1}, results=results, wandb=False)
    for s in steps:
        run.log({"loss": value(s)}, step=s)
    run._write({"kind": "figure", "run_id": run.run_id, "name": "f", "paths": []})
    run.log_summary({"final": 1.0})
    if torn:
        run._file.write('{"kind": "record", "run_id": "' + run.run_id + '", "step": 99, "lo')
        run._file.flush()
    run._file.close()  # no finish(): the process "died"
    run._lock.release()
    return run.run_id


def test_resume_supersedes_every_record_past_the_checkpoint(tmp_path):
    results = tmp_path / "exp.jsonl"
    run_id = killed_run(results, range(1, 11))
    assert [r["step"] for r in read_results(results)] == list(range(1, 11))  # the torn line is not a record
    # resumed from the checkpoint at step 7: the attempt redoes 8.. with other values
    with Tracker("exp", {"lr": 0.1}, results=results, resume=True, resume_step=7, wandb=False) as run:
        assert run.run_id == run_id and run.attempt == 2
        assert [r["step"] for r in read_results(results)] == list(range(1, 8))  # rewritten before appending
        for s in range(8, 13):
            run.log({"loss": -float(s)}, step=s)
        run.log({"note": "auto"})  # an unnumbered record continues after the last one
    records = read_results(results)
    assert [r["step"] for r in records] == list(range(1, 14)), "each step exactly once"
    assert [r.get("loss") for r in records[:12]] == [float(s) for s in range(1, 8)] + [-float(s) for s in range(8, 13)]
    assert {r["run_id"] for r in records} == {run_id}
    headers = read_results(results, "run")
    assert [(h["run_id"], h["attempt"], h.get("resumed_from_step")) for h in headers] == [(run_id, 1, None),
                                                                                          (run_id, 2, 7)]
    # the killed attempt's summary and figure are gone: they described a run that did not end that way
    assert read_results(results, "summary") == [] and read_results(results, "figure") == []
    assert results.read_text().endswith("\n")
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]

    # resuming again (e.g. killed again) applies the same rule to the file as it now is
    with Tracker("exp", results=results, resume=True, resume_step=10, wandb=False) as run:
        assert run.attempt == 3
        run.log({"loss": 0.0}, step=11)
    assert [r["step"] for r in read_results(results)] == list(range(1, 12))


def test_resume_without_a_checkpoint_redoes_the_whole_run(tmp_path):
    """Scripts with no checkpoint (sweeps, benchmarks) redo their work: none of the killed attempt's records stay,
    and unnumbered records count from 0 again, so the file reads as one uninterrupted run."""
    results = tmp_path / "sweep.jsonl"
    with Tracker("sweep", results=results, wandb=False) as run:
        for cell in "abc":
            run.log({"cell": cell})
    clean = [(r["step"], r["cell"]) for r in read_results(results)]
    killed = tmp_path / "killed.jsonl"
    killed_run(killed, [0, 1], name="sweep")
    with Tracker("sweep", results=killed, resume=True, wandb=False) as run:
        for cell in "abc":
            run.log({"cell": cell})
    assert [(r["step"], r["cell"]) for r in read_results(killed)] == clean
    assert len(read_results(killed, "run")) == 2 and len({r["run_id"] for r in read_results(killed, "run")}) == 1


def test_resume_of_a_missing_file_starts_the_run(tmp_path):
    with Tracker("exp", results=tmp_path / "new.jsonl", resume=True, resume_step=5, wandb=False) as run:
        run.log({"loss": 1.0}, step=1)
        assert run.attempt == 1
    assert [r["step"] for r in read_results(tmp_path / "new.jsonl")] == [1]


def test_a_crash_during_the_rewrite_loses_nothing(tmp_path, monkeypatch):
    results = tmp_path / "exp.jsonl"
    killed_run(results, range(1, 6))
    before = results.read_bytes()

    def crash(*_):
        raise KeyboardInterrupt  # the process dies between writing the new file and renaming it

    monkeypatch.setattr(results_module.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        Tracker("exp", results=results, resume=True, resume_step=2, wandb=False)
    assert results.read_bytes() == before
    monkeypatch.undo()
    with Tracker("exp", results=results, resume=True, resume_step=2, wandb=False) as run:  # not locked out
        run.log({"loss": 3.5}, step=3)
    assert [(r["step"], r["loss"]) for r in read_results(results)] == [(1, 1.0), (2, 2.0), (3, 3.5)]


def test_atomic_write_replaces_whole_files(tmp_path):
    path = tmp_path / "marker.done"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second")
    assert path.read_text() == "second" and [p.name for p in tmp_path.iterdir()] == ["marker.done"]


def test_one_writer_at_a_time_and_the_lock_dies_with_its_holder(tmp_path):
    results = tmp_path / "exp.jsonl"
    with Tracker("exp", results=results, wandb=False):
        with pytest.raises(RuntimeError, match="another live process"):
            Tracker("exp", results=results, resume=True, wandb=False)
    # a writer killed by SIGKILL (no cleanup at all) does not lock out the resumed run
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from lrmoe.integrations.tracking import Tracker
        run = Tracker("exp", results={str(results)!r}, resume=True, wandb=False, quiet=True)
        run.log({{"loss": 1.0}}, step=1)
        print("ready", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(RuntimeError, match="another live process"):
            Tracker("exp", results=results, resume=True, wandb=False)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with Tracker("exp", results=results, resume=True, resume_step=1, wandb=False) as run:
        run.log({"loss": 2.0}, step=2)
    assert [r["step"] for r in read_results(results)] == [1, 2]


def test_a_resumed_run_continues_the_same_wandb_run_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", os.fspath(tmp_path / "wb"))
    results = tmp_path / "exp.jsonl"
    sent = []

    def spy(run):
        log = run.wandb_run.log
        run.wandb_run.log = lambda values, step=None, **kw: (sent.append((run.attempt, step)), log(values, step=step))

    first = Tracker("exp", results=results, quiet=True)
    spy(first)
    for s in range(1, 6):
        first.log({"loss": float(s)}, step=s)
    first.finish()
    with Tracker("exp", results=results, resume=True, resume_step=3, quiet=True) as second:
        spy(second)
        assert second.wandb_run.id == first.run_id == second.run_id
        for s in range(4, 9):
            second.log({"loss": float(s)}, step=s)
    # W&B's history is append-only: the resumed attempt sends only the steps W&B does not have yet
    assert sent == [(1, s) for s in range(1, 6)] + [(2, s) for s in range(6, 9)]
    assert offline_run_ids(tmp_path / "wb") == [first.run_id] * 2  # two attempts' folders, one W&B run


def offline_run_ids(wandb_dir) -> list[str]:
    """The run id of every offline W&B run folder (one per attempt) under ``wandb_dir``."""
    return sorted(f.name[len("run-"):-len(".wandb")] for f in (wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_argv_names_paths_relative_to_the_working_folder(monkeypatch, tmp_path):
    from lrmoe.integrations.provenance import portable_argv

    monkeypatch.chdir(tmp_path)
    assert portable_argv([str(tmp_path / "experiments" / "x.py"), "--out", str(tmp_path / "o.jsonl"), "/elsewhere/y",
                          "rel/z"]) == ["experiments/x.py", "--out", "o.jsonl", "/elsewhere/y", "rel/z"]


def test_overwrite_refuses_a_results_file_the_script_did_not_write(tmp_path, capsys):
    """--overwrite replaces only what this script wrote (its manifest, or the run header of an older file)."""
    import argparse

    from lrmoe.integrations.tracking_args import add_tracking_args, check_tracking_args

    def check(out, name="exp"):
        parser = argparse.ArgumentParser()
        add_tracking_args(parser, "x.jsonl")
        check_tracking_args(parser, parser.parse_args(["--out", str(out), "--overwrite", "--no-wandb"]), name)

    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"mine": 1}\n')
    with pytest.raises(SystemExit) as exc:
        check(notes)
    assert exc.value.code == 2 and "not a results file of exp" in capsys.readouterr().err
    results = tmp_path / "exp.jsonl"
    with Tracker("exp", results=results, wandb=False) as run:
        run.log({"x": 1.0})
    check(results)  # its own: fine
    with pytest.raises(SystemExit):
        check(results, name="other")


def test_overwrite_removes_the_replaced_run_s_figures_and_wandb_run_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    results = tmp_path / "exp.jsonl"
    with Tracker("exp", results=results) as run:
        run.log({"x": 1.0})
        fig, ax = plt.subplots()
        old_figure = run.log_figure("old", fig)
        old_run = run.run_id
    theirs = tmp_path / "exp_notes.png"
    theirs.write_text("mine")
    assert list((tmp_path / "wandb").glob(f"*-{old_run}"))
    with Tracker("exp", results=results, overwrite=True) as run:
        run.log({"x": 2.0})
        new_run = run.run_id
    assert not any(p.exists() for p in old_figure), "a figure of the replaced run stayed beside the new results"
    assert not list((tmp_path / "wandb").glob(f"*-{old_run}")) and list((tmp_path / "wandb").glob(f"*-{new_run}"))
    assert theirs.read_text() == "mine"
    with pytest.raises(FileExistsError, match="not written by"), Tracker("exp", results=results, overwrite=True,
                                                                         wandb=False) as run:
        run.log({"x": 3.0})
        run.log_figure("notes", plt.subplots()[0])  # would save over the user's exp_notes.png
    assert theirs.read_text() == "mine"
