"""The kernel benchmark's measurements (``experiments/bench_kernels.py``): compaction bandwidth against a copy of the
same bytes, the grouped GEMM's throughput against a dense matmul of the same FLOPs (and torch's grouped_mm on a GPU),
and the correctness checks of the Triton paths against torch. Torch and the kernels load in the functions; the
Triton kernels run interpreted when there is no GPU (:func:`interpret_without_gpu`)."""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


# --------------------------------------------------------------------------------------------------------------
# timing


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, cuda: bool) -> dict:
    """Median milliseconds of each function, the functions run in turn within every repeat (so drift on a
    shared machine hits all alike). CUDA events on a GPU, wall clock on CPU."""
    import torch

    from lrmoe.harness.timing import time_once_ms

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if cuda:
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_once_ms(fn, cuda))
    return {name: statistics.median(ts) for name, ts in times.items()}


def group_sizes(M: int, E: int, gen: torch.Generator) -> list[int]:
    """M rows split over E groups with Dirichlet(1) popularity (normalised exponentials: Gini about 0.5, the
    skewed end of DESIGN.md's range; some groups may come out empty)."""
    import torch

    probs = -torch.log(torch.rand(E, generator=gen, dtype=torch.float64).clamp_min(1e-12))
    idx = torch.multinomial(probs / probs.sum(), M, replacement=True, generator=gen)
    return torch.bincount(idx, minlength=E).tolist()


def routing(T: int, k: int, N: int, E: int, keep_frac: float, gen: torch.Generator, device):
    import torch

    P = T * k
    dest_P = torch.randint(0, N, (P,), generator=gen)
    expert_P = torch.randint(0, E, (P,), generator=gen)
    keep_P = torch.rand(P, generator=gen) < keep_frac
    return dest_P.to(device), expert_P.to(device), keep_P.to(device)


def device_generator(gen: torch.Generator, device) -> torch.Generator:
    """A generator on ``device`` seeded from ``gen``: device tensors drawn where they live, reproducibly."""
    import torch

    return torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=gen)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------------------------
# measurements (shared by both parts; `backend` and `device` decide which)


def bench_compaction(T, k, D, N, E, keep_frac, dtype, device, backends, repeats, warmup, gen):
    """Pack (rows per pair: the backward dispatch; rows per token: the forward dispatch) and the weighted unpack
    (the combine) on each backend, against a plain copy of the packed bytes, all on one routing."""
    import torch

    interpret_without_gpu()
    from lrmoe.kernels.compact import compact_plan, pack, unpack

    cuda = device.type == "cuda"
    dest, expert, keep = routing(T, k, N, E, keep_frac, gen, device)
    t0 = time.perf_counter()
    plan = compact_plan(dest, expert, N, E, keep, top_k=k)
    if cuda:
        torch.cuda.synchronize()
    plan_ms = (time.perf_counter() - t0) * 1e3
    M, P, elt = plan.num_packed, T * k, torch.empty(0, dtype=dtype).element_size()
    dg = device_generator(gen, device)
    rows_PD = torch.randn(P, D, device=device, generator=dg).to(dtype)
    x_TD = torch.randn(T, D, device=device, generator=dg).to(dtype)
    w_P = torch.rand(P, device=device, generator=dg)
    packed_MD = pack(rows_PD, plan, backend="torch")
    src_MD = packed_MD.clone()
    fns = {("copy", "torch"): lambda: src_MD.clone()}  # allocates its output, as pack and unpack do
    for b in backends:
        fns[("pack_pairs", b)] = lambda b=b: pack(rows_PD, plan, backend=b)
        fns[("pack_tokens", b)] = lambda b=b: pack(x_TD, plan, backend=b)
        fns[("unpack_tokens", b)] = lambda b=b: unpack(packed_MD, plan, w_P, backend=b)
    ms = interleaved_medians(fns, repeats, warmup, cuda)
    bytes_ = {"copy": 2 * M * D * elt, "pack_pairs": 2 * M * D * elt, "pack_tokens": 2 * M * D * elt,
              "unpack_tokens": (M + T) * D * elt}  # bytes that must move: read each packed row, write its copy
    copy_gbps = bytes_["copy"] / ms[("copy", "torch")] / 1e6
    shape = f"T={T} k={k} D={D} N={N} E={E} keep={keep_frac} M={M} {str(dtype).replace('torch.', '')}"
    records = [{"op": "compact_plan", "impl": "torch", "shape": shape, "median_ms": plan_ms}]
    for (op, impl), t in ms.items():
        gbps = bytes_[op] / t / 1e6
        records.append({"op": op, "impl": impl, "shape": shape, "median_ms": t, "gbps": gbps,
                        "ratio_vs_copy": gbps / copy_gbps})
    return records


