"""transformers.Trainer with the drop-in on 2 and 4 gloo processes (tiny Qwen3-MoE and GLM-4.5, fp32, CPU), through
``EPTrainerCallback`` (lrmoe.integrations.hf.trainer).

Trainer wraps the model in DistributedDataParallel and runs its own loop: gradient accumulation over 2 micro-batches
(``no_sync`` but for the last), a scheduler, and ``max_grad_norm`` set in TrainingArguments small enough that every
step clips. Properties: the weights after 3 steps (experts gathered from both ranks) equal those of lrmoe's own loop
on the same ranks and micro-batches (``ep.optimizer(AdamW, max_grad_norm=...)``, the plain loop of docs/hf.md) to
float noise, with the same clipped norm at the last step; Trainer's own clipping is off during the run and restored
after it; a Trainer resumed from its step-2 checkpoint (HF's full tensors written by the main process alone, each
rank's expert state beside them) ends bitwise where the uninterrupted run ended; the checkpoint loads into the
unmodified HF class. With ``EPTrainerCallback(ep, sharded=True)`` nothing is gathered: the checkpoint's model file
holds the dense part alone and its per-rank shards, consolidated, load into the unmodified class as exactly what
the gathering run's checkpoint holds; a run resumed from it ends bitwise where the gathering run ended.
"""

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM, Trainer, TrainingArguments  # noqa: E402

from lrmoe.integrations.hf import swap_moe_blocks  # noqa: E402
from lrmoe.integrations.hf.checkpoint import consolidate  # noqa: E402
from lrmoe.integrations.hf.trainer import SHARDS, EPTrainerCallback, expert_state_file  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import Rows, tiny_config, tiny_hf_model, weight_mismatches  # noqa: E402

TINY = tiny_config()
BATCH, SEQ, MICRO, STEPS, LR = 2, 8, 2, 3, 1e-2
MAX_NORM = 0.5  # the mean loss's gradient norm is about 2-3 here: every step clips
WEIGHTS = dict(rtol=1e-4, atol=LR / 100)  # DDP's average against lrmoe's sum: float noise, through Adam



def warmup(step: int) -> float:
    return (step + 1) / STEPS


def run_trainer(family: str, folder: str, resume: str | None = None, sharded: bool = False) -> tuple:
    """Trainer on this rank with the callback; returns (model, ep, optimizer, the token ids of its training
    forwards, Trainer's max_grad_norm after the run)."""
    os.environ.update(LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"], OMP_NUM_THREADS="1")  # what torchrun sets
    model = tiny_hf_model(family)
    ep = swap_moe_blocks(model, "lrmoe-no-quotas")
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs["input_ids"].clone())
                                    if torch.is_grad_enabled() else None, with_kwargs=True)
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.0)
    args = TrainingArguments(folder, per_device_train_batch_size=BATCH, gradient_accumulation_steps=MICRO,
                             max_steps=STEPS, max_grad_norm=MAX_NORM, train_sampling_strategy="sequential",
                             use_cpu=True, logging_steps=1, save_strategy="steps", save_steps=2, report_to=[],
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    rows = torch.randint(0, TINY.vocab_size, (int(os.environ["WORLD_SIZE"]) * STEPS * MICRO * BATCH, SEQ),
                         generator=torch.Generator().manual_seed(1))
    t = Trainer(model=model, args=args, train_dataset=Rows(rows), callbacks=[EPTrainerCallback(ep, sharded=sharded)],
                optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)))
    t.train(resume_from_checkpoint=resume)
    return model, ep, opt, seen, args.max_grad_norm


def own_loop(family: str, micro_batches: list[torch.Tensor]) -> tuple:
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


def _trainer_against_own_loop(rank: int, family: str, folder: str) -> dict:
    model, ep, opt, seen, trainer_norm = run_trainer(family, folder)
    got = model.state_dict()  # collective: the experts gathered
    ref, ref_opt = own_loop(family, seen)
    want = ref.state_dict()
    resumed, _, _, resumed_seen, _ = run_trainer(family, folder, resume=f"{folder}/checkpoint-2")
    again = resumed.state_dict()
    out = {"seen": len(seen), "resumed_seen": len(resumed_seen), "trainer_norm_after": trainer_norm,
           "norm": (float(opt.last_grad_norm), float(ref_opt.last_grad_norm)),
           "state_files": sorted(os.listdir(f"{folder}/checkpoint-2")),
           "expert_state": os.path.isfile(expert_state_file(f"{folder}/checkpoint-2", rank, ep.num_ranks)),
           "resumed_unequal": [k for k in got if not torch.equal(got[k], again[k])], "weights": {}}
    out["weights"] = weight_mismatches(got, want, **WEIGHTS)
    if rank == 0:  # the checkpoint is HF's: the unmodified class loads it, experts whole
        cls = Qwen3MoeForCausalLM if family == "qwen" else Glm4MoeForCausalLM
        loaded = cls.from_pretrained(f"{folder}/checkpoint-2")
        out["loads"] = type(loaded.model.layers[0].mlp.experts).__name__
    return out


