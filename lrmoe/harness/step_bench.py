"""The step benchmark (experiments/bench_step.py): one training step split into its phases, for every system of the
time-to-quality protocol on the emulated engine at its shape (docs/protocols/time_to_quality.md §11.1: 16 ranks,
E 128, top-8, hidden 64, 2 MoE layers, 4 × 64 tokens per rank), for the distributed engine on gloo ranks, and for
the dense single-process reference of the same model on the same tokens (the arithmetic floor).

Each run is a fresh process running experiments/step_probe.py (by file path) over experiments/train.py, so
a second interpreter (``baseline_python``, another checkout's) runs the same arguments through its own code: the
two alternate, run by run, on the same machine. A run's numbers, medians over its steps after the warm-up:

* ``step_s``: the median of rank 0's step-to-step wall times (a training step with its records);
  ``step_amortized_s`` adds the evaluation at the protocol's rate (one every 15 steps), what a run pays per step;
* ``phase_s``: each phase's thread CPU per step, summed over the ranks on the emulated engine (which runs one rank
  at a time, so these add up to its wall time less the hand-offs between ranks, ``hand-off``), the mean rank's on
  the distributed engine (whose ranks run side by side; ``waiting``: the wall time that CPU does not cover);
* ``host_per_layer_ms``: (step − the floor's step) ÷ (ranks × MoE layers) for the emulated engine: the host
  overhead of one MoE layer on one rank in one step;
* ``tokens_per_s`` and the losses of every step (the same maths: compared bit for bit with the baseline).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

def probe_path() -> Path:
    """experiments/step_probe.py, found without importing it (it imports train.py; this module stays below the
    scripts)."""
    from importlib.util import find_spec

    return Path(find_spec("lrmoe.experiments.step_probe").origin)


ENGINES = ("emulated", "distributed")
PHASE_ORDER = ("plan", "forward exchange", "expert compute", "backward exchange", "replica gradients",
               "optimizer and redistribution", "records", "evaluation", "other", "hand-off", "waiting")


def with_values(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with the values of some of its flags replaced."""
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def run_probe(python: str, train_argv: list[str], warmup: int, timeout_s: float) -> dict:
    """One probe run in a fresh process; its ranks' rows, summarised (:func:`summarise`)."""
    with tempfile.TemporaryDirectory(prefix="lrmoe-step-") as tmp:
        argv = [*train_argv, "--out", str(Path(tmp) / "run.jsonl"), "--no-wandb", "--quiet", "--ckpt-every", "0"]
        start = time.perf_counter()
        proc = subprocess.run([python, str(probe_path()), "--out-dir", tmp, "--probe-warmup", str(warmup), "--",
                               *argv], capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - start
        if proc.returncode:
            raise RuntimeError(f"{python} step_probe.py {' '.join(argv)} exited {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    return summarise(ranks, train_argv) | {"process_wall_s": wall}


def summarise(ranks: list[dict], train_argv: list[str], eval_every: int = 15) -> dict:
    """A run's medians and phases from its ranks' probe rows (module doc). The step is the median of rank 0's
    step-to-step wall times (an evaluation step is an outlier the median leaves out); the evaluation is added at the
    protocol's rate (its wall time per evaluation on rank 0 ÷ ``eval_every``): ``step_amortized_s``. Phases are the
    ranks' thread CPU per step, the evaluation's left out and added at that rate; on the emulated engine, the step's
    wall time the ranks' CPU does not cover is ``hand-off``."""
    rank0 = next(r for r in ranks if r["rank"] == 0)
    warmup, starts = rank0["warmup"], rank0["starts"]
    steps = [b - a for a, b in zip(starts[warmup:-1], starts[warmup + 1:])]
    measured, step = len(steps), statistics.median(steps)
    phase = {}
    for r in ranks:
        for name, sec in r["seconds"].items():
            if name != "evaluation":
                phase[name] = phase.get(name, 0.0) + sec / measured
    # the ranks' CPU of a typical step: the median over the steps of its sum over the ranks (like the wall time's,
    # it leaves the evaluation steps out)
    cpu = statistics.median(sum(r["cpu"][i + 1] - r["cpu"][i] for r in ranks) for i in range(warmup, warmup + measured))
    phase["other"] = max(cpu - sum(phase.values()), 0.0)
    engine = train_argv[train_argv.index("--engine") + 1]
    world = int(train_argv[train_argv.index("--ranks") + 1])
    if engine == "emulated":  # one rank at a time: the wall time the ranks' CPU does not cover is their hand-offs
        phase["hand-off"] = max(step - cpu, 0.0)
    else:  # ranks side by side: the mean rank's CPU per phase, and the wall time it does not cover (its waits)
        phase = {name: sec / world for name, sec in phase.items()}
        cpu /= world
        phase["waiting"] = max(step - cpu, 0.0)
    evals = rank0.get("calls", {}).get("evaluation", 0)
    eval_wall = rank0.get("walls", {}).get("evaluation", 0.0) / evals if evals else 0.0
    phase["evaluation"] = eval_wall / eval_every
    tokens = int(train_argv[train_argv.index("--batch") + 1]) * int(train_argv[train_argv.index("--seq-len") + 1])
    return {"engine": engine, "system": train_argv[train_argv.index("--policy") + 1], "ranks": world,
            "steps_measured": measured, "step_s": step, "step_amortized_s": step + eval_wall / eval_every,
            "eval_s": eval_wall, "tokens_per_s": tokens * world / step, "phase_s": phase, "cpu_s": cpu,
            "losses": rank0.get("losses", []), "missing": rank0.get("missing", [])}


def _grouped_reference(cfg, seed: int):
    """The reference MoE layer with its experts as three grouped GEMMs over expert-sorted rows (the package's
    ``swiglu_experts``) instead of a loop over experts: the same function, the floor's arithmetic without a per-expert
    Python call."""
    import torch

    from lrmoe.kernels.grouped_gemm import swiglu_experts
    from lrmoe.runtime.reference import ReferenceMoE

    class GroupedReferenceMoE(ReferenceMoE):
        def expert_outputs(self, x_TD, idx_TK):
            K, idx_P = idx_TK.shape[1], idx_TK.reshape(-1)
            order_P = torch.argsort(idx_P, stable=True)
            offs_E = torch.cumsum(torch.bincount(idx_P, minlength=self.num_experts), 0).to(torch.int32)
            o_PD, h_PF = swiglu_experts(x_TD[order_P // K], self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD, offs_E,
                                        backend="torch", return_hidden=True)
            inverse_P = torch.argsort(order_P)
            return o_PD[inverse_P], h_PF.detach().norm(dim=1)[inverse_P]

    return GroupedReferenceMoE.from_config(cfg, seed=seed)


def floor_step(steps: int, warmup: int, preset: str, ranks: int, batch: int, seq_len: int, seed: int = 2000) -> dict:
    """The arithmetic floor: the same model with reference MoE layers (every expert local, as grouped GEMMs) in one
    process on one thread, one step over the tokens of all ``ranks`` (batch × ranks sequences): forward, backward,
    AdamW."""
    import torch

    from lrmoe.config import layer_seed, model_preset
    from lrmoe.integrations.data import get_batch, load_corpus
    from lrmoe.integrations.model import MoETransformer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = model_preset(preset)
        model = MoETransformer(cfg, lambda i: _grouped_reference(cfg, layer_seed(seed, i)), seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        corpus = load_corpus(None)
        gen = torch.Generator().manual_seed(seed)
        times = []
        for _ in range(steps):
            x, y = get_batch(corpus.train, batch * ranks, seq_len, gen)
            t0 = time.perf_counter()
            loss = model(x, y)[2]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return {"engine": "floor", "model": "dense reference", "ranks": 1, "steps_measured": steps - warmup,
            "step_s": statistics.median(times[warmup:]), "step_amortized_s": statistics.median(times[warmup:]),
            "tokens_per_s": batch * ranks * seq_len / statistics.median(times[warmup:])}


def moe_layers(preset: str) -> int:
    from lrmoe.config import model_preset

    cfg = model_preset(preset)
    return cfg.num_layers - cfg.first_dense_layers


def compare(current: dict, baseline: dict | None, floor: dict, layers: int) -> dict:
    """One (engine, system) row: the current run's numbers, the baseline's beside them, the ratios and whether the
    losses are bitwise the same."""
    row = {k: current[k] for k in ("engine", "system", "ranks", "steps_measured", "step_s", "step_amortized_s",
                                   "eval_s", "tokens_per_s", "cpu_s")}
    row["phase_s"] = current["phase_s"]
    total = sum(current["phase_s"].values())
    row["phase_share"] = {k: v / total for k, v in current["phase_s"].items()} if total else {}
    row["step_over_floor"] = current["step_s"] / floor["step_s"]
    if current["engine"] == "emulated":
        row["host_per_layer_ms"] = 1e3 * (current["step_s"] - floor["step_s"]) / (current["ranks"] * layers)
    if baseline is not None:
        row |= {"baseline_step_s": baseline["step_s"], "baseline_step_amortized_s": baseline["step_amortized_s"],
                "baseline_tokens_per_s": baseline["tokens_per_s"], "baseline_phase_s": baseline["phase_s"],
                "speedup": baseline["step_s"] / current["step_s"],
                "speedup_amortized": baseline["step_amortized_s"] / current["step_amortized_s"],
                "same_losses": current["losses"] == baseline["losses"],
                "max_loss_rel_diff": max((abs(a - b) / abs(b) for a, b in zip(current["losses"], baseline["losses"])),
                                         default=0.0)}
        if current["engine"] == "emulated":
            row["baseline_host_per_layer_ms"] = 1e3 * (baseline["step_s"] - floor["step_s"]) / (
                current["ranks"] * layers)
    return row


def table(rows: list[dict]) -> str:
    """The benchmark's rows as Markdown: step, ratios, the phases' shares."""
    lines = ["| engine | system | step (s) | baseline (s) | speedup (step / with evaluation) | step ÷ floor | "
             "host ms per layer per rank | same losses | largest phases |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r["engine"] == "floor":
            lines.append(f"| floor | {r['model']} | {r['step_s']:.3f} | | | 1 | | | |")
            continue
        shares = sorted(r.get("phase_share", {}).items(), key=lambda kv: -kv[1])[:3]
        lines.append(
            f"| {r['engine']} ({r['ranks']}) | {r['system']} | {r['step_s']:.3f} | "
            + (f"{r['baseline_step_s']:.3f} | {r['speedup']:.2f} / {r['speedup_amortized']:.2f}" if "speedup" in r
               else " | ")
            + f" | {r['step_over_floor']:.1f} | "
            + (f"{r['host_per_layer_ms']:.1f}" if "host_per_layer_ms" in r else "")
            + f" | {r.get('same_losses', '')} | " + ", ".join(f"{k} {100 * v:.0f} %" for k, v in shares) + " |")
    return "\n".join(lines)


def bench(runs: list[tuple[str, str, list[str]]], steps: int, warmup: int, floor_shape: dict,
          baseline_python: str | None, timeout_s: float, log=print) -> list[dict]:
    """Every run (engine, system, train.py arguments) by this checkout's code, each beside the baseline's when one
    is given (alternating which goes first), then the floor (:func:`floor_step` at ``floor_shape``: preset, ranks,
    batch, seq_len); the rows of :func:`compare` and the floor's row."""
    floor = floor_step(max(steps, warmup + 3), warmup, **floor_shape)
    log(f"floor: {floor['step_s']:.3f} s per step (dense reference, "
        f"{floor_shape['ranks'] * floor_shape['batch']} sequences, one thread)")
    rows, flip = [], False
    for engine, system, argv in runs:
        order = [("current", sys.executable), ("baseline", baseline_python)] if baseline_python else \
            [("current", sys.executable)]
        if flip:
            order.reverse()
        flip = not flip
        got = {name: run_probe(python, argv, warmup, timeout_s) for name, python in order}
        row = compare(got["current"], got.get("baseline"), floor, moe_layers(floor_shape["preset"]))
        rows.append(row)
        log(f"{engine} {system}: {row['step_s']:.3f} s per step"
            + (f", baseline {row['baseline_step_s']:.3f} s ({row['speedup']:.2f}x), same losses: "
               f"{row['same_losses']}" if "speedup" in row else ""), flush=True)
    return [*rows, floor]


def summary(rows: list[dict]) -> dict:
    """The targets of the host-path work against the rows: per engine the smallest and median speedup over the
    baseline, whether every run kept the baseline's losses bit for bit, and the emulated engine's host overhead per
    MoE layer and rank-step (largest over the systems)."""
    out: dict = {"floor_step_s": next(r["step_s"] for r in rows if r["engine"] == "floor")}
    for engine in ENGINES:
        mine = [r for r in rows if r["engine"] == engine]
        if not mine:
            continue
        if all("speedup" in r for r in mine):
            out[f"{engine}_speedup_min"] = min(r["speedup"] for r in mine)
            out[f"{engine}_speedup_median"] = statistics.median(r["speedup"] for r in mine)
            out[f"{engine}_speedup_amortized_min"] = min(r["speedup_amortized"] for r in mine)
            out[f"{engine}_same_losses"] = all(r["same_losses"] for r in mine)
        if engine == "emulated":
            out["host_per_layer_ms_max"] = max(r["host_per_layer_ms"] for r in mine)
    out |= {"target_emulated_speedup": 5.0, "goal_emulated_speedup": 10.0, "target_host_per_layer_ms": 10.0,
            "target_distributed_speedup": 2.0}
    return out
