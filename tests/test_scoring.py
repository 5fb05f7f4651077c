"""Recalibration metrics as objects: hand values, each metric means what it claims, declares exactly what it
reads, scores on the device of its data, and a new metric plugs into the hook without touching anything else."""

import pytest
import torch

from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.recal.recalibrate import Recalibration, pair_hook, score_and_select
from lrmoe.recal.scoring import METRIC_REGISTRY, METRICS, NEEDS, Metric, PairParts, get_metric, pair_scores


def test_hand_values():
    # one pair: g = 0.5, δ = (3, 4) so ‖δ‖ = 5, o = (-1, 0) so ⟨δ, o⟩ = -3, ‖h‖ = 2
    g, delta, o = torch.tensor([0.5]), torch.tensor([[3.0, 4.0]]), torch.tensor([[-1.0, 0.0]])
    h_norm = torch.tensor([2.0])
    grad_o = g[:, None] * delta
    got = {m: float(pair_scores(m, grad_o, o_PD=o, h_norm_P=h_norm, gate_P=g)) for m in ("m1", "m2", "m3", "gate")}
    assert got == {"m1": 2.5, "m2": 5.0, "m3": 1.5, "gate": 0.5}


def test_m2_is_the_norm_of_the_pairs_down_projection_gradient_term():
    """The pair's term in dW_down is hᵀ(g·δ); its Frobenius norm is g·‖δ‖·‖h‖."""
    gen = torch.Generator().manual_seed(1)
    h_PF = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    grad_o_PD = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    terms = torch.stack([torch.outer(h_PF[p], grad_o_PD[p]).norm() for p in range(5)])
    torch.testing.assert_close(pair_scores("m2", grad_o_PD, h_norm_P=h_PF.norm(dim=1)), terms)


