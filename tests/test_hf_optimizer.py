"""The swapped model's optimizer (lrmoe.integrations.hf.EPOptimizer) in real training loops, tiny Qwen3-MoE, fp32,
gloo ranks.

Clipping: ``ep.optimizer(AdamW, max_grad_norm=...)`` on 2 and 3 ranks, with micro-batches and a norm small enough
that every step clips, trains exactly as the unmodified model on one process does with
``torch.nn.utils.clip_grad_norm_`` over all its parameters and AdamW (the same clipped gradients, the same norm at
every step, the same weights after the steps, experts included), for dropless systems (static EP, SYMI-dropless,
online replication by the greedy rule).
``clip_grad_norm_(model.parameters())`` on the swapped model would see the dense parameters only: their norm is
outside the test's tolerance of the whole model's.

A foreign optimizer: ``torch.optim.AdamW(model.parameters())`` (foreach or fused) or a hand-written update
stepping a swapped model's dense parameters raises :class:`ForeignOptimizerError` at the next training forward;
the legal loops (the optimizer object with micro-batches, activation checkpointing, online replication, an
evaluation forward and a state dict loaded between micro-batches, a resume from its state dicts, the low-level
API with another dense optimizer) never do.
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from transformers import Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.integrations.hf import (FOREIGN_OPTIMIZER, ForeignOptimizerError, hf_config, swap_moe_blocks)
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import expert_grads_used, tiny_config  # noqa: E402

TINY = tiny_config(6)
BATCH, SEQ, MICRO, STEPS, LR = 2, 8, 2, 3, 1e-2
MAX_NORM = 0.5  # the mean loss's gradient norm is about 2-3 here: every step clips
# Adam moves a weight by about lr · g / (|g| + eps): where g is near zero, the float noise of the ranks' other
# summation order moves it by a fraction of lr. The weights agree to 1 % of one step; the gradients and norms closer.
WEIGHTS = dict(rtol=1e-4, atol=LR / 100)
NORM_RTOL = 1e-5
GRAD = dict(rtol=1e-4, atol=1e-6)


def tiny_model():
    torch.manual_seed(0)  # the same weights on every rank
    return Qwen3MoeForCausalLM(hf_config(TINY))


def ids(step: int, m: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
    return torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=gen)


# -- clipping ---------------------------------------------------------------------------------------------------------
def _clipped(rank: int, system: str) -> dict:
    world = dist.get_world_size()
    model = tiny_model()
    ref = copy.deepcopy(model)
    ep = swap_moe_blocks(model, system)
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.0, max_grad_norm=MAX_NORM)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    norms, ref_norms, dense_only = [], [], []
    for step in range(STEPS):
        for m in range(MICRO):
            x = ids(step, m, rank)
            model(x, labels=x).loss.backward()
        opt.step()
        norms.append(float(opt.last_grad_norm))
        used = {n: p.grad.clone() for n, p in model.named_parameters() if not n.endswith("slots_SW")}
        used |= expert_grads_used(ep)
        opt.zero_grad()
        # the reference: one process, the mean loss over every rank's micro-batches, torch's clipping over all
        loss = sum(ref(x, labels=x).loss for m in range(MICRO) for r in range(world)
                   for x in [ids(step, m, r)]) / (world * MICRO)
        loss.backward()
        # what clip_grad_norm_(model.parameters()) sees on the swapped model: every parameter but the experts
        dense_only.append(float(torch.nn.utils.get_total_norm([p.grad for n, p in ref.named_parameters()
                                                               if ".experts." not in n])))
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        if step == 0:  # the same weights so far: the steps applied torch's clipped gradients
            for name, p in ref.named_parameters():
                torch.testing.assert_close(used[name], p.grad, **GRAD, msg=lambda msg: f"{system} {name}: {msg}")
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = model.state_dict(), ref.state_dict()  # collective: the experts gathered from every rank
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **WEIGHTS, msg=lambda msg: f"{system} {name}: {msg}")
    return {"norms": norms, "ref_norms": ref_norms, "dense_only": dense_only}


def _systems(rank: int, systems: list[str]) -> dict:
    return {system: _clipped(rank, system) for system in systems}


@pytest.mark.parametrize("ranks", [2, 3])
def test_clipping_trains_as_torch_clip_grad_norm_on_the_unswapped_model(ranks):
    for out in launch(_systems, ranks, ["static-ep", "symi-dropless", "online-greedy"], timeout_s=240):
        for system, rec in out.items():
            assert min(rec["ref_norms"]) > 2 * MAX_NORM, (system, rec)  # every step clipped
            torch.testing.assert_close(rec["norms"], rec["ref_norms"], rtol=NORM_RTOL, atol=0)
            # leaving the experts out moves the norm by ten times that tolerance or more (their share of the
            # gradient is small in this model: embeddings and head dominate; tests/test_clip.py has a larger one)
            assert all(r - d > 10 * NORM_RTOL * r for d, r in zip(rec["dense_only"], rec["ref_norms"])), rec


# -- a foreign optimizer ----------------------------------------------------------------------------------------------
def _train(model, step_fn, steps: int = 2, micro: int = MICRO, rank: int = 0) -> None:
    for step in range(steps):
        for m in range(micro):
            x = ids(step, m, rank)
            model(x, labels=x).loss.backward()
        step_fn()


def _foreign(rank: int, kind: str) -> tuple:
    model = tiny_model()
    ep = swap_moe_blocks(model, "symi-dropless")
    if kind == "by hand":  # no torch optimizer: seen by the parameters' version counters

        @torch.no_grad()
        def step():
            for p in model.parameters():
                p -= LR * p.grad
            model.zero_grad()
    else:  # the dense parameters only; a fused optimizer leaves the version counters alone: seen by its step hook
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=kind == "fused")

        def step():
            opt.step()
            opt.zero_grad()

    try:
        _train(model, step, rank=rank)
    except ForeignOptimizerError as exc:
        return str(exc), ep.layers[0].micro_batches, ep.layers[0].store.adam_steps
    return "trained", ep.layers[0].micro_batches, ep.layers[0].store.adam_steps


@pytest.mark.parametrize("kind", ["adamw", "fused", "by hand"])
def test_a_dense_step_without_the_experts_is_refused_at_the_next_training_forward(kind):
    for message, micro_batches, expert_steps in launch(_foreign, 2, kind, timeout_s=60):
        assert message == FOREIGN_OPTIMIZER
        assert micro_batches == MICRO and expert_steps == 0  # at the second step's first forward, on every rank


def _legal_loops(rank: int, folder: str) -> int:
    """Loops that step the experts: none may trip the check. Returns the experts' Adam steps."""
    model = tiny_model()
    model.train()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ep = swap_moe_blocks(model, "online-greedy")
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, max_grad_norm=1.0)

    def step():
        opt.step()
        opt.zero_grad()

    _train(model, step, rank=rank)  # micro-batches, recomputation, online replication
    # an evaluation forward between micro-batches, and a state dict loaded in the middle of an iteration
    x = ids(5, 0, rank)
    model(x, labels=x).loss.backward()
    with torch.no_grad():
        model(x)
    model.load_state_dict(model.state_dict())  # collective (the experts are gathered)
    model(x, labels=x).loss.backward()
    step()
    # a resume: the state dicts into a fresh swapped model and optimizer, then more steps
    state, opt_state = model.state_dict(), opt.state_dict()
    model = tiny_model()
    ep = swap_moe_blocks(model, "online-greedy")
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, max_grad_norm=1.0)
    model.load_state_dict(state)
    opt.load_state_dict(opt_state)
    _train(model, step, rank=rank)
    # the low-level API: any torch optimizer over the dense parameters, stepped by ep.step
    dense = torch.optim.SGD(ep.dense_parameters(), lr=LR)
    _train(model, lambda: ep.step(dense, max_grad_norm=1.0), rank=rank)
    return ep.layers[0].store.adam_steps


def test_the_legal_loops_never_trip_the_check(tmp_path):
    assert launch(_legal_loops, 2, str(tmp_path), timeout_s=120) == [7, 7]
