"""Accelerate's own loop with the drop-in on 4 gloo processes (tiny Qwen3-MoE and GLM-4.5, fp32, CPU).

``Accelerator(gradient_accumulation_steps=2).prepare(model, ep.optimizer(...), loader)`` wraps the swapped model in
DistributedDataParallel, the optimizer in its ``AcceleratedOptimizer`` (which steps only at the end of an
accumulation window) and the loader in its per-process shard; ``accelerator.backward`` divides each micro-batch's
loss by the window, so the optimizer's gradient scale is 1 / ranks; clipping is the optimizer's
(``max_grad_norm``), once over the dense part and every expert. Property: after 3 steps of 2 micro-batches, with a
clipping that binds at every step, the weights (experts gathered) equal lrmoe's own loop on the same ranks and
micro-batches (``ep.optimizer(AdamW, max_grad_norm=...)``) to float noise, with the same clipped norm. Run through
Accelerate's API in the package's fork launcher, and through ``accelerate launch`` itself (its torchrun launcher,
4 processes: what a user types), the same checks.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lrmoe.integrations.hf import swap_moe_blocks  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import Rows, tiny_config, tiny_hf_model, weight_mismatches  # noqa: E402

TINY = tiny_config()
RANKS, BATCH, SEQ, MICRO, STEPS, LR = 4, 2, 8, 2, 3, 1e-2
MAX_NORM = 0.5  # the mean loss's gradient norm is about 2-3 here: every step clips
WEIGHTS = dict(rtol=1e-4, atol=LR / 100)  # DDP's average against lrmoe's sum: float noise, through Adam



def warmup(step: int) -> float:
    return (step + 1) / STEPS


def own_loop(family: str, micro_batches: list[torch.Tensor]):
    """lrmoe's own loop (docs/hf.md) on this rank's micro-batches: the mean loss's gradient, clipped in the step."""
    model = tiny_hf_model(family)
    ep = swap_moe_blocks(model, "lrmoe-no-quotas")
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.0, max_grad_norm=MAX_NORM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    for step in range(STEPS):
        for m in range(MICRO):
            x = micro_batches[step * MICRO + m]
            model(x, labels=x).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt


def accelerated_against_own_loop(rank: int, family: str) -> dict:
    """Accelerate's loop on this process, then lrmoe's own loop on the micro-batches it saw; the comparison."""
    from accelerate import Accelerator

    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])  # what torchrun sets
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    world = accelerator.num_processes
    model = tiny_hf_model(family)
    ep = swap_moe_blocks(model, "lrmoe-no-quotas")
    # accelerator.backward divides each micro-batch's loss by the window: only the ranks are left to average over
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.0, max_grad_norm=MAX_NORM, grad_scale=1.0 / world)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)  # stepped by hand at each optimizer step
    rows = torch.randint(0, TINY.vocab_size, (world * STEPS * MICRO * BATCH, SEQ),
                         generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(Rows(rows), batch_size=BATCH)
    ddp, aopt, loader = accelerator.prepare(model, opt, loader)
    seen, steps = [], 0
    for batch in loader:
        with accelerator.accumulate(ddp):
            seen.append(batch["input_ids"].clone())
            accelerator.backward(ddp(**batch).loss)
            aopt.step()  # only at the window's end (AcceleratedOptimizer)
            if accelerator.sync_gradients:
                sched.step()
                steps += 1
            aopt.zero_grad()
    got = model.state_dict()  # collective: the experts gathered
    ref, ref_opt = own_loop(family, seen)
    want = ref.state_dict()
    out = {"world": world, "ddp": type(ddp).__name__, "seen": len(seen), "steps": steps,
           "norm": (float(opt.last_grad_norm), float(ref_opt.last_grad_norm)), "weights": {}}
    out["weights"] = weight_mismatches(got, want, **WEIGHTS)
    return out


def check(outs: list[dict]) -> None:
    for out in outs:
        assert out["world"] == RANKS and out["ddp"] == "DistributedDataParallel", out
        assert out["seen"] == STEPS * MICRO and out["steps"] == STEPS, out
        assert not out["weights"], out["weights"]
        got, want = out["norm"]
        assert got > MAX_NORM and got == pytest.approx(want, rel=1e-5), out["norm"]  # clipped, once, globally


@pytest.mark.parametrize("family", ["qwen", "glm"])
def test_accelerates_loop_on_four_processes_trains_as_lrmoes_own_loop(family):
    os.environ["OMP_NUM_THREADS"] = "1"
    check(launch(accelerated_against_own_loop, RANKS, family, timeout_s=300))


def test_accelerate_launch_on_four_processes_trains_as_lrmoes_own_loop(tmp_path):
    """``accelerate launch --multi_gpu --num_processes 4`` starts torchrun's processes; on a machine without GPUs
    the script's ``Accelerator(cpu=True)`` runs them over gloo."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(RANKS),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           os.path.abspath(__file__), "qwen", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    check([json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)])


if __name__ == "__main__":  # one process of `accelerate launch`: family, results folder
    import torch.distributed as dist

    dist.init_process_group("gloo")  # before the swap: it places the experts over the ranks
    result = accelerated_against_own_loop(dist.get_rank(), sys.argv[1])
    with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