def test_m3_is_the_loss_change_of_removing_the_pair_under_a_linear_loss():
    """With L = ⟨d, y⟩ the loss is linear in each pair's contribution g·o, so removing pair p changes L by
    exactly g·⟨δ, o⟩ (δ = d): m3 is its magnitude."""
    layer = ReferenceMoE(8, 6, 4, 2, seed=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    d = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y, aux = layer(x)
    T, K = aux.idx_TK.shape
    contrib_TKD = aux.gate_TK[..., None] * aux.o_TKD
    change = torch.stack([(d[t] * contrib_TKD[t, j]).sum() for t in range(T) for j in range(K)])
    grad_o = (aux.gate_TK[..., None] * d[:, None, :]).reshape(T * K, -1)
    torch.testing.assert_close(pair_scores("m3", grad_o, o_PD=aux.o_TKD.reshape(T * K, -1)), change.abs())


def parts(num_pairs=40, width=6, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.rand(num_pairs, generator=gen, dtype=dtype)
    return PairParts(grad_o_MD=(gate[:, None] * torch.randn(num_pairs, width, generator=gen, dtype=dtype)).to(device),
                     o_MD=torch.randn(num_pairs, width, generator=gen, dtype=dtype).to(device),
                     h_norm_M=(torch.rand(num_pairs, generator=gen, dtype=dtype) * 3).to(device),
                     gate_M=gate.to(device))


def only(p: PairParts, needs) -> PairParts:
    """The parts with everything the metric does not declare removed."""
    return PairParts(p.grad_o_MD, **{NEEDS[n]: getattr(p, NEEDS[n]) for n in needs})


def test_registry_names_order_and_declarations():
    assert METRICS == ("m1", "m2", "m3", "gate", "random") == tuple(METRIC_REGISTRY)
    declared = {m: (get_metric(m).needs, get_metric(m).combine_cols, get_metric(m).save_output) for m in METRICS}
    assert declared == {"m1": (frozenset(), 0, False), "m2": (frozenset({"h_norm"}), 1, False),
                        "m3": (frozenset({"o"}), 0, True), "gate": (frozenset({"gate"}), 0, False),
                        "random": (frozenset(), 0, False)}
    for name, metric in METRIC_REGISTRY.items():
        assert isinstance(metric, Metric) and metric.name == name and get_metric(metric) is metric


@pytest.mark.parametrize("mode", ["topk", "unbiased"])
@pytest.mark.parametrize("metric", METRICS)
def test_a_metric_reads_only_what_it_declares(metric, mode):
    """Scores from the declared parts alone equal the scores from all parts; each declared part is refused
    when missing, naming it."""
    m, full = get_metric(metric), parts()
    a = m.score(full, torch.Generator().manual_seed(3), mode)
    b = m.score(only(full, m.needs), torch.Generator().manual_seed(3), mode)
    assert torch.equal(a, b) and a.shape == (40,) and a.dtype == torch.float64 and bool((a >= 0).all())
    for need in m.needs:
        with pytest.raises(ValueError, match=f"needs {need}"):
            m.score(only(full, m.needs - {need}), None, mode)


def test_pair_scores_is_the_metric_objects_top_k_score():
    p = parts()
    for metric in METRICS:
        got = pair_scores(metric, p.grad_o_MD, o_PD=p.o_MD, h_norm_P=p.h_norm_M, gate_P=p.gate_M,
                          generator=torch.Generator().manual_seed(1))
        assert torch.equal(got, get_metric(metric).score(p, torch.Generator().manual_seed(1), "topk"))


def test_random_draws_torch_rand_from_the_generator_and_upcasts_low_precision():
    grad = torch.randn(1000, 4).to(torch.bfloat16)
    a = pair_scores("random", grad, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, torch.rand(1000, generator=torch.Generator().manual_seed(1)))  # the draw of old
    c = pair_scores("random", grad, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(a, c)
    assert a.dtype == torch.float32 and float(a.min()) >= 0 and float(a.max()) < 1
    assert abs(float(a.mean()) - 0.5) < 0.05
    assert pair_scores("m1", grad).dtype == torch.float32
    wide = pair_scores("random", grad.double(), generator=torch.Generator().manual_seed(1))
    assert torch.equal(wide, torch.rand(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64))


def test_random_unbiased_is_equal_scores_and_draws_nothing():
    gen = torch.Generator().manual_seed(4)
    state = gen.get_state()
    scores = get_metric("random").score(parts(), gen, "unbiased")
    assert torch.equal(scores, torch.ones(40, dtype=torch.float64))
    assert torch.equal(gen.get_state(), state)


class GateTimesNorm(Metric):
    """A metric the library does not know: g²·‖δ‖, from grad_o and the gate."""

    name, needs = "g2norm", frozenset({"gate"})

    def compute(self, parts, dtype, generator, mode):
        return parts.gate_M.to(dtype) * torch.linalg.vector_norm(parts.grad_o_MD.to(dtype), dim=1)


def test_a_new_metric_plugs_into_the_hook_unchanged():
    """A subclass with ``needs`` and ``compute`` is enough: Recalibration, score_and_select and the autograd
    hook run it, and it selects the pairs its scores rank highest."""
    metric = GateTimesNorm()
    assert (metric.combine_cols, metric.save_output) == (0, False)
    p = parts(8, 3)
    rec = Recalibration(metric, "topk", torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor([2, 1]))
    scores, sel = score_and_select(rec, p.grad_o_MD, gate_P=p.gate_M)
    want = p.gate_M * p.gate_M * torch.linalg.vector_norm(p.grad_o_MD / p.gate_M[:, None], dim=1)
    torch.testing.assert_close(scores, want)
    assert sel.keep_P[:4].sum() == 2 and sel.keep_P[4:].sum() == 1
    assert bool(scores[:4][sel.keep_P[:4]].min() >= scores[:4][~sel.keep_P[:4]].max())
    # through the reference layer's hook (rho = 1: every pair kept, the gradient exact)
    layer = ReferenceMoE(8, 6, 4, 2, seed=3, dtype=torch.float64)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    _, aux = layer(x)
    rec = Recalibration(metric, "topk", torch.zeros(10, dtype=torch.long), torch.tensor([10]))
    y, _ = layer(x, pair_hook=pair_hook(rec))
    y.sum().backward()
    assert rec.num_backward == 1 and bool(rec.keep_P.all())
    gate = aux.gate_TK.reshape(-1)  # L = Σ y: δ = 1, so grad_o = g·1 and the score is g²·√D
    torch.testing.assert_close(rec.scores_P, gate * gate * 8 ** 0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("metric", METRICS)
def test_scores_on_the_gpu_without_host_sync_and_random_picks_the_cpus_pairs(metric):
    cpu, gpu = parts(dtype=torch.float32), parts(dtype=torch.float32, device="cuda")
    m = get_metric(metric)
    want = m.score(cpu, torch.Generator().manual_seed(7))
    if metric != "random":  # random draws on its CPU generator and moves the draw
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = m.score(gpu, torch.Generator().manual_seed(7))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.device.type == "cuda"
    if metric == "random":
        assert torch.equal(got.cpu(), want)
    else:
        torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("call, message", [
    (lambda: get_metric("m4"), r"metric='m4' is not one of \('m1', 'm2', 'm3', 'gate', 'random'\)"),
    (lambda: pair_scores("m4", torch.ones(2, 3)), "metric"),
    (lambda: pair_scores("m2", torch.ones(2, 3)), "h_norm_M"),
    (lambda: pair_scores("m3", torch.ones(2, 3)), "o_MD"),
    (lambda: pair_scores("gate", torch.ones(2, 3)), "gate_M"),
    (lambda: pair_scores("gate", torch.ones(2, 3), gate_P=torch.ones(3)), r"gate_M must have shape \(2,\)"),
    (lambda: pair_scores("m3", torch.ones(2, 3), o_PD=torch.ones(2, 4)), r"o_MD must have shape \(2, 3\)"),
    (lambda: pair_scores("m1", torch.ones(3)), "grad_o_MD must be 2-D"),
    (lambda: get_metric("m1").score(PairParts(torch.ones(2, 3)), None, "fair"), "mode"),
    (lambda: get_metric("m2").score(PairParts(torch.ones(2, 3), h_norm_M=torch.ones(2, device="meta")), None),
     "one device"),
])
def test_bad_input_raises_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()
