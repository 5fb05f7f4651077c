"""The emulated engine (lrmoe.runtime.inprocess): its process group gives what gloo gives, bit for bit (the ring
all-reduce's summation order included), it fails fast instead of hanging, and train.py's --engine emulated trains
the same losses and weights as the distributed runtime (fork launcher, gloo) on the same seed and data."""

import math
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _scripts import load_experiment

from lrmoe.config import full_scale_preset, model_preset
from lrmoe.integrations.checkpoint import step_folder
from lrmoe.integrations.checkpoint_state import read_full_state
from lrmoe.traces.trace import load_trace
from lrmoe.runtime.distributed.comm import all_gather_rows, all_to_all_rows, exchange_rows
from lrmoe.runtime.distributed.launch import LaunchError, launch
from lrmoe.runtime.inprocess import launch_inprocess
from lrmoe.runtime.inprocess.group import ring_chunk

train = load_experiment("train")
pytestmark = [pytest.mark.timeout(900)]

# every system docs/protocols/time_to_quality.md §11.2 runs (the references, early selection and m2 unbiased at rho 0.75
# and m2 unbiased at
# 0.9, cap mode, random 1/p and SYMI's random trim with 1/p at rho 0.75), and §10.2's random trim without 1/p
ARMS = ("static-ep", "symi-dropless", "lrmoe-rho0.75-early-unbiased", "lrmoe-rho0.9-unbiased",
        "lrmoe-rho0.75-unbiased", "lrmoe", "lrmoe-rho0.75-random-unbiased", "symi-dropless-rho0.75-unbiased",
        "symi-dropless-rho0.75")


