"""The transformers drop-in (lrmoe.integrations.hf) against the unmodified HF models, on 2 gloo ranks, both families,
fp32.

Every rank builds the same tiny model (hidden 32, 8 experts, top-2, 2 MoE layers) from the same seed, keeps an
unmodified copy as the reference and swaps the other's MoE blocks onto the expert-parallel layer. Rank n feeds its
own batch; the reference sees every rank's batch. Properties: the swapped logits and router logits equal HF's; with
nothing trimmed (retention 1) every parameter's gradient equals HF's gradient of the summed losses (experts
gathered from the replica store); save_pretrained of a swapped model loads into the unmodified class and gives the
same logits; an evaluation forward between two training steps changes nothing; a recorded trace holds exactly
the counts the layers planned and replays in the simulator. The GLM config uses group-limited routing (2 groups,
1 chosen), a non-zero e_score_correction_bias, routed_scaling_factor 2.5 and norm_topk_prob=False; Qwen's
norm_topk_prob=True.
"""

import copy
import io

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

from lrmoe.config import MoEConfig, cluster_preset, model_preset  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import expert_grads_used, tiny_config  # noqa: E402
from lrmoe.integrations.hf import (EPExperts, gather_trace, hf_config, hf_to_reference, moe_blocks, reference_to_hf,
                                   swap_moe_blocks)
from lrmoe.runtime.reference import swiglu  # noqa: E402
from lrmoe.sim.simulator import simulate  # noqa: E402
from lrmoe.sim.simulated_systems import simulator_system  # noqa: E402
from lrmoe.systems import SystemContext, get_system  # noqa: E402
from lrmoe.integrations.traces import RouterRecorder  # noqa: E402

TINY = tiny_config()
CLOSE = dict(rtol=1e-5, atol=1e-5)
GRAD = dict(rtol=1e-4, atol=1e-6)
RANKS, BATCH, SEQ = 2, 2, 8


def tiny_model(family: str):
    """The tiny model of a family, same weights on every rank (seeded); GLM with a non-zero selection bias."""
    torch.manual_seed(0)
    if family == "qwen":
        return Qwen3MoeForCausalLM(hf_config(TINY))
    cfg = TINY.replace(router="sigmoid_bias", num_shared_experts=1, shared_ffn=16)
    model = Glm4MoeForCausalLM(hf_config(cfg, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                         norm_topk_prob=False))
    for block in model.model.layers:
        block.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    return model


