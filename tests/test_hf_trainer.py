"""The drop-in (lrmoe.integrations.hf) inside a real transformers.Trainer and DistributedDataParallel, tiny
Qwen3-MoE, fp32, CPU.

One process: Trainer, given ``optimizers=(ep.optimizer(AdamW, grad_scale=1.0), scheduler)`` and
``max_grad_norm=0``, trains exactly as the plain loop of the README does (the same losses and weights, experts
included; also when ep.optimizer clips); without ``optimizers=`` its own optimizer would leave the experts
untrained, and the swapped model refuses it (ForeignOptimizerError) at the first forward after that optimizer's
first step. FSDP and nn.DataParallel's copies are refused (DistributedDataParallel: tests/test_hf_ddp.py).
"""

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import Qwen3MoeForCausalLM, Trainer, TrainingArguments  # noqa: E402

from lrmoe.integrations.hf import (FOREIGN_OPTIMIZER, FSDP_REFUSAL, GRADIENT_EDIT, DataParallelError,  # noqa: E402
                                   ForeignOptimizerError, GradientEditError, hf_config, swap_moe_blocks)
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import Rows, tiny_config  # noqa: E402

TINY = tiny_config()
BATCH, SEQ, MICRO, STEPS = 2, 8, 2, 3  # sequences per micro-batch, tokens per sequence, micro-batches per step
SYSTEM = "lrmoe-no-quotas"  # every pair kept: the gradients are continuous in the weights


def tiny_model():
    torch.manual_seed(0)  # the same weights in every run and on every rank
    return Qwen3MoeForCausalLM(hf_config(TINY))


