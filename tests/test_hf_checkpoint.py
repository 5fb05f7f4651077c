"""Per-rank checkpoints of a swapped model and their consolidation (lrmoe.integrations.hf.checkpoint), tiny
Qwen3-MoE and GLM-4.5, fp32, CPU, gloo ranks.

A model trained two steps (GLM: its ``e_score_correction_bias`` moved too) is written by ``save_sharded``: rank 0
the dense part once, each rank its own fp32 master shards and nothing else. ``consolidate`` (one process, through
the ``python -m`` command) joins them into a checkpoint that transformers' own ``save_pretrained`` shards over
several files (a small ``max_shard_size``). Properties: the unmodified class's ``from_pretrained`` gives the trained
model's logits and holds, tensor for tensor, exactly what the swapped model's (collective, gathered)
``state_dict`` holds; no rank's shard file holds another rank's columns or the dense part; and ``load_safetensors_``
reads the sharded checkpoint (its ``model.safetensors.index.json``) into a model built on the meta device, which
then gives the same logits on every rank.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.integrations.hf import hf_config, load_safetensors_, swap_moe_blocks  # noqa: E402
from lrmoe.integrations.hf.checkpoint import DENSE_FILE, consolidate, expert_shard_file, save_sharded  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import tiny_config  # noqa: E402

TINY = tiny_config()
BATCH, SEQ, STEPS, LR = 2, 8, 2, 1e-2
LOGITS = dict(rtol=1e-5, atol=1e-5)  # the swapped forward sums the same products in another order
MAX_SHARD = "40KB"  # the tiny model is about 0.2 MB: several files


def family_config(family: str, ranks: int):
    cfg = TINY.replace(num_experts=6 if ranks == 3 else 8)  # whole home slots per rank
    if family == "qwen":
        return Qwen3MoeForCausalLM, hf_config(cfg)
    return Glm4MoeForCausalLM, hf_config(cfg.replace(router="sigmoid_bias", num_shared_experts=1, shared_ffn=16))


def ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def _saved_and_consolidated(rank: int, family: str, folder: str) -> dict:
    cls, config = family_config(family, dist.get_world_size())
    torch.manual_seed(0)
    model = cls(config)
    ep = swap_moe_blocks(model, "lrmoe-no-quotas")
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, bias_rate=1e-2)
    for step in range(STEPS):
        x = ids(step, rank)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    shards, hf = os.path.join(folder, "shards"), os.path.join(folder, "hf")
    written = save_sharded(model, shards)
    x = ids(STEPS, rank)
    with torch.no_grad():
        trained = model(x).logits
    gathered = model.state_dict()  # collective: every expert gathered, HF's names
    out = {"written": sorted(os.path.basename(p) for p in written)}
    with safe_open(os.path.join(shards, expert_shard_file(rank, dist.get_world_size())), framework="pt") as f:
        own = {k: f.get_tensor(k) for k in f.keys()}
    out["own_shards"] = all(torch.equal(own[f"{name}.experts.master_EW"], layer.store.master_EW)
                            for name, layer in zip(ep.names, ep.layers))
    out["own_keys"] = sorted(own)
    if rank == 0:
        with safe_open(os.path.join(shards, DENSE_FILE), framework="pt") as f:
            out["dense_has_experts"] = [k for k in f.keys() if ".experts." in k]
        run = subprocess.run([sys.executable, "-m", "lrmoe.integrations.hf.checkpoint", shards, hf,
                              "--max-shard-size", MAX_SHARD], capture_output=True, text=True, timeout=120)
        out["cli"] = (run.returncode, run.stderr[-2000:])
        with open(os.path.join(hf, "model.safetensors.index.json")) as f:
            out["files"] = len(set(json.load(f)["weight_map"].values()))
        loaded = cls.from_pretrained(hf)  # the unmodified class
        out["loaded_class"] = type(loaded.model.layers[-1].mlp.experts).__name__
        with torch.no_grad():
            out["hf_logits"] = torch.allclose(loaded(x).logits, trained, **LOGITS)
        state = loaded.state_dict()
        out["unequal"] = [k for k in gathered if k not in state or not torch.equal(state[k], gathered[k])]
    dist.barrier()
    with torch.device("meta"):
        meta = cls(config)
    swap_moe_blocks(meta, "lrmoe-no-quotas", device="cpu")
    out["unexpected"] = load_safetensors_(meta, hf)  # the folder: its index, several files
    meta.model.rotary_emb = type(meta.model.rotary_emb)(config=config)
    with torch.no_grad():
        out["meta_logits"] = torch.allclose(meta(x).logits, trained, **LOGITS)
    return out


@pytest.mark.parametrize("family, ranks", [("qwen", 2), ("glm", 3), ("qwen", 3)])
def test_per_rank_shards_consolidate_into_what_the_unmodified_class_loads(tmp_path, family, ranks):
    outs = launch(_saved_and_consolidated, ranks, family, str(tmp_path), timeout_s=300)
    first = outs[0]
    assert first["cli"][0] == 0, first["cli"]
    assert first["files"] > 1, first["files"]  # a sharded checkpoint
    assert first["loaded_class"] != "EPExperts" and first["hf_logits"], first
    assert not first["unequal"], first["unequal"]  # bitwise what the gathered state dict holds
    assert not first["dense_has_experts"], first["dense_has_experts"]
    layers = [f"model.layers.{i}.mlp.experts.master_EW" for i in range(TINY.num_layers)]
    for rank, out in enumerate(outs):
        assert out["own_shards"] and out["own_keys"] == sorted(layers), out["own_keys"]
        expected = {expert_shard_file(rank, ranks)} | ({DENSE_FILE, "config.json", "lrmoe-shards.json"}
                                                       if rank == 0 else set())
        assert set(out["written"]) == expected, out["written"]
        assert not out["unexpected"] and out["meta_logits"], out


# -- the training loop's checkpoint (lrmoe.integrations.checkpoint_state, train.py --hf-config) -----------------
def _bf16_resume(rank: int, family: str, folder: str) -> dict:
    """A bf16 model (its slots bf16, its masters fp32) trained 2 steps, saved, trained 1 more; and a fresh one
    loaded from the checkpoint and trained the same step. What the save wrote under ``model/``, and whether the
    masters and the slots agree, bit for bit, after the load and after the step."""
    from lrmoe.integrations.checkpoint_state import load_state, read_full_state, save_state

    def built():
        cls, config = family_config(family, dist.get_world_size())
        torch.manual_seed(0)
        model = cls(config).to(torch.bfloat16)
        ep = swap_moe_blocks(model, "lrmoe-no-quotas")
        return model, ep, ep.optimizer(torch.optim.AdamW, lr=LR, bias_rate=1e-2)

    def step(model, opt, s):
        x = ids(s, rank)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    def experts(ep):
        return [(layer.store.master_EW.clone(), layer.store.slots_SW.detach().clone()) for layer in ep.layers]

    model, ep, opt = built()
    for s in range(STEPS):
        step(model, opt, s)
    save_state(folder, model, opt.dense, ep.layers, {})
    saved = experts(ep)
    step(model, opt, STEPS)
    again, again_ep, again_opt = built()
    load_state(folder, again, again_opt.dense, again_ep.layers, dist.get_world_size(), {})
    loaded = experts(again_ep)
    step(again, again_opt, STEPS)
    same = lambda a, b: all(torch.equal(x, y) for u, v in zip(a, b) for x, y in zip(u, v))  # noqa: E731
    model_keys = [k for k in read_full_state(folder) if k.startswith("model/")] if rank == 0 else []
    return {"loaded": same(loaded, saved), "stepped": same(experts(again_ep), experts(ep)),
            "masters_fp32": all(m.dtype == torch.float32 for m, _ in saved),
            "masters_not_bf16": any(not torch.equal(m, m.bfloat16().float()) for m, _ in saved),
            "model_keys": model_keys}


@pytest.mark.parametrize("family", ["qwen", "glm"])
def test_a_bf16_model_resumes_from_its_fp32_masters(family, tmp_path):
    """The loop's checkpoint holds the experts as their fp32 master shards only (its dense part gathers nothing),
    and a bf16 model resumes from them bit-identically: before, the experts gathered in bf16 were saved with the
    dense part and loaded back over the masters, rounding them to bf16."""
    outs = launch(_bf16_resume, 2, family, str(tmp_path / "ckpt"), timeout_s=120)
    for out in outs:
        assert out["masters_fp32"] and out["masters_not_bf16"], out  # the masters hold more than the slots' bf16
        assert out["loaded"] and out["stepped"], out
    keys = outs[0]["model_keys"]
    assert any(k.endswith("mlp.gate.weight") for k in keys), keys  # the dense part is there, the experts not
    assert not [k for k in keys if ".experts." in k], keys


def _saved_twice(rank: int, folder: str) -> None:
    cls, config = family_config("qwen", dist.get_world_size())
    torch.manual_seed(0)
    model = cls(config)
    swap_moe_blocks(model, "lrmoe-no-quotas")
    save_sharded(model, os.path.join(folder, "a"), step=1)
    save_sharded(model, os.path.join(folder, "b"), step=2)


def test_consolidate_refuses_shards_of_different_saves_naming_the_files(tmp_path):
    """Each file of a save carries the save's identity (save id, step, world size): a folder where one rank's shard
    is another save's (here step 1's, beside step 2's manifest, dense part and rank 0 shard) is refused, naming that
    file and what it holds, and nothing is written."""
    launch(_saved_twice, 2, str(tmp_path), timeout_s=120)
    stale = expert_shard_file(1, 2)
    shutil.copy(tmp_path / "a" / stale, tmp_path / "b" / stale)  # rank 1's file left by the earlier save
    with pytest.raises(ValueError, match="mixes files of different saves") as exc:
        consolidate(str(tmp_path / "b"), str(tmp_path / "hf"))
    assert f"{stale} (save_id " in str(exc.value) and "step 1, num_ranks 2)" in str(exc.value)
    assert expert_shard_file(0, 2) not in str(exc.value) and DENSE_FILE not in str(exc.value)
    assert not (tmp_path / "hf").exists()
