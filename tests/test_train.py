"""Expert-parallel training on gloo ranks, on lrmoe's model and on HF's Qwen3-MoE and GLM-4.5 (--hf-config): the
loss falls, --resume is exact, the records are complete (load statistics included), the recorded trace round-trips."""

import json
import math

import pytest
import torch
from _scripts import load_experiment

from lrmoe.integrations.checkpoint import identity_mismatch
from lrmoe.traces.trace import load_trace

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
    assert trace.meta["source"] == "recorded" and trace.counts_ILNE.shape == (6, 2, 2, 16)
    assert (trace.counts_ILNE.sum(dim=(2, 3)) == 2 * 2 * 32 * 4).all()  # ranks × batch × seq × top-k
    assert "val_loss" in history[-1]


def test_stop_and_resume_give_the_same_losses(tmp_path):
    sched = ["--lr-schedule", "cosine", "--warmup", "1"]  # the schedule continues from the checkpoint's step
    full = run(tmp_path, "--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "2", *sched, "--out",
               str(tmp_path / "a.jsonl"), "--ckpt-dir", str(tmp_path / "a"))
    run(tmp_path, "--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "2", "--stop-after", "3", *sched,
        "--out", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(tmp_path / "b"))
    resumed = run(tmp_path, "--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "2", "--resume", *sched,
                  "--out", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(tmp_path / "b"))
    assert [h["loss"] for h in resumed] == [h["loss"] for h in full]
    assert full[-1]["dropped_frac"] > 0  # SYMI-cf1 drops overflow


def test_micro_batches_stopped_and_resumed_under_checkpointing_equal_an_unbroken_run(tmp_path):
    """--micro-batches 2 (online replication: replicas per micro-batch), unbroken, against the same run with
    --activation-checkpointing stopped between two checkpoints and resumed: bit-identical losses and records."""
    args = ["--policy", "online", "--steps", "4", "--ckpt-every", "2", "--micro-batches", "2", "--eval-every", "2"]
    full = run(tmp_path, *args, "--out", str(tmp_path / "a.jsonl"), "--ckpt-dir", str(tmp_path / "a"))
    ckpt = [*args, "--activation-checkpointing", "--out", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(tmp_path / "b")]
    run(tmp_path, *ckpt, "--stop-after", "3")
    resumed = run(tmp_path, *ckpt, "--resume")

    def same(h):  # everything but the wall-clock throughput and the checkpointing flag
        return {k: v for k, v in h.items() if k not in ("tokens_per_s", "activation_checkpointing")}

    assert [same(h) for h in resumed] == [same(h) for h in full]
    assert all(h["micro_batches"] == 2 and h["activation_checkpointing"] for h in resumed)
    with pytest.raises(SystemExit):
        train.parse_args(["--batch", "3", "--micro-batches", "2"])  # must divide the batch


@pytest.mark.parametrize("arch", [[], ["--hf-config", "qwen3"]])
def test_clip_grad_records_the_norm_and_checkpoints_without_it_ran_unclipped(tmp_path, arch):
    """--clip-grad on each architecture: every record holds the setting and the norm before clipping (the budget
    system lrmoe clips its recalibrated gradient); a checkpoint from before the argument existed is a run without
    clipping. (Exactness against torch's clipping: tests/test_clip.py, tests/test_hf_optimizer.py.)"""
    history = run(tmp_path, *arch, "--policy", "lrmoe", "--steps", "2", "--clip-grad", "0.5", "--ckpt-every", "0",
                  "--out", str(tmp_path / "r.jsonl"))
    assert all(h["clip_grad"] == 0.5 and math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0.5 for h in history)
    assert results(tmp_path / "r.jsonl")[-1]["grad_norm"] == history[-1]["grad_norm"]
    here = {"script": "train", "run_id": "r", "results": "r.jsonl", "args": {"lr": 1e-3, "clip_grad": 0.0}}
    older = {"script": "train", "run_id": "r", "results": "r.jsonl", "args": {"lr": 1e-3}}
    assert identity_mismatch(tmp_path, older, here, train.RUN_ARG_DEFAULTS) is None
    assert "--clip-grad 0.0 there, 1.0 here" in identity_mismatch(
        tmp_path, older, {**here, "args": {"lr": 1e-3, "clip_grad": 1.0}}, train.RUN_ARG_DEFAULTS)