def bench_grouped_gemm(M, K, N, E, dtype, device, backend, repeats, warmup, gen, torch_grouped: bool):
    """Forward, dX and dW of the grouped GEMM against one dense matmul of the same FLOPs (and, on a GPU,
    against torch's grouped_mm on the same operands). Weights are stored [E, N, K] and used transposed."""
    import torch

    cuda = device.type == "cuda"
    sizes = group_sizes(M, E, gen)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    dg = device_generator(gen, device)
    x_MK = torch.randn(M, K, device=device, generator=dg).to(dtype)
    dy_MN = torch.randn(M, N, device=device, generator=dg).to(dtype)
    w_ENK = (torch.randn(E, N, K, device=device, generator=dg) / K ** 0.5).to(dtype)
    w_EKN = w_ENK.transpose(1, 2)
    dense_w_KN = w_EKN[0]
    interpret_without_gpu()
    from lrmoe.kernels.grouped_gemm import _mm, _mm_dw

    ops = {
        "fwd": (lambda: _mm(x_MK, w_EKN, offs, backend), lambda: x_MK @ dense_w_KN,
                lambda: torch.nn.functional.grouped_mm(x_MK, w_EKN, offs=offs)),
        "dx": (lambda: _mm(dy_MN, w_ENK, offs, backend), lambda: dy_MN @ dense_w_KN.t(),
               lambda: torch.nn.functional.grouped_mm(dy_MN, w_ENK, offs=offs)),
        "dw": (lambda: _mm_dw(x_MK, dy_MN, offs, E, backend), lambda: x_MK.t() @ dy_MN,
               lambda: torch.nn.functional.grouped_mm(x_MK.t(), dy_MN, offs=offs)),
    }
    shape = f"M={M} K={K} N={N} E={E} max/mean={max(sizes) * E / M:.2f} empty={sizes.count(0)}"
    flops = 2 * M * K * N
    records = []
    for op, (grouped, dense, torch_g) in ops.items():
        fns = {"grouped": grouped, "dense": dense}
        if torch_grouped:
            fns["torch_grouped"] = torch_g
        ms = interleaved_medians(fns, repeats, warmup, cuda)
        rec = {"op": f"grouped_mm_{op}", "impl": backend, "shape": shape, "median_ms": ms["grouped"],
               "tflops": flops / ms["grouped"] / 1e9, "dense_ms": ms["dense"],
               "dense_tflops": flops / ms["dense"] / 1e9, "ratio_vs_dense": ms["dense"] / ms["grouped"]}
        if torch_grouped:
            rec.update(torch_grouped_ms=ms["torch_grouped"], torch_grouped_tflops=flops / ms["torch_grouped"] / 1e9,
                       ratio_vs_torch_grouped=ms["torch_grouped"] / ms["grouped"])
        records.append(rec)
    return records


# --------------------------------------------------------------------------------------------------------------
# correctness checks


def check_interpreter_small(gen) -> list[dict]:
    """The interpreted Triton kernels against the torch path on small CPU shapes (float32)."""
    import torch

    interpret_without_gpu()
    from lrmoe.kernels.compact import compact_plan, pack, unpack
    from lrmoe.kernels.grouped_gemm import grouped_mm

    records = []
    dest, expert, keep = routing(13, 2, 3, 4, 0.7, gen, "cpu")
    plan = compact_plan(dest, expert, 3, 4, keep, top_k=2)
    x = torch.randn(13, 37, generator=gen)
    w = torch.rand(26, generator=gen)
    p_t, p_i = pack(x, plan, backend="torch"), pack(x, plan, backend="interpret")
    u_t, u_i = unpack(p_t, plan, w, backend="torch"), unpack(p_t, plan, w, backend="interpret")
    records.append({"op": "check_pack_interpret", "exact": bool(torch.equal(p_t, p_i))})
    records.append({"op": "check_unpack_interpret", "exact": bool(torch.equal(u_t, u_i))})
    offs = torch.tensor([5, 5, 21, 24], dtype=torch.int32)
    xg, wg = torch.randn(24, 20, generator=gen), torch.randn(4, 20, 24, generator=gen)
    err = rel_err(grouped_mm(xg, wg, offs, backend="interpret"), grouped_mm(xg, wg, offs, backend="torch"))
    records.append({"op": "check_grouped_mm_interpret", "rel_err": err, "ok": err < 1e-5})
    return records


