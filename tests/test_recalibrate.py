"""The backward hook on the reference layer: exact at ρ = 1, equal to the retained-set reference at ρ < 1,
router and shared expert untouched, quotas kept, and the unbiased mode converging to the full gradient."""

import math

import pytest
import torch

from lrmoe.recal.recalibrate import (Recalibration, pair_groups, pair_hook, proportional_quotas, recalibrate,
                               score_and_select)
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.recal.scoring import METRICS, pair_scores
from lrmoe.recal.selection import MODES
from _scripts import load_experiment

D, FFN, E, K, T, SOURCES = 8, 6, 6, 2, 24, 2
EXPERT_WEIGHTS = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")


def make_layer(router="sigmoid_bias", shared=4):
    layer = ReferenceMoE(D, FFN, E, K, router, shared_ffn=shared, seed=1, dtype=torch.float64)
    if router == "sigmoid_bias":
        layer.bias_E.copy_(torch.linspace(-0.2, 0.2, E))
    return layer


def batch(seed=0, tokens=T):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, D, generator=gen, dtype=torch.float64),
            torch.randn(tokens, D, generator=gen, dtype=torch.float64))


def gradients(layer, x, d, **kwargs):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y, aux = layer(x, **kwargs)
    (y * d).sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}, x.grad, y.detach(), aux


def recalibration(layer, x, metric, mode, rho, seed=0):
    with torch.no_grad():
        _, aux = layer(x)
    group_P, counts_Q = pair_groups(aux.idx_TK, E, SOURCES)
    return Recalibration(metric, mode, group_P, proportional_quotas(counts_Q, rho),
                         torch.Generator().manual_seed(seed))


LAYERS = [("softmax_topk", 0), ("sigmoid_bias", 4)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("metric", METRICS)
def test_rho_one_gives_the_full_gradient(metric, mode):
    layer = make_layer()
    x, d = batch()
    full, full_x, y_full, _ = gradients(layer, x, d)
    rec = recalibration(layer, x, metric, mode, 1.0)
    got, got_x, y, _ = gradients(layer, x, d, pair_hook=pair_hook(rec))
    assert torch.equal(y, y_full)  # identity in the forward
    assert bool(rec.keep_P.all()) and bool((rec.scale_P == 1).all())
    for name in full:
        torch.testing.assert_close(got[name], full[name], rtol=1e-12, atol=0, msg=name)
    torch.testing.assert_close(got_x, full_x, rtol=1e-12, atol=0)


@pytest.mark.parametrize("router, shared", LAYERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("metric", METRICS)
def test_rho_below_one_equals_the_reference_on_the_retained_pair_set(metric, mode, router, shared):
    layer = make_layer(router, shared)
    x, d = batch(1)
    full, _, _, _ = gradients(layer, x, d)
    rec = recalibration(layer, x, metric, mode, 0.5, seed=2)
    got, got_x, _, aux = gradients(layer, x, d, pair_hook=pair_hook(rec))
    want, want_x, _, _ = gradients(layer, x, d, keep_TK=rec.keep_P.view(T, K), scale_TK=rec.scale_P.view(T, K))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-15, msg=name)
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-15)
    # the selection really dropped something, and the router / shared expert gradients did not notice
    assert int(rec.keep_P.sum()) == int(rec.quota_Q.sum()) < T * K
    for name in ("w_router_ED",) + (("w_shared_gate_DF", "w_shared_up_DF", "w_shared_down_FD") if shared else ()):
        assert torch.equal(got[name], full[name]), name
    assert not torch.allclose(got["w_down_EFD"], full["w_down_EFD"])


def test_hook_scores_are_the_metric_of_the_true_output_gradient():
    """In the backward the hook sees grad_o = g·δ, so its m2 scores are g·‖δ_t‖·‖h‖ of the forward."""
    layer = make_layer()
    x, d = batch(2)
    rec = recalibration(layer, x, "m2", "topk", 0.5)
    _, _, _, aux = gradients(layer, x, d, pair_hook=pair_hook(rec))
    g_P = aux.gate_TK.detach().reshape(-1)
    grad_o = g_P[:, None] * d.repeat_interleave(K, dim=0)
    torch.testing.assert_close(rec.scores_P, pair_scores("m2", grad_o, h_norm_P=aux.h_norm_TK.reshape(-1)))


