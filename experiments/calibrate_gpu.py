"""Calibrate the cost model's expert-GEMM curve on a GPU: grouped-GEMM time vs rows per expert, in bf16, for the
expert shapes of both model presets; fit ``eff(m) = eff_max * m / (m + m_half)`` (plus a launch time per call)
and write the fit, the measurements and their provenance to a JSON data file that the cost model loads as the
GPU preset's GEMM constants (``lrmoe/sim/presets/<gpu>_gemm.json``).

One GPU cannot measure inter-GPU links: bandwidths and latencies stay the public figures of
``lrmoe.config``. Without a CUDA GPU the script says so and exits without writing anything.

    python experiments/calibrate_gpu.py                      # H200: writes lrmoe/sim/presets/h200_gemm.json
    python experiments/calibrate_gpu.py --quick --preset-out /tmp/h200_gemm.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules; torch loads in the functions that measure.
from lrmoe.cli import positive_float_arg, positive_int_arg
from lrmoe.cli import script_parser
from lrmoe.config import cluster_preset, model_preset
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parent.parent
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
QUICK_ROWS = [1, 8, 32, 128, 512, 2048]
MODELS = ["qwen3-30b-a3b", "glm-4.5-air"]
GPU_PRESETS = {"H200": "h200x8", "A100": "a100-40gb-x8"}  # name fragment -> cluster preset


def swiglu_grouped(x_MD, w_gate_GFD, w_up_GFD, w_down_GDF, offs_G, grouped_mm):
    """The routed-expert SwiGLU as three grouped GEMMs (weights stored [G, out, in], passed transposed)."""
    import torch

    gate = grouped_mm(x_MD, w_gate_GFD.transpose(-2, -1), offs_G)
    up = grouped_mm(x_MD, w_up_GFD.transpose(-2, -1), offs_G)
    return grouped_mm(torch.nn.functional.silu(gate) * up, w_down_GDF.transpose(-2, -1), offs_G)


def pick_grouped_mm(backend: str):
    """The grouped GEMM to time: torch's (``torch``), the package's kernel (``lrmoe``) or a loop of mm."""
    import torch

    if backend == "torch":
        fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        if fn is None:
            raise ValueError("backend='torch': this torch has neither nn.functional.grouped_mm nor _grouped_mm")
        return lambda x, w, offs: fn(x, w, offs=offs)
    if backend == "lrmoe":
        from lrmoe.kernels.grouped_gemm import grouped_mm

        return grouped_mm
    if backend == "loop":
        def loop(x, w, offs):
            starts = [0] + offs[:-1].tolist()
            return torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])
        return loop
    raise ValueError(f"unknown backend {backend!r}; use 'torch', 'lrmoe' or 'loop'")


def time_call(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after two warm-ups (CUDA events on a GPU)."""
    from lrmoe.harness.timing import time_ms

    return statistics.median(time_ms(fn, repeats, warmup=2, cuda=device.type == "cuda")) / 1e3


def measure(hidden: int, ffn: int, rows: int, groups: int, grouped_mm, device: torch.device, dtype: torch.dtype,
            repeats: int, generator: torch.Generator) -> dict:
    """Forward and forward+backward seconds of ``groups`` experts with ``rows`` rows each."""
    import torch

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(device=device, dtype=dtype)

    x = rand(rows * groups, hidden).requires_grad_(True)
    w = [rand(groups, ffn, hidden).requires_grad_(True), rand(groups, ffn, hidden).requires_grad_(True),
         rand(groups, hidden, ffn).requires_grad_(True)]
    offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows
    grad = rand(rows * groups, hidden)

    def fwd():
        with torch.no_grad():
            swiglu_grouped(x, *w, offs, grouped_mm)

    def fwd_bwd():
        y = swiglu_grouped(x, *w, offs, grouped_mm)
        torch.autograd.backward(y, grad)

    return {"rows": rows, "groups": groups, "fwd_s": time_call(fwd, repeats, device),
            "fwd_bwd_s": time_call(fwd_bwd, repeats, device)}


