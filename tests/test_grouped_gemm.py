"""Grouped GEMM: the interpreted Triton kernels (forward, dX, dW) against ``torch.nn.functional.grouped_mm`` and a
loop reference, edge cases (empty groups, one row, rows past the last offset, ragged sizes), gradcheck of the
autograd function in float64, the SwiGLU experts against a dense per-expert reference, and bad input."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.kernels.dispatch import interpreter_enabled
from lrmoe.kernels.grouped_gemm import grouped_mm, swiglu_experts

needs_interp = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (set by conftest)")
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}


def loop_reference(x_MK, w_EKN, offs_E):
    """y[rows of e] = x[rows of e] @ w[e] in float64, rows past offs[-1] zero."""
    y = torch.zeros(x_MK.shape[0], w_EKN.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs_E.tolist()):
        y[start:end] = x_MK[start:end].double() @ w_EKN[e].double()
        start = end
    return y


def make_case(sizes, K, N, dtype, seed=0, extra_rows=0):
    g = torch.Generator().manual_seed(seed)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    M = int(sum(sizes)) + extra_rows
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(len(sizes), K, N, generator=g) / K ** 0.5).to(dtype)
    return x, w, offs


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_matches_torch_grouped_mm(dtype):
    """Aligned shapes (torch's grouped_mm wants 16-byte rows): the interpreted kernel equals torch's."""
    x, w, offs = make_case([5, 0, 21, 3], K=32, N=16, dtype=dtype)
    got = grouped_mm(x, w, offs, backend="interpret")
    ref = F.grouped_mm(x, w, offs=offs)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])


CASES = {
    "ragged": ([5, 0, 21, 3], 20, 24, 0),  # K, N, M not multiples of the 16-blocks; an empty group
    "one_row": ([1], 16, 16, 0),
    "empty_first_and_last": ([0, 7, 0], 17, 9, 0),
    "all_empty": ([0, 0], 8, 8, 3),  # every row past offs[-1]
    "rows_past_last_offset": ([4, 6], 12, 20, 5),
    "single_group_many_tiles": ([40], 24, 40, 0),
}


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_loop_reference(case, dtype):
    sizes, K, N, extra = CASES[case]
    x, w, offs = make_case(sizes, K, N, dtype, extra_rows=extra)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm(xi, wi, offs, backend="interpret")
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(dy)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = loop_reference(xr, wr, offs)
    yr.backward(dy.double())
    torch.testing.assert_close(y.double(), yr, **TOL[dtype])
    assert (y[int(offs[-1]) if len(sizes) else 0:] == 0).all(), "rows past offs[-1] must be zero"
    torch.testing.assert_close(xi.grad.double(), xr.grad, **TOL[dtype])
    torch.testing.assert_close(wi.grad.double(), wr.grad, **TOL[dtype])
    empty = torch.tensor(sizes) == 0
    assert (wi.grad[empty] == 0).all(), "an empty group's weight gradient must be zero"


@needs_interp
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=4), K=st.integers(1, 36), N=st.integers(1, 36),
       extra=st.integers(0, 3), seed=st.integers(0, 1000))
@settings(max_examples=30, deadline=None)
def test_random_shapes_interpreted_forward_and_backward(sizes, K, N, extra, seed):
    x, w, offs = make_case(sizes, K, N, torch.float32, seed, extra_rows=extra)
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm(xi, wi, offs, backend="interpret")
    y.backward(torch.ones_like(y))
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = loop_reference(xr, wr, offs)
    yr.backward(torch.ones_like(yr))
    torch.testing.assert_close(y.double(), yr, **TOL[torch.float32])
    torch.testing.assert_close(xi.grad.double(), xr.grad, **TOL[torch.float32])
    torch.testing.assert_close(wi.grad.double(), wr.grad, **TOL[torch.float32])


@needs_interp
def test_transposed_weight_view():
    """Weights stored [E, N, K] and passed as a transposed view (as torch's grouped_mm is used) work unchanged."""
    x, w, offs = make_case([9, 4, 0, 11], K=20, N=12, dtype=torch.float32)
    w_ENK = w.transpose(1, 2).contiguous()
    got = grouped_mm(x, w_ENK.transpose(1, 2), offs, backend="interpret")
    torch.testing.assert_close(got.double(), loop_reference(x, w, offs), **TOL[torch.float32])


def test_torch_path_matches_torch_grouped_mm_and_loop():
    x, w, offs = make_case([30, 0, 17, 1, 12], K=32, N=24, dtype=torch.float32)
    got = grouped_mm(x, w, offs, backend="torch")
    torch.testing.assert_close(got, F.grouped_mm(x, w, offs=offs))
    torch.testing.assert_close(got.double(), loop_reference(x, w, offs), **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["torch", pytest.param("interpret", marks=needs_interp)])
def test_gradcheck_float64(backend):
    x, w, offs = make_case([3, 0, 4, 1], K=3, N=5, dtype=torch.float64, extra_rows=2)
    x.requires_grad_()
    w.requires_grad_()
    # fast mode (random projections) keeps the interpreter's evaluations few
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs, backend=backend), (x, w),
                                    fast_mode=backend == "interpret")


