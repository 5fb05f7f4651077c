"""transformers' own expert parallelism beside lrmoe's static EP, on the same tiny models and data, 2 gloo ranks, CPU.

transformers 5 ships expert parallelism: the Qwen3-MoE and GLM-4.5 configs carry a ``base_model_ep_plan`` (the
experts' fused weights ``grouped_gemm``-sharded over the EP mesh, whole experts per rank, and the experts module
``ep_dispatch_experts``), applied by ``transformers.distributed.expert_parallel.apply_expert_parallelism`` with an
``EPImplementation`` from ``EPImplementationInterface`` (``all_to_all``: the pairs to the experts' ranks and back).
It runs here on a CPU device mesh over gloo. Each rank feeds its own batch to both models (one expert-parallel
group, no tensor parallelism), built from the same weights: the losses and every gradient agree to float noise
(each rank's dense gradients its own; each expert's gradient summed over the ranks' tokens: transformers' local
shard of the DTensor against lrmoe's gathered experts).
"""

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.integrations.hf import hf_config, swap_moe_blocks  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import tiny_config  # noqa: E402

TINY = tiny_config()
RANKS, BATCH, SEQ = 2, 2, 8
CLOSE = dict(rtol=1e-5, atol=1e-6)


def tiny_model(family: str):
    torch.manual_seed(0)  # the same weights on every rank
    if family == "qwen":
        return Qwen3MoeForCausalLM(hf_config(TINY))
    return Glm4MoeForCausalLM(hf_config(TINY.replace(router="sigmoid_bias", num_shared_experts=1, shared_ffn=16)))


def transformers_ep(model, implementation: str = "all_to_all"):
    """``model`` with transformers' expert parallelism over every rank: its config's ``base_model_ep_plan``, the
    wildcards expanded to the model's layers, on a CPU mesh (ep = the world, tp = 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(), 1), mesh_dim_names=("ep", "tp"))
    base = model.model
    plan = {}
    for pattern, style in type(model.config).base_model_ep_plan.items():
        for i, layer in enumerate(base.layers):
            name = pattern.replace("*", str(i))
            if hasattr(layer.mlp, "experts"):
                plan[name] = style
    apply_expert_parallelism(base, mesh["ep"], mesh["tp"], plan, implementation)
    return model


def _side_by_side(rank: int, family: str) -> dict:
    ref = tiny_model(family)
    theirs = transformers_ep(copy.deepcopy(ref))
    ours = copy.deepcopy(ref)
    ep = swap_moe_blocks(ours, "static-ep")
    x = torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    loss_theirs, loss_ours = theirs(x, labels=x).loss, ours(x, labels=x).loss
    loss_theirs.backward()
    loss_ours.backward()
    grads = ep.gather_expert_grads(1.0)  # every expert, summed over the ranks' tokens
    out = {"loss": (float(loss_theirs), float(loss_ours)), "unequal": []}
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        g = p.grad
        if hasattr(g, "to_local"):  # an expert tensor: this rank's contiguous block of experts
            local = g.to_local()
            lo = rank * local.shape[0]
            want = grads[name][lo:lo + local.shape[0]]
            g = local
        else:
            want = mine[name].grad
        try:
            torch.testing.assert_close(g, want, **CLOSE)
        except AssertionError as exc:
            out["unequal"].append(f"{name}: {str(exc)[:200]}")
    return out


@pytest.mark.parametrize("family", ["qwen", "glm"])
def test_transformers_all_to_all_ep_equals_lrmoes_static_ep(family):
    for out in launch(_side_by_side, RANKS, family, timeout_s=120):
        theirs, ours = out["loss"]
        assert theirs == pytest.approx(ours, rel=1e-6), out["loss"]
        assert not out["unequal"], out["unequal"]


def test_the_side_by_side_benchmark_runs_both_and_their_outputs_are_bitwise_equal():
    """experiments/hf_ep_bench.py at a tiny shape: both sides timed, the same outputs (to float noise: bitwise at
    the documented shape, another summation order at this one)."""
    from lrmoe.experiments.hf_ep_bench import main

    out = main(["--hidden", "32", "--ffn", "16", "--experts", "4", "--top-k", "2", "--tokens", "64", "--repeats", "1"])
    assert out["transformers_s"] > 0 and out["lrmoe_s"] > 0 and out["outputs_max_rel_diff"] < 1e-5, out
