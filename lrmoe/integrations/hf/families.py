"""What lrmoe knows of each Hugging Face MoE architecture it swaps (Qwen3-MoE, GLM-4.5): its sparse block, a
transformers config of an lrmoe shape, and HF's fused expert layout against the reference layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lrmoe.config import MoEConfig

DEFAULT_BIAS_RATE = 1e-3  # aux-loss-free bias update speed (DeepSeek-V3 §2.1.2; GLM-4.5 trains with it)


@dataclass(frozen=True)
class Family:
    """What lrmoe needs to know about one HF MoE architecture."""

    model_type: str
    block: str  # the sparse MoE block's class, in transformers.models.<model_type>.modeling_<model_type>
    router: str  # the lrmoe router family of its gate (the layer's own router is unused: HF's routing is passed)
    biased: bool  # its gate carries e_score_correction_bias (aux-loss-free balancing)


FAMILIES = {
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "softmax_topk", biased=False),
    "glm4_moe": Family("glm4_moe", "Glm4MoeMoE", "sigmoid_bias", biased=True),
}


def _family(config) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"lrmoe.integrations.hf swaps the MoE blocks of {sorted(FAMILIES)} models; "
                         f"this model's model_type is "
                         f"{model_type!r}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"the expert-parallel layer computes SwiGLU experts (silu); this config has "
                         f"hidden_act={act!r}")
    return FAMILIES[model_type]


def _block_class(family: Family) -> type:
    import importlib

    module = importlib.import_module(f"transformers.models.{family.model_type}.modeling_{family.model_type}")
    return getattr(module, family.block)


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, block) of every sparse MoE block of a Qwen3-MoE or GLM-4.5 model, in layer order."""
    cls = _block_class(_family(model.config))
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def hf_config(cfg: MoEConfig, **overrides):
    """A transformers config of ``cfg``'s shape: ``Qwen3MoeConfig`` for the softmax_topk family, ``Glm4MoeConfig``
    for sigmoid_bias (e.g. the ``-debug`` presets, to train HF's architectures at CPU scale). The router keeps
    lrmoe's semantics (``norm_topk_prob=True``, no group-limited routing); ``overrides`` set any other field.
    :meth:`MoEConfig.from_hf` reads it back."""
    from transformers import Glm4MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, moe_intermediate_size=cfg.expert_ffn,
                  num_experts_per_tok=cfg.top_k, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim or cfg.hidden // cfg.num_heads,
                  max_position_embeddings=cfg.seq_len, intermediate_size=cfg.dense_ffn or 4 * cfg.hidden,
                  norm_topk_prob=True, tie_word_embeddings=False, dtype=cfg.dtype)
    if cfg.router == "softmax_topk":
        if cfg.num_shared_experts:
            raise ValueError(f"{cfg.name}: Qwen3-MoE has no shared expert (num_shared_experts="
                             f"{cfg.num_shared_experts})")
        qwen = dict(num_experts=cfg.num_experts, mlp_only_layers=list(range(cfg.first_dense_layers)))
        config = Qwen3MoeConfig(**{**common, **qwen, **overrides})
    else:
        if cfg.num_shared_experts and cfg.shared_ffn != cfg.expert_ffn:
            raise ValueError(f"{cfg.name}: GLM-4.5's shared experts are as wide as the routed ones "
                             f"(moe_intermediate_size); shared_ffn={cfg.shared_ffn}, expert_ffn={cfg.expert_ffn}")
        glm = dict(n_routed_experts=cfg.num_experts, n_shared_experts=cfg.num_shared_experts,
                   first_k_dense_replace=cfg.first_dense_layers, routed_scaling_factor=cfg.routed_scaling,
                   n_group=1, topk_group=1)
        config = Glm4MoeConfig(**{**common, **glm, **overrides})
    config._name_or_path = cfg.name
    return config


# -- weight layout -----------------------------------------------------------------------------------------------
def hf_to_reference(gate_up_EXD: torch.Tensor, down_EDF: torch.Tensor):
    """HF's fused experts (``gate_up_proj`` [E, 2F, D], X = 2F, gate rows first; ``down_proj`` [E, D, F]) as
    (w_gate_EDF, w_up_EDF, w_down_EFD), the reference layout (y = (silu(x W_gate) * (x W_up)) W_down)."""
    E, X, D = gate_up_EXD.shape
    if X % 2 or tuple(down_EDF.shape) != (E, D, X // 2):
        raise ValueError(f"gate_up_proj {tuple(gate_up_EXD.shape)} and down_proj {tuple(down_EDF.shape)} are not "
                         f"HF's fused experts [E, 2F, D] and [E, D, F]")
    F = X // 2
    return (gate_up_EXD[:, :F].transpose(1, 2).contiguous(), gate_up_EXD[:, F:].transpose(1, 2).contiguous(),
            down_EDF.transpose(1, 2).contiguous())


def reference_to_hf(w_gate_EDF: torch.Tensor, w_up_EDF: torch.Tensor, w_down_EFD: torch.Tensor):
    """(gate_up_proj [E, 2F, D], down_proj [E, D, F]) from the reference layout: the inverse of
    :func:`hf_to_reference`."""
    gate_up_EXD = torch.cat([w_gate_EDF.transpose(1, 2), w_up_EDF.transpose(1, 2)], dim=1).contiguous()
    return gate_up_EXD, w_down_EFD.transpose(1, 2).contiguous()
