"""Traces: format round-trip, calibration of the skew against DESIGN.md §5, statistics on hand cases."""

import pytest
import torch

from lrmoe.integrations.traces import sample_routing
from lrmoe.traces.stats import gini, max_over_mean, rank_loads
from lrmoe.traces.synthetic import generate_trace, inclusion_probs, sample_topk, zipf_popularity
from lrmoe.traces.trace import Trace, load_trace


def test_trace_round_trips_and_never_overwrites(tmp_path):
    trace = generate_trace(3, 2, 4, 16, 2, 64, seed=3, model="qwen3-30b-a3b-debug")
    path = trace.save(tmp_path / "t.npz")
    back = load_trace(path)
    assert torch.equal(back.counts_ILNE, trace.counts_ILNE)
    assert back.meta["source"] == "synthetic" and back.meta["seed"] == 3 and back.meta["generator"]["skew"] == "zipf"
    with pytest.raises(FileExistsError):
        trace.save(path)


def test_counts_sum_to_tokens_times_k_in_both_modes():
    for exact in (False, True):
        trace = generate_trace(2, 2, 3, 16, 4, 50, exact=exact)
        assert (trace.counts_ILNE.sum(-1) == 200).all()
        if exact:  # without replacement: no expert gets more pairs than there are tokens
            assert trace.counts_ILNE.max() <= 50


def test_same_seed_same_trace():
    a = generate_trace(2, 3, 4, 32, 2, 100, seed=7, skew="dirichlet", skew_param=1.0)
    b = generate_trace(2, 3, 4, 32, 2, 100, seed=7, skew="dirichlet", skew_param=1.0)
    assert torch.equal(a.counts_ILNE, b.counts_ILNE)


def test_zipf_04_over_128_experts_calibrates_to_gini_023():
    trace = generate_trace(2, 8, 8, 128, 8, 4096, skew_param=0.4, drift_sigma=0.0, seed=1)
    assert trace.summary()["gini_mean"] == pytest.approx(0.23, abs=0.03)
    pop = zipf_popularity(128, 0.4, torch.Generator().manual_seed(0))
    assert float(gini(pop)) == pytest.approx(0.23, abs=0.01)
    assert float(max_over_mean(pop)) == pytest.approx(4.3, abs=0.1)


def test_fast_mode_matches_exact_gumbel_topk_means():
    pop = zipf_popularity(64, 0.8, torch.Generator().manual_seed(0))
    idx = sample_topk(torch.log(pop), 50_000, 4, torch.Generator().manual_seed(1))
    empirical = torch.bincount(idx.flatten(), minlength=64).double() / 50_000
    error = (inclusion_probs(pop, 4) - empirical).abs()
    assert error.max() < 0.02 and error.mean() < 0.004
    assert idx.unique(dim=1).shape == idx.shape  # k distinct experts per token


def test_statistics_on_hand_cases():
    assert float(gini(torch.tensor([1.0, 1.0, 1.0, 1.0]))) == pytest.approx(0.0)
    assert float(gini(torch.tensor([0.0, 0.0, 0.0, 4.0]))) == pytest.approx(0.75)  # (n-1)/n
    assert float(max_over_mean(torch.tensor([1.0, 3.0]))) == pytest.approx(1.5)
    # expert 0 has two replicas (rank 0 and rank 1): its 8 pairs split 4 + 4
    placement = torch.tensor([[0, 1], [0, 2]])
    assert rank_loads(torch.tensor([8, 2, 6]), placement).tolist() == [6.0, 10.0]
    with pytest.raises(ValueError, match=r"experts \[2\] have no slot"):
        rank_loads(torch.tensor([1, 1, 1]), torch.tensor([[0, 1]]))


def test_sample_routing_has_the_family_form():
    pop = zipf_popularity(16, 0.4, torch.Generator().manual_seed(0))
    out = sample_routing(pop, 32, 4, "softmax_topk", torch.Generator().manual_seed(0))
    assert out.weight_TK.sum(-1).allclose(torch.ones(32))
    out = sample_routing(pop, 32, 4, "sigmoid_bias", torch.Generator().manual_seed(0))
    assert out.idx_TK.shape == (32, 4)


def test_bad_trace_input_raises():
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        generate_trace(1, 1, 1, 8, 9, 10)
    with pytest.raises(ValueError, match="unknown skew"):
        generate_trace(1, 1, 1, 8, 2, 10, skew="pareto")
    with pytest.raises(ValueError, match="negative"):
        Trace(-torch.ones(1, 1, 1, 2, dtype=torch.long))


