"""W&B project, group and job type of a run: flags, then the environment, then the script's own choice (and a real
offline W&B run takes them)."""

import argparse

from lrmoe.integrations.tracking import Tracker
from lrmoe.integrations.tracking_args import add_tracking_args
from lrmoe.integrations.wandb_policy import DEFAULT_PROJECT, wandb_names


def test_flags_beat_the_environment_which_beats_the_scripts_choice(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    assert wandb_names({}, None, "preset-a") == (DEFAULT_PROJECT, "preset-a")
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
    assert wandb_names({}, None, "preset-a") == ("env-project", "env-group")
    assert wandb_names({"wandb_project": "flag-p", "wandb_group": "flag-g"}, None, "preset-a") == ("flag-p", "flag-g")


def test_the_flags_exist_on_every_scripts_shared_parser():
    parser = argparse.ArgumentParser()
    add_tracking_args(parser, "x.jsonl")
    args = parser.parse_args(["--wandb-project", "p", "--wandb-group", "g"])
    assert (args.wandb_project, args.wandb_group) == ("p", "g")


def test_an_offline_run_is_filed_under_the_environments_project_with_the_scripts_job_type(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "elsewhere")
    monkeypatch.setenv("WANDB_RUN_GROUP", "my-group")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with Tracker("bench_x", {"a": 1}, results=tmp_path / "r.jsonl", group="preset", quiet=True) as tracker:
        run = tracker.wandb_run
        assert (run.project, run.group, run.job_type) == ("elsewhere", "my-group", "bench_x")