@pytest.mark.parametrize("family, ranks", [("qwen", 2), ("glm", 2), ("qwen", 4), ("glm", 4)])
def test_trainer_on_several_processes_trains_as_lrmoes_own_loop_and_resumes_bitwise(tmp_path, family, ranks):
    outs = launch(_trainer_against_own_loop, ranks, family, str(tmp_path / "run"), timeout_s=600)
    for rank, out in enumerate(outs):
        assert out["seen"] == STEPS * MICRO and out["resumed_seen"] == (STEPS - 2) * MICRO, out
        assert not out["weights"], out["weights"]
        got, want = out["norm"]
        assert got > MAX_NORM and got == pytest.approx(want, rel=1e-5), out["norm"]  # clipped, once, globally
        assert out["trainer_norm_after"] == MAX_NORM  # Trainer's own clipping was off for the run only
        assert out["expert_state"] and "model.safetensors" in out["state_files"], out["state_files"]
        assert not out["resumed_unequal"], out["resumed_unequal"]  # bitwise
    assert outs[0]["loads"] != "EPExperts"


def _sharded_checkpoints(rank: int, family: str, folder: str) -> dict:
    import torch.distributed as dist
    from safetensors import safe_open

    model, _, _, _, _ = run_trainer(family, f"{folder}/gathered")
    want = model.state_dict()  # collective
    run_trainer(family, f"{folder}/sharded", sharded=True)
    resumed, _, _, _, _ = run_trainer(family, f"{folder}/sharded", resume=f"{folder}/sharded/checkpoint-2",
                                      sharded=True)
    got = resumed.state_dict()
    out = {"resumed_unequal": [k for k in want if not torch.equal(got[k], want[k])]}
    if rank == 0:
        with safe_open(f"{folder}/sharded/checkpoint-2/model.safetensors", framework="pt") as f:
            out["model_file_experts"] = [k for k in f.keys() if ".experts." in k]
        consolidate(f"{folder}/sharded/checkpoint-2/{SHARDS}", f"{folder}/consolidated")
        cls = Qwen3MoeForCausalLM if family == "qwen" else Glm4MoeForCausalLM
        a = cls.from_pretrained(f"{folder}/consolidated").state_dict()
        b = cls.from_pretrained(f"{folder}/gathered/checkpoint-2").state_dict()
        out["consolidated_unequal"] = [k for k in b if k not in a or not torch.equal(a[k], b[k])]
    dist.barrier()
    return out


@pytest.mark.parametrize("family", ["qwen", "glm"])
def test_sharded_trainer_checkpoints_gather_nothing_consolidate_and_resume_bitwise(tmp_path, family):
    outs = launch(_sharded_checkpoints, 2, family, str(tmp_path), timeout_s=600)
    assert outs[0]["model_file_experts"] == [], outs[0]["model_file_experts"]  # the dense part alone
    assert not outs[0]["consolidated_unequal"], outs[0]["consolidated_unequal"]
    for out in outs:
        assert not out["resumed_unequal"], out["resumed_unequal"]


@pytest.mark.slow  # two torchrun processes training 6 steps: about a minute on a loaded machine
@pytest.mark.timeout(600)
def test_the_documented_trainer_script_runs_under_torchrun(tmp_path):
    """docs/hf.md's Trainer script, as written, under ``torchrun --nproc-per-node 2`` (CPU: gloo): it trains its 6
    steps, writes its checkpoints at steps 3 and 6 (each with every rank's expert state), and its final folder loads
    into the unmodified class."""
    import re
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    guide = (root / "docs" / "hf.md").read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", guide, re.S)]
    (code,) = [b for b in blocks if "callbacks=[EPTrainerCallback(ep)]" in b and "trainer.train()" in b]
    (tmp_path / "train_hf.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "train_hf.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stderr[-4000:]
    for step in (3, 6):
        files = os.listdir(tmp_path / "hf-run" / f"checkpoint-{step}")
        assert {"model.safetensors", "lrmoe-experts-rank0-of-2.pt", "lrmoe-experts-rank1-of-2.pt"} <= set(files)
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf-run" / "final")
    assert type(loaded.model.layers[0].mlp.experts).__name__ != "EPExperts"
