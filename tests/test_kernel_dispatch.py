"""Backend dispatch: precedence (argument > use_backend > LRMOE_KERNEL_BACKEND > automatic), the automatic rule,
refusal of a forced backend that cannot run here, and that the ops really run the chosen implementation."""

import pytest
import torch

import lrmoe.kernels.compact as compact
import lrmoe.kernels.grouped_gemm as grouped_gemm
from lrmoe.kernels.dispatch import (BACKEND_ENV, BACKENDS, active_backend, check_kernel_mode, choose_backend,
                                    interpreter_enabled, use_backend)

# Tests that launch interpreted kernels need TRITON_INTERPRET=1 from the start (conftest sets it without a GPU):
# Triton fixes a kernel's mode when its module is imported.
needs_interp = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (set by conftest)")


@pytest.fixture
def no_interp(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(BACKEND_ENV, raising=False)


@pytest.fixture
def interp(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_automatic_choice_on_cpu(no_interp, monkeypatch):
    choice = active_backend("cpu")
    assert choice.name == "torch" and "automatic" in choice.reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    choice = active_backend("cpu")
    assert choice.name == "interpret" and "TRITON_INTERPRET" in choice.reason


def test_automatic_choice_for_cuda_tensors(no_interp):
    assert active_backend("cuda").name == "triton"  # decided from the device alone; no GPU needed


def test_precedence_argument_context_environment(interp, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    x = torch.zeros(1)
    assert choose_backend(x).name == "torch" and BACKEND_ENV in choose_backend(x).reason
    with use_backend("interpret"):
        assert choose_backend(x).name == "interpret"
        assert "use_backend" in choose_backend(x).reason
        with use_backend("torch"):
            assert choose_backend(x).name == "torch"
        assert choose_backend(x).name == "interpret"  # the inner block restored the outer choice
        assert choose_backend(x, backend="torch").name == "torch"  # the argument beats the context
    assert choose_backend(x).name == "torch"
    monkeypatch.setenv(BACKEND_ENV, "auto")
    assert choose_backend(x).name == "interpret"


def test_context_is_restored_after_an_exception(interp):
    with pytest.raises(RuntimeError):
        with use_backend("torch"):
            raise RuntimeError("boom")
    assert active_backend().name == "interpret"


def test_forced_backend_that_cannot_run_raises(no_interp, monkeypatch):
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        choose_backend(torch.zeros(1), backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 is not set"):
        choose_backend(torch.zeros(1), backend="interpret")
    monkeypatch.setenv(BACKEND_ENV, "interpret")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        choose_backend(torch.zeros(1))
    monkeypatch.setenv(BACKEND_ENV, "gpu")
    with pytest.raises(ValueError, match="unknown kernel backend 'gpu'"):
        choose_backend(torch.zeros(1))
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with use_backend("fast"):
            pass
    assert set(BACKENDS) == {"triton", "interpret", "torch"}


def test_kernel_mode_mismatch_is_refused():
    check_kernel_mode("interpret", interpreted=True)
    with pytest.raises(ValueError, match="imported compiled"):
        check_kernel_mode("interpret", interpreted=False)
    with pytest.raises(ValueError, match="interpreted"):
        check_kernel_mode("triton", interpreted=True)


@needs_interp
def test_ops_run_the_chosen_implementation(interp, monkeypatch):
    """Spy on the torch references: the ops call them exactly when the torch backend is chosen."""
    calls = []
    real_mm, real_scatter = grouped_gemm._mm_torch, compact._scatter_rows_torch
    monkeypatch.setattr(grouped_gemm, "_mm_torch", lambda *a: calls.append("mm") or real_mm(*a))
    monkeypatch.setattr(compact, "_scatter_rows_torch", lambda *a: calls.append("pack") or real_scatter(*a))
    x, w, offs = torch.randn(5, 16), torch.randn(2, 16, 16), torch.tensor([2, 5], dtype=torch.int32)
    plan = compact.compact_plan(torch.tensor([0, 1, 0]), torch.tensor([1, 0, 0]), 2, 2)
    rows = torch.randn(3, 4)
    y_interp = grouped_gemm.grouped_mm(x, w, offs)
    p_interp = compact.pack(rows, plan)
    assert calls == []
    with use_backend("torch"):
        y_torch = grouped_gemm.grouped_mm(x, w, offs)
        p_torch = compact.pack(rows, plan)
    assert calls == ["mm", "pack"]
    torch.testing.assert_close(y_interp, y_torch)
    assert torch.equal(p_interp, p_torch)


def _load_bench():
    from _scripts import load_experiment

    return load_experiment("bench_kernels")


@needs_interp
def test_bench_gpu_code_paths_run_on_cpu_interpreted(interp):
    """The GPU part of experiments/bench_kernels.py runs once, unattended: exercise its functions
    (lrmoe.harness.kernel_bench) here on CPU, with the interpreter standing in for compiled Triton and float32 for
    bf16."""
    from lrmoe.harness import kernel_bench as bench

    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    checks = bench.check_bf16_paths(cpu, gen, D=16, F=8, E=3, M=24, T=6, k=2, backend="interpret",
                                    dtype=torch.float32)
    assert checks and all(r.get("ok", r.get("exact")) for r in checks), checks
    comp = bench.bench_compaction(6, 2, 16, 2, 3, 0.7, torch.float32, cpu, ["interpret", "torch"], 1, 0, gen)
    assert {(r["op"], r["impl"]) for r in comp} >= {("pack_pairs", "interpret"), ("unpack_tokens", "torch")}
    gemm = bench.bench_grouped_gemm(24, 16, 8, 3, torch.float32, cpu, "interpret", 1, 0, gen, torch_grouped=True)
    assert [r["op"] for r in gemm] == ["grouped_mm_fwd", "grouped_mm_dx", "grouped_mm_dw"]
    assert all(r["ratio_vs_torch_grouped"] > 0 for r in gemm)


@needs_interp
def test_bench_cpu_part_writes_results_and_summary(interp, tmp_path):
    from lrmoe.results import read_results

    bench = _load_bench()
    out = tmp_path / "bench.jsonl"
    log = bench.main(["--quick", "--repeats", "1", "--skip-gpu", "--no-wandb", "--out", str(out)])
    assert any(r["op"] == "pack_pairs" and r["ratio_vs_copy"] > 0 for r in log)
    assert any(r["op"] == "grouped_mm_fwd" and r["ratio_vs_dense"] > 0 for r in log)
    assert all(r.get("ok", r.get("exact", True)) for r in log if r["op"].startswith("check"))
    summary = read_results(out, kind="summary")[0]
    assert summary["gpu_part_ran"] is False and summary["cpu_pack_pairs_vs_copy"] > 0