def test_a_group_with_zero_quota_contributes_nothing_to_its_expert_or_its_tokens_inputs():
    layer = make_layer()
    x, d = batch(3)
    rec = recalibration(layer, x, "m1", "topk", 1.0)
    expert = int(torch.argmax(torch.bincount(rec.group_P % E, minlength=E)))
    rec.quota_Q[torch.arange(SOURCES) * E + expert] = 0  # drop every pair of one expert
    got, got_x, _, aux = gradients(layer, x, d, pair_hook=pair_hook(rec))
    for name in EXPERT_WEIGHTS:
        assert bool((got[name][expert] == 0).all()), name
    # the input gradient equals the reference with exactly those pairs dropped
    keep = aux.idx_TK != expert
    _, want_x, _, _ = gradients(layer, x, d, keep_TK=keep)
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_quotas_are_exact_for_every_group_in_every_draw(mode):
    layer = make_layer()
    x, d = batch(4)
    rec = recalibration(layer, x, "m3", mode, 0.7, seed=5)
    x = x.clone().requires_grad_()
    y, _ = layer(x, pair_hook=pair_hook(rec))
    for draw in range(20):
        y.backward(d, retain_graph=True)
        kept_Q = torch.bincount(rec.group_P[rec.keep_P], minlength=rec.quota_Q.numel())
        assert torch.equal(kept_Q, rec.quota_Q)
    assert rec.num_backward == 20


def flat_gradient(layer, y, x, d):
    """Expert weight gradients and the input gradient, concatenated, for one backward of a retained graph."""
    params = [getattr(layer, n) for n in EXPERT_WEIGHTS]
    grads = torch.autograd.grad(y, params + [x], grad_outputs=d, retain_graph=True)
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("metric", ["m2", "random"])
def test_unbiased_mean_over_draws_converges_to_the_full_gradient_as_one_over_sqrt_draws(metric):
    layer = make_layer()
    x, d = batch(5, tokens=32)
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    full = flat_gradient(layer, y, x, d)
    rec = recalibration(layer, x.detach(), metric, "unbiased", 0.5, seed=6)
    y, _ = layer(x, pair_hook=pair_hook(rec))
    draws = [8, 32, 128, 512]
    total, errors = torch.zeros_like(full), []
    for n in range(1, draws[-1] + 1):
        total += flat_gradient(layer, y, x, d)
        if n in draws:
            errors.append(float((total / n - full).norm() / full.norm()))
    slope = torch.linalg.lstsq(torch.tensor([[math.log(n), 1.0] for n in draws]),
                               torch.tensor(errors).log()[:, None]).solution[0, 0]
    assert -0.7 < float(slope) < -0.3, (errors, float(slope))
    assert errors[-1] < errors[0] / 4


def test_biased_selection_does_not_converge():
    """Control: the top-quota mode is deterministic and keeps its bias however many draws are averaged."""
    layer = make_layer()
    x, d = batch(5, tokens=32)
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    full = flat_gradient(layer, y, x, d)
    rec = recalibration(layer, x.detach(), "m2", "topk", 0.5)
    y, _ = layer(x, pair_hook=pair_hook(rec))
    one = flat_gradient(layer, y, x, d)
    assert torch.equal(one, flat_gradient(layer, y, x, d))
    assert float((one - full).norm() / full.norm()) > 0.05


def test_score_and_select_random_unbiased_uses_equal_probabilities():
    rec = Recalibration("random", "unbiased", torch.tensor([0, 0, 0, 0, 1, 1]), torch.tensor([1, 1]),
                        torch.Generator().manual_seed(0))
    _, sel = score_and_select(rec, torch.randn(6, 3))
    torch.testing.assert_close(sel.prob_P, torch.tensor([0.25] * 4 + [0.5] * 2))


def test_pair_groups_hand_example():
    # 4 tokens, k = 2, 3 experts, 2 source ranks: tokens 0-1 on rank 0, tokens 2-3 on rank 1
    idx_TK = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 2]])
    group_P, counts_Q = pair_groups(idx_TK, num_experts=3, num_sources=2)
    assert group_P.tolist() == [0, 2, 2, 1, 4, 3, 5, 5]
    assert counts_Q.tolist() == [1, 1, 2, 1, 1, 2]


