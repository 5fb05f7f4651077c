"""What the Hugging Face drop-in's tests share: the tiny model's shape, a token dataset for transformers.Trainer, and
the expert gradients the last expert step applied, in HF's parameter names."""

import torch

from lrmoe.config import MoEConfig
from lrmoe.integrations.hf import reference_to_hf
from lrmoe.runtime.distributed.replica import unflatten_experts


def tiny_config(num_experts: int = 8) -> MoEConfig:
    """The drop-in tests' tiny Qwen3-shaped model: 2 layers, hidden 32, ``num_experts`` experts of width 16, top-2."""
    return MoEConfig(name="tiny", hidden=32, expert_ffn=16, num_experts=num_experts, top_k=2, router="softmax_topk",
                     num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64, seq_len=32, dtype="float32")


class Rows(torch.utils.data.Dataset):
    """Token rows as Trainer reads them: each row its own labels (the model shifts them)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def expert_grads_used(ep) -> dict[str, torch.Tensor]:
    """The expert gradients the last expert step applied (its collected shards, after any clipping), gathered and in
    HF's names (``<block>.experts.gate_up_proj`` / ``.down_proj``)."""
    out = {}
    for name, layer in zip(ep.names, ep.layers):
        store = layer.store
        flat_EW = store.gather_full(store.grad_shards_EW)
        gate_up, down = reference_to_hf(*unflatten_experts(flat_EW, store.hidden, store.ffn))
        out[f"{name}.experts.gate_up_proj"], out[f"{name}.experts.down_proj"] = gate_up, down
    return out


def tiny_hf_model(family: str, num_experts: int = 8):
    """Hugging Face's own Qwen3-MoE ("qwen") or GLM-4.5 (with a shared expert) at :func:`tiny_config`'s shape, the
    same weights in every run and on every rank."""
    from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM

    from lrmoe.integrations.hf import hf_config

    tiny = tiny_config(num_experts)
    torch.manual_seed(0)
    if family == "qwen":
        return Qwen3MoeForCausalLM(hf_config(tiny))
    return Glm4MoeForCausalLM(hf_config(tiny.replace(router="sigmoid_bias", num_shared_experts=1, shared_ffn=16)))


def weight_mismatches(got: dict, want: dict, **tolerance) -> dict[str, str]:
    """{name: why} for every tensor of ``want`` that ``got`` does not match within ``tolerance``."""
    out = {}
    for name in want:
        try:
            torch.testing.assert_close(got[name], want[name], **tolerance)
        except AssertionError as exc:
            out[name] = str(exc)[:300]
    return out