# -- the process group against gloo -----------------------------------------------------------------------------------
def _collectives(rank: int, sizes: list[int]) -> list:
    """Every collective the runtime uses, on data that makes the summation order visible."""
    N = dist.get_world_size()
    out = []
    for n in sizes:
        g = torch.Generator().manual_seed(1000 * n + rank)
        scale = torch.logspace(-8, 8, n, dtype=torch.float64)[torch.randperm(n, generator=g)]
        for dtype in (torch.float32, torch.float64):
            x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
            dist.all_reduce(x)
            out.append(x)
    m = torch.tensor([float(rank), -float(rank)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out.append(m)
    out.append(all_gather_rows(torch.tensor([rank, 7 * rank])))
    send = [(rank + r) % 3 for r in range(N)]  # uneven, some zero
    recv = [(q + rank) % 3 for q in range(N)]
    out.append(all_to_all_rows(torch.arange(sum(send) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank, send, recv))
    got = exchange_rows({p: torch.full((p + 1,), float(rank)) for p in range(N) if p != rank and p != 1},
                        {q: rank + 1 for q in range(N) if q != rank and rank != 1}, torch.float32,
                        torch.device("cpu"))
    out.append(sorted((q, t.tolist()) for q, t in got.items()))
    pair = dist.new_group([0, N - 1])
    z = torch.tensor([1.0 + rank])
    if rank in (0, N - 1):
        dist.all_reduce(z, group=pair)
    out.append(z)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=N - 1)
    dist.barrier()
    out.append(b)
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_collective_matches_gloo_bit_for_bit(ranks):
    # 600,001 float64 elements over 2 ranks make 6 ring segments of at most 1 MiB, not the minimum 4: the chunk
    # boundary moves (300,003, not 300,002), and with it which rank's value a sum starts from
    sizes = [1, 5, 1001, 600_001] if ranks == 2 else [1, 7, 1001]
    assert ring_chunk(600_001, 8, 2) == 300_003
    emulated = launch_inprocess(_collectives, ranks, sizes, timeout_s=120)
    distributed = launch(_collectives, ranks, sizes, timeout_s=120)
    for rank, (a, b) in enumerate(zip(emulated, distributed)):
        for x, y in zip(a, b):
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), (rank, x, y)
            else:
                assert x == y, (rank, x, y)
    assert not dist.is_initialized()  # the caller's world is untouched


def _default_world(rank: int):
    return dist.get_rank(), dist.get_world_size(), dist.get_backend(), torch.rand(1).item()


def test_each_rank_has_its_own_world_and_random_generator():
    torch.manual_seed(3)
    expected = torch.rand(1).item()
    torch.manual_seed(3)
    got = launch_inprocess(_default_world, 4)
    assert [g[:3] for g in got] == [(r, 4, "inprocess") for r in range(4)]
    assert all(g[3] == expected for g in got)  # every rank starts from the caller's generator, as a fork does


def _fails_on_rank_2(rank: int):
    if rank == 2:
        raise KeyError("rank 2's own error")
    dist.barrier()
    return rank


def _skips_a_collective(rank: int):
    if rank != 1:
        dist.all_reduce(torch.ones(1))
    return rank


def test_a_failing_rank_and_a_deadlock_raise_at_once_and_the_next_launch_runs():
    with pytest.raises(LaunchError, match="rank 2's own error"):
        launch_inprocess(_fails_on_rank_2, 4, timeout_s=60)
    with pytest.raises(LaunchError, match="deadlock"):
        launch_inprocess(_skips_a_collective, 3, timeout_s=60)
    assert not dist.is_initialized()
    assert [g[0] for g in launch_inprocess(_default_world, 2)] == [0, 1]
    assert launch(_default_world, 2, timeout_s=60)[1][:2] == (1, 2)  # the fork launcher is unaffected


def _rank_1_is_slow(rank: int):
    dist.barrier()
    if rank == 1:
        time.sleep(2.0)  # holds the turn: the others wait for it at the barrier
    dist.barrier()
    return rank


def test_a_timed_out_launch_names_the_slow_rank_and_stops_its_threads_and_hooks_are_restored():
    """Past its timeout a launch raises a LaunchError naming the rank that held the turn, only once every rank's
    thread has stopped (no rank thread alive at interpreter exit, which aborted the process); and the per-rank
    exception hooks that torch's init_process_group installs ("[rankN]: " prefixes) do not outlive a launch."""
    hook = sys.excepthook
    with pytest.raises(LaunchError, match=r"rank\(s\) \[1\] held the turn.*ranks \[0, 2\] waited") as exc:
        launch_inprocess(_rank_1_is_slow, 3, timeout_s=0.5)
    assert "did not stop" not in str(exc.value)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lrmoe-rank")]
    assert sys.excepthook is hook
    assert launch_inprocess(_default_world, 2)[1][:2] == (1, 2) and sys.excepthook is hook


# -- train.py: the engines against each other -------------------------------------------------------------------------
def _run(tmp, engine: str, policy: str, steps: int, ranks: int = 4, preset: str = "qwen3-30b-a3b-debug",
         extra_slots: int = 1, batch: int = 4, seq_len: int = 64, eval_batches: int = 2, replica_grad: str = "range"):
    """One train.py run at the protocol's settings (docs/protocols/frontier.md §10.2: cosine with warm-up, aux 0.1, ε
    0.1, 1 spare slot per 4 home slots), its per-step records and its checkpoint of the last step (every tensor
    whole)."""
    out = tmp / f"{engine}-{policy}.jsonl"
    history = train.main(["--preset", preset, "--policy", policy, "--engine", engine, "--ranks", str(ranks),
                          "--steps", str(steps), "--batch", str(batch), "--seq-len", str(seq_len),
                          "--eval-every", str(steps), "--eval-batches", str(eval_batches), "--lr-schedule", "cosine",
                          "--warmup", str(min(10, steps - 1)), "--aux-coef", "0.1", "--extra-slots", str(extra_slots),
                          "--eps", "0.1", "--seed", "1000", "--ckpt-every", str(steps), "--out", str(out),
                          "--trace-out", str(tmp / f"{engine}-{policy}.npz"), "--max-bytes", "400000",
                          "--no-wandb", "--quiet", "--timeout", "1800", "--replica-grad", replica_grad])
    states = [read_full_state(step_folder(train.parse_args(["--out", str(out)]).ckpt_dir, steps))]
    return history, states


def _tensors(state, prefix=""):
    """Every tensor of a checkpoint, by its path (weights, optimizer moments, routing counts)."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _tensors(v, f"{prefix}/{i}")


def assert_same_run(a, b, rel=1e-5):
    """Losses, validation losses and every weight and optimizer state within ``rel`` (relative to the tensor's
    largest entry), the routing and the plans' records equal. Returns the largest relative difference seen."""
    (hist_a, states_a), (hist_b, states_b) = a, b
    assert len(hist_a) == len(hist_b)
    worst = 0.0
    for ra, rb in zip(hist_a, hist_b):
        for key in ("loss", "val_loss"):
            if key in ra or key in rb:
                assert math.isclose(ra[key], rb[key], rel_tol=rel), (ra["step"], key, ra[key], rb[key])
                worst = max(worst, abs(ra[key] - rb[key]) / abs(rb[key]))
        for key in ("dropped_frac", "fwd_pairs_max", "bwd_pairs_max", "bwd_pairs_mean"):
            assert math.isclose(ra[key], rb[key], rel_tol=rel, abs_tol=1e-9), (ra["step"], key)
    for rank, (sa, sb) in enumerate(zip(states_a, states_b)):
        ta, tb = dict(_tensors({k: v for k, v in sa.items() if k != "run"})), \
            dict(_tensors({k: v for k, v in sb.items() if k != "run"}))
        assert ta.keys() == tb.keys()
        assert any("master_EW" in k for k in ta) and any("exp_avg_sq_EW" in k for k in ta)
        for key, x in ta.items():
            y = tb[key]
            if not x.is_floating_point():
                assert torch.equal(x, y), (rank, key)
                continue
            if x.numel():
                diff = float((x - y).abs().max()) / max(float(y.abs().max()), 1e-30)
                assert diff <= rel, (rank, key, diff)
                worst = max(worst, diff)
    print(f"largest relative difference over the losses and the checkpoint: {worst:.3g}")
    return worst


@pytest.mark.script
def test_emulated_training_equals_the_distributed_runtime_over_a_few_steps(tmp_path):
    """The fast check of the slow one below: early selection (a random stream, replicas, quotas, the keep bits'
    exchange), 3 steps at 4 ranks: the same losses and weights."""
    policy = "lrmoe-rho0.75-early-unbiased"
    assert_same_run(_run(tmp_path, "emulated", policy, 3), _run(tmp_path, "distributed", policy, 3))


@pytest.mark.script
def test_the_two_replica_gradient_modes_train_bitwise_the_same_on_the_emulated_engine(tmp_path):
    """docs/protocols/time_to_quality.md §11.6 Record 3: the sweep's runs use `shard`, the pilot's `range`, as the
    same maths: LRMoE with replicas on 4 emulated ranks, 4 steps, the same losses and every checkpoint tensor bit
    for bit."""
    policy = "lrmoe-rho0.75-unbiased"
    (tmp_path / "range").mkdir()
    (tmp_path / "shard").mkdir()
    worst = assert_same_run(_run(tmp_path / "range", "emulated", policy, 4),
                            _run(tmp_path / "shard", "emulated", policy, 4, replica_grad="shard"), rel=0.0)
    assert worst == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ARMS)