def token_rows() -> torch.Tensor:
    """[STEPS * MICRO * BATCH, SEQ] token ids: the training set, in the order both loops read it."""
    return torch.randint(0, TINY.vocab_size, (STEPS * MICRO * BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def warmup(step: int) -> float:
    return (step + 1) / STEPS  # the learning rate moves at every step, so a scheduler step out of place shows


def as_torchrun() -> None:
    """The environment torchrun gives a rank beyond the launcher's RANK / WORLD_SIZE / LOCAL_RANK (Accelerate reads
    LOCAL_WORLD_SIZE), and one intra-op thread (Accelerate would otherwise set its own count)."""
    os.environ.update(LOCAL_WORLD_SIZE=os.environ["WORLD_SIZE"], OMP_NUM_THREADS="1")


def trainer(model, optimizer, folder: str) -> Trainer:
    args = TrainingArguments(folder, per_device_train_batch_size=BATCH, gradient_accumulation_steps=MICRO,
                             max_steps=STEPS, max_grad_norm=0.0, train_sampling_strategy="sequential", use_cpu=True,
                             logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
                             disable_tqdm=True, seed=0)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    return Trainer(model=model, args=args, train_dataset=Rows(token_rows()), optimizers=(optimizer, sched))


# -- one process: Trainer is the plain loop ---------------------------------------------------------------------------
def _plain_loop(max_grad_norm: float = 0.0) -> tuple[list[float], dict]:
    """The README's loop: each micro-batch's mean loss backward, ep.optimizer at its default gradient (the mean
    over micro-batches), the scheduler after each step. Returns each step's mean loss and the final state dict."""
    model = tiny_model()
    ep = swap_moe_blocks(model, SYSTEM)
    opt = ep.optimizer(torch.optim.AdamW, lr=1e-2, max_grad_norm=max_grad_norm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    rows, losses = token_rows(), []
    for step in range(STEPS):
        step_loss = 0.0
        for m in range(MICRO):
            x = rows[(step * MICRO + m) * BATCH:][:BATCH]
            loss = model(x, labels=x).loss
            loss.backward()
            step_loss += loss.item() / MICRO
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(step_loss)
    return losses, model.state_dict()


def _trainer_equals_plain_loop(rank: int, folder: str, max_grad_norm: float) -> dict:
    as_torchrun()  # one process under torchrun's variables: Accelerate wraps the model in a one-rank DDP
    want_losses, want_state = _plain_loop(max_grad_norm)
    model = tiny_model()
    ep = swap_moe_blocks(model, SYSTEM)
    # Trainer's loss of a micro-batch is already its share of the step's mean: no division by the micro-batches
    opt = ep.optimizer(torch.optim.AdamW, lr=1e-2, grad_scale=1.0, max_grad_norm=max_grad_norm)
    t = trainer(model, opt, folder)
    t.train()
    got = model.state_dict()  # dense weights and the experts gathered from the replica store
    return {"wrapped": type(t.model_wrapped).__name__,
            "losses": ([h["loss"] for h in t.state.log_history if "loss" in h], want_losses),
            "unequal": [k for k in want_state if not torch.equal(got[k], want_state[k])],
            "same_keys": got.keys() == want_state.keys(),
            # Accelerate reloads the optimizer's state dict when it prepares it: the scheduler must still reach
            # the groups the dense optimizer steps
            "groups_shared": all(a is b for a, b in zip(opt.param_groups, opt.dense.param_groups)),
            "expert_lr": opt.expert_group["lr"], "adam_steps": ep.layers[0].store.adam_steps,
            "grad_norm": None if opt.last_grad_norm is None else float(opt.last_grad_norm)}


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])  # the second clips every step (the norms are about 2-3)
def test_trainer_on_one_process_trains_exactly_as_the_plain_loop(tmp_path, max_grad_norm):
    """Also with clipping in ep.optimizer (Trainer's own max_grad_norm=0): the same weights, bitwise."""
    out = launch(_trainer_equals_plain_loop, 1, str(tmp_path), max_grad_norm, timeout_s=120)[0]
    assert out["wrapped"] == "DistributedDataParallel"  # the guard lets a one-rank DDP through: it changes nothing
    got, want = out["losses"]
    assert len(got) == STEPS
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # Trainer sums the logged loss in fp32
    assert out["same_keys"] and not out["unequal"], out["unequal"]  # bitwise
    assert out["groups_shared"] and out["adam_steps"] == STEPS
    assert out["expert_lr"] == pytest.approx(1e-2 * warmup(STEPS))
    assert (out["grad_norm"] is None) == (max_grad_norm == 0) and (out["grad_norm"] or 1.0) > max_grad_norm


def _trainer_resumes(rank: int, folder: str) -> list[str]:
    as_torchrun()
    runs = []
    for resume in (None, os.path.join(folder, "checkpoint-2")):  # the whole run, then steps 3 from its checkpoint
        model = tiny_model()
        ep = swap_moe_blocks(model, SYSTEM)
        t = trainer(model, ep.optimizer(torch.optim.AdamW, lr=1e-2, grad_scale=1.0), folder)
        t.args.save_strategy, t.args.save_steps = "steps", 2
        t.train(resume_from_checkpoint=resume)  # Trainer saves the model (experts gathered) and EPOptimizer's state
        runs.append(model.state_dict())
    return [k for k in runs[0] if not torch.equal(runs[0][k], runs[1][k])]


def test_trainer_on_one_process_resumes_from_its_checkpoint_exactly(tmp_path):
    assert launch(_trainer_resumes, 1, str(tmp_path), timeout_s=120)[0] == []


def _trainer_without_optimizers(rank: int, folder: str) -> tuple:
    as_torchrun()
    model = tiny_model()
    ep = swap_moe_blocks(model, SYSTEM)
    args = TrainingArguments(folder, per_device_train_batch_size=BATCH, gradient_accumulation_steps=MICRO,
                             max_steps=STEPS, train_sampling_strategy="sequential", use_cpu=True, save_strategy="no",
                             report_to=[], dataloader_num_workers=0, disable_tqdm=True, seed=0)
    t = Trainer(model=model, args=args, train_dataset=Rows(token_rows()))  # Trainer's own AdamW, its clipping
    return train_until(t, ep, ForeignOptimizerError)


def train_until(t, ep, error: type[Exception]) -> tuple:
    """Train; the error's message (or "trained"), Trainer's optimizer steps and the experts' Adam steps."""
    try:
        t.train()
    except error as exc:
        return str(exc), t.state.global_step, ep.layers[0].store.adam_steps
    return "trained", t.state.global_step, ep.layers[0].store.adam_steps


def test_trainer_without_the_swapped_models_optimizer_is_refused_after_its_first_step(tmp_path):
    message, steps, expert_steps = launch(_trainer_without_optimizers, 1, str(tmp_path), timeout_s=120)[0]
    assert message == FOREIGN_OPTIMIZER and "ep.optimizer(torch.optim.AdamW, lr=...)" in message
    assert steps == 1 and expert_steps == 0  # at the first forward of its second step


def _trainer_clipping_too(rank: int, folder: str) -> tuple:
    as_torchrun()
    model = tiny_model()
    ep = swap_moe_blocks(model, SYSTEM)
    t = trainer(model, ep.optimizer(torch.optim.AdamW, lr=1e-2, grad_scale=1.0, max_grad_norm=1.0), folder)
    t.args.max_grad_norm = 1.0  # Trainer's default: it clips model.parameters(), the dense part alone, first
    return train_until(t, ep, GradientEditError)


def test_trainer_clipping_beside_the_swapped_models_optimizer_is_refused_at_its_first_step(tmp_path):
    """Trainer's own clipping (max_grad_norm > 0) rescales the dense gradients by the dense norm alone before
    ep.optimizer's step, which would clip them again: refused at that step, before anything is stepped. Its
    max_grad_norm=0 (which still multiplies every gradient by 1 to log the norm) trains bitwise as the plain loop
    (the test above)."""
    message, steps, expert_steps = launch(_trainer_clipping_too, 1, str(tmp_path), timeout_s=120)[0]
    # under Accelerate's one-rank DDP the check watches the expert slots, which DDP leaves alone and the clipping
    # over model.parameters() scales too
    assert message == GRADIENT_EDIT.format(edited=2, total=2) and "TrainingArguments(max_grad_norm=0)" in message
    assert steps == 0 and expert_steps == 0


def _plain_loop_clipped_outside(rank: int, max_norm: float, allow: bool) -> tuple:
    """The plain loop with torch's clipping over model.parameters() before ep.optimizer's step, 2 micro-batches."""
    model = tiny_model()
    ep = swap_moe_blocks(model, SYSTEM)
    opt = ep.optimizer(torch.optim.AdamW, lr=1e-2, allow_grad_edits=allow)
    rows, outcome = token_rows(), []
    for step in range(2):
        for m in range(2):
            x = rows[(step * 2 + m) * BATCH:][:BATCH]
            model(x, labels=x).loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        try:
            opt.step()
            outcome.append(("stepped", norm))
        except GradientEditError as exc:
            outcome.append((str(exc), norm))
        opt.zero_grad()
    return outcome, ep.layers[0].store.adam_steps


def test_a_dense_gradient_edited_before_the_step_is_refused_unless_allowed():
    clipped, expert_steps = launch(_plain_loop_clipped_outside, 1, 0.01, False, timeout_s=60)[0]
    assert all(m == GRADIENT_EDIT.format(edited=23, total=23) and n > 0.01 for m, n in clipped)  # 21 dense, 2 slots
    assert expert_steps == 0
    # a clipping that does not bind multiplies by 1: the gradients are what the backward left, nothing to refuse
    loose, expert_steps = launch(_plain_loop_clipped_outside, 1, 1e6, False, timeout_s=60)[0]
    assert [m for m, _ in loose] == ["stepped", "stepped"] and expert_steps == 2
    allowed, expert_steps = launch(_plain_loop_clipped_outside, 1, 0.01, True, timeout_s=60)[0]
    assert [m for m, _ in allowed] == ["stepped", "stepped"] and expert_steps == 2


# -- data-parallel wrappers that cannot run the drop-in ------------------------------------------------------------
def _replicate(rank: int) -> str:
    model = tiny_model()
    swap_moe_blocks(model, "static-ep")
    experts = model.model.layers[0].mlp.experts
    copy = experts._replicate_for_data_parallel()  # what nn.DataParallel runs on each GPU
    x = torch.randn(4, TINY.hidden)
    idx, w = torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5)
    experts(x, idx, w)  # the original still runs
    try:
        copy(x, idx, w)
    except DataParallelError as exc:
        return str(exc)
    return "ran"


