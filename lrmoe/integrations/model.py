"""A small decoder-only MoE transformer for CPU-scale training runs (nanoGPT-sized, no distributed plumbing).

Blocks: RMSNorm → causal grouped-query attention with rotary embeddings → RMSNorm → FFN, where the FFN is a dense
SwiGLU for the first ``cfg.first_dense_layers`` blocks (GLM-4.5) and an MoE layer everywhere else. The MoE layer
is injected by ``moe_factory(layer_index)``: the single-process reference layer or the expert-parallel one; either
returns ``(y_TD, info)`` where ``info`` has ``scores_TE`` (router scores, differentiable) and ``counts_E``
(routed pairs per expert; global counts give the global-batch auxiliary loss).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lrmoe.config import MoEConfig
from lrmoe.runtime.routing import load_balancing_loss


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x_BHTd: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding on the last dimension (pairs of halves)."""
    t, d = x_BHTd.shape[-2], x_BHTd.shape[-1]
    inv = base ** (-torch.arange(0, d // 2, dtype=torch.float32, device=x_BHTd.device) / (d // 2))
    angle_Td = torch.arange(t, dtype=torch.float32, device=x_BHTd.device)[:, None] * inv[None, :]
    cos, sin = angle_Td.cos().to(x_BHTd.dtype), angle_Td.sin().to(x_BHTd.dtype)
    x1, x2 = x_BHTd[..., : d // 2], x_BHTd[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim or cfg.hidden // cfg.num_heads
        self.q = nn.Linear(cfg.hidden, self.heads * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.hidden, 2 * self.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(self.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x_BTD):
        b, t, _ = x_BTD.shape
        q = self.q(x_BTD).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        k, v = self.kv(x_BTD).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotary(q), rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, ffn: nn.Module, is_moe: bool):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ffn = ffn
        self.is_moe = is_moe

    def forward(self, x_BTD):
        x_BTD = x_BTD + self.attn(self.norm1(x_BTD))
        h_BTD = self.norm2(x_BTD)
        if not self.is_moe:
            return x_BTD + self.ffn(h_BTD), None
        b, t, d = h_BTD.shape
        y_TD, info = self.ffn(h_BTD.reshape(b * t, d))
        return x_BTD + y_TD.view(b, t, d), info


class MoETransformer(nn.Module):
    """Byte-level decoder-only MoE language model."""

    def __init__(self, cfg: MoEConfig, moe_factory: Callable[[int], nn.Module], seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = False  # recompute each block in the backward (torch's non-reentrant checkpoint)
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)  # the dense parameters are identical on every rank for a given seed
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        blocks = []
        for i in range(cfg.num_layers):
            is_moe = i >= cfg.first_dense_layers
            ffn = moe_factory(i - cfg.first_dense_layers) if is_moe else SwiGLU(cfg.hidden, cfg.dense_ffn)
            blocks.append(Block(cfg, ffn, is_moe))
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        moe_params = {id(p) for b in self.blocks if b.is_moe for p in b.ffn.parameters()}
        for p in self.parameters():
            if p.dim() == 2 and id(p) not in moe_params:  # the MoE layer initialises its own weights
                nn.init.normal_(p, std=0.02)
        torch.random.set_rng_state(gen_state)

    def forward(self, ids_BT: torch.Tensor, targets_BT: torch.Tensor | None = None, aux_coef: float = 0.0):
        x = self.embed(ids_BT)
        infos = []
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            # activation checkpointing: a block's activations are recomputed in the backward (the MoE layer
            # replays its recorded plan, lrmoe.runtime.layer)
            x, info = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
            if block.is_moe:
                infos.append(info)
        logits = self.head(self.norm(x))
        if targets_BT is None:
            return logits, infos
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets_BT.reshape(-1))
        total = loss
        if aux_coef and infos:
            aux = [load_balancing_loss(i.scores_TE, i.counts_E, self.cfg.top_k,
                                       num_tokens=int(i.counts_E.sum()) // self.cfg.top_k) for i in infos]
            total = loss + aux_coef * torch.stack(aux).sum()
        return logits, infos, loss, total