def fit_curve(samples: list[dict], peak_flops: float) -> dict:
    """Fit ``t = launch + groups * flops_per_row * (rows + m_half) / (eff_max * peak)`` to forward times.

    Linear least squares in (launch, 1/(eff_max peak), m_half/(eff_max peak)), weighted by 1/t so that every
    row count counts by its relative error. Each sample needs rows, groups, flops_per_row and fwd_s.
    """
    import torch

    if len(samples) < 3:
        raise ValueError(f"fit_curve needs at least 3 samples, got {len(samples)}")
    a = torch.tensor([[1.0, s["groups"] * s["flops_per_row"] * s["rows"], s["groups"] * s["flops_per_row"]]
                      for s in samples], dtype=torch.float64)
    t = torch.tensor([s["fwd_s"] for s in samples], dtype=torch.float64)
    if (t <= 0).any():
        raise ValueError("fit_curve: every fwd_s must be positive")
    w = (1.0 / t)[:, None]
    coef = torch.linalg.lstsq(a * w, (t * w[:, 0])[:, None]).solution[:, 0]
    launch, inv_rate, half_term = (float(v) for v in coef)
    if inv_rate <= 0:
        raise ValueError(f"fit_curve: time does not grow with rows (slope {inv_rate:.3g}); check the samples")
    eff_max = 1.0 / (inv_rate * peak_flops)
    pred = a @ coef
    return {"eff_max": min(eff_max, 1.0), "eff_max_raw": eff_max, "m_half": max(half_term / inv_rate, 0.0),
            "launch_s": max(launch, 0.0), "median_rel_error": float(((pred - t).abs() / t).median()),
            "bwd_over_fwd": statistics.median((s["fwd_bwd_s"] - s["fwd_s"]) / s["fwd_s"] for s in samples
                                              if "fwd_bwd_s" in s)
            if all("fwd_bwd_s" in s for s in samples) else None}


