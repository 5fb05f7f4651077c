"""experiments/train.py under torchrun, as typed from the docs (no extra flag): it runs as torchrun's ranks (found
from their environment), rank 0 alone writes the results file, and the run equals the fork launcher's on the same
arguments; an EP 2 x DP 2 mesh of forked ranks trains the GLM preset (selection bias, summed over the DP copies)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _scripts import load_experiment

from lrmoe.results import read_results
from lrmoe.runtime.distributed.torchrun import TORCHRUN_VARS

train = load_experiment("train")
ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--policy", "symi-dropless", "--steps", "3", "--batch", "2", "--seq-len", "32", "--eval-every", "100",
          "--eval-batches", "1", "--max-bytes", "300000", "--no-wandb", "--quiet", "--ckpt-every", "0"]


def rank_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_standalone_runs_train_py_without_a_flag_as_the_fork_launcher_does(tmp_path):
    out = tmp_path / "torchrun.jsonl"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(ROOT / "experiments" / "train.py"), *COMMON, "--out", str(out)],
                          capture_output=True, text=True, env=rank_env(), timeout=500, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(read_results(out, "run")) == 1  # one run header: rank 0's
    got = read_results(out)
    forked = train.main([*COMMON, "--ranks", "2", "--out", str(tmp_path / "fork.jsonl")])
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in forked], rel=1e-9, abs=0)


def test_torchrun_flag_outside_torchrun_and_bad_ep_sizes_are_named(tmp_path, capsys):
    for argv, message in ((["--torchrun"], "not started by torchrun"), (["--ep-size", "3"], "must divide"),
                          (["--ep-size", "2", "--hf-config", "qwen3"], "--hf-config runs"),
                          (["--ep-size", "2", "--engine", "emulated"], "--engine emulated runs")):
        with pytest.raises(SystemExit) as exc:
            train.main([*COMMON, "--ranks", "4", "--out", str(tmp_path / "r.jsonl"), *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.timeout(300)
def test_an_ep2_dp2_mesh_trains_the_glm_preset_on_forked_ranks(tmp_path):
    """Four forked ranks, --ep-size 2: two EP groups, data-parallel copies of each other; the loss falls."""
    history = train.main([*COMMON, "--preset", "glm-4.5-air-debug", "--ranks", "4", "--ep-size", "2", "--steps",
                          "4", "--lr", "1e-2", "--out", str(tmp_path / "r.jsonl")])
    losses = [h["loss"] for h in history]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


@pytest.mark.timeout(300)
def test_an_ep2_dp2_run_stopped_and_resumed_gives_the_same_losses(tmp_path):
    """The DCP checkpoint of a mesh: the DP copies write their shared shards once, each EP group its own placement
    and counts, so a resumed run on the same mesh continues bit for bit."""
    base = [*COMMON, "--ranks", "4", "--ep-size", "2", "--steps", "4", "--ckpt-every", "2", "--lr", "1e-2"]
    full = train.main([*base, "--out", str(tmp_path / "a.jsonl")])
    train.main([*base, "--stop-after", "3", "--out", str(tmp_path / "b.jsonl")])
    resumed = train.main([*base, "--resume", "--out", str(tmp_path / "b.jsonl")])
    assert [h["loss"] for h in resumed] == [h["loss"] for h in full]
