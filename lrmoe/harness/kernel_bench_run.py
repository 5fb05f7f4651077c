"""The kernel benchmark's run (``experiments/bench_kernels.py``): every part in turn (CPU always, GPU when asked),
each logged as it completes, then the summary of the run and its Markdown tables. The measurements themselves are
:mod:`lrmoe.harness.kernel_bench`."""

from __future__ import annotations

import importlib.util
import os
import traceback

from lrmoe.config import cluster_preset, model_preset

GPU_PRESETS = [("H200", "h200x8"), ("A100-SXM4-80GB", "a100-80gb-x16"), ("A100", "a100-40gb-x8")]
BW_GOAL, GEMM_GOAL = 0.8, 0.9


def run_parts(run, log: list[dict], *, seed: int, repeats: int, quick: bool, gpu: bool,
              hbm_peak_gbs: float | None) -> None:
    """The CPU part (torch path, float32, shapes a 2-core machine measures in seconds; the interpreted-Triton check
    when triton runs interpreted), then on ``gpu`` the bf16 checks and the compiled-Triton measurements at the
    presets' shapes. Each part's records go to ``run`` and ``log``; a part that fails is logged as an error."""
    import torch

    from lrmoe.harness.kernel_bench import (bench_compaction, bench_grouped_gemm, check_bf16_paths,
                                            check_interpreter_small)

    gen = torch.Generator().manual_seed(seed)
    qwen, glm = model_preset("qwen3-30b-a3b"), model_preset("glm-4.5-air")
    cpu = torch.device("cpu")
    # CPU: the torch path, float32, shapes a 2-core machine measures in seconds.
    T, D = (1024, 256) if quick else (2048, 512)
    run_part("cpu", lambda: bench_compaction(T, 8, D, 8, 4, 0.7, torch.float32, cpu, ["torch"], repeats, 2, gen),
             run, log)
    M, K, N = (2048, 256, 192) if quick else (4096, 512, 384)
    for E in (8, 32):
        run_part("cpu", lambda: bench_grouped_gemm(M, K, N, E, torch.float32, cpu, "torch", repeats, 2, gen,
                                                   torch_grouped=False), run, log)
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
        run_part("cpu", lambda: check_interpreter_small(gen), run, log)
    if not gpu:
        return
    dev = torch.device("cuda")
    peak, peak_src = hbm_peak_gbps(hbm_peak_gbs)
    print(f"GPU: {torch.cuda.get_device_name(0)}; HBM peak {peak} GB/s ({peak_src})", flush=True)
    gen_gpu = torch.Generator().manual_seed(seed)
    run_part("gpu", lambda: check_bf16_paths(dev, gen_gpu, qwen.hidden, qwen.expert_ffn, 16, 4096, 2048,
                                             qwen.top_k), run, log)
    T = 8192 if quick else 16384
    for D in [glm.hidden] if quick else [qwen.hidden, glm.hidden]:
        run_part("gpu", lambda: with_peak(bench_compaction(T, 8, D, 8, 16, 0.7, torch.bfloat16, dev,
                                                           ["triton", "torch"], repeats, 3, gen_gpu), peak),
                 run, log)
    for cfg in [glm] if quick else [qwen, glm]:
        for K, N in [(cfg.hidden, cfg.expert_ffn), (cfg.expert_ffn, cfg.hidden)]:  # gate/up, then down
            run_part("gpu", lambda: [dict(r, model=cfg.name) for r in bench_grouped_gemm(
                16384, K, N, 16, torch.bfloat16, dev, "triton", repeats, 3, gen_gpu, torch_grouped=True)],
                run, log)


def hbm_peak_gbps(hbm_peak_gbs: float | None) -> tuple[float | None, str]:
    """The HBM peak in GB/s and where it came from: ``--hbm-peak-gbs``, else the cluster preset of the GPU's name."""
    import torch

    if hbm_peak_gbs:
        return hbm_peak_gbs, "--hbm-peak-gbs"
    name = torch.cuda.get_device_name(0)
    for fragment, preset in GPU_PRESETS:
        if fragment in name:
            return cluster_preset(preset).hbm_bw / 1e9, f"cluster preset {preset}"
    return None, f"unknown GPU {name!r}: pass --hbm-peak-gbs"


def with_peak(records: list[dict], peak_gbps: float | None) -> list[dict]:
    """Add each bandwidth's fraction of the HBM peak."""
    for r in records:
        if peak_gbps and "gbps" in r:
            r["frac_hbm_peak"] = r["gbps"] / peak_gbps
    return records


