"""Expert-parallel training on gloo ranks: the loss falls, --resume is exact, the recorded trace round-trips."""

import pytest
import torch
from _scripts import load_experiment

from lrmoe.traces import load_trace

train = load_experiment("train")
pytestmark = [pytest.mark.script, pytest.mark.timeout(600)]


def run(tmp_path, *extra):
    common = ["--ranks", "2", "--batch", "2", "--seq-len", "32", "--eval-every", "100", "--eval-batches", "1",
              "--max-bytes", "300000", "--no-wandb", "--quiet", "--timeout", "120"]
    return train.main([*common, *extra])


def test_a_few_steps_on_two_ranks_lower_the_loss_and_record_a_trace(tmp_path):
    history = run(tmp_path, "--policy", "symi-dropless", "--steps", "6", "--lr", "1e-2",
                  "--out", str(tmp_path / "r.jsonl"), "--ckpt-dir", str(tmp_path / "ck"),
                  "--trace-out", str(tmp_path / "trace.npz"))
    losses = [h["loss"] for h in history]
    assert losses[-1] < losses[0] - 0.3, losses
    trace = load_trace(tmp_path / "trace.npz")
    assert trace.meta["source"] == "recorded" and trace.counts_SLNE.shape == (6, 2, 2, 16)
    assert (trace.counts_SLNE.sum(dim=(2, 3)) == 2 * 2 * 32 * 4).all()  # ranks × batch × seq × top-k
    assert "val_loss" in history[-1]


def test_stop_and_resume_give_the_same_losses(tmp_path):
    full = run(tmp_path, "--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "2", "--out",
               str(tmp_path / "a.jsonl"), "--ckpt-dir", str(tmp_path / "a"))
    run(tmp_path, "--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "2", "--stop-after", "3",
        "--out", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(tmp_path / "b"))
    resumed = run(tmp_path, "--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "2", "--resume",
                  "--out", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(tmp_path / "b"))
    assert [h["loss"] for h in resumed] == [h["loss"] for h in full]
    assert full[-1]["dropped_frac"] > 0  # SYMI-cf1 drops overflow


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        train.parse_args(["--policy", "deepspeed"])
    assert torch.get_num_threads() >= 1
