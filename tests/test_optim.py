"""The step core (lrmoe.runtime.optim.ExpertParallelOptimizer) on gloo ranks, against torch on the single-process
reference layer (float32, D=8, F=5, E=8, top-2, 8 tokens per rank, a shared expert, GLM's biased router):

* with AdamW and weight decay, clipping, a LambdaLR schedule and GLM's bias update, three steps train the
  expert-parallel layer exactly as torch's AdamW, ``clip_grad_norm_`` and the same LambdaLR train the reference on
  the whole batch: the schedule's rate reaches the experts' Adam, the decay is AdamW's;
* the parts run in their order (dense sync, clip, dense step, expert step, bias update), seen from torch's own
  step hooks on the dense optimizer and on the core; a non-finite gradient stops the step before anything moves;
* one step issues exactly one all-reduce of the dense gradients, micro-batches or not;
* the experts' Adam is torch's Adam or AdamW with decay, bit for bit, and takes its settings from the dense
  optimizer's.
"""

import pytest
import torch
import torch.distributed as dist

from lrmoe.planner.policies import Symi
from lrmoe.runtime.dense_sync import NonFiniteError
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, adam_update_, flatten_experts
from lrmoe.runtime.layer import EPMoELayer, initial_placement
from lrmoe.runtime.optim import ExpertParallelOptimizer, dense_hyperparameters
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.runtime.routing import update_expert_bias

D, F, E, K, T = 8, 5, 8, 2, 8
LR, WD, MAX_NORM, BIAS_RATE = 1e-2, 0.1, 0.5, 0.01
FACTORS = [0.5, 1.0, 0.25]  # the LambdaLR's factor of each step
# Adam moves a weight by about lr where its gradient is not near zero: the ranks' other summation order moves it by
# far less than 1 % of a step
CLOSE = dict(rtol=1e-4, atol=LR / 100)


def _reference() -> ReferenceMoE:
    ref = ReferenceMoE(D, F, E, K, "sigmoid_bias", shared_ffn=4, seed=3, dtype=torch.float32)
    with torch.no_grad():
        ref.bias_E.copy_(torch.linspace(-0.2, 0.2, E))
    return ref


def _layer(ref: ReferenceMoE) -> EPMoELayer:
    world = dist.get_world_size()
    policy = Symi(slots_per_rank=6, cf=None)  # replicas that follow the counts: redistribution at every step
    return EPMoELayer(ref.export_weights(), K, "sigmoid_bias", policy, initial_placement(policy, world, E),
                      RangeGroups(), adam=AdamConfig(lr=1.0))  # lr, decay: the core's, from the dense AdamW


def _core(layer: EPMoELayer, **kw) -> ExpertParallelOptimizer:
    dense = torch.optim.AdamW(layer.dense_parameters(), lr=LR, weight_decay=WD, foreach=False)
    return ExpertParallelOptimizer(dense, [layer], biases=[layer.bias_E], bias_rate=BIAS_RATE, **kw)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    world = dist.get_world_size()
    return torch.randn(world * T, D, generator=g), torch.randn(world * T, D, generator=g)