def test_emulated_training_equals_the_distributed_runtime_over_20_steps(tmp_path, policy):
    emulated = _run(tmp_path, "emulated", policy, 20)
    assert_same_run(emulated, _run(tmp_path, "distributed", policy, 20))
    assert torch.equal(load_trace(tmp_path / f"emulated-{policy}.npz").counts_ILNE,
                       load_trace(tmp_path / f"distributed-{policy}.npz").counts_ILNE)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ARMS)
def test_emulated_training_at_qwen3s_routing_shape_equals_16_gloo_ranks(tmp_path, policy):
    """128 experts, top-8, 16 ranks (2 spare slots per 8 home slots, the regime's share), 3 steps."""
    kw = dict(ranks=16, preset="qwen3-30b-a3b-routing-debug", extra_slots=2, batch=2, seq_len=64, eval_batches=1)
    assert_same_run(_run(tmp_path, "emulated", policy, 3, **kw), _run(tmp_path, "distributed", policy, 3, **kw))


@pytest.mark.slow  # 8 s: make test-all; the engines' equality and its checkpoints stay in make test
@pytest.mark.script
def test_an_emulated_run_at_qwen3s_routing_shape_records_every_layers_counts(tmp_path):
    history, _ = _run(tmp_path, "emulated", "lrmoe-rho0.75-unbiased", 2, ranks=16,
                      preset="qwen3-30b-a3b-routing-debug", extra_slots=2, batch=1, seq_len=16, eval_batches=1)
    trace = load_trace(tmp_path / "emulated-lrmoe-rho0.75-unbiased.npz")
    assert trace.counts_ILNE.shape == (2, 2, 16, 128)  # steps, layers, ranks, experts
    assert (trace.counts_ILNE.sum(dim=(2, 3)) == 16 * 1 * 16 * 8).all()  # ranks × batch × seq × top-k
    assert trace.meta["model"] == "qwen3-30b-a3b-routing-debug" and len(history) == 2


