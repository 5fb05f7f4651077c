"""Tracking: an offline W&B run is created, the results file is appended record by record, never overwritten."""

import json
import os

import matplotlib.pyplot as plt
import pytest

from lrmoe.tracking import Tracker, read_results, wandb_mode


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
    assert header["config"] == {"lr": 0.1} and header["seed"] == 5
    assert {"git_commit", "versions", "device"} <= set(header) and header["versions"]["torch"]
    assert "W&B: offline" in capsys.readouterr().out
    assert any(p.name.startswith("offline-run-") for p in (wandb_dir / "wandb").iterdir())

    with pytest.raises(FileExistsError, match="--overwrite"):
        Tracker("exp", results=results, wandb=False)
    with Tracker("exp", results=results, resume=True, wandb=False) as run:
        run.log({"policy": "symi", "time_ms": 2.0})
    assert [r["policy"] for r in read_results(results)] == ["lrmoe", "symi"]
    with Tracker("exp", results=results, overwrite=True, wandb=False) as run:
        run.log({"x": float("nan")})
    records = read_results(results)
    assert len(records) == 1 and records[0]["x"] == "nan"
    json.loads(results.read_text().splitlines()[0])


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