def test_loading_a_trace_file_imports_neither_the_distributed_stack_nor_wandb(tmp_path):
    """The trace file sits below the simulator (DESIGN.md §7): a fresh process that loads one and reads its shape
    and metadata imports no torch (which itself imports torch.distributed), no runtime and no W&B."""
    import subprocess
    import sys

    path = generate_trace(2, 3, 4, 8, 2, 16, seed=5).save(tmp_path / "t.npz")
    probe = ("import sys; from lrmoe.traces.trace import load_trace; t = load_trace(sys.argv[1]); "
             "print(t.shape, t.meta['source']); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'wandb') "
             "or m.startswith('lrmoe.runtime') or m.startswith('lrmoe.integrations')))")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=300,
                         check=True).stdout.splitlines()
    assert out[0] == "(2, 3, 4, 8) synthetic"
    assert out[1] == "[]", f"loading a trace imported {out[1]}"


# -- loading is checked: every bad file names itself and what is wrong -------------------------------------------
def test_a_file_that_is_not_a_trace_gets_an_error_naming_it(tmp_path):
    import json

    import numpy as np

    from lrmoe.traces.trace import TraceFormatError

    cases = {}
    (tmp_path / "notes.txt").write_text("step,layer,counts\n1,2,3\n")
    cases["notes.txt"] = "a text file"
    (tmp_path / "empty.npz").write_bytes(b"")
    cases["empty.npz"] = "an empty file"
    (tmp_path / "router_trace_rank0.jsonl").write_text('{"step": 0, "layer": 0, "rank": 0, "top_indices": [[1]]}\n')
    cases["router_trace_rank0.jsonl"] = "import_megatron_trace"
    torch.save({"counts": torch.zeros(1)}, tmp_path / "ckpt.npz")
    cases["ckpt.npz"] = r"an \.npz archive but not an lrmoe-trace file: it lacks"  # torch.save writes a zip
    np.save(tmp_path / "bare.npy", np.zeros((1, 1, 1, 2), dtype=np.int64))
    cases["bare.npy"] = "bare .npy array"
    np.savez(tmp_path / "objects.npz", counts=np.array([{"a": 1}], dtype=object), meta=np.array("{}"))
    cases["objects.npz"] = "pickled"
    np.savez(tmp_path / "nometa.npz", counts=np.zeros((1, 1, 1, 2), dtype=np.int64))
    cases["nometa.npz"] = r"lacks \['meta'\]"
    np.savez(tmp_path / "badjson.npz", counts=np.zeros((1, 1, 1, 2), dtype=np.int64), meta=np.array("{oops"))
    cases["badjson.npz"] = "not valid JSON"
    good_meta = np.array(json.dumps({"format": "lrmoe-trace", "version": 1}))
    np.savez(tmp_path / "floats.npz", counts=np.zeros((1, 1, 1, 2)), meta=good_meta)
    cases["floats.npz"] = "integer array"
    np.savez(tmp_path / "threed.npz", counts=np.zeros((1, 1, 2), dtype=np.int64), meta=good_meta)
    cases["threed.npz"] = "integer array"
    np.savez(tmp_path / "negative.npz", counts=-np.ones((1, 1, 1, 2), dtype=np.int64), meta=good_meta)
    cases["negative.npz"] = "negative"
    np.savez(tmp_path / "other.npz", counts=np.zeros((1, 1, 1, 2), dtype=np.int64),
             meta=np.array(json.dumps({"format": "something-else"})))
    cases["other.npz"] = "format='something-else'"
    for name, what in cases.items():
        with pytest.raises(TraceFormatError, match=what) as err:
            load_trace(tmp_path / name)
        assert str(tmp_path / name) in str(err.value)
        assert isinstance(err.value, ValueError)  # scripts that catch ValueError report it as an argument error
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_trace(tmp_path / "missing.npz")
    with pytest.raises(TraceFormatError, match="is a directory"):
        load_trace(tmp_path)


def test_join_ranks_concatenates_source_ranks():
    from lrmoe.traces.trace import join_ranks

    a, b = generate_trace(2, 3, 1, 8, 2, 16, seed=1), generate_trace(2, 3, 2, 8, 2, 16, seed=2)
    joined = join_ranks([a, b])
    assert joined.num_ranks == 3 and torch.equal(joined.counts_ILNE[:, :, 1:], b.counts_ILNE)
    with pytest.raises(ValueError, match="layers"):
        join_ranks([a, generate_trace(2, 2, 1, 8, 2, 16)])


