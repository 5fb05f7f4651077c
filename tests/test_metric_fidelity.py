"""The fidelity sweep's trained source (lrmoe.analysis.fidelity_sources): real inputs and upstream gradients of trained
MoE layers; and experiments/metric_fidelity.py end to end on it."""

from pathlib import Path

import pytest
import torch
from _scripts import load_experiment

from lrmoe.analysis import fidelity_sources as sources
from lrmoe.config import model_preset
from lrmoe.harness.job_stages import markdown_tables
from lrmoe.results import read_results

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ["qwen3-30b-a3b-debug", "glm-4.5-air-debug"]


@pytest.fixture(scope="module")
def fidelity():
    return load_experiment("metric_fidelity")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A small text corpus with files on both sides of the train/validation split."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(60):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}\n" for j in range(40))
        (root / f"mod{i}.py").write_text(body)
    return root


@pytest.mark.parametrize("name", PRESETS)
def test_captured_delta_is_the_autograd_gradient_of_the_layer_output(fidelity, name):
    """capture_moe_io's δ (tensor hook) must equal ∂(LM loss)/∂y obtained independently, by adding a zero probe to
    each MoE layer's output and differentiating the loss with respect to it; its x must be the layer's input."""
    cfg = model_preset(name)
    model = sources.build_model(cfg, seed=3)
    gen = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)
    targets_BT = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen)

    xs, deltas, loss = sources.capture_moe_io(model, ids_BT, targets_BT)
    assert all(p.grad is None for p in model.parameters())  # the capture leaves no gradients behind

    layers = sources.moe_layers(model)
    probes = [torch.zeros(32, cfg.hidden, requires_grad=True) for _ in layers]
    inputs = [None] * len(layers)

    def probe_hook(i):
        def hook(module, args, output):
            inputs[i] = args[0].detach()
            return output[0] + probes[i], output[1]
        return hook

    handles = [layer.register_forward_hook(probe_hook(i)) for i, layer in enumerate(layers)]
    _, _, loss_ref, _ = model(ids_BT, targets_BT)
    for handle in handles:
        handle.remove()
    expected = torch.autograd.grad(loss_ref, probes)

    assert len(xs) == len(deltas) == cfg.num_moe_layers
    assert float(loss_ref.detach()) == loss
    for x_TD, delta_TD, inp_TD, exp_TD in zip(xs, deltas, inputs, expected):
        assert torch.equal(x_TD, inp_TD)
        assert delta_TD.shape == (32, cfg.hidden) and delta_TD.abs().sum() > 0
        torch.testing.assert_close(delta_TD, exp_TD, rtol=0, atol=1e-12)


def run_text(fidelity, tmp_path, corpus_dir, out_name="fid.jsonl", steps=3, extra=()):
    out = tmp_path / out_name
    table = fidelity.main(["--quick", "--no-wandb", "--overwrite", "--out", str(out), "--presets", PRESETS[1],
                           "--data", "text", "--train-steps", str(steps), "--train-batch", "2", "--train-seq-len",
                           "32", "--corpus", str(corpus_dir), "--metrics", "m2", "random", "--rhos", "0.5", "1.0",
                           "--cache-dir", str(tmp_path / "cache"), *extra])
    return out, table


def test_trained_source_records_have_the_expected_fields(fidelity, tmp_path, corpus_dir, capsys):
    out, _ = run_text(fidelity, tmp_path, corpus_dir)
    records = read_results(out)
    cfg = model_preset(PRESETS[1])
    assert len(records) == cfg.num_moe_layers * 2 * 2 * 2  # layers × metrics × modes × ρ
    assert {r["layer"] for r in records} == set(range(cfg.num_moe_layers))
    for rec in records:
        assert rec["preset"] == PRESETS[1] and rec["data"] == "text" and rec["weights"] == "trained-3"
        assert rec["tokens"] == 128 and rec["train_loss"] > 0
        for key in ("mode", "metric", "rho", "rel_w_all", "cos_w_mean", "rel_x"):
            assert key in rec, key
        if rec["rho"] == 1.0:  # keeping every pair reproduces the full gradient of the real batch exactly
            assert rec["rel_w_all"] < 1e-6 and rec["rel_x"] < 1e-6, rec
        else:
            assert rec["rel_w_all"] > 1e-3, rec
    summary = read_results(out, kind="summary")[0]
    assert summary["training"][PRESETS[1]]["cached"] is False
    assert {row["metric"] for row in summary["ratio_to_random"]} == {"m2"}
    assert (tmp_path / "fid_fidelity.png").exists()
    # the main job shows the second-to-last table: it must be the ratio-to-random headline
    headline = markdown_tables(capsys.readouterr().out, -2)
    assert headline.splitlines()[0].split("|")[1:4] == [" mode     ", " metric   ", "   all "]
    assert "trained-3 / text ρ=0.5" in headline.splitlines()[0]


def test_trained_weights_are_cached_and_reused(fidelity, tmp_path, corpus_dir, monkeypatch):
    first, _ = run_text(fidelity, tmp_path, corpus_dir, "first.jsonl")
    cache = list((tmp_path / "cache").glob("*.pt"))
    assert len(cache) == 1 and cache[0].name.startswith(f"{PRESETS[1]}-trained-3-")

    def no_training(*args, **kwargs):
        raise AssertionError("a cached model was retrained")

    with monkeypatch.context() as patch:
        patch.setattr(sources, "train_model", no_training)
        second, _ = run_text(fidelity, tmp_path, corpus_dir, "second.jsonl")
    assert read_results(second, kind="summary")[0]["training"][PRESETS[1]]["cached"] is True
    keys = ("layer", "mode", "metric", "rho", "rel_w_all", "rel_x", "train_loss", "batch_loss")

    def strip(recs):
        return [{k: r[k] for k in keys} for r in recs]

    assert strip(read_results(first)) == strip(read_results(second))  # the cached model is the trained one

    # another training spec is another cache entry
    third, _ = run_text(fidelity, tmp_path, corpus_dir, "third.jsonl", steps=4)
    assert read_results(third, kind="summary")[0]["training"][PRESETS[1]]["cached"] is False
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2


def test_training_lowers_the_loss_and_is_deterministic(corpus_dir):
    from lrmoe.integrations.data import load_corpus

    corpus = load_corpus(str(corpus_dir))
    spec = sources.TrainSpec(preset=PRESETS[0], steps=12, batch=4, seq_len=32, lr=3e-3, aux_coef=0.1,
                             bias_rate=1e-3, seed=0, corpus_digest=sources.corpus_digest(corpus))
    model, losses = sources.train_model(spec, corpus)
    assert losses[-1] < losses[0] - 0.5
    model2, losses2 = sources.train_model(spec, corpus)
    assert losses2 == losses
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


@pytest.mark.parametrize("call, message", [
    (lambda: sources.make_batch("text", 8, 4, 0), "data='text'"),
    (lambda: sources.TrainSpec("qwen3-30b-a3b-debug", 0, 2, 8, 1e-3, 0.0, 0.0, 0, ""), "steps"),
    (lambda: sources.TrainSpec("qwen3-30b-a3b-debug", 2, 2, 8, -1.0, 0.0, 0.0, 0, ""), "lr"),
    (lambda: sources.TrainSpec("qwen3-30b-a3b-debug", 2, 2, 8, 1e-3, -0.1, 0.0, 0, ""), "aux_coef"),
])
def test_bad_input_raises_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_command_line_is_refused(fidelity, tmp_path):
    with pytest.raises(SystemExit):
        fidelity.main(["--train-steps", "0", "--out", str(tmp_path / "x.jsonl"), "--no-wandb"])