def test_bad_engine_arguments_are_refused_before_any_rank_starts(capsys):
    for argv in (["--engine", "emulated", "--torchrun"], ["--engine", "emulated", "--hf-config", "qwen3"],
                 ["--engine", "threads"]):
        with pytest.raises(SystemExit) as exc:
            train.parse_args(argv)
        assert exc.value.code == 2
    assert "--engine" in capsys.readouterr().err


def test_the_convergence_sweep_passes_the_engine_to_every_run(tmp_path):
    convergence = load_experiment("convergence")
    args = convergence.parse_args(["--engine", "emulated", "--policies", "static-ep", "--out",
                                   str(tmp_path / "c.jsonl"), "--no-wandb"])
    argv = convergence.train_argv(args, "static-ep", 0, tmp_path / "r.jsonl")
    assert argv[argv.index("--engine") + 1] == "emulated"
    assert train.parse_args(argv).engine == "emulated"


@pytest.mark.script
def test_a_distributed_run_stopped_and_resumed_on_the_emulated_engine_equals_an_unbroken_emulated_run(tmp_path):
    """The checkpoints are the engines' common format: a run interrupted under gloo continues in-process exactly."""
    common = ["--policy", "lrmoe-rho0.75-unbiased", "--ranks", "2", "--batch", "2", "--seq-len", "32", "--steps", "4",
              "--ckpt-every", "2", "--eval-every", "100", "--eval-batches", "1", "--lr-schedule", "cosine",
              "--warmup", "1", "--max-bytes", "300000", "--no-wandb", "--quiet", "--timeout", "120"]
    full = train.main([*common, "--engine", "emulated", "--out", str(tmp_path / "a.jsonl")])
    stopped = train.main([*common, "--engine", "distributed", "--stop-after", "3", "--out", str(tmp_path / "b.jsonl")])
    assert [h["step"] for h in stopped] == [1, 2, 3]
    resumed = train.main([*common, "--engine", "emulated", "--resume", "--out", str(tmp_path / "b.jsonl")])
    assert resumed[:2] == stopped[:2]  # steps 1-2 from the checkpoint (their wall-clock throughput included)
    assert [h["loss"] for h in resumed] == [h["loss"] for h in full]


def test_the_routing_shape_preset_is_qwen3s_routing_priced_as_qwen3():
    cfg = model_preset("qwen3-30b-a3b-routing-debug")
    assert (cfg.num_experts, cfg.top_k, cfg.router) == (128, 8, "softmax_topk")
    cfg.check_divisible(16)
    assert full_scale_preset(cfg.name).name == "qwen3-30b-a3b"
