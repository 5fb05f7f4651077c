"""bf16 mixed precision of the transformers drop-in: ``torch.autocast("cpu", dtype=torch.bfloat16)`` around the
forward of a swapped fp32 model (fp32 weights, fp32 master and optimizer state, bf16 compute), 2 gloo ranks.

Under autocast the expert exchange computes in bf16, as autocast's matmuls do (lrmoe.runtime.exchange._Exchange):
the swapped experts module moves half the bytes of its fp32 run through both all-to-alls and gives what HF's own
experts module gives on bf16 copies of its input and weights. Trained under autocast, the swapped model follows
the unswapped HF model trained under the same autocast (Qwen3-MoE and GLM-4.5 shapes; static EP, SYMI-dropless,
and LRMoE where it trims nothing), within bf16's tolerance:

* losses: relative 4e-3, one bf16 epsilon (2^-8);
* first-step gradients: relative L2 error 3e-2 per tensor (every GEMM input rounded to 8 bits of mantissa);
* weights after 3 AdamW steps: Adam divides each gradient by its own size, so a coordinate whose gradient is bf16
  noise still moves by a whole learning rate, either way, and how far the updates move depends on how many such
  coordinates a tensor has, which depends on the CPU's bf16 kernels (measured 0.16-0.23 of the update with AVX-512,
  up to 0.39 with ATEN_CPU_CAPABILITY=default). The bound is the same comparison made for the unswapped model: its
  autocast run against its own fp32 run is one bf16 perturbation of the same updates; the swapped run rounds the same
  GEMM inputs in another order, at most two such perturbations, so its update error is at most twice the unswapped
  model's, per tensor, plus the gradients' tolerance (measured ratio at most 1.30 on both settings).

Against the same system's fp32 run (GLM's LRMoE, which trims, and SYMI-dropless), the losses agree to a
relative 2e-3; the first-step gradients (every system, both families) as far from fp32 as the unswapped model under
autocast is, within 2e-2 per tensor (autocast moves HF's router too and some tokens route to other experts, so both
are far from fp32: up to 0.39 relative L2 for a router gate). The gradients the optimizer sees are fp32
(the dense ones and the expert slots'), so the fp32 master step is unchanged.
"""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.integrations.hf import swap_moe_blocks  # noqa: E402
from lrmoe.runtime.distributed.accounting import Accountant  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import expert_grads_used, tiny_config  # noqa: E402

TINY = tiny_config()
BATCH, SEQ, STEPS, LR = 2, 8, 3, 1e-2
LOSS_RTOL = 2.0 ** -8
FP32_LOSS_RTOL = 2e-3
GRAD_REL = 3e-2
UPDATE_PERTURBATIONS = 2  # the swapped run's update error: at most two of autocast's own (module doc)
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def tiny_model(family: str):
    from lrmoe.integrations.hf import hf_config

    torch.manual_seed(0)  # the same weights on every rank
    if family == "qwen":
        return Qwen3MoeForCausalLM(hf_config(TINY))
    return Glm4MoeForCausalLM(hf_config(TINY.replace(router="sigmoid_bias", num_shared_experts=1, shared_ffn=16)))


