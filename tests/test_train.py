"""Expert-parallel training on gloo ranks, on lrmoe's model and on HF's Qwen3-MoE and GLM-4.5 (--hf-config): the
loss falls, --resume is exact, the records are complete (load statistics included), the recorded trace round-trips."""

import json
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from _scripts import load_experiment

from lrmoe.config import model_preset
from lrmoe.integrations.checkpoint import identity_mismatch
from lrmoe.traces.trace import load_trace
from lrmoe.training import loop
from lrmoe.training.models import NativeModel
from lrmoe.training.resume import RUN_ARG_DEFAULTS
from lrmoe.training.schedule import lr_at
from lrmoe.training.sizing import cost_model, expert_memory, system_context

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
    assert identity_mismatch(tmp_path, older, here, RUN_ARG_DEFAULTS) is None
    assert "--clip-grad 0.0 there, 1.0 here" in identity_mismatch(
        tmp_path, older, {**here, "args": {"lr": 1e-3, "clip_grad": 1.0}}, RUN_ARG_DEFAULTS)


def test_the_cosine_schedule_warms_up_then_decays_to_its_floor():
    args = train.parse_args(["--steps", "101", "--lr", "1e-2", "--lr-schedule", "cosine", "--warmup", "10",
                             "--min-lr-frac", "0.1"])
    lrs = [lr_at(step, args) for step in range(args.steps)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[9] == pytest.approx(1e-2)  # linear warm-up to --lr
    assert all(a >= b - 1e-12 for a, b in zip(lrs[9:], lrs[10:]))  # then never rises
    assert lrs[-1] == pytest.approx(1e-3)  # the floor at the last step
    assert lrs[55] == pytest.approx(0.55e-2)  # half-way through the decay: the mid-point of lr and floor
    constant = train.parse_args(["--lr", "1e-2"])
    assert {lr_at(step, constant) for step in range(100)} == {1e-2}
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


# --- checks before launch, and how a run ends (bad input, a hung rank, an interrupt) ----------------------------------

@pytest.mark.parametrize("argv,flag", [
    (["--lr", "nan"], "--lr"), (["--lr", "-1"], "--lr"), (["--aux-coef", "nan"], "--aux-coef"),
    (["--hf-config", "glm", "--bias-rate", "nan"], "--bias-rate"), (["--bias-rate", "inf"], "--bias-rate"),
    (["--trace-out", "x.txt"], "--trace-out"), (["--timeout", "0"], "--timeout"), (["--timeout", "-3"], "--timeout"),
    (["--timeout", "nan"], "--timeout"), (["--max-bytes", "-5"], "--max-bytes"), (["--eps", "nan"], "--eps"),
    (["--extra-slots", "-1"], "--extra-slots"), (["--seed", "-1"], "--seed")])
def test_bad_values_are_argparse_errors_naming_the_flag(capsys, argv, flag):
    """Each was accepted and found out late (after the ranks started, or after the whole run trained: --trace-out),
    or with a misleading message (--max-bytes -5: "corpus too small"), or a traceback (--timeout 0)."""
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_extra_slots_are_bounded_by_the_memory_the_machine_has(tmp_path, capsys):
    """--extra-slots 100000 passed the checks and allocated about 10 GB per rank; the experts' memory is now estimated
    (lrmoe.training.sizing.expert_memory: every slot's weights, gradient and working copy in every MoE layer, the
    plans, buffers and optimizer shards) and refused, before any rank starts and before any file is written (the
    results file's lock too), when the ranks' experts would not fit. (Issue 53's case: tests/test_sizing.py.)"""
    out = tmp_path / "r.jsonl"
    err = refused(capsys, tmp_path, "--extra-slots", "10000000", "--out", str(out))
    assert "--extra-slots 10000000: the experts need" in err and "GiB of memory it has available" in err
    assert "10000008 slots x 2 MoE layers x 24 KiB: weights" in err  # 16/2 home slots + the extra, 3·64·32 fp32
    assert list(tmp_path.iterdir()) == []  # no results file, no checkpoint folder, no .r.jsonl.lock


def test_the_results_lock_check_still_refuses_a_live_writer(tmp_path, capsys):
    """The check no longer creates the lock file it probes (a failed check left `.r.jsonl.lock` behind), and still
    finds a live writer's lock."""
    from lrmoe.integrations.tracking import Tracker

    out = tmp_path / "r.jsonl"
    with Tracker("train", results=out, wandb=False):
        err = refused(capsys, tmp_path, "--resume", "--steps", "2", "--out", str(out))
    assert "is being written by another live process" in err


def _slot_bytes(rank, args):
    cfg = model_preset(args.preset)
    run = NativeModel(args, cfg, 1, torch.device("cpu"))
    return sum(2 * layer.store.slots_SW.numel() * layer.store.slots_SW.element_size() for layer in run.layers)


def test_the_slot_memory_estimate_is_what_the_model_allocates():
    """The estimate's weights and gradients against the slots a rank's model really holds (weights, and a gradient
    as large). (The whole estimate against a real run's peak memory: tests/test_sizing.py.)"""
    from lrmoe.runtime.distributed.launch import launch

    args = train.parse_args(["--ranks", "1", "--extra-slots", "3", "--policy", "lrmoe"])
    args.run_id = "x"
    estimate = expert_memory(args, model_preset(args.preset), 1)
    assert launch(_slot_bytes, 1, args, timeout_s=120)[0] == estimate.weights + estimate.grads


def test_the_cost_model_prices_each_system_as_the_simulator_builds_it():
    """--cost-model priced lrmoe-padded as compacted (11.99 against the simulator's 11.48 ms per layer and
    iteration): it now takes compaction and optimizer sharding from the system's entry, as the simulator does, so
    the same plan is priced differently as lrmoe (compact backward) and as lrmoe-padded (padded packets)."""
    from lrmoe.sim.simulated_systems import simulator_system
    from lrmoe.systems import get_system

    counts_NE = torch.tensor([[60] * 4 + [4] * 12] * 4)  # rank 0's experts hot; no spare slot: LRMoE trims
    priced = {}
    for policy in ("lrmoe", "lrmoe-padded"):
        args = train.parse_args(["--policy", policy, "--ranks", "4", "--extra-slots", "0"])
        cfg = model_preset(args.preset)
        system = simulator_system(get_system(policy), system_context(args, cfg, 4))
        cost = cost_model(args, cfg, 4)
        assert (cost.compaction, cost.sharded_optimizer) == (system.compaction, system.sharded_optimizer)
        priced[policy] = cost
    assert priced["lrmoe-padded"].compaction is False
    plan = simulator_system(get_system("lrmoe-padded"), system_context(args, cfg, 4)).make_policy().plan(
        counts_NE, counts_NE.sum(0))
    assert plan.bwd_load_N.sum() < plan.fwd_load_N.sum()  # the plan trims: padding costs something
    assert priced["lrmoe-padded"].cost(plan).total_s != priced["lrmoe"].cost(plan).total_s


def _hang_on_rank_1(batches_seen):
    def get_batch(*args, **kw):
        batches_seen.append(1)
        if dist.get_rank() == 1 and len(batches_seen) == 2:
            time.sleep(3600)  # the second step: rank 1 never reaches the step's collectives
        return real_get_batch(*args, **kw)
    return get_batch


def _slow_steps(*args, **kw):
    time.sleep(2.5)  # every rank as slow: a healthy run, longer than --timeout in all
    return real_get_batch(*args, **kw)


real_get_batch = loop.get_batch


@pytest.mark.slow  # 7 s: make test-all; a hung rank is named at the launcher in test_launch
def test_a_hung_rank_is_named_after_timeout_seconds(tmp_path, monkeypatch):
    """A rank that stops before a collective: its peers give up after --timeout and the run ends naming it, with
    where it is (before: --timeout, default an hour, bounded the whole run, and the message blamed every rank)."""
    from lrmoe.runtime.distributed.launch import LaunchError

    monkeypatch.setattr(loop, "get_batch", _hang_on_rank_1([]))
    start = time.monotonic()
    with pytest.raises(LaunchError) as exc:
        run(tmp_path, "--steps", "4", "--ckpt-every", "0", "--timeout", "6", "--out", str(tmp_path / "r.jsonl"))
    assert exc.value.rank == 1 and str(exc.value).startswith("rank 1 of 2 did not arrive at a collective")
    assert "rank 1: not in a collective" in str(exc.value) and "in get_batch" in str(exc.value)
    assert time.monotonic() - start < 120


@pytest.mark.slow  # 11 s: make test-all; the same bound at the launcher: test_launch
def test_a_healthy_run_longer_than_its_timeout_finishes(tmp_path, monkeypatch):
    """--timeout bounds each wait for the other ranks, not the run: 3 steps of 2.5 s pass --timeout 6 (before: the
    run was killed after 6 s)."""
    monkeypatch.setattr(loop, "get_batch", _slow_steps)
    start = time.monotonic()
    history = run(tmp_path, "--steps", "3", "--ckpt-every", "0", "--timeout", "6", "--out", str(tmp_path / "r.jsonl"))
    assert len(history) == 3 and time.monotonic() - start > 7.5


def test_an_interrupt_ends_the_run_with_status_130_and_one_line(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while the ranks train: status 130, one
    line, no traceback (before: status 1 and a KeyboardInterrupt traceback)."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "r.jsonl"
    script = train.__file__
    proc = subprocess.Popen([sys.executable, script, "--ranks", "2", "--batch", "2", "--seq-len", "32", "--steps",
                             "100000", "--max-bytes", "300000", "--eval-every", "1000", "--ckpt-every", "0",
                             "--no-wandb", "--quiet", "--out", str(out)],
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (out.is_file() and '"kind": "record"' in out.read_text()):  # training: a step is recorded
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("train.py: interrupted"), err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