# -- Megatron-Core router traces --------------------------------------------------------------------------------
def _write_jsonl(path, records):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_imported_megatron_trace_equals_the_counts_it_encodes(tmp_path):
    from lrmoe.integrations.traces import import_megatron_trace

    E, K = 8, 2
    gen = torch.Generator().manual_seed(0)
    want = torch.zeros(2, 2, 2, E, dtype=torch.long)  # [steps, layers, ranks, experts]
    for rank in range(2):
        records = []
        for step in (5, 6):  # Megatron's step ids need not start at 0
            for layer in (1, 3):  # nor its layer numbers
                for _ in range(2):  # two micro-batches of one (step, layer, rank) add up
                    top = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(4)])
                    want[step - 5, (layer - 1) // 2, rank] += torch.bincount(top.flatten(), minlength=E)
                    records.append({"step": step, "stage": "pre_dispatch", "block": "decoder", "layer": layer,
                                    "rank": rank, "num_tokens": 4, "topk": K, "top_indices": top.tolist()})
                records.append({"step": step, "block": "mtp", "mtp_idx": 0, "layer": 0, "rank": rank,
                                "num_tokens": 1, "topk": K, "top_indices": [[0, 1]]})  # skipped: not decoder
        _write_jsonl(tmp_path / f"router_trace_rank{rank}.jsonl", records)
    trace = import_megatron_trace(tmp_path, num_experts=E, model="tiny")
    assert torch.equal(trace.counts_ILNE, want)
    assert trace.meta["steps"] == [5, 6] and trace.meta["layers"] == [1, 3] and trace.meta["ranks"] == [0, 1]
    assert trace.meta["source"] == "recorded" and trace.meta["top_k"] == K and trace.meta["micro_batches"] == 2
    back = load_trace(trace.save(tmp_path / "imported.npz"))  # the project's format from here on
    assert torch.equal(back.counts_ILNE, want)
    one = import_megatron_trace(tmp_path / "router_trace_rank1.jsonl", num_experts=E)
    assert torch.equal(one.counts_ILNE, want[:, :, 1:])
    assert torch.equal(import_megatron_trace(tmp_path, num_experts=E, ranks=[0]).counts_ILNE, want[:, :, :1])


def test_bad_megatron_records_name_file_and_line(tmp_path):
    from lrmoe.integrations.traces import import_megatron_trace
    from lrmoe.traces.trace import TraceFormatError

    ok = {"step": 0, "layer": 0, "rank": 0, "topk": 2, "top_indices": [[0, 1]]}
    cases = {
        "garbage": (["not json"], "not a JSON record"),
        "missing": ([{"step": 0, "layer": 0, "top_indices": [[0, 1]]}], r"lacks \['rank'\]"),
        "ragged": ([{**ok, "top_indices": [[0, 1], [2]]}], "list of integer lists"),
        "topk": ([{**ok, "topk": 3}], "topk=3"),
        "tokens": ([{**ok, "num_tokens": 5}], "num_tokens=5"),
        "negative": ([{**ok, "step": -1}], "step must be a non-negative integer"),
        "range": ([ok, {**ok, "top_indices": [[0, 9]]}], r"outside \[0, num_experts=8\)"),
    }
    for name, (records, what) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        if isinstance(records[0], str):
            path.write_text(records[0] + "\n")
        else:
            _write_jsonl(path, records)
        with pytest.raises(TraceFormatError, match=what) as err:
            import_megatron_trace(path, num_experts=8)
        assert f"{path}:" in str(err.value)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match="no Megatron-Core router trace"):
        import_megatron_trace(tmp_path / "empty_dir")


def test_a_missing_megatron_record_is_a_named_hole_not_a_zero_count(tmp_path):
    """Issue 38 (18): a (step, layer, rank) without a record became zero counts, a rank that routed nothing."""
    from lrmoe.integrations.traces import import_megatron_trace
    from lrmoe.traces.trace import TraceFormatError

    records = [{"step": s, "layer": layer, "rank": r, "topk": 2, "top_indices": [[0, 1], [2, 3]]}
               for s in range(3) for layer in range(2) for r in range(2)]
    _write_jsonl(tmp_path / "router_trace_rank0.jsonl", [r for r in records if r["rank"] == 0])
    _write_jsonl(tmp_path / "router_trace_rank1.jsonl",
                 [r for r in records if r["rank"] == 1 and (r["step"], r["layer"]) != (2, 1)])  # cut short
    with pytest.raises(TraceFormatError, match=r"no record for 1 of the 12 \(step, layer, rank\).*\(2, 1, 1\)"):
        import_megatron_trace(tmp_path, num_experts=4)
    assert import_megatron_trace(tmp_path, num_experts=4, ranks=[0]).counts_ILNE.shape == (3, 2, 1, 4)