@pytest.mark.parametrize("rho", [0.0, 0.33, 0.5, 0.85, 1.0])
def test_proportional_quotas_total_and_bounds(rho):
    counts = torch.tensor([0, 1, 2, 3, 7, 10, 13])
    quotas = proportional_quotas(counts, rho)
    exact = counts.double() * rho
    floor_one = torch.minimum(counts, torch.tensor(1 if rho > 0 else 0))  # every group with pairs keeps one
    assert bool((quotas >= torch.maximum(exact.floor().long(), floor_one)).all())
    assert bool((quotas <= torch.maximum(exact.ceil().long(), floor_one)).all())
    rounded = math.floor(float(exact.sum()) + 0.5)
    assert rounded <= int(quotas.sum()) <= rounded + int((counts > 0).sum())
    if rho == 1.0:
        assert torch.equal(quotas, counts)


@pytest.mark.parametrize("call, message", [
    (lambda: proportional_quotas(torch.tensor([1, 2]), 1.5), "rho"),
    (lambda: Recalibration("m9", "topk", torch.zeros(2, dtype=torch.long), torch.ones(1, dtype=torch.long)), "metric"),
    (lambda: Recalibration("m1", "fair", torch.zeros(2, dtype=torch.long), torch.ones(1, dtype=torch.long)), "mode"),
    (lambda: recalibrate(torch.zeros(3, 4), Recalibration("m1", "topk", torch.zeros(2, dtype=torch.long),
                                                          torch.ones(1, dtype=torch.long))), "group_P"),
    (lambda: recalibrate(torch.zeros(2, 4), Recalibration("m2", "topk", torch.zeros(2, dtype=torch.long),
                                                          torch.ones(1, dtype=torch.long))), "h_norm_P"),
    (lambda: pair_groups(torch.zeros(3, dtype=torch.long), 4), "idx_TK"),
    (lambda: Recalibration("m1", "topk", torch.tensor([0, 3]), torch.ones(2, dtype=torch.long)), "group_P values"),
    (lambda: Recalibration("m1", "topk", torch.tensor([0, 1]), torch.tensor([1, -1])), "non-negative"),
    (lambda: Recalibration("m1", "topk", torch.tensor([0, 1]), torch.tensor([1.0, 1.0])), "quota_Q"),
])
def test_bad_input_raises_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- the fidelity harness ----------------------------------------------------------------------------------------



def test_metric_fidelity_quick_run(tmp_path):
    """At ρ = 1 the harness must measure no error at all; at ρ = 0.5 on heavy-tailed token gradients the
    gradient-norm metric must beat random in the biased mode (a large, robust effect)."""
    from lrmoe.results import read_results

    fidelity = load_experiment("metric_fidelity")
    out = tmp_path / "fidelity.jsonl"
    fidelity.main(["--quick", "--no-wandb", "--out", str(out), "--presets", "qwen3-30b-a3b-debug",
                   "--data", "heavy", "--rhos", "0.5", "1.0"])
    records = read_results(out)
    assert len(records) == len(METRICS) * len(MODES) * 2
    for rec in records:
        if rec["rho"] == 1.0:
            assert rec["rel_w_all"] < 1e-6 and rec["rel_x"] < 1e-6 and rec["cos_w_min"] > 1 - 1e-6, rec
    half = {(r["metric"], r["mode"]): r for r in records if r["rho"] == 0.5}
    assert half["m2", "topk"]["rel_w_all"] < 0.5 * half["random", "topk"]["rel_w_all"]
    assert (tmp_path / "fidelity_fidelity.png").exists() and (tmp_path / "fidelity_fidelity.pdf").exists()


def test_bench_scoring_quick_run(tmp_path):
    from lrmoe.results import read_results

    bench = load_experiment("bench_scoring")
    out = tmp_path / "bench.jsonl"
    bench.main(["--quick", "--no-wandb", "--out", str(out)])
    records = read_results(out)
    assert {(r["metric"], r["mode"]) for r in records} == {(m, mode) for m in METRICS for mode in MODES}
    assert all(r["select_ms"] > 0 and r["score_ms"] >= 0 and r["width"] == 64 for r in records)
