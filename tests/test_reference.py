"""The reference MoE layer: outputs against a dense formula, gradients on a retained pair set against a
pair-by-pair oracle, weight exchange in the shared layout."""

import pytest
import torch
import torch.nn.functional as F

from lrmoe.config import model_preset
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.runtime.routing import route

D, FFN, E, K, T = 8, 6, 5, 2, 7


def make_layer(router="softmax_topk", shared=0, seed=0):
    layer = ReferenceMoE(D, FFN, E, K, router, shared_ffn=shared, routed_scaling=1.5 if router == "sigmoid_bias"
                         else 1.0, seed=seed, dtype=torch.float64)
    if router == "sigmoid_bias":
        layer.bias_E.copy_(torch.linspace(-0.3, 0.3, E))  # a selection bias that matters
    return layer


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, D, generator=gen, dtype=torch.float64),
            torch.randn(T, D, generator=gen, dtype=torch.float64))  # x, upstream gradient d = ∂L/∂y


LAYERS = [("softmax_topk", 0), ("sigmoid_bias", 0), ("sigmoid_bias", 4)]


def dense_forward(layer, x):
    """Every expert on every token (einsum), then the chosen ones gathered: a second way to the same y."""
    w = layer.export_weights()
    logits = x @ w["w_router_ED"].T
    if layer.router == "softmax_topk":
        p = torch.softmax(logits.float(), -1)
        top, idx = p.topk(K, -1)
        gate = top / top.sum(-1, keepdim=True)
    else:
        s = torch.sigmoid(logits.float())
        idx = (s + w["bias_E"]).topk(K, -1).indices
        chosen = s.gather(1, idx)
        gate = chosen / chosen.sum(-1, keepdim=True) * layer.routed_scaling
    h_TEF = F.silu(torch.einsum("td,edf->tef", x, w["w_gate_EDF"])) * torch.einsum("td,edf->tef", x, w["w_up_EDF"])
    o_TED = torch.einsum("tef,efd->ted", h_TEF, w["w_down_EFD"])
    o_TKD = o_TED.gather(1, idx[..., None].expand(-1, -1, D))
    y = (gate.to(x.dtype)[..., None] * o_TKD).sum(1)
    if layer.shared_ffn:
        y = y + (F.silu(x @ w["w_shared_gate_DF"]) * (x @ w["w_shared_up_DF"])) @ w["w_shared_down_FD"]
    return y, idx, h_TEF.gather(1, idx[..., None].expand(-1, -1, FFN)).norm(dim=-1), o_TKD


@pytest.mark.parametrize("router, shared", LAYERS)
def test_forward_matches_dense_formula(router, shared):
    layer = make_layer(router, shared)
    x, _ = batch()
    y, aux = layer(x)
    y_ref, idx_ref, h_norm_ref, o_ref = dense_forward(layer, x)
    assert torch.equal(aux.idx_TK, idx_ref)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(aux.h_norm_TK, h_norm_ref)
    torch.testing.assert_close(aux.o_TKD, o_ref)
    assert torch.equal(aux.counts_E, torch.bincount(idx_ref.reshape(-1), minlength=E))


def test_sigmoid_bias_steers_selection_only():
    layer = make_layer("sigmoid_bias")
    layer.bias_E.zero_()
    layer.bias_E[3] = 10.0  # expert 3 is chosen by every token, its gate still comes from its sigmoid score
    x, _ = batch()
    _, aux = layer(x)
    assert bool((aux.idx_TK == 3).any(dim=1).all())
    chosen = aux.scores_TE.gather(1, aux.idx_TK)
    torch.testing.assert_close(aux.gate_TK, (chosen / chosen.sum(1, keepdim=True) * 1.5).double())


def pair_by_pair_gradients(layer, x, d, weight_TK):
    """The gradients of L = ⟨d, y⟩ built pair by pair: expert weights and x through the experts from each pair's
    own SwiGLU term times weight = keep·scale; router and shared-expert parts from every pair, unweighted."""
    w = {k: v.clone() for k, v in layer.export_weights().items()}
    grads = {k: torch.zeros_like(v) for k, v in w.items() if k != "bias_E"}
    gx = torch.zeros_like(x)
    with torch.no_grad():
        _, aux = layer(x)
    for t in range(T):
        for j in range(K):
            e, g = int(aux.idx_TK[t, j]), aux.gate_TK[t, j].detach()
            wg, wu, wd = (w[n][e].clone().requires_grad_() for n in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"))
            xt = x[t].clone().requires_grad_()
            term = g * (d[t] * ((F.silu(xt @ wg) * (xt @ wu)) @ wd)).sum()
            dg, du, dd, dx = torch.autograd.grad(term, (wg, wu, wd, xt))
            m = weight_TK[t, j]
            grads["w_gate_EDF"][e] += m * dg
            grads["w_up_EDF"][e] += m * du
            grads["w_down_EFD"][e] += m * dd
            gx[t] += m * dx
    # router path: Σ_p g_p(x, W_router) · ⟨d_t, o_p⟩ with o held fixed
    xr, wr = x.clone().requires_grad_(), w["w_router_ED"].clone().requires_grad_()
    bias = w["bias_E"] if layer.router == "sigmoid_bias" else None
    gate = route(xr @ wr.T, layer.router, K, bias, layer.routed_scaling).weight_TK.to(x.dtype)
    dot_TK = (d[:, None, :] * aux.o_TKD).sum(-1)
    drx, drw = torch.autograd.grad((gate * dot_TK).sum(), (xr, wr))
    gx += drx
    grads["w_router_ED"] = drw
    if layer.shared_ffn:
        names = ("w_shared_gate_DF", "w_shared_up_DF", "w_shared_down_FD")
        xs = x.clone().requires_grad_()
        ws = [w[n].clone().requires_grad_() for n in names]
        out = (d * ((F.silu(xs @ ws[0]) * (xs @ ws[1])) @ ws[2])).sum()
        *dws, dxs = torch.autograd.grad(out, (*ws, xs))
        grads.update(zip(names, dws))
        gx += dxs
    return grads, gx


def layer_gradients(layer, x, d, **kwargs):
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y, _ = layer(x, **kwargs)
    (y * d).sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}, x.grad, y.detach()