def dense_swiglu(x_MD, w_gate, w_up, w_down, offs):
    y = torch.zeros_like(x_MD)
    start = 0
    for e, end in enumerate(offs.tolist()):
        xe = x_MD[start:end]
        y[start:end] = (F.silu(xe @ w_gate[e]) * (xe @ w_up[e])) @ w_down[e]
        start = end
    return y


@pytest.mark.parametrize("backend", ["torch", pytest.param("interpret", marks=needs_interp)])
def test_swiglu_experts_matches_dense_reference(backend):
    g = torch.Generator().manual_seed(3)
    E, D, Fw = 3, 16, 24
    offs = torch.tensor([6, 6, 19], dtype=torch.int32)
    x = torch.randn(19, D, generator=g, dtype=torch.float64)
    ws = [torch.randn(E, D, Fw, generator=g, dtype=torch.float64) / 4,
          torch.randn(E, D, Fw, generator=g, dtype=torch.float64) / 4,
          torch.randn(E, Fw, D, generator=g, dtype=torch.float64) / 5]
    dtype = torch.float64 if backend == "torch" else torch.float32
    args = [t.to(dtype).clone().requires_grad_() for t in [x] + ws]
    y, h = swiglu_experts(*args, offs, backend=backend, return_hidden=True)
    assert h.shape == (19, Fw)
    up = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y.double() * up).sum().backward()
    refs = [t.clone().requires_grad_() for t in [x] + ws]
    y_ref = dense_swiglu(*refs, offs)
    (y_ref * up).sum().backward()
    tol = TOL[dtype]
    torch.testing.assert_close(y.double(), y_ref, **tol)
    for a, r in zip(args, refs):
        torch.testing.assert_close(a.grad.double(), r.grad, **tol)


def test_bad_input_raises_value_error():
    x, w, offs = make_case([2, 3], K=4, N=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="K=4 columns"):
        grouped_mm(x, torch.zeros(2, 3, 5), offs)
    with pytest.raises(ValueError, match="offs_E must be 1-D"):
        grouped_mm(x, w, offs[:1])
    with pytest.raises(ValueError, match="int32"):
        grouped_mm(x, w, offs.float())
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(x, w, torch.tensor([3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(x, w, torch.tensor([2, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        grouped_mm(x, w.double(), offs)
    with pytest.raises(ValueError, match="w_down_EFD"):
        swiglu_experts(x, torch.zeros(2, 4, 6), torch.zeros(2, 4, 6), torch.zeros(2, 4, 6), offs)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        grouped_mm(x, w, offs, backend="cuda")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_triton_matches_torch_on_gpu(dtype):
    """On a GPU: the compiled kernels (forward, dX, dW) against the float64 loop reference."""
    x, w, offs = make_case([37, 0, 150, 3, 64], K=96, N=80, dtype=dtype, extra_rows=7)
    x, w, offs = x.cuda().requires_grad_(), w.cuda().requires_grad_(), offs.cuda()
    y = grouped_mm(x, w, offs, backend="triton")
    y.float().square().sum().backward()
    xr, wr = x.detach().cpu().double().requires_grad_(), w.detach().cpu().double().requires_grad_()
    yr = loop_reference(xr, wr, offs.cpu())
    yr.square().sum().backward()
    tol = dict(atol=5e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(y.double().cpu(), yr, **tol)
    torch.testing.assert_close(x.grad.double().cpu(), xr.grad, **tol)
    torch.testing.assert_close(w.grad.double().cpu(), wr.grad, **tol)


def test_public_weight_gradient_op_equals_the_autograd_weight_gradient():
    from lrmoe.kernels.grouped_gemm import grouped_mm, grouped_mm_dw

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(13, 5, generator=gen, dtype=torch.float64)
    dy = torch.randn(13, 7, generator=gen, dtype=torch.float64)
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)  # group 1 empty, rows 11-12 belong to no group
    w = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    (grouped_mm(x, w, offs, backend="torch") * dy).sum().backward()
    dw = grouped_mm_dw(x, dy, offs, 3, backend="torch")
    assert torch.allclose(dw, w.grad) and not dw[1].any()
    with pytest.raises(ValueError, match="same rows"):
        grouped_mm_dw(x, dy[:5], offs, 3, backend="torch")