def check_bf16_paths(device, gen, D, F, E, M, T, k, backend="triton", dtype=None) -> list[dict]:
    """bf16 on the GPU: Triton against torch (exact for copies; relative error for sums and GEMMs), plus a
    float32 reference for the GEMMs. (``backend``/``dtype`` let the tests run this on CPU, interpreted; the dtype
    is bf16 when None.)"""
    import torch

    dtype = dtype or torch.bfloat16

    interpret_without_gpu()
    from lrmoe.kernels.compact import compact_plan, pack, unpack
    from lrmoe.kernels.grouped_gemm import grouped_mm, swiglu_experts

    records = []
    tag = f"{backend}_{str(dtype).replace('torch.', '')}"
    dest, expert, keep = routing(T, k, 8, E, 0.7, gen, device)
    plan = compact_plan(dest, expert, 8, E, keep, top_k=k)
    dg = device_generator(gen, device)
    x = torch.randn(T, D, device=device, generator=dg).to(dtype)
    w = torch.rand(T * k, device=device, generator=dg)
    p_t, p_g = pack(x, plan, backend="torch"), pack(x, plan, backend=backend)
    records.append({"op": "check_pack", "impl": tag, "vs": "torch", "exact": bool(torch.equal(p_t, p_g))})
    u_t, u_g = unpack(p_t, plan, w, backend="torch"), unpack(p_t, plan, w, backend=backend)
    err = rel_err(u_g, u_t)
    records.append({"op": "check_unpack", "impl": tag, "vs": "torch", "exact": bool(torch.equal(u_t, u_g)),
                    "rel_err": err, "ok": err < 1e-2})
    sizes = group_sizes(M, E, gen)
    sizes[0] = 0  # an empty group
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    Mv = int(sum(sizes))
    # rows past offs[-1] come out zero, an empty group's weight gradient is zero, the rest matches torch
    xt = torch.randn(Mv + 5, D, device=device, generator=dg).to(dtype).requires_grad_()
    wt = (torch.randn(E, D, F, device=device, generator=dg) / D ** 0.5).to(dtype).requires_grad_()
    yt = grouped_mm(xt, wt, offs, backend=backend)
    yt.float().sum().backward()
    ref = torch.nn.functional.grouped_mm(xt.detach()[:Mv], wt.detach(), offs=offs)
    err = rel_err(yt[:Mv].detach(), ref)
    records.append({"op": "check_grouped_mm_tail_and_empty", "impl": tag, "vs": "torch",
                    "rel_err": err, "ok": bool(err < 1e-2 and (yt[Mv:] == 0).all() and (wt.grad[0] == 0).all()
                                               and (xt.grad[Mv:] == 0).all())})
    xs = [torch.randn(Mv, D, device=device, generator=dg) * 0.5]
    ws = [torch.randn(E, D, F, device=device, generator=dg) / D ** 0.5,
          torch.randn(E, D, F, device=device, generator=dg) / D ** 0.5,
          torch.randn(E, F, D, device=device, generator=dg) / F ** 0.5]
    up = torch.randn(Mv, D, device=device, generator=dg)
    results = {}
    for name, dt, b in [("fp32", torch.float32, "torch"), ("torch", dtype, "torch"), (tag, dtype, backend)]:
        args = [t.to(dt).clone().requires_grad_() for t in xs + ws]
        y = swiglu_experts(*args, offs, backend=b)
        (y.float() * up).sum().backward()
        results[name] = [y.detach()] + [a.grad for a in args]
    names = ["y", "dx", "dw_gate", "dw_up", "dw_down"]
    for impl, vs in [("torch", "fp32"), (tag, "fp32"), (tag, "torch")]:
        for name, got, ref in zip(names, results[impl], results[vs]):
            err = rel_err(got, ref)
            records.append({"op": f"check_swiglu_{name}", "impl": impl, "vs": vs, "rel_err": err, "ok": err < 2e-2})
    return records


def interpret_without_gpu() -> None:
    """Run the Triton kernels in the interpreter when there is no GPU: set before a kernel module imports triton."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