@pytest.mark.parametrize("router, shared", LAYERS)
def test_gradients_on_a_retained_pair_set_match_the_pair_by_pair_oracle(router, shared):
    layer = make_layer(router, shared)
    x, d = batch(1)
    gen = torch.Generator().manual_seed(3)
    keep = torch.rand(T, K, generator=gen) < 0.6
    scale = 1.0 + 2.0 * torch.rand(T, K, generator=gen, dtype=torch.float64)
    grads, gx, y = layer_gradients(layer, x, d, keep_TK=keep, scale_TK=scale)
    want, want_x = pair_by_pair_gradients(layer, x, d, keep.double() * scale)
    assert set(grads) == set(want)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-9, msg=name)
    torch.testing.assert_close(gx, want_x, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(y, layer(x)[0].detach(), rtol=0, atol=0)  # the mask never changes the value


@pytest.mark.parametrize("router, shared", LAYERS)
def test_full_gradient_matches_the_oracle_and_keeping_everything_changes_nothing(router, shared):
    layer = make_layer(router, shared)
    x, d = batch(2)
    full, full_x, _ = layer_gradients(layer, x, d)
    want, want_x = pair_by_pair_gradients(layer, x, d, torch.ones(T, K, dtype=torch.float64))
    for name in want:
        torch.testing.assert_close(full[name], want[name], rtol=1e-5, atol=1e-9, msg=name)
    torch.testing.assert_close(full_x, want_x, rtol=1e-5, atol=1e-9)
    kept, kept_x, _ = layer_gradients(layer, x, d, keep_TK=torch.ones(T, K, dtype=torch.bool))
    for name in full:
        torch.testing.assert_close(kept[name], full[name], rtol=1e-12, atol=0, msg=name)
    torch.testing.assert_close(kept_x, full_x, rtol=1e-12, atol=0)


def test_dropping_every_pair_leaves_router_and_shared_gradients_exact():
    layer = make_layer("sigmoid_bias", 4)
    x, d = batch(3)
    full, _, _ = layer_gradients(layer, x, d)
    none, _, _ = layer_gradients(layer, x, d, keep_TK=torch.zeros(T, K, dtype=torch.bool))
    for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
        assert bool((none[name] == 0).all()), name
    for name in ("w_router_ED", "w_shared_gate_DF", "w_shared_up_DF", "w_shared_down_FD"):
        assert torch.equal(none[name], full[name]), name


# --- construction and weight exchange -----------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["qwen3-30b-a3b-debug", "glm-4.5-air-debug"])
def test_from_config_and_weight_round_trip(preset):
    cfg = model_preset(preset)
    a = ReferenceMoE.from_config(cfg, seed=4)
    weights = a.export_weights()
    assert weights["w_gate_EDF"].shape == (cfg.num_experts, cfg.hidden, cfg.expert_ffn)
    assert weights["w_down_EFD"].shape == (cfg.num_experts, cfg.expert_ffn, cfg.hidden)
    assert weights["w_router_ED"].shape == (cfg.num_experts, cfg.hidden)
    assert ("w_shared_gate_DF" in weights) == bool(cfg.num_shared_experts)
    assert a.router == cfg.router and a.top_k == cfg.top_k
    b = ReferenceMoE.from_config(cfg, seed=5)
    x = torch.randn(9, cfg.hidden)
    assert not torch.equal(a(x)[0], b(x)[0])
    b.load_weights(weights)
    assert torch.equal(a(x)[0], b(x)[0])


def test_same_seed_same_weights_at_every_precision():
    a = ReferenceMoE(D, FFN, E, K, seed=9, dtype=torch.float32).export_weights()
    b = ReferenceMoE(D, FFN, E, K, seed=9, dtype=torch.float64).export_weights()
    for name in a:
        assert torch.equal(a[name], b[name].float()), name


@pytest.mark.parametrize("call, message", [
    (lambda m: m.load_weights({"w_router_ED": torch.zeros(E, D)}), "expected keys"),
    (lambda m: m.load_weights({**m.export_weights(), "w_up_EDF": torch.zeros(E, FFN, D)}), "w_up_EDF"),
    (lambda m: m(torch.zeros(3, D + 1)), "x_TD"),
    (lambda m: m(torch.zeros(3, D), keep_TK=torch.ones(3, K + 1, dtype=torch.bool)), "keep_TK"),
    (lambda m: m(torch.zeros(3, D), keep_TK=torch.ones(3, K, dtype=torch.bool), pair_hook=lambda o, a: o), "not both"),
    (lambda m: ReferenceMoE(D, FFN, E, E + 1), "top_k"),
    (lambda m: ReferenceMoE(D, FFN, E, K, "softmax"), "router"),
])
def test_bad_input_raises_value_error_naming_it(call, message):
    with pytest.raises(ValueError, match=message):
        call(ReferenceMoE(D, FFN, E, K))