def run_part(part: str, fn, run, log: list[dict]) -> None:
    """Run one measurement function, logging its records; an exception is logged and reported, not raised."""
    try:
        records = fn()
    except Exception as exc:  # an unattended GPU run should report every part it can
        records = [{"op": "error", "error": f"{type(exc).__name__}: {exc}"}]
        traceback.print_exc()
    for rec in records:
        rec = {"part": part, **rec}
        run.log(rec)
        log.append(rec)


def summarise(log: list[dict], gpu: bool) -> dict:
    """The run's headline numbers: per measurement, its minimum over the shapes measured; on a GPU also the checks
    that failed and the errors."""

    def pick(part, op, key, impl=None):
        vals = [r[key] for r in log if r.get("part") == part and r.get("op") == op and key in r
                and (impl is None or r.get("impl") == impl)]
        return min(vals) if vals else None

    s = {"gpu_part_ran": gpu,
         "cpu_plan_ms": pick("cpu", "compact_plan", "median_ms"),
         "cpu_pack_pairs_vs_copy": pick("cpu", "pack_pairs", "ratio_vs_copy"),
         "cpu_pack_tokens_vs_copy": pick("cpu", "pack_tokens", "ratio_vs_copy"),
         "cpu_unpack_tokens_vs_copy": pick("cpu", "unpack_tokens", "ratio_vs_copy"),
         "cpu_grouped_fwd_vs_dense_min": pick("cpu", "grouped_mm_fwd", "ratio_vs_dense"),
         "cpu_grouped_dx_vs_dense_min": pick("cpu", "grouped_mm_dx", "ratio_vs_dense"),
         "cpu_grouped_dw_vs_dense_min": pick("cpu", "grouped_mm_dw", "ratio_vs_dense")}
    if gpu:
        s.update({"gpu_pack_pairs_frac_hbm_min": pick("gpu", "pack_pairs", "frac_hbm_peak", "triton"),
                  "gpu_pack_tokens_frac_hbm_min": pick("gpu", "pack_tokens", "frac_hbm_peak", "triton"),
                  "gpu_unpack_frac_hbm_min": pick("gpu", "unpack_tokens", "frac_hbm_peak", "triton"),
                  "gpu_copy_frac_hbm_min": pick("gpu", "copy", "frac_hbm_peak", "torch"),
                  "gpu_pack_pairs_vs_copy_min": pick("gpu", "pack_pairs", "ratio_vs_copy", "triton"),
                  "gpu_grouped_fwd_vs_torch_min": pick("gpu", "grouped_mm_fwd", "ratio_vs_torch_grouped"),
                  "gpu_grouped_dx_vs_torch_min": pick("gpu", "grouped_mm_dx", "ratio_vs_torch_grouped"),
                  "gpu_grouped_dw_vs_torch_min": pick("gpu", "grouped_mm_dw", "ratio_vs_torch_grouped"),
                  "gpu_checks_failed": [f"{r['op']}:{r.get('impl', '')}" for r in log if r.get("part") == "gpu"
                                        and (r.get("ok") is False or r.get("exact") is False and "ok" not in r)],
                  "errors": [r["error"] for r in log if "error" in r]})
    return s


def report(log: list[dict], summary: dict, gpu: bool) -> None:
    """Print the compaction, grouped-GEMM, correctness and summary tables (Markdown)."""
    cols_c = ["part", "impl", "op", "shape", "median_ms", "gbps", "ratio_vs_copy", "frac_hbm_peak"]
    cols_g = ["part", "model", "impl", "op", "shape", "median_ms", "tflops", "dense_tflops", "ratio_vs_dense",
              "torch_grouped_tflops", "ratio_vs_torch_grouped"]
    cols_k = ["part", "op", "impl", "vs", "exact", "rel_err", "ok", "error"]
    comp = [r for r in log if "gbps" in r or r.get("op") == "compact_plan"]
    gemm = [r for r in log if "tflops" in r]
    checks = [r for r in log if r.get("op", "").startswith("check") or "error" in r]
    print("\n## Compaction\n\n" + markdown(comp, cols_c))
    print("\n## Grouped GEMM (ratio > 1: faster than the comparison)\n\n" + markdown(gemm, cols_g))
    print("\n## Correctness\n\n" + markdown(checks, cols_k))
    print("\n## Summary\n\n" + markdown([{"metric": k, "value": v} for k, v in summary.items()],
                                        ["metric", "value"]))
    if gpu:
        print(f"\ngoals: compaction >= {BW_GOAL} of HBM peak; grouped GEMM >= {GEMM_GOAL} of torch's grouped_mm")
    else:
        print("\nGPU part: not run (no CUDA device)")


def markdown(rows: list[dict], columns: list[str]) -> str:
    """``rows`` as a Markdown table of ``columns`` (a missing value: an empty cell)."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