def provenance(device: torch.device, backend: str) -> dict:
    import torch

    import platform

    prov = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "backend": backend,
            "script": "experiments/calibrate_gpu.py", "dtype": "bfloat16"}
    try:
        import triton

        prov["triton"] = triton.__version__
    except ImportError:
        prov["triton"] = "absent"
    if device.type == "cuda":
        prov["device"] = torch.cuda.get_device_name(device)
        prov["cuda"] = torch.version.cuda
        prov["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        prov["device"] = "cpu"
    try:
        from lrmoe.integrations.provenance import git_commit

        prov["git_commit"] = git_commit(ROOT)
    except ImportError:
        pass
    return prov


def gpu_preset_for(device_name: str) -> str:
    for fragment, preset in GPU_PRESETS.items():
        if fragment in device_name.upper():
            return preset
    raise ValueError(f"no cluster preset for GPU {device_name!r}; known fragments: {sorted(GPU_PRESETS)} "
                     f"(pass --peak-tflops and --preset-out)")


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/calibrate_gpu.jsonl")  # --overwrite also replaces the data file
    parser.add_argument("--models", nargs="+", default=MODELS,
                        help="model presets (lrmoe.config) whose expert shapes are timed")
    parser.add_argument("--groups", nargs="+", type=positive_int_arg, default=[1, 8],
                        help="experts per grouped GEMM call")
    parser.add_argument("--rows", nargs="+", type=positive_int_arg, default=None,
                        help="rows per expert to time (default: 1 to 8192 in 20 steps; --quick 6)")
    parser.add_argument("--repeats", type=positive_int_arg, default=20, help="timed repeats per shape (median)")
    parser.add_argument("--backend", default="torch", choices=["torch", "lrmoe", "loop"],
                        help="grouped GEMM timed: torch's grouped_mm, lrmoe's Triton kernel, or a loop of matmuls")
    parser.add_argument("--peak-tflops", type=positive_float_arg, default=None,
                        help="peak bf16 TFLOP/s (default: the preset)")
    parser.add_argument("--preset-out", default=None, help="data file (default lrmoe/sim/presets/<gpu>_gemm.json)")
    parser.add_argument("--quick", action="store_true", help="a few row counts, 5 repeats")
    parser.add_argument("--cpu", action="store_true", help="run on CPU in float32 (to test the script only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    return parser


def main(argv=None) -> dict | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "calibrate_gpu")
    import torch

    from lrmoe.integrations.tracking import Tracker

    if not torch.cuda.is_available() and not args.cpu:
        print("calibrate_gpu: no CUDA GPU is visible, so nothing was measured and no data file was written; the "
              "cost model keeps its placeholder GEMM constants (see lrmoe/sim/cost.py). Run this on a GPU.")
        return None
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    rows_list = args.rows or (QUICK_ROWS if args.quick else ROWS)
    repeats = 5 if args.quick else args.repeats
    if device.type == "cuda":
        preset = gpu_preset_for(torch.cuda.get_device_name(device))
    else:
        preset = "cpu"
    peak = (args.peak_tflops * 1e12 if args.peak_tflops else
            cluster_preset(preset).peak_flops if preset != "cpu" else None)
    if peak is None:
        raise ValueError("--cpu needs --peak-tflops (the CPU's peak FLOP/s is not a preset)")
    gpu = preset.split("x")[0].split("-")[0]
    preset_out = Path(args.preset_out) if args.preset_out else ROOT / "lrmoe" / "sim" / "presets" / f"{gpu}_gemm.json"
    if preset_out.exists() and not args.overwrite:
        raise FileExistsError(f"{preset_out} exists; pass --overwrite to replace it")
    grouped_mm = pick_grouped_mm(args.backend)
    gen = torch.Generator().manual_seed(args.seed)

    samples: list[dict] = []
    with Tracker("calibrate_gpu", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        for name in args.models:
            model = model_preset(name)
            flops = float(model.pair_fwd_flops)
            for groups in args.groups:
                for rows in rows_list:
                    rec = {"model": name, "flops_per_row": flops,
                           **measure(model.hidden, model.expert_ffn, rows, groups, grouped_mm, device, dtype,
                                     repeats, gen)}
                    rec["tflops"] = groups * rows * flops / rec["fwd_s"] / 1e12
                    run.log(rec)
                    samples.append(rec)
                    print(f"{name:15s} groups={groups:2d} rows={rows:5d} fwd {rec['fwd_s'] * 1e6:9.1f} us "
                          f"({rec['tflops']:6.1f} TFLOP/s)  fwd+bwd {rec['fwd_bwd_s'] * 1e6:9.1f} us", flush=True)
        fits = {name: fit_curve([s for s in samples if s["model"] == name], peak) for name in args.models}
        pooled = fit_curve(samples, peak)
        data = {"provenance": provenance(device, args.backend), "peak_flops": peak, "cluster_preset": preset,
                "pooled": pooled, "fits": fits, "measurements": samples,
                "model": "t = launch_s + groups * flops_per_row * (rows + m_half) / (eff_max * peak_flops)"}
        preset_out.parent.mkdir(parents=True, exist_ok=True)
        preset_out.write_text(json.dumps(data, indent=1))
        run.log_summary({"pooled": pooled, "fits": fits, "preset_out": str(preset_out)})
        print("\n| fit | eff_max | m_half (rows) | launch (us) | median rel. error | bwd/fwd |")
        print("|---|---|---|---|---|---|")
        for label, f in [*fits.items(), ("pooled", pooled)]:
            bwd = "n/a" if f["bwd_over_fwd"] is None else f"{f['bwd_over_fwd']:.2f}"
            print(f"| {label} | {f['eff_max']:.3f} | {f['m_half']:.0f} | {f['launch_s'] * 1e6:.1f} | "
                  f"{f['median_rel_error']:.1%} | {bwd} |")
        print(f"data file: {preset_out}; results: {args.out}")
        if not math.isfinite(pooled["eff_max"]):
            raise RuntimeError("the pooled fit is not finite")
    return data


if __name__ == "__main__":
    main()
