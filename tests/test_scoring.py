"""Recalibration metrics: hand values, the two entry points agree, and each metric means what it claims."""

import pytest
import torch

from lrmoe.reference import ReferenceMoE
from lrmoe.scoring import METRICS, pair_scores, scores_from_parts


def test_hand_values():
    # one pair: g = 0.5, δ = (3, 4) so ‖δ‖ = 5, o = (-1, 0) so ⟨δ, o⟩ = -3, ‖h‖ = 2
    g, delta, o = torch.tensor([0.5]), torch.tensor([[3.0, 4.0]]), torch.tensor([[-1.0, 0.0]])
    h_norm = torch.tensor([2.0])
    grad_o = g[:, None] * delta
    got = {m: float(pair_scores(m, grad_o, o_PD=o, h_norm_P=h_norm, gate_P=g)) for m in ("m1", "m2", "m3", "gate")}
    assert got == {"m1": 2.5, "m2": 5.0, "m3": 1.5, "gate": 0.5}


@pytest.mark.parametrize("metric", METRICS)
def test_gradient_and_parts_entry_points_agree(metric):
    """grad_o = g·δ_t holds everything; the parts are per-token ‖δ‖ and per-pair g, ‖h‖, ⟨δ, o⟩."""
    gen = torch.Generator().manual_seed(0)
    T, K, D = 12, 3, 8
    delta_TD = torch.randn(T, D, generator=gen, dtype=torch.float64)
    gate_P = torch.rand(T * K, generator=gen, dtype=torch.float64)
    o_PD = torch.randn(T * K, D, generator=gen, dtype=torch.float64)
    h_norm_P = torch.rand(T * K, generator=gen, dtype=torch.float64) * 3
    delta_PD = delta_TD.repeat_interleave(K, dim=0)  # pair p = t·K + j
    from_grad = pair_scores(metric, gate_P[:, None] * delta_PD, o_PD=o_PD, h_norm_P=h_norm_P, gate_P=gate_P,
                            generator=torch.Generator().manual_seed(5))
    from_parts = scores_from_parts(metric, gate_P, delta_norm_P=delta_TD.norm(dim=1).repeat_interleave(K),
                                   h_norm_P=h_norm_P, delta_dot_o_P=(delta_PD * o_PD).sum(1),
                                   generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(from_grad, from_parts)
    assert bool((from_grad >= 0).all())


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


def test_random_is_seeded_uniform_and_upcasts_low_precision():
    grad = torch.randn(1000, 4).to(torch.bfloat16)
    a = pair_scores("random", grad, generator=torch.Generator().manual_seed(1))
    b = pair_scores("random", grad, generator=torch.Generator().manual_seed(1))
    c = pair_scores("random", grad, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float32 and float(a.min()) >= 0 and float(a.max()) < 1
    assert abs(float(a.mean()) - 0.5) < 0.05
    assert pair_scores("m1", grad).dtype == torch.float32


@pytest.mark.parametrize("call, message", [
    (lambda: pair_scores("m4", torch.ones(2, 3)), "metric"),
    (lambda: pair_scores("m2", torch.ones(2, 3)), "h_norm_P"),
    (lambda: pair_scores("m3", torch.ones(2, 3)), "o_PD"),
    (lambda: pair_scores("gate", torch.ones(2, 3)), "gate_P"),
    (lambda: pair_scores("gate", torch.ones(2, 3), gate_P=torch.ones(3)), "gate_P must have shape"),
    (lambda: pair_scores("m1", torch.ones(3)), "grad_o_PD"),
    (lambda: scores_from_parts("m1", torch.ones(2)), "delta_norm_P"),
    (lambda: scores_from_parts("m3", torch.ones(2), delta_dot_o_P=torch.ones(4)), "delta_dot_o_P"),
])
def test_bad_input_raises_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call()