def _against_torch(rank: int) -> dict:
    world = dist.get_world_size()
    ref = _reference()
    layer = _layer(ref)
    opt = _core(layer, max_grad_norm=MAX_NORM)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: FACTORS[min(s, 2)])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: FACTORS[min(s, 2)])
    mine = slice(rank * T, (rank + 1) * T)
    norms, lrs = [], []
    for step in range(len(FACTORS)):
        x, w = _batch(step)
        y, _ = layer(x[mine])
        (y * w[mine]).sum().backward()
        y_ref, aux = ref(x)
        ((y_ref * w).sum() / world).backward()  # the mean loss over ranks: the core's default
        torch.testing.assert_close(y, y_ref[mine].detach(), rtol=1e-5, atol=1e-6)
        opt.step()
        lrs.append(layer.store.adam.lr)  # the rate the experts' Adam ran this step at
        opt.zero_grad()
        sched.step()
        norms.append((float(opt.last_grad_norm), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        with torch.no_grad():  # GLM's bias from the step's global counts
            ref.bias_E.copy_(update_expert_bias(ref.bias_E, aux.counts_E, BIAS_RATE))
    want = flatten_experts(ref.w_gate_EDF.detach(), ref.w_up_EDF.detach(), ref.w_down_EFD.detach())
    torch.testing.assert_close(layer.store.full_master(), want, **CLOSE)
    for p, q in zip(layer.dense_parameters(), [ref.w_router_ED, ref.w_shared_gate_DF, ref.w_shared_up_DF,
                                               ref.w_shared_down_FD]):
        torch.testing.assert_close(p.detach(), q.detach(), **CLOSE)
    assert torch.equal(layer.bias_E, ref.bias_E.to(layer.bias_E))
    adam = layer.store.adam
    return {"norms": norms, "lrs": lrs, "decay": (adam.weight_decay, adam.decoupled)}


def test_the_step_core_trains_as_torch_adamw_clip_and_lambdalr_on_the_reference():
    for out in launch(_against_torch, 2, timeout_s=120):
        assert out["lrs"] == [LR * f for f in FACTORS]  # the scheduler reached the experts' Adam every step
        assert out["decay"] == (WD, True)  # AdamW's decay, decoupled
        got, want = zip(*out["norms"])
        assert min(want) > MAX_NORM  # every step clipped
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


# -- the order of the parts --------------------------------------------------------------------------------------
def _gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts)


def _order(rank: int) -> list:
    ref = _reference()
    layer = _layer(ref)
    opt = _core(layer, max_grad_norm=MAX_NORM)
    seen = []

    def before_dense_step(optimizer, args, kwargs):  # torch's pre-hook of the dense optimizer
        grads = torch.cat([p.grad.reshape(-1) for p in layer.dense_parameters()])
        synced = bool((_gathered(grads) == grads).all())  # the same on every rank: reduced
        expert_sq = layer.store.grad_shards_EW.pow(2).sum()
        dist.all_reduce(expert_sq)
        norm = float((grads.pow(2).sum() + expert_sq).sqrt())  # the clipped global norm
        seen.append(("dense step", synced, norm, layer.store.adam_steps, layer.bias_E.clone()))

    def after_step(optimizer, args, kwargs):  # registered after the core's own bias hook: runs after it
        seen.append(("after", layer.store.adam_steps, layer.bias_E.clone()))

    opt.dense.register_step_pre_hook(before_dense_step)
    opt.register_step_post_hook(after_step)
    bias0 = layer.bias_E.clone()
    x, w = _batch(0)
    y, _ = layer(x[rank * T:(rank + 1) * T])
    (y * w[rank * T:(rank + 1) * T]).sum().backward()
    opt.step()
    (_, synced, norm, steps_then, bias_then), (_, steps_after, bias_after) = seen
    out = [synced, norm, steps_then, bool(torch.equal(bias_then, bias0)), steps_after,
           bool(torch.equal(bias_after, bias0))]
    # a NaN in one rank's gradient: the sync raises on every rank, before the dense or the expert step
    opt.zero_grad()
    y, _ = layer(x[rank * T:(rank + 1) * T])
    (y * w[rank * T:(rank + 1) * T] * (float("nan") if rank == 1 else 1.0)).sum().backward()
    dense_before = [p.detach().clone() for p in layer.dense_parameters()]
    try:
        opt.step()
    except NonFiniteError as exc:
        out.append(str(exc))
    out += [layer.store.adam_steps, all(torch.equal(a, p) for a, p in zip(dense_before, layer.dense_parameters()))]
    return out


def test_the_parts_run_in_order_sync_clip_dense_step_expert_step_bias():
    for synced, norm, steps_then, bias_kept, steps_after, bias_kept_after, error, steps, dense_kept in launch(
            _order, 2, timeout_s=120):
        assert synced  # the dense step sees reduced gradients,
        assert norm == pytest.approx(MAX_NORM, rel=1e-6)  # clipped over dense and experts,
        assert steps_then == 0 and bias_kept  # before the experts' step and the bias update,
        assert steps_after == 1 and not bias_kept_after  # which both ran by the step's end
        assert "non-finite gradient" in error and "rank 1" in error
        assert steps == 1 and dense_kept  # nothing moved


# -- one sync ------------------------------------------------------------------------------------------------------
def _all_reduces(rank: int, micro_batches: int) -> list[int]:
    layer = _layer(_reference())
    opt = _core(layer)
    dense_numel = sum(p.numel() for p in layer.dense_parameters())
    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):  # the real collective, counted when it carries the dense gradients
        if tensor.numel() == dense_numel + dist.get_world_size():
            calls.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    per_step = []
    dist.all_reduce = counting
    try:
        for step in range(2):
            for m in range(micro_batches):
                x, w = _batch(10 * step + m)
                y, _ = layer(x[rank * T:(rank + 1) * T])
                (y * w[rank * T:(rank + 1) * T]).sum().backward()
            calls.clear()
            opt.step()
            opt.zero_grad()
            per_step.append(len(calls))
            assert all(g is None for g in calls)  # on the world group
    finally:
        dist.all_reduce = real
    return per_step


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_one_step_issues_one_dense_all_reduce(micro_batches):
    assert launch(_all_reduces, 2, micro_batches, timeout_s=120) == [[1, 1], [1, 1]]


# -- the experts' Adam ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls,decoupled", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_the_experts_adam_with_decay_is_torchs_bit_for_bit(cls, decoupled):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(40, generator=g)
    grads = [torch.randn(40, generator=g) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = cls([p], lr=0.1, weight_decay=0.5, foreach=False)
    cfg = AdamConfig(lr=0.1, weight_decay=0.5, decoupled=decoupled)
    mine, m, v = w0.clone(), torch.zeros(40), torch.zeros(40)
    for step, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        adam_update_(mine, grad.clone(), m, v, step, cfg)
        assert torch.equal(mine, p.detach()), step


def test_the_expert_group_starts_as_the_dense_optimizers():
    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = AdamConfig(lr=5.0, beta1=0.8, beta2=0.9, eps=1e-6)
    hp = dense_hyperparameters(torch.optim.AdamW(p, lr=0.1, betas=(0.7, 0.95), weight_decay=0.2), adam)
    assert hp == {"lr": 0.1, "betas": (0.7, 0.95), "eps": 1e-8, "weight_decay": 0.2, "decoupled_weight_decay": True}
    assert dense_hyperparameters(torch.optim.AdamW(p), adam)["weight_decay"] == 0.01  # AdamW's default decays
    assert dense_hyperparameters(torch.optim.Adam(p, weight_decay=0.3), adam)["decoupled_weight_decay"] is False
    sgd = dense_hyperparameters(torch.optim.SGD(p, lr=0.2, weight_decay=0.1), adam)  # Adam's keys from AdamConfig
    assert sgd == {"lr": 0.2, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1, "decoupled_weight_decay": False}
    with pytest.raises(ValueError, match="amsgrad"):
        dense_hyperparameters(torch.optim.AdamW(p, amsgrad=True), adam)