def test_a_stray_huge_expert_index_is_refused_before_any_allocation(tmp_path):
    """Issue 38 (18): one stray index 30,000,000 built a 480 MB trace (E inferred as the largest index + 1)."""
    from lrmoe.integrations.traces import import_megatron_trace
    from lrmoe.traces.trace import TraceFormatError

    path = tmp_path / "router_trace_rank0.jsonl"
    _write_jsonl(path, [{"step": 0, "layer": 0, "rank": 0, "topk": 2, "top_indices": [[0, 1]]},
                        {"step": 1, "layer": 0, "rank": 0, "topk": 2, "top_indices": [[0, 30_000_000]]}])
    with pytest.raises(TraceFormatError, match=rf"{path}:2: expert index 30000000.*num_experts"):
        import_megatron_trace(path)
    with pytest.raises(TraceFormatError, match=r"outside \[0, num_experts=16\)"):
        import_megatron_trace(path, num_experts=16)


# -- recording an unmodified Hugging Face model (single process) -------------------------------------------------
def test_recorder_counts_the_routers_choices_of_an_hf_model():
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeForCausalLM

    from lrmoe.config import model_preset
    from lrmoe.integrations.hf import hf_config
    from lrmoe.integrations.traces import RouterRecorder

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_config(model_preset("qwen3-30b-a3b-debug").replace(num_layers=2)))
    E, K = 16, 4
    ids = [torch.randint(0, 256, (4, 6)) for _ in range(2)]
    with RouterRecorder(model, num_ranks=2) as rec:
        with torch.no_grad():
            outs = [model(x, output_router_logits=True) for x in ids]
    trace = rec.trace(note="test")
    assert trace.counts_ILNE.shape == (2, 2, 2, E) and trace.meta["note"] == "test"
    for step, out in enumerate(outs):
        for layer, logits_TE in enumerate(out.router_logits):  # HF's own record of the router: top-k of softmax
            idx_TK = torch.topk(torch.softmax(logits_TE, -1), K, dim=-1).indices
            halves = idx_TK.view(2, -1, K)  # virtual ranks: the first and second half of the tokens (2 sequences)
            for n in range(2):
                assert torch.equal(trace.counts_ILNE[step, layer, n], torch.bincount(halves[n].flatten(), minlength=E))
    assert len(rec._handles) == 0  # the context manager removed the hooks


def test_recorder_counts_a_checkpointed_forward_once():
    """With activation checkpointing the routers run again in the backward: that recomputation is not a step."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeForCausalLM

    from lrmoe.config import model_preset
    from lrmoe.integrations.hf import hf_config
    from lrmoe.integrations.traces import RouterRecorder

    ids = [torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(m)) for m in range(2)]
    traces = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(hf_config(model_preset("qwen3-30b-a3b-debug").replace(num_layers=2)))
        model.train()
        if checkpointing:
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        with RouterRecorder(model) as rec:
            for x in ids:  # two micro-batches, each forward then backward
                model(x, labels=x).loss.backward()
        traces.append(rec.trace().counts_ILNE)
    assert traces[0].shape == (2, 2, 1, 16) and torch.equal(traces[1], traces[0])


def test_recorder_steps_once_per_optimizer_step_of_micro_batches():
    """micro_batches=k: every k-th forward closes a step (the sum of its micro-batches, recomputations not
    counted), the metadata says k, and the simulator prices a micro-batch as a k-th of each step's pairs."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeForCausalLM

    from lrmoe.config import model_preset
    from lrmoe.integrations.hf import hf_config
    from lrmoe.integrations.traces import RouterRecorder
    from lrmoe.sim.simulator import micro_batch_counts

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_config(model_preset("qwen3-30b-a3b-debug").replace(num_layers=2)))
    model.train()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids = [torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(m)) for m in range(4)]
    with RouterRecorder(model) as per_forward, RouterRecorder(model, micro_batches=2) as per_step:
        for x in ids:  # two optimizer steps of two micro-batches
            model(x, labels=x).loss.backward()
    forwards, steps = per_forward.trace(), per_step.trace()
    assert forwards.meta["micro_batches"] == 1 and steps.meta["micro_batches"] == 2
    assert steps.counts_ILNE.shape == (2, 2, 1, 16)
    assert torch.equal(steps.counts_ILNE, forwards.counts_ILNE.view(2, 2, 2, 1, 16).sum(1))
    one, k = micro_batch_counts(steps)  # what the simulator prices per micro-batch: half of each step's pairs
    assert k == 2 and torch.equal(one.sum(-1) * 2, steps.counts_ILNE.sum(-1))
    with pytest.raises(ValueError, match="micro_batches must be a positive int"):
        RouterRecorder(model, micro_batches=0)
