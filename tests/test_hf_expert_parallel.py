"""What the swapped model's step refuses, and what its optimizer applies to the experts (tiny Qwen3-MoE, fp32, gloo
ranks):

* ranks whose models were built from different seeds are refused at the swap, on every rank, naming the ranks that
  differ from rank 0 (a checksum per parameter in one all-gather);
* ``ep.optimizer(torch.optim.AdamW, weight_decay=wd)`` decays the experts as torch's AdamW decays every weight of
  the unswapped model (decoupled), and ``torch.optim.Adam`` adds the L2 term as torch's Adam does: after one step
  at wd 0.5 and lr 0.1, every weight, experts included, equals the unswapped model's on one process;
* a dense step without the dense sync (``torch.optim.AdamW(model.parameters())`` then ``ep.expert_step()``, or a
  hand-written update) is refused at the expert step, before any expert moves; with ``ep.sync_dense_grads()``
  first the same low-level loop runs and the ranks' dense weights stay equal;
* GLM's bias update reads the gates' ``e_score_correction_bias`` at every step: a buffer replaced after the
  optimizer was built (as ``model.to(device)`` replaces it) is the one updated, with the values a model whose
  buffer was never replaced gets.
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.integrations.hf import ForeignOptimizerError, hf_config, swap_moe_blocks  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import tiny_config  # noqa: E402

TINY = tiny_config(6)
BATCH, SEQ = 2, 8


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(hf_config(TINY))


def ids(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=gen)


# -- 38.6: different seeds ----------------------------------------------------------------------------------------
def _seeded(rank: int, seeds: list[int]) -> str:
    model = tiny_model(seeds[rank])
    try:
        swap_moe_blocks(model, "symi-dropless")
    except ValueError as exc:
        return str(exc)
    return "swapped"


def test_ranks_built_from_different_seeds_are_refused_at_the_swap():
    for message in launch(_seeded, 3, [0, 0, 1], timeout_s=120):
        assert "ranks [2] hold other initial weights than rank 0" in message, message
        assert "model.embed_tokens.weight" in message  # the first parameter that differs


# -- 38.7: weight decay reaches the experts ---------------------------------------------------------------------
WD, LR = 0.5, 0.1


def _decayed(rank: int, optimizer: str) -> dict:
    world = dist.get_world_size()
    cls = getattr(torch.optim, optimizer)
    model = tiny_model()
    ref = copy.deepcopy(model)
    ep = swap_moe_blocks(model, "symi-dropless")
    opt = ep.optimizer(cls, lr=LR, weight_decay=WD)
    x = ids(0, rank)
    model(x, labels=x).loss.backward()
    opt.step()
    # the unswapped model on one process: the mean loss over every rank's batch, torch's optimizer over all weights
    ref_opt = cls(ref.parameters(), lr=LR, weight_decay=WD)
    (sum(ref(x, labels=x).loss for r in range(world) for x in [ids(0, r)]) / world).backward()
    # Adam's first move is lr · g / (|g| + eps): where |g| is within float noise of 0 the ranks' other summation
    # order can move a weight by up to lr; compared where |g| > 1e-5, that noise moves it by less than 1e-8 (and
    # where g is exactly 0: rows no token used)
    clear = {name: (p.grad.abs() > 1e-5) | (p.grad == 0) for name, p in ref.named_parameters()}
    ref_opt.step()
    got, want = model.state_dict(), ref.state_dict()  # collective: the experts gathered from every rank
    return {name: (float((got[name] - want[name])[clear[name]].abs().max()), float(clear[name].float().mean()))
            for name in clear}


@pytest.mark.parametrize("optimizer", ["AdamW", "Adam"])
def test_weight_decay_reaches_the_experts_as_torch_applies_it(optimizer):
    for errors in launch(_decayed, 2, optimizer, timeout_s=120):
        experts = {n: e for n, (e, _) in errors.items() if ".experts." in n}
        assert experts and len(experts) < len(errors)
        assert all(errors[n][1] > 0.9 for n in experts)  # nearly every expert weight compared
        # the old experts' Adam, without the decay, is 4e-3 away from torch's AdamW after this one step
        assert max(e for e, _ in errors.values()) < 1e-6, {n: e for n, (e, _) in errors.items() if e >= 1e-6}


# -- 38.8: a dense step without the dense sync ------------------------------------------------------------------
def _unsynced(rank: int, kind: str) -> dict:
    model = tiny_model()
    ep = swap_moe_blocks(model, "symi-dropless")
    dense = ep.dense_parameters()
    # the case of the report: an optimizer over model.parameters(); the legal loop steps the dense parameters
    opt = torch.optim.AdamW(dense if kind == "synced" else model.parameters(), lr=1e-2)
    out = {}
    for step in range(2):
        x = ids(step, rank)
        model(x, labels=x).loss.backward()
        if kind == "synced":
            ep.sync_dense_grads()
        if kind == "by hand":
            with torch.no_grad():
                for p in dense:
                    p -= 1e-2 * p.grad
        else:
            opt.step()
        try:
            ep.expert_step()
        except ForeignOptimizerError as exc:
            out["error"] = str(exc)
            break
        opt.zero_grad()
    out["expert_steps"] = ep.layers[0].store.adam_steps
    flat = torch.cat([p.detach().reshape(-1) for p in dense])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    out["ranks_apart"] = float((gathered[0] - gathered[1]).abs().max())
    return out


@pytest.mark.parametrize("kind", ["adamw", "by hand"])
def test_a_dense_step_without_the_dense_sync_is_refused_at_the_expert_step(kind):
    for out in launch(_unsynced, 2, kind, timeout_s=120):
        assert "before their gradients were reduced (ep.sync_dense_grads()" in out.get("error", ""), out
        assert out["expert_steps"] == 0  # refused before any expert moved, at the first step


def test_the_same_low_level_loop_with_the_dense_sync_runs_and_keeps_the_ranks_together():
    for out in launch(_unsynced, 2, "synced", timeout_s=120):
        assert "error" not in out and out["expert_steps"] == 2
        assert out["ranks_apart"] == 0.0


def _bias_after_replacement(rank: int) -> dict:
    out = {}
    for replace in (False, True):
        torch.manual_seed(0)
        model = Glm4MoeForCausalLM(hf_config(TINY.replace(router="sigmoid_bias", num_shared_experts=1,
                                                          shared_ffn=16)))
        ep = swap_moe_blocks(model, "static-ep")
        opt = ep.optimizer(torch.optim.AdamW, lr=1e-2, bias_rate=1e-2)
        if replace:  # a new tensor under the buffer's name, as Module.to / _apply leaves it
            for block in ep.blocks:
                block.gate.e_score_correction_bias = block.gate.e_score_correction_bias.clone()
        for step in range(2):
            x = ids(step, rank)
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        out[replace] = torch.stack([block.gate.e_score_correction_bias for block in ep.blocks])
    return {"moved": bool(out[False].abs().sum() > 0), "same": torch.equal(out[True], out[False])}


def test_the_bias_update_reaches_a_gate_buffer_replaced_after_the_optimizer_was_built():
    for out in launch(_bias_after_replacement, 2, timeout_s=120):
        assert out["moved"] and out["same"], out
