"""The drop-in from a model built on the meta device, 2 gloo ranks, tiny Qwen3-MoE, fp32, CPU.

``with torch.device("meta"): model = cls(config)``, then ``swap_moe_blocks(model, system, device="cpu")``: every
layer allocates this rank's slots and optimizer shards only, and ``load_safetensors_`` fills them and
materialises the dense part from the unmodified class's checkpoint, one tensor at a time. Properties: the model so
loaded computes the same logits as the model built whole and swapped, and trains the same step; and (slow) its
peak resident memory over build, swap and load, on 4 ranks, stays below that of the unmodified class's own
``from_pretrained`` followed by the swap (lrmoe.harness.rss), and below what the rank keeps (its slots, fp32 master
and Adam shards, the dense part) plus one whole copy of the experts. Measured there, for 144 MiB of experts: 203-214
MiB per rank against 392-724 MiB (from_pretrained, several runs), the rank keeping 147 MiB; the rest is one layer's
fused tensors as read (12 MiB) and the forked rank's first model build (about 25 MiB, before the swap). Before the
swap and load made no whole flattened copy of a layer (246-258 MiB), those copies' frees stayed on glibc's heap.
Read memory-mapped, the checkpoint's pages (every rank reads every expert's columns) added the whole file: 392 MiB.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from transformers import Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.config import MoEConfig  # noqa: E402
from lrmoe.harness.rss import peak_bytes, reset_peak  # noqa: E402
from lrmoe.integrations.hf import hf_config, load_safetensors_, swap_moe_blocks  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import tiny_config  # noqa: E402

TINY = tiny_config()
# many layers, so that one layer's transient copies are small beside all of them: 12 layers x 32 experts x 3 x
# 128 x 256 fp32 = 144 MiB of experts; the dense part is about 2 MiB
BIG = TINY.replace(name="big", hidden=128, expert_ffn=256, num_experts=32, num_layers=12, num_heads=4, num_kv_heads=2)
CLOSE = dict(rtol=1e-6, atol=1e-6)
PEAK_RANKS = 4  # each rank's optimizer shards shrink as 1 / ranks; the whole model's copy does not


def from_meta(cfg: MoEConfig, path: str, system: str):
    """The model built on the meta device, swapped, loaded from ``path`` (its rotary buffers rebuilt)."""
    config = hf_config(cfg)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    ep = swap_moe_blocks(model, system, device="cpu")
    unexpected = load_safetensors_(model, os.path.join(path, "model.safetensors"))
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # non-persistent: not in a checkpoint
    return model, ep, unexpected


def _same_as_whole(rank: int, folder: str) -> dict:
    torch.manual_seed(0)
    whole = Qwen3MoeForCausalLM(hf_config(TINY))
    if rank == 0:
        whole.save_pretrained(folder)
    dist.barrier()
    ref = copy.deepcopy(whole)
    ref_ep = swap_moe_blocks(ref, "symi-dropless")
    model, ep, unexpected = from_meta(TINY, folder, "symi-dropless")
    meta_left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    x = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    same_logits = torch.allclose(model(x).logits, ref(x).logits, **CLOSE)
    for m, e in ((model, ep), (ref, ref_ep)):
        opt = e.optimizer(torch.optim.AdamW, lr=1e-2)
        m(x, labels=x).loss.backward()
        opt.step()
    got, want = model.state_dict(), ref.state_dict()  # collective: the experts gathered
    return {"unexpected": unexpected, "meta_left": meta_left, "logits": same_logits,
            "unequal": [k for k in want if not torch.allclose(got[k], want[k], **CLOSE)]}


def test_a_meta_device_model_swaps_loads_and_trains_as_the_whole_one(tmp_path):
    for out in launch(_same_as_whole, 2, str(tmp_path), timeout_s=120):
        assert not out["unexpected"] and not out["meta_left"], out
        assert out["logits"] and not out["unequal"], out["unequal"]


def _peak(rank: int, folder: str, how: str) -> int:
    if how == "save" and rank == 0:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(hf_config(BIG)).save_pretrained(folder)
    if how == "save":
        dist.barrier()
        return 0
    base = reset_peak()
    if how == "whole":  # the unmodified class's own load, then the swap
        model = Qwen3MoeForCausalLM.from_pretrained(folder)
        swap_moe_blocks(model, "static-ep")
        return peak_bytes() - base
    model, ep, _ = from_meta(BIG, folder, "static-ep")
    peak = peak_bytes() - base
    kept = [layer.store.slots_SW for layer in ep.layers]
    kept += [getattr(layer.store, n) for layer in ep.layers for n in ("master_EW", "exp_avg_EW", "exp_avg_sq_EW")]
    kept += ep.dense_parameters()
    return peak, sum(t.numel() * t.element_size() for t in kept)  # what this rank keeps: slots, shards, dense


@pytest.mark.slow  # 300 MB of experts per rank, built twice per rank
def test_a_meta_device_load_peaks_below_the_whole_models_load(tmp_path):
    launch(_peak, PEAK_RANKS, str(tmp_path), "save", timeout_s=300)
    whole = max(launch(_peak, PEAK_RANKS, str(tmp_path), "whole", timeout_s=300))
    meta, kept = max(launch(_peak, PEAK_RANKS, str(tmp_path), "meta", timeout_s=300))
    experts = BIG.num_layers * BIG.num_experts * 3 * BIG.hidden * BIG.expert_ffn * 4
    print(f"peak added per rank: whole {whole / 2**20:.0f} MiB, meta {meta / 2**20:.0f} MiB, kept {kept / 2**20:.0f} "
          f"MiB, experts {experts / 2**20:.0f} MiB")
    assert meta < whole, (whole, meta, experts)
    # never the whole model's experts on top of what the rank keeps (a memory-mapped checkpoint's pages would be)
    assert meta < kept + experts, (meta, kept, experts)
