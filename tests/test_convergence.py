"""experiments/convergence.py reuses a per-run file only for the run it asks for: the run's stored configuration
(train.py's results header) is compared with the arguments it would pass; a difference is an error naming it, or,
with --overwrite, a rerun (issue 38, item 3)."""

import pytest
from _scripts import load_experiment

from lrmoe.integrations.tracking import Tracker

convergence = load_experiment("convergence")
train = load_experiment("train")


def finished_run(path, train_argv, steps):
    """A per-run results file as train.py writes it: its header's config is train.py's parsed arguments."""
    config = vars(train.parse_args(train_argv))
    with Tracker("train", config, results=path, wandb=False, quiet=True) as run:
        for step in range(1, steps + 1):
            run.log({"loss": 1.0}, step=step)


def argv(out, *extra):
    return ["--policies", "static-ep", "--steps", "3", "--ranks", "2", "--out", str(out), "--no-wandb", *extra]


def test_a_finished_run_of_other_settings_is_neither_reused_nor_resumed(tmp_path, capsys):
    out = tmp_path / "conv.jsonl"
    args = convergence.parse_args(argv(out, "--aux-coef", "0.1"))
    run = convergence.run_path(out.with_suffix(""), "static-ep", 0, [0])
    run.parent.mkdir(parents=True)
    finished_run(run, convergence.train_argv(args, "static-ep", 0, run), steps=3)
    for mode in ([], ["--resume"]):
        with pytest.raises(SystemExit) as exc:
            convergence.parse_args(argv(out, "--aux-coef", "0.5", *mode))
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--aux-coef: was 0.1, now 0.5" in err and "other settings" in err
    assert convergence.finished(args, "static-ep", 0)  # the same settings: reused
    changed = convergence.parse_args(argv(out, "--aux-coef", "0.5", "--overwrite"))
    assert not convergence.finished(changed, "static-ep", 0)  # rerun, not reported under the new header
    assert convergence.finished(convergence.parse_args(argv(out, "--aux-coef", "0.1", "--overwrite")), "static-ep", 0)


def test_a_switch_turned_off_is_a_difference(tmp_path):
    out = tmp_path / "conv.jsonl"
    args = convergence.parse_args(argv(out, "--activation-checkpointing"))
    run = convergence.run_path(out.with_suffix(""), "static-ep", 0, [0])
    run.parent.mkdir(parents=True)
    finished_run(run, convergence.train_argv(args, "static-ep", 0, run), steps=3)
    plain = convergence.parse_args(argv(out, "--overwrite"))
    assert convergence.run_differences(plain, "static-ep", 0) == ["--activation-checkpointing: was on, now off"]


def test_a_run_trains_in_this_process_and_its_failure_names_the_run(tmp_path, capsys):
    """convergence.py runs train.py through its entry point, in this process (no script by its path): train.py's
    own argparse error reaches this process's stderr (a child process's would not reach capsys), and the sweep
    stops with an error naming train.py and the run's arguments."""
    run_argv = ["--preset", "qwen3-30b-a3b-debug", "--steps", "0", "--out", str(tmp_path / "run.jsonl")]
    with pytest.raises(SystemExit) as exc:
        convergence.train(run_argv)
    assert exc.value.code == f"convergence.py: error: train.py {' '.join(run_argv)} failed: exited with 2"
    assert "train.py: error: --steps must be positive" in capsys.readouterr().err
    assert not (tmp_path / "run.jsonl").exists()