def ids(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=gen)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads_used(model, ep) -> dict[str, torch.Tensor]:
    """The gradients the last optimizer step applied, in HF's names: the dense ones (all-reduced, scaled to the
    mean loss over the ranks) and the experts' (their collected shards, gathered)."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if not n.endswith("slots_SW")} | \
        expert_grads_used(ep)


# -- the exchange computes in bf16 --------------------------------------------------------------------------------
def _experts_module(rank: int) -> dict:
    model = tiny_model("qwen")
    block = model.model.layers[0].mlp
    hf_bf16 = copy.deepcopy(block.experts).to(torch.bfloat16)  # HF's experts on bf16 copies of the weights
    accountant = Accountant()
    swap_moe_blocks(model, "static-ep", accountant=accountant)
    gen = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(12, TINY.hidden, generator=gen)
    idx_TK = torch.randint(0, TINY.num_experts, (12, TINY.top_k), generator=gen)
    w_TK = torch.rand(12, TINY.top_k, generator=gen)
    sent = {}
    for amp in (False, True):
        accountant.reset()
        with torch.autocast(**BF16, enabled=amp):
            y_TD = block.experts(x_TD, idx_TK, w_TK)
        sent[amp] = {p: accountant.stats(p).sent_bytes for p in ("dispatch_a2a", "combine_a2a")}
        if amp:
            y_amp_TD = y_TD
        else:
            y_fp32_TD = y_TD
    want_TD = hf_bf16(x_TD.to(torch.bfloat16), idx_TK, w_TK.to(torch.bfloat16)).float()
    return {"sent": sent, "dtype": y_amp_TD.dtype, "to_bf16": rel(y_amp_TD, want_TD),
            "to_fp32": rel(y_amp_TD, y_fp32_TD)}


def test_under_autocast_the_experts_move_and_compute_bf16():
    for out in launch(_experts_module, 2, timeout_s=120):
        fp32, bf16 = out["sent"][False], out["sent"][True]
        assert all(fp32[p] > 0 and bf16[p] * 2 == fp32[p] for p in fp32), out["sent"]  # half the bytes on the wire
        assert out["dtype"] == torch.float32  # combined in the model's dtype, as HF's experts accumulate
        # HF's experts on bf16 weights: the same up to the order of the sums; fp32 is a bf16 rounding away
        assert out["to_bf16"] < 1e-2 < 10 * out["to_bf16"] and out["to_fp32"] > 1e-3, out


# -- training under autocast --------------------------------------------------------------------------------------
def _train(rank: int, family: str, system: str, against: str) -> dict:
    """3 steps of the swapped model under autocast (AdamW; GLM's bias update off so that HF can follow), and of
    the reference: the unswapped model on the mean loss over every rank's batch under the same autocast
    (``against="hf"``, beside the unswapped model's fp32 run: autocast's own update error), or the same swapped
    system without autocast (``against="fp32"``)."""
    world = dist.get_world_size()
    model = tiny_model(family)
    ref, start = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    ref32 = copy.deepcopy(model) if against == "hf" else None
    ref32_opt = torch.optim.AdamW(ref32.parameters(), lr=LR, weight_decay=0.0) if ref32 is not None else None
    ep = swap_moe_blocks(model, system)
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.0, bias_rate=0.0)
    if against == "hf":
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    else:
        ref_ep = swap_moe_blocks(ref, system)
        ref_opt = ref_ep.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.0, bias_rate=0.0)
    out = {"loss": [], "ref_loss": [], "grad_dtypes": set()}
    for step in range(STEPS):
        x = ids(step, rank)
        with torch.autocast(**BF16):
            loss = model(x, labels=x).loss
        loss.backward()
        out["grad_dtypes"] |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        out["grad_dtypes"] |= {str(layer.store.slots_SW.grad.dtype) for layer in ep.layers}
        opt.step()
        mine = grads_used(model, ep) if step == 0 else None
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        out["loss"].append(float(loss) / world)
        if against == "hf":
            with torch.autocast(**BF16):
                ref_loss = sum(ref(ids(step, r), labels=ids(step, r)).loss for r in range(world)) / world
            ref_loss.backward()
            ref_opt.step()
            theirs = {n: p.grad.clone() for n, p in ref.named_parameters()}
            (sum(ref32(ids(step, r), labels=ids(step, r)).loss for r in range(world)) / world).backward()
            ref32_opt.step()
            ref32_opt.zero_grad()
        else:
            ref_loss = ref(x, labels=x).loss
            ref_loss.backward()
            ref_opt.step()
            theirs = grads_used(ref, ref_ep)
            ref_loss = ref_loss.detach().clone()
            dist.all_reduce(ref_loss)
            ref_loss = ref_loss / world
        ref_opt.zero_grad()
        out["ref_loss"].append(float(ref_loss))
        if step == 0:
            out["grads"] = {n: rel(mine[n], theirs[n]) for n in theirs}
    got, want = model.state_dict(), ref.state_dict()  # collective: the experts gathered
    out["update"] = {n: rel(got[n] - start[n], want[n] - start[n]) for n in want if (want[n] - start[n]).norm() > 0}
    if ref32 is not None:  # autocast's own update error, the unswapped model's
        fp32 = ref32.state_dict()
        out["amp_update"] = {n: rel(want[n] - start[n], fp32[n] - start[n]) for n in out["update"]}
    return out


def _cases(rank: int, cases: list[tuple]) -> list[dict]:
    return [_train(rank, *case) for case in cases]


# against HF under the same autocast: systems that compute every pair (LRMoE trims nothing in this Qwen model);
# against its own fp32 run: GLM's LRMoE (it trims) and one more
CASES = [("qwen", "static-ep", "hf"), ("qwen", "lrmoe", "hf"), ("glm", "symi-dropless", "hf"),
         ("glm", "lrmoe", "fp32"), ("qwen", "symi-dropless", "fp32")]


def test_the_drop_in_trains_under_autocast_as_the_unswapped_model_does():
    outs = launch(_cases, 2, CASES, timeout_s=300)
    for case, out in zip(CASES, outs[0]):
        assert out["grad_dtypes"] == {"torch.float32"}, (case, out["grad_dtypes"])
        rtol = LOSS_RTOL if case[2] == "hf" else FP32_LOSS_RTOL
        torch.testing.assert_close(out["loss"], out["ref_loss"], rtol=rtol, atol=0, msg=lambda m: f"{case}: {m}")
        if case[2] == "fp32":  # autocast moves HF's own router, attention and head too: some tokens route
            continue  # elsewhere, so the gradients are compared with HF's under the same autocast only
        worst = max(out["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < GRAD_REL, (case, worst)
        bound = {n: UPDATE_PERTURBATIONS * out["amp_update"][n] + GRAD_REL for n in out["update"]}
        over = {n: (err, bound[n]) for n, err in out["update"].items() if err >= bound[n]}
        assert not over, (case, over)


# -- against the same system's fp32 run, gradients --------------------------------------------------------------
# autocast rounds HF's router logits too, so a few tokens pick other experts than in fp32: the first-step gradients
# of the router gates and the experts then differ by far more than one rounding (measured, 2 ranks: dense up to
# 0.39 relative L2 (Qwen's last router gate; GLM 0.13), experts up to 0.25 (GLM 0.23), the same for every system
# to 1e-3). The error is autocast's own: the unswapped HF model under autocast against its fp32 run differs by as
# much, tensor by tensor (measured gap at most 5.2e-3 Qwen, 2.3e-3 GLM).
FP32_GAP = 2e-2
FP32_SYSTEMS = ("static-ep", "symi-dropless", "lrmoe")


def _first_grads(rank: int, family: str) -> dict:
    """First-step gradients under autocast against fp32, per tensor (relative L2): each system's, and the unswapped
    HF model's on the mean loss over every rank's batch."""
    world = dist.get_world_size()
    x = ids(0, rank)
    hf = {}
    for amp in (True, False):
        model = tiny_model(family)
        with torch.autocast(**BF16, enabled=amp):
            loss = sum(model(ids(0, r), labels=ids(0, r)).loss for r in range(world)) / world
        loss.backward()
        hf[amp] = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = {"hf": {n: rel(hf[True][n], hf[False][n]) for n in hf[False]}}
    for system in FP32_SYSTEMS:
        grads = {}
        for amp in (True, False):
            model = tiny_model(family)
            ep = swap_moe_blocks(model, system)
            opt = ep.optimizer(torch.optim.SGD, lr=0.0, bias_rate=0.0)
            with torch.autocast(**BF16, enabled=amp):
                loss = model(x, labels=x).loss
            loss.backward()
            opt.step()  # collects the expert gradients and all-reduces the dense ones
            grads[amp] = grads_used(model, ep)
        out[system] = {n: rel(grads[True][n], grads[False][n]) for n in grads[False]}
    return out


@pytest.mark.parametrize("family", ["qwen", "glm"])
def test_under_autocast_every_system_s_gradients_follow_its_fp32_run(family):
    out = launch(_first_grads, 2, family, timeout_s=300)[0]
    for system in FP32_SYSTEMS:
        errs = out[system]
        assert errs.keys() == out["hf"].keys(), (system, errs.keys() ^ out["hf"].keys())
        for name, err in errs.items():
            # as far from fp32 as the unswapped model under autocast is, within bf16's own noise
            assert abs(err - out["hf"][name]) < FP32_GAP, (family, system, name, err, out["hf"][name])
