"""Routers against hand-computed small cases; the aux loss and the aux-free bias update."""

import math

import pytest
import torch

from lrmoe.runtime.routing import expert_counts, load_balancing_loss, route, update_expert_bias


def test_softmax_topk_hand_case():
    # logits of one token over 4 experts: softmax = [e^2, e^1, e^0, e^0] / Z; top-2 = experts 0, 1
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    out = route(logits, "softmax_topk", 2)
    assert out.idx_TK.tolist() == [[0, 1]]
    e = math.e
    assert out.weight_TK[0].tolist() == pytest.approx([e**2 / (e**2 + e), e / (e**2 + e)])
    assert out.scores_TE.sum().item() == pytest.approx(1.0)


def test_sigmoid_bias_selects_on_score_plus_bias_but_weights_ignore_bias():
    # scores sigmoid([0, 1, 2]) = [0.5, 0.731, 0.881]; a bias of +1 on expert 0 makes it beat expert 1
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    bias = torch.tensor([1.0, 0.0, 0.0])
    out = route(logits, "sigmoid_bias", 2, bias_E=bias, scaling=2.5)
    assert sorted(out.idx_TK[0].tolist()) == [0, 2]
    s0, s2 = 1 / (1 + math.exp(0)), 1 / (1 + math.exp(-2))
    weights = dict(zip(out.idx_TK[0].tolist(), out.weight_TK[0].tolist()))
    assert weights[0] == pytest.approx(2.5 * s0 / (s0 + s2)) and weights[2] == pytest.approx(2.5 * s2 / (s0 + s2))


def test_bias_gets_no_gradient_and_router_logits_do():
    logits = torch.randn(6, 8, requires_grad=True)
    bias = torch.zeros(8, requires_grad=True)
    out = route(logits, "sigmoid_bias", 2, bias_E=bias)
    out.weight_TK.sum().backward()
    assert bias.grad is None and logits.grad is not None


def test_router_rejects_bad_input():
    with pytest.raises(ValueError, match="top_k=5"):
        route(torch.randn(2, 4), "softmax_topk", 5)
    with pytest.raises(ValueError, match="unknown router family"):
        route(torch.randn(2, 4), "relu", 1)
    with pytest.raises(ValueError, match="bias_E must have shape"):
        route(torch.randn(2, 4), "sigmoid_bias", 1, bias_E=torch.zeros(3))


def test_load_balancing_loss_is_one_when_uniform_and_larger_when_skewed():
    scores = torch.full((8, 4), 0.25)
    assert load_balancing_loss(scores, torch.tensor([4, 4, 4, 4]), top_k=2).item() == pytest.approx(1.0)
    # all pairs on expert 0 while its probability is 1: E * f_0 * P_0 = 4 * 1 * 1
    skewed = torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 8)
    assert load_balancing_loss(skewed, torch.tensor([8, 0, 0, 0]), top_k=1).item() == pytest.approx(4.0)
    # global-batch form: counts of a larger batch with num_tokens
    assert load_balancing_loss(scores, torch.tensor([40, 40, 40, 40]), 2, num_tokens=80).item() == pytest.approx(1.0)


def test_aux_free_bias_update_moves_toward_mean_load():
    bias = torch.zeros(4)
    new = update_expert_bias(bias, torch.tensor([10, 2, 4, 4]), rate=0.01)  # mean 5
    assert new.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert expert_counts(torch.tensor([[0, 1], [1, 3]]), 4).tolist() == [1, 2, 0, 1]


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -1e-3])
def test_aux_free_bias_update_refuses_a_rate_that_is_not_finite_and_non_negative(rate):
    """A NaN or infinite rate made the bias NaN, which collapsed GLM's routing onto a few experts while the loss stayed
    finite; now it is refused."""
    with pytest.raises(ValueError, match="update rate must be a finite non-negative number"):
        update_expert_bias(torch.zeros(4), torch.tensor([10, 2, 4, 4]), rate=rate)


def test_aux_free_bias_update_refuses_a_bias_that_is_not_finite():
    """The bias buffer is state the gradient and activation checks never see: a non-finite entry (e.g. a loaded or
    edited buffer, or an update that overflowed) is named, before and after the update."""
    with pytest.raises(ValueError, match=r"not finite before the update \(experts \[2\] of 4\)"):
        update_expert_bias(torch.tensor([0.0, 0.0, float("nan"), 0.0]), torch.tensor([10, 2, 4, 4]), rate=1e-3)
    with pytest.raises(ValueError, match=r"not finite after an update at rate 1e\+308"):
        update_expert_bias(torch.full((4,), 3e38), torch.tensor([1, 9, 1, 1]), rate=1e308)