def test_the_cosine_schedule_warms_up_then_decays_to_its_floor():
    args = train.parse_args(["--steps", "101", "--lr", "1e-2", "--lr-schedule", "cosine", "--warmup", "10",
                             "--min-lr-frac", "0.1"])
    lrs = [train.lr_at(step, args) for step in range(args.steps)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[9] == pytest.approx(1e-2)  # linear warm-up to --lr
    assert all(a >= b - 1e-12 for a, b in zip(lrs[9:], lrs[10:]))  # then never rises
    assert lrs[-1] == pytest.approx(1e-3)  # the floor at the last step
    assert lrs[55] == pytest.approx(0.55e-2)  # half-way through the decay: the mid-point of lr and floor
    constant = train.parse_args(["--lr", "1e-2"])
    assert {train.lr_at(step, constant) for step in range(100)} == {1e-2}
    for bad in (["--warmup", "5", "--steps", "5"], ["--min-lr-frac", "0"]):
        with pytest.raises(SystemExit):
            train.parse_args(bad)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        train.parse_args(["--policy", "deepspeed"])
    assert torch.get_num_threads() >= 1


def test_hf_config_names_a_family_or_a_preset():
    assert train.parse_args(["--hf-config", "glm"]).preset == "glm-4.5-air-debug"
    assert train.parse_args(["--hf-config", "qwen3-30b-a3b-debug"]).preset == "qwen3-30b-a3b-debug"
    assert train.parse_args([]).preset == "qwen3-30b-a3b-debug" and train.parse_args([]).hf_config is None
    with pytest.raises(SystemExit):  # two different models asked for
        train.parse_args(["--hf-config", "qwen3", "--preset", "glm-4.5-air-debug"])
    with pytest.raises(SystemExit):  # no such preset
        train.check_args(train.parse_args(["--hf-config", "llama", "--ranks", "2"]))


def results(path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "record"]


SUMMARY_KEYS = [f"load/{k}_{s}" for k in ("gini", "rank_max_over_mean", "tokens_per_expert_std", "retained_frac")
                for s in ("mean", "p50", "p90", "p99")] + ["load/dropped_pairs", "load/trimmed_pairs"]
PAIRS = 2 * 2 * 32 * 4  # routed pairs per MoE layer and step: ranks × batch × seq × top-k


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family,policy", [("qwen3", "lrmoe"), ("glm", "symi-cf1")])
def test_an_hf_model_of_each_family_trains_with_complete_records(tmp_path, family, policy):
    history = run(tmp_path, "--hf-config", family, "--policy", policy, "--steps", "6", "--lr", "1e-2",
                  "--eval-every", "3", "--out", str(tmp_path / "r.jsonl"), "--ckpt-dir", str(tmp_path / "ck"),
                  "--trace-out", str(tmp_path / "trace.npz"))
    losses = [h["loss"] for h in history]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 0.3, losses
    assert [h["step"] for h in history] == list(range(1, 7))
    for h in history:
        for key in ("dropped_frac", "bwd_pairs_max", "bwd_pairs_mean", "hot_rank_bwd_cut", "modelled_s",
                    *SUMMARY_KEYS):
            assert math.isfinite(h[key]), key
        assert h["load/layers"] == 2  # GLM's first layer is dense
        assert h["load/tokens_per_expert_mean_mean"] == PAIRS / 16
        assert h["load/dropped_pairs"] == pytest.approx(h["dropped_frac"] * 2 * PAIRS)
        assert 0 < h["load/retained_frac_mean"] <= 1 and h["load/rank_max_over_mean_p99"] >= 1
        evaluated = h["step"] % 3 == 0
        assert ("val_loss" in h) == evaluated and math.isfinite(h.get("val_loss", 0.0))
        assert ("load/layer1/gini" in h) == evaluated  # each layer's numbers only every --eval-every steps
    assert history[-1]["dropped_frac"] > 0 if policy == "symi-cf1" else history[-1]["load/trimmed_pairs"] > 0
    written = results(tmp_path / "r.jsonl")
    assert len(written) == len(history) and all({k: r[k] for k in h} == h for r, h in zip(written, history))
    trace = load_trace(tmp_path / "trace.npz")
    assert trace.meta["architecture"] == {"qwen3": "qwen3_moe", "glm": "glm4_moe"}[family]
    assert trace.counts_ILNE.shape == (6, 2, 2, 16) and (trace.counts_ILNE.sum(dim=(2, 3)) == PAIRS).all()


@pytest.mark.timeout(180)
def test_an_hf_run_stopped_and_resumed_continues_bit_identically(tmp_path):
    args = ["--hf-config", "glm", "--policy", "lrmoe", "--steps", "4", "--ckpt-every", "2", "--eval-every", "2"]
    full = run(tmp_path, *args, "--out", str(tmp_path / "a.jsonl"), "--ckpt-dir", str(tmp_path / "a"))
    run(tmp_path, *args, "--stop-after", "3", "--out", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(tmp_path / "b"))
    resumed = run(tmp_path, *args, "--resume", "--out", str(tmp_path / "b.jsonl"), "--ckpt-dir", str(tmp_path / "b"))

    def same(h):  # everything but the wall-clock throughput (and the results file's run ids)
        return {k: v for k, v in h.items() if k not in ("tokens_per_s", "run_id")}

    assert [same(h) for h in resumed] == [same(h) for h in full]
    assert [same(r) for r in results(tmp_path / "b.jsonl")] == [same(r) for r in results(tmp_path / "a.jsonl")]
    assert any("load/layer0/gini" in h for h in resumed)


def refused(capsys, tmp_path, *argv) -> str:
    """The argparse-style error with which train.py refuses ``argv`` before any rank starts."""
    with pytest.raises(SystemExit) as exc:
        run(tmp_path, *argv)
    assert exc.value.code == 2
    return capsys.readouterr().err