def _fully_sharded(rank: int, where: str) -> tuple:
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    ep = swap_moe_blocks(model, "symi-dropless")
    for layer in model.model.layers:  # the usual pattern: each decoder layer, then (or not) the root
        fully_shard(layer)
    if where == "root":
        fully_shard(model)
    x = token_rows()[:BATCH]
    try:
        model(x, labels=x).loss.backward()
    except DataParallelError as exc:
        return str(exc), ep.layers[0].micro_batches
    return "trained", ep.layers[0].micro_batches


@pytest.mark.parametrize("where", ["root", "layers"])
def test_fsdp_is_refused_at_the_first_training_forward_on_every_rank(where):
    """FSDP2's fully_shard on the decoder layers (and the root): every rank refuses at its first training forward,
    before any expert runs, naming the wrapped module (not the DTensor error the layer would otherwise hit)."""
    for message, micro_batches in launch(_fully_sharded, 2, where, timeout_s=60):
        wrapped = "the root" if where == "root" else "module 'model.layers.0'"
        assert message == FSDP_REFUSAL.format(where=wrapped) and micro_batches == 0, message


def test_a_data_parallel_copy_of_the_experts_refuses_to_run():
    assert launch(_replicate, 1, timeout_s=60)[0].startswith("nn.DataParallel (what transformers.Trainer uses")