def dense_named(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The swapped model's named parameters but the expert slots (which the replica store steps)."""
    return [(n, p) for n, p in model.named_parameters() if not n.endswith(".experts.slots_SW")]


def batches(step: int = 0, seq: int = SEQ) -> list[torch.Tensor]:
    """Every rank's token batch of a step, the same on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randint(0, TINY.vocab_size, (BATCH, seq), generator=gen) for _ in range(RANKS)]


# -- weight layout (single process) -------------------------------------------------------------------------------
def test_fused_layout_maps_to_the_reference_swiglu_and_back():
    model = tiny_model("qwen")
    experts = model.model.layers[0].mlp.experts
    w_gate, w_up, w_down = hf_to_reference(experts.gate_up_proj.detach(), experts.down_proj.detach())
    x_TD = torch.randn(5, 32)
    idx_TK = torch.tensor([[3, 0]] * 5)
    hf = experts(x_TD, idx_TK, torch.tensor([[1.0, 0.0]] * 5))  # HF's experts, all weight on expert 3
    assert torch.allclose(hf, swiglu(x_TD, w_gate[3], w_up[3], w_down[3])[0], atol=1e-6)
    gate_up, down = reference_to_hf(w_gate, w_up, w_down)
    assert torch.equal(gate_up, experts.gate_up_proj) and torch.equal(down, experts.down_proj)


def test_hf_config_round_trips_through_moe_config_from_hf():
    for name in ("qwen3-30b-a3b", "glm-4.5-air", "qwen3-30b-a3b-debug", "glm-4.5-air-debug"):
        assert MoEConfig.from_hf(hf_config(model_preset(name))) == model_preset(name)
    with pytest.raises(ValueError, match="qwen3_moe and glm4_moe"):
        MoEConfig.from_hf(type("Cfg", (), {"model_type": "llama"})())


def test_refusals_name_the_problem():
    model = tiny_model("qwen")
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        swap_moe_blocks(model, "static-ep")
    model.config.model_type = "llama"
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        swap_moe_blocks(model, "static-ep")
    with pytest.raises(ValueError, match="process group"):
        swap_moe_blocks(tiny_model("glm"), "static-ep")


# -- 2 gloo ranks ---------------------------------------------------------------------------------------------------
def _equal_to_hf(rank: int, family: str, system: str) -> dict:
    ref = tiny_model(family)
    model = copy.deepcopy(ref)
    ep = swap_moe_blocks(model, system)
    assert all(isinstance(b.experts, EPExperts) for _, b in moe_blocks(model)) and len(ep.layers) == 2
    ids = batches()
    mine = ids[rank]
    with torch.no_grad():  # evaluation path: the placement the slots hold
        torch.testing.assert_close(model(mine).logits, ref(mine).logits, **CLOSE)
    out = model(mine, labels=mine, output_router_logits=True)  # training path: the system's plan
    want = ref(mine, labels=mine, output_router_logits=True)
    torch.testing.assert_close(out.logits, want.logits, **CLOSE)
    assert len(out.router_logits) == 2
    for got, exp in zip(out.router_logits, want.router_logits):
        torch.testing.assert_close(got, exp, **CLOSE)
    if family == "qwen":
        torch.testing.assert_close(out.aux_loss, want.aux_loss, **CLOSE)
    out.loss.backward()
    ep.sync_dense_grads(1.0)
    expert_grads = ep.gather_expert_grads(1.0)
    sum(ref(x, labels=x, output_router_logits=True).loss for x in ids).backward()
    # the experts are parameters too, each block's slots on this rank (what DDP is told to leave alone)
    slots = {n for n, _ in model.named_parameters() if n.endswith(".experts.slots_SW")}
    assert len(slots) == 2
    assert {id(model.get_parameter(n)) for n in slots} == {id(layer.store.slots_SW) for layer in ep.layers}
    dense = {n: p for n, p in model.named_parameters() if n not in slots}
    names = dict(ref.named_parameters())
    assert set(dense) | set(expert_grads) == set(names) and not set(dense) & set(expert_grads)
    assert {p for p in map(id, ep.dense_parameters())} == {id(p) for p in dense.values()}
    for name, p in names.items():
        got = expert_grads[name] if name in expert_grads else dense[name].grad
        torch.testing.assert_close(got, p.grad, **GRAD, msg=lambda m: f"{name}: {m}")
    return {"params": len(names)}


@pytest.mark.parametrize("family,system", [("qwen", "lrmoe-no-quotas"), ("qwen", "symi-dropless"),
                                           ("glm", "lrmoe-no-quotas"), ("glm", "symi-dropless")])
def test_logits_router_logits_and_every_gradient_equal_hf(family, system):
    out = launch(_equal_to_hf, RANKS, family, system, timeout_s=120)
    assert out[0] == out[1]


def _train_step(model, ep, opt, step: int, rank: int) -> None:
    x = batches(step)[rank]
    model(x, labels=x).loss.backward()
    ep.step(opt)


def _save_and_load(rank: int, family: str, folder: str) -> None:
    model = tiny_model(family)
    ep = swap_moe_blocks(model, "lrmoe")
    opt = torch.optim.AdamW(ep.dense_parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("gate_up_proj", "down_proj"))}
    _train_step(model, ep, opt, 0, rank)
    model.save_pretrained(folder, is_main_process=rank == 0)  # collective: every rank gathers the experts
    dist.barrier()
    loaded = type(model).from_pretrained(folder)  # the unmodified HF class
    assert not any(isinstance(m, EPExperts) for m in loaded.modules())
    x = batches(1)[rank]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, **CLOSE)
    after = {k: v for k, v in loaded.state_dict().items() if k in before}
    assert set(after) == set(before) and all(not torch.equal(after[k], before[k]) for k in before)  # trained
    # and back into a swapped model: HF's tensors load into the replica store
    other = tiny_model(family)
    swap_moe_blocks(other, "symi-dropless")
    other.load_state_dict(loaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(other(x).logits, loaded(x).logits, **CLOSE)


@pytest.mark.parametrize("family", ["qwen", "glm"])
def test_save_pretrained_loads_into_the_unmodified_class(family, tmp_path):
    launch(_save_and_load, RANKS, family, str(tmp_path), timeout_s=120)


def _eval_between_steps(rank: int, family: str, system: str) -> None:
    runs = []
    for with_eval in (False, True):
        model = tiny_model(family)
        ep = swap_moe_blocks(model, system)
        opt = torch.optim.AdamW(ep.dense_parameters(), lr=1e-2)
        _train_step(model, ep, opt, 0, rank)
        if with_eval:  # evaluation and a generation-like forward of another length, on different tokens
            with torch.no_grad():
                model(batches(7, seq=3)[rank])
            with torch.inference_mode():
                model(batches(8, seq=1)[rank][:1])
        _train_step(model, ep, opt, 1, rank)
        x = batches(2)[rank]
        with torch.no_grad():
            logits = model(x).logits
        runs.append((logits, model.state_dict(), [(lay.placement_NS, lay.prev_counts_E) for lay in ep.layers]))
    (l0, sd0, lay0), (l1, sd1, lay1) = runs
    assert torch.equal(l0, l1)
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    for (p0, c0), (p1, c1) in zip(lay0, lay1):
        assert torch.equal(p0, p1) and torch.equal(c0, c1)


@pytest.mark.parametrize("family,system", [("qwen", "lrmoe"), ("glm", "symi-dropless")])
def test_an_eval_forward_between_training_steps_changes_nothing(family, system):
    launch(_eval_between_steps, RANKS, family, system, timeout_s=120)


def _record(rank: int, system: str):
    model = tiny_model("qwen")
    ep = swap_moe_blocks(model, system)
    opt = torch.optim.AdamW(ep.dense_parameters(), lr=1e-2)
    planned = []
    with RouterRecorder(model) as recorder:
        for step in range(3):
            _train_step(model, ep, opt, step, rank)
            planned.append(torch.stack([plan.routed_NE for plan in ep.plans()]))
    trace = gather_trace(recorder)
    stats = ep.load_stats()
    return trace.counts_ILNE, torch.stack(planned), trace.meta, stats


def test_a_recorded_trace_equals_the_planned_counts_and_replays_in_the_simulator():
    counts, planned, meta, stats = launch(_record, RANKS, "symi-dropless", timeout_s=120)[0]
    assert counts.shape == (3, 2, RANKS, 8) and torch.equal(counts, planned)
    assert (counts.sum(-1) == BATCH * SEQ * TINY.top_k).all()
    assert meta["source"] == "recorded" and len(meta["routers"]) == 2
    assert stats["summary"]["layers"] == 2 and stats["summary"]["dropped_pairs"] == 0
    cfg = MoEConfig.from_hf(hf_config(TINY))
    spec = get_system("symi-dropless")
    cluster = cluster_preset("h200x8").replace(num_ranks=RANKS, ranks_per_node=RANKS)
    result = simulate(counts, simulator_system(spec, SystemContext(num_experts=8, num_ranks=RANKS)), cfg, cluster)
    assert result.routed_IL.tolist() == [[BATCH * SEQ * TINY.top_k * RANKS] * 2] * 3
    assert torch.isfinite(result.phase_ILH).all() and (result.phase_ILH.sum(-1) > 0).all()


def _resume(rank: int, family: str, system: str) -> None:
    model = tiny_model(family)
    ep = swap_moe_blocks(model, system)
    opt = torch.optim.AdamW(ep.dense_parameters(), lr=1e-2)
    _train_step(model, ep, opt, 0, rank)
    buffer = io.BytesIO()  # a checkpoint file, read back without pickle's arbitrary objects
    torch.save((model.state_dict(), ep.expert_state_dict(), opt.state_dict()), buffer)  # HF state dict: collective
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    _train_step(model, ep, opt, 1, rank)
    again = tiny_model(family)
    ep2 = swap_moe_blocks(again, system)
    opt2 = torch.optim.AdamW(ep2.dense_parameters(), lr=1e-2)
    again.load_state_dict(saved[0])
    ep2.load_expert_state_dict(saved[1])
    opt2.load_state_dict(saved[2])
    _train_step(again, ep2, opt2, 1, rank)
    x = batches(2)[rank]
    with torch.no_grad():
        assert torch.equal(model(x).logits, again(x).logits)
    for a, b in zip(ep.layers, ep2.layers):
        assert torch.equal(a.placement_NS, b.placement_NS) and torch.equal(a.store.exp_avg_EW, b.store.exp_avg_EW)


@pytest.mark.parametrize("family,system", [("glm", "lrmoe")])
def test_resuming_from_the_state_dicts_continues_exactly(family, system):
    launch(_resume, RANKS, family, system, timeout_s=120)


# -- a plain PyTorch loop: the optimizer object, micro-batches, gradient checkpointing, an LR scheduler ------------
MICRO = 2


def _plain_loop(rank: int, family: str, system: str, ckpt: bool):
    """Two steps of MICRO micro-batches through ``ep.optimizer`` and a LambdaLR, as a plain PyTorch loop. Returns
    every gradient each step used, the final logits, and (first step) the reference's mean-loss gradients."""
    model = tiny_model(family)
    ref = copy.deepcopy(model)
    model.train()
    if ckpt:
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ep = swap_moe_blocks(model, system)
    opt = ep.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    steps = []
    for step in range(2):
        for m in range(MICRO):
            x = batches(10 * step + m)[rank]
            model(x, labels=x).loss.backward()
        # each forward's decision is kept for its recomputation, and taken by it when the model checkpoints
        assert all(len(layer.decisions) == (0 if ckpt else MICRO) for layer in ep.layers)
        opt.step()
        used = {n: p.grad.clone() for n, p in dense_named(model)} | expert_grads_used(ep)
        steps.append(used)
        sched.step()
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    assert opt.expert_group["lr"] == opt.param_groups[0]["lr"] == 2.5e-3  # the scheduler moves both parts
    assert all(layer.store.adam.lr == 5e-3 for layer in ep.layers)  # the expert Adam ran step 2 at its lr
    # the reference: the unmodified model, gradient of the mean loss over ranks and micro-batches
    loss = sum(ref(x, labels=x).loss for m in range(MICRO) for x in batches(m)) / (RANKS * MICRO)
    loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    with torch.no_grad():
        logits = model(batches(5)[rank]).logits
    return steps, logits, want, opt.state_dict()


def _loops(rank: int, family: str, system: str):
    plain, logits, want, state = _plain_loop(rank, family, system, ckpt=False)
    assert set(plain[0]) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(plain[0][name], g, **GRAD, msg=lambda m: f"{name}: {m}")
    ckpt, logits_ckpt, _, _ = _plain_loop(rank, family, system, ckpt=True)
    for a, b in zip(plain, ckpt):  # gradient checkpointing: bitwise the same run
        assert all(torch.equal(a[name], b[name]) for name in a)
    assert torch.equal(logits, logits_ckpt)
    assert set(state) == {"dense", "expert_group", "experts"} and state["dense"]["state"]
    return True


@pytest.mark.parametrize("family,system", [("qwen", "lrmoe-no-quotas"), ("glm", "symi-dropless")])
def test_a_plain_pytorch_loop_with_micro_batches_and_checkpointing(family, system):
    assert launch(_loops, RANKS, family, system, timeout_s=180) == [True] * RANKS


def _defaults_agree(rank: int) -> dict:
    """Every method that reduces gradients defaults to the gradient of the mean loss over ranks and micro-batches."""
    model = tiny_model("qwen")
    ep = swap_moe_blocks(model, "symi-dropless")
    for m in range(MICRO):
        x = batches(m)[rank]
        model(x, labels=x).loss.backward()
    assert ep.mean_grad_scale() == 1.0 / (RANKS * MICRO)
    summed = ep.gather_expert_grads(1.0)
    mean = ep.gather_expert_grads()
    for name in summed:
        torch.testing.assert_close(mean[name], summed[name] / (RANKS * MICRO), rtol=1e-6, atol=0)
    raw = {n: p.grad.clone() for n, p in dense_named(model)}
    ep.sync_dense_grads()
    ep.expert_step()
    used = expert_grads_used(ep)
    for name, p in dense_named(model):
        total = raw[name].clone()
        dist.all_reduce(total)
        torch.testing.assert_close(p.grad, total / (RANKS * MICRO), rtol=1e-6, atol=1e-9)
    for name in used:
        torch.testing.assert_close(used[name], mean[name], rtol=0, atol=0)
    return True


def test_every_gradient_method_defaults_to_the_mean_over_ranks_and_micro_batches():
    assert launch(_defaults_agree, RANKS, timeout_s=120) == [True] * RANKS


@pytest.mark.slow  # about 10 s of CPU, minutes of wall time on a loaded machine: `make test-all`
@pytest.mark.timeout(600)
def test_the_readme_example_runs(tmp_path):
    """docs/hf.md, "Use it with transformers": the example (micro-batches, checkpointing, the optimizer object with
    clipping, a recorder stepping per optimizer step) runs and its checkpoint loads into the unmodified class."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    guide = (Path(__file__).resolve().parent.parent / "docs" / "hf.md").read_text()
    section = guide[guide.index("# Use it with transformers"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "ep.optimizer(" in code and "activation_checkpointing_enable()" in code and "MICRO_BATCHES" in code
    assert "max_grad_norm=" in code and "micro_batches=MICRO_BATCHES" in code
    (tmp_path / "example.py").write_text(code)
    # as the page runs it (torchrun --nproc-per-node 2), on a free port
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2 loss" in proc.stdout and proc.stdout.strip().endswith("Qwen3MoeExperts")


def _nan_input(rank: int) -> str:
    model = tiny_model("qwen")
    swap_moe_blocks(model, "lrmoe")
    ids = batches()[rank]
    if rank == 1:  # one token's embedding turns NaN on rank 1 only
        with torch.no_grad():
            model.model.embed_tokens.weight[ids[0, 0]] = float("nan")
    try:
        model(ids, labels=ids).loss.backward()
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_nan_through_the_drop_in_names_the_block_and_the_rank_not_an_internal_tensor():
    for rank, message in enumerate(launch(_nan_input, RANKS)):
        assert message.startswith("NonFiniteError: model.layers.0.mlp") and "rank 1" in message, message
        assert f"this is rank {rank}" in message and "_P" not in message
