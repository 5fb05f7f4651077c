"""How far to trust the simulator: the cost model's per-phase predictions for the exact plans of a measured
``layer_bench.py`` run, against the times measured per phase, on a CPU "cluster" calibrated on this machine.

    python experiments/validate_sim.py --quick                       # runs a small layer_bench itself, < 1 min
    python experiments/validate_sim.py --bench outputs/layer_bench.jsonl
    python experiments/validate_sim.py --bench B.jsonl --calibration C.json   # reuse a calibration file
    python experiments/validate_sim.py --regimes production weak    # the frontier protocol's measured points

1. *Calibrate* (:mod:`lrmoe.harness.calibrate_cpu`): on as many forked gloo ranks as the benchmark had, at its D and F,
   time the layer's grouped-GEMM SwiGLU (forward and backward) vs rows, ``all_to_all_single`` vs bytes, and Adam;
   fit the cost model's GEMM curve, an all-to-all latency + bytes/bandwidth line and a memory bandwidth. Written
   as a JSON file with its provenance beside the results file; :func:`lrmoe.sim.cost.cpu_gloo_preset` reads it.
2. *Replay the plans*: the benchmark's synthetic traces are regenerated from its run header (same arguments, same
   seed) and fed through fresh policy objects built by ``lrmoe.harness.layer_bench_setup.make_policy``, step by
   step as the layer feeds them (``prev_counts_E`` = the previous step's global counts). The replay is checked
   against what the benchmark counted: every rank's pairs and bytes of every phase, each step, must equal the formulas
   of :mod:`lrmoe.runtime.distributed.accounting` on the replayed plan (the benchmark checked the same formulas on the
   plan it
   ran).
3. *Predict and compare*: ``CostModel.cost(plan)`` per step and rank; per phase the predicted time against the
   measured one (statistics below); error = predicted / measured - 1, per (trace, policy, phase) cell, then its
   median over cells per phase and over all cells (target 4 of DESIGN.md §5.8: median |error| <= 20 %).

Clocks. The layer records each rank's elapsed (``wall``) and CPU (``cpu``) time per phase; the calibration
measures both, and the model is compared with each. The CPU clock is the headline (as in ``layer_bench``'s own
targets): with 4 ranks on 2 shared cores, elapsed time is mostly waiting for a core, for peers, and for other
processes, none of which a per-rank cost model describes, and a rank waiting in a collective uses no CPU.

Which rank's time is "the phase's time": each rank's median over the measured steps (a rank's times have rare
spikes of a few ms, from the Python runtime and the scheduler, that a per-step maximum over ranks picks up about
every other step), then the **slowest rank**, the same statistic on the predicted per-rank times. By the wall clock
a collective's slowest rank also waited for the peers that arrived late (the previous phase's imbalance, which the
model charges to that phase), so the all-to-alls, the gradient collection and the redistribution take the
**fastest rank** there, the last one to arrive, which waits for nobody (the replica sync starts right after the
dense gradients' all-reduce over all ranks, and ranks outside every replica range skip it: the slowest rank). The
literal statistic, the median over steps of each step's slowest rank, is reported beside it
(``step_slowest_median_abs_error``).

Measured points of the frontier protocol (``--regimes``, DESIGN.md §10): per regime, ``layer_bench.py --regime R``
(the regime's arms at its settings, the skew matched to its training runs), one calibration for all, and the same
replay and prediction, now of every phase the model prices; the table: per arm, the slowest rank's CPU time per
step (forward + backward, the bench's headline; also the covered phases alone, and the iteration with the optimizer
step), median over steps, ÷ SYMI-dropless's, measured beside modelled on the same plans, their difference, and where
the time goes per group of phases. A Markdown report beside the results file.

Phases the cost model does not cover, excluded and listed in the output: route, plan, permute, unpermute,
recalibrate, bwd_index_a2a, unpermute_bwd (and shared_fwd / shared_bwd, which the model covers but the layer does
not time). Times on this machine are noisy (2 cores shared by 4 ranks and whatever else runs): every number is a
median, the per-cell spread is large, and two runs of the same command differ by several points of error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from argparse import Namespace
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from lrmoe.analysis.protocol import REGIMES
from lrmoe.bytemodel.layout import BACKWARD_PHASES, FORWARD_PHASES, STEP_PHASES
from lrmoe.bytemodel.layout import PHASES as LAYER_PHASES
from lrmoe.checks import positive_int_arg
from lrmoe.config import model_preset
from lrmoe.runtime.distributed.accounting import expected_layer, expected_step
from lrmoe.harness.calibrate_cpu import CLOCKS, calibrate, spec_for_bench, write_calibration
from lrmoe.harness.layer_bench_setup import make_policy, make_traces, memory_model, system_context
from lrmoe.sim.cost import PHASES as MODEL_PHASES
from lrmoe.sim.cost import CostModel, cpu_gloo_preset
from lrmoe.sim.systems import cost_options
from lrmoe.systems import get_system
from lrmoe.integrations.tracking import Tracker, add_tracking_args, check_tracking_args, read_results, write_report

ROOT = Path(__file__).resolve().parent.parent

LOCAL = ("expert_fwd", "expert_bwd", "adam")  # measured as the slowest rank
COLLECTIVE = ("dispatch_a2a", "combine_a2a", "combine_a2a_bwd", "dispatch_a2a_bwd", "grad_collect", "redistribute")
LOCKSTEP = ("replica_sync",)  # a collective entered in step: the slowest rank
COVERED = tuple(p for p in MODEL_PHASES if p in LOCAL + COLLECTIVE + LOCKSTEP)
EXCLUDED = {
    "route": "router GEMM and top-k on the home rank: not in the cost model",
    "plan": "counts all-gather and the planner on the host: not in the cost model",
    "permute": "local packing of the pairs by destination: the model leaves local permutations out",
    "unpermute": "weighted scatter-add of the outputs at home: local permutation, not modelled",
    "recalibrate": "scoring and selection at home: not in the cost model",
    "bwd_index_a2a": "the compact backward's int32 row-index all-to-all: not a phase of the model",
    "unpermute_bwd": "scatter-add of the input gradients at home: local permutation, not modelled",
    "shared_fwd": "modelled, but the layer does not time the shared expert (and the Qwen debug preset has none)",
    "shared_bwd": "modelled, but the layer does not time the shared expert",
}
TARGET = 0.20  # median |error|: target 4 of DESIGN.md §5.8
QUICK_BENCH = ["--quick", "--no-grad-error"]
LAYER_BENCH = Path(__file__).resolve().parent / "layer_bench.py"
REGIME_STEPS, REGIME_WARMUP = 32, 2  # --regimes: per arm; about 4 minutes a regime at layer_bench's default size
FULL_BENCH = ["--no-grad-error", "--policies", "static-ep", "capacity-cf1", "symi-cf1", "symi-dropless", "lrmoe-m1",
              "lrmoe-m2", "lrmoe-padded"]


# -- the benchmark's results --------------------------------------------------------------------------------------
def read_bench(path: str | Path) -> tuple[dict, pd.DataFrame]:
    """(run config, per-rank-step records) of the last run in a layer_bench results file that has records."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--bench {str(path)!r} is not a file")
    runs = read_results(path, "run")
    records = [r for r in read_results(path) if r.get("table") == "per_rank_step"]
    for run in reversed(runs):
        mine = [r for r in records if r["run_id"] == run["run_id"]]
        if mine and run.get("name") == "layer_bench":
            return run["config"], pd.DataFrame(mine)
    raise ValueError(f"--bench {str(path)!r} holds no layer_bench run with per_rank_step records")


def bench_shapes(config: dict):
    """(model config at the benchmark's D, F and dtype, ranks, E/N home slots, element bytes)."""
    model = model_preset(config["model"])
    model = model.replace(hidden=config["hidden"] or model.hidden, expert_ffn=config["ffn"] or model.expert_ffn,
                          dtype=config["dtype"])
    n = int(config["world_size"])
    return model, n, model.num_experts // n, model.dtype_bytes


# -- replaying the plans ---------------------------------------------------------------------------------------------
def replay_plans(config: dict) -> dict:
    """{(trace, policy): {"plans": [LayerPlan per step], "next": [placement after each step], "backward": cfg}}.

    Every step of the run, warm-up included, in the order the layer plans them. The recorded trace of
    ``--trace`` is replayed when its file is still there (else left out, with a note on stderr)."""
    model, n, base, elem = bench_shapes(config)
    ns = Namespace(**config)
    if ns.trace and not Path(ns.trace).is_file():
        print(f"validate_sim: the recorded trace {ns.trace} is gone; its records are left out", file=sys.stderr)
        ns.trace = None
    out = {}
    for label, counts_INE, tokens in make_traces(ns, n, model.num_experts, model.top_k, model.name):
        buffer_load = 1.0 + ns.eps if ns.buffer_load is None else ns.buffer_load
        memory = memory_model(base, ns.spare_slots, tokens, model.top_k, model.hidden, model.expert_ffn, elem,
                                    buffer_load)
        global_IE = counts_INE.sum(1)
        for name in ns.policies:
            policy, backward = make_policy(
                name, system_context(ns, n, model.num_experts, memory, tokens, model.top_k))
            plans, nxt = [], []
            for step in range(counts_INE.shape[0]):
                prev = global_IE[step - 1] if step else None
                plans.append(policy.plan(counts_INE[step], prev))
                nxt.append(plans[-1].next_placement_NS)
            out[(label, name)] = {"plans": plans, "next": nxt, "backward": backward, "memory": memory}
    return out


def bench_replica_grad(config: dict) -> str:
    """The replica-gradient mode the benchmark ran (one mode: a run comparing both is not a replay target)."""
    mode = config.get("replica_grad", "range")
    modes = [mode] if isinstance(mode, str) else list(mode)
    if len(modes) != 1:
        raise ValueError(f"the benchmark ran replica-gradient modes {modes}; validate a run of one mode")
    return modes[0]


def check_replay(raw: pd.DataFrame, replay: dict, config: dict) -> pd.DataFrame:
    """Every counted quantity of the benchmark (pairs per rank, bytes per phase and rank) against the formulas of
    :mod:`lrmoe.runtime.distributed.accounting` on the replayed plan of the same step. Returns the mismatches (empty:
    the replay
    is the plan the benchmark ran, as far as anything it recorded can tell)."""
    model, n, _, elem = bench_shapes(config)
    warmup = int(config["warmup"])
    bad = []
    for (trace, policy), df in raw.groupby(["trace", "policy"], sort=False):
        if (trace, policy) not in replay:
            continue
        rep = replay[(trace, policy)]
        for step, rows in df.groupby("step"):
            t = int(step) + warmup
            plan = rep["plans"][t]
            want = expected_layer(plan, model.hidden, model.expert_ffn, elem, rep["backward"].metric,
                                         rep["backward"].compact)
            want.update(expected_step(plan.placement_NS, rep["next"][t], model.num_experts, model.hidden,
                                      model.expert_ffn, elem, replica_grad=bench_replica_grad(config)))
            want["replica_slots"] = torch.full((n,), int((plan.placement_NS >= 0).sum()))
            want["floor_excess"] = plan.floor_excess_N
            for rec in rows.to_dict("records"):
                r = int(rec["rank"])
                for key, values in want.items():
                    got = rec.get(key)
                    got = 0 if got is None or got != got else int(got)  # a phase never run counted nothing
                    if got != int(values[r]):
                        bad.append({"trace": trace, "policy": policy, "step": int(step), "rank": r, "key": key,
                                    "counted": got, "replayed": int(values[r])})
    return pd.DataFrame(bad, columns=["trace", "policy", "step", "rank", "key", "counted", "replayed"])


# -- predicted and measured --------------------------------------------------------------------------------------
KEYS = ["clock", "trace", "policy", "phase"]


def bench_cost_model(model, cluster, curve, rep: dict, config: dict, policy: str) -> CostModel:
    """The cost model of one system as the layer benchmark runs it: its registry entry's cost options
    (:func:`lrmoe.sim.systems.cost_options`: planner, quota stage, metric and mode, sync groups, early selection)
    except fixed-size capacity buffers (the layer multiplies only the rows that arrive); every system's optimizer
    state sharded (the layer shards all); the backward's compaction, the bench's budget and replica-gradient mode."""
    options = {k: v for k, v in cost_options(get_system(policy)).items() if k != "capacity_cf"}
    return CostModel(model, cluster, gemm=curve, compaction=rep["backward"].compact, sharded_optimizer=True,
                     mem_budget_bytes=rep["memory"].budget_bytes, replica_grad=bench_replica_grad(config), **options)


def predict(replay: dict, config: dict, calibration: str | Path, clock: str | None = "cpu",
            phases=COVERED) -> pd.DataFrame:
    """Predicted ms per (clock, trace, policy, measured step, phase, rank) on the CPU cluster calibrated by
    ``clock`` (that clock's constants of the calibration file; None: its top-level ones), for ``phases`` of the
    cost model (default: those it covers and the layer times)."""
    model, n, _, _ = bench_shapes(config)
    cluster, curve = cpu_gloo_preset(calibration, n, clock=clock)
    warmup, frames = int(config["warmup"]), []
    phases = list(phases)
    cols = [MODEL_PHASES.index(p) for p in phases]
    for (trace, policy), rep in replay.items():
        cm = bench_cost_model(model, cluster, curve, rep, config, policy)
        for t, plan in enumerate(rep["plans"][warmup:]):
            ms_NC = cm.cost(plan).time_NH[:, cols] * 1e3
            frames.append(pd.DataFrame({"trace": trace, "policy": policy, "step": t,
                                        "phase": [p for _ in range(n) for p in phases],
                                        "rank": [r for r in range(n) for _ in phases],
                                        "predicted_ms": ms_NC.reshape(-1).tolist()}))
    return pd.concat(frames, ignore_index=True).assign(clock=clock or "cpu")


def phase_statistic(phase: str, clock: str) -> str:
    """Which rank's time is the phase's time: "slowest", or "fastest" for a collective by the wall clock (the
    last rank to arrive, see the module doc). By the CPU clock a rank's wait costs no CPU: always the slowest."""
    return "fastest" if clock == "wall" and phase in COLLECTIVE else "slowest"


def measured_phase_ms(raw: pd.DataFrame, clock: str = "cpu", phases=COVERED) -> pd.DataFrame:
    """Measured ms per (clock, trace, policy, step, phase, rank) by ``clock`` (``cpu``: the rank's CPU time,
    ``wall``: elapsed) for those of ``phases`` the layer timed (default: the covered ones); 0 for a rank that
    skipped a phase others ran (e.g. outside every replica range)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    cols = {f"{p}.{clock}_ms": p for p in phases if f"{p}.{clock}_ms" in raw and raw[f"{p}.{clock}_ms"].notna().any()}
    if not cols:
        raise ValueError(f"the benchmark records no {clock}-clock time of any phase of {tuple(phases)}")
    long = raw[["trace", "policy", "step", "rank", *cols]].melt(id_vars=["trace", "policy", "step", "rank"],
                                                                 var_name="phase", value_name="measured_ms")
    long["phase"] = long["phase"].map(cols)
    long["measured_ms"] = long["measured_ms"].fillna(0.0)
    return long.assign(clock=clock, step=long["step"].astype(int), rank=long["rank"].astype(int))


def compare(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """One row per (clock, trace, policy, phase): predicted and measured ms, and the error predicted / measured - 1.

    Both sides alike: each rank's median over the steps, then the slowest rank (or, for a collective by the wall
    clock, the measured fastest rank: :func:`phase_statistic`; the model's collective still ends with its slowest
    rank). Beside it, the literal statistic: the median over steps of each step's slowest rank
    (``*_step_slowest_ms``, ``error_step_slowest``), which the ranks' rare few-ms spikes inflate."""
    both = predicted.merge(measured, on=KEYS + ["step", "rank"], how="inner")
    if both.empty:
        raise ValueError("no (clock, trace, policy, step, phase, rank) is both predicted and measured")
    per_rank = both.groupby(KEYS + ["rank"], sort=False)[["predicted_ms", "measured_ms"]].median().reset_index()
    grouped = per_rank.groupby(KEYS, sort=False)
    cells = grouped["predicted_ms"].max().to_frame()
    cells["measured_slowest_ms"] = grouped["measured_ms"].max()
    cells["measured_fastest_ms"] = grouped["measured_ms"].min()
    step_max = both.groupby(KEYS + ["step"], sort=False)[["predicted_ms", "measured_ms"]].max()
    step_max = step_max.groupby(KEYS, sort=False).median()
    cells["predicted_step_slowest_ms"] = step_max["predicted_ms"]
    cells["measured_step_slowest_ms"] = step_max["measured_ms"]
    cells["steps"] = both.groupby(KEYS, sort=False)["step"].nunique()
    cells = cells.reset_index()
    fastest = [phase_statistic(p, c) == "fastest" for p, c in zip(cells["phase"], cells["clock"])]
    cells["measured_ms"] = cells["measured_slowest_ms"].where(~pd.Series(fastest), cells["measured_fastest_ms"])
    for err, pred, meas in (("error", "predicted_ms", "measured_ms"),
                            ("error_step_slowest", "predicted_step_slowest_ms", "measured_step_slowest_ms")):
        timed = cells[meas] > 0  # a phase that took no measurable time has no relative error (NaN)
        cells[err] = float("nan")
        cells.loc[timed, err] = relative_error(cells.loc[timed, pred], cells.loc[timed, meas])
    return cells


def relative_error(predicted, measured):
    """predicted / measured - 1, elementwise (pandas, torch or floats); measured times must be positive."""
    bad = measured <= 0
    if bool(bad.any() if hasattr(bad, "any") else bad):
        raise ValueError(f"relative_error: measured times must be positive, got {measured}")
    return predicted / measured - 1.0


def phase_table(cells: pd.DataFrame, clock: str = "cpu") -> pd.DataFrame:
    """One row per covered phase that was measured: medians over the (trace, policy) cells of ``clock``, and
    the median |error| by the other clock beside them."""
    rows = []
    for phase in COVERED:
        c = cells[(cells["phase"] == phase) & (cells["clock"] == clock)]
        if c.empty:
            continue
        row = {"phase": phase, "rank": phase_statistic(phase, clock), "cells": len(c),
               "predicted_ms": c["predicted_ms"].median(), "measured_ms": c["measured_ms"].median(),
               "median_error": c["error"].median(), "median_abs_error": c["error"].abs().median()}
        for other in CLOCKS:
            o = cells[(cells["phase"] == phase) & (cells["clock"] == other)]
            if other != clock and not o.empty:
                row[f"{other}_median_abs_error"] = o["error"].abs().median()
        row["step_slowest_median_abs_error"] = c["error_step_slowest"].abs().median()
        rows.append(row)
    return pd.DataFrame(rows)


# -- measured points of the frontier protocol (--regimes) ----------------------------------------------------------
REFERENCE = "symi-dropless"  # the frontier's unit of time
# what one rank's time sums, per statistic: the layer (forward + backward, layer_bench's headline), the phases of it
# the cost model covers and the layer times, and the iteration (with the optimizer step, what the frontier prices)
SPANS = {"layer": FORWARD_PHASES + BACKWARD_PHASES,
         "covered": tuple(p for p in FORWARD_PHASES + BACKWARD_PHASES if p in COVERED),
         "iteration": LAYER_PHASES}
PLAN_KEYS = ["trace", "policy", "step"]


def slowest_rank_ms(frame: pd.DataFrame, value: str, phases) -> pd.Series:
    """Per (trace, policy, step): the slowest rank's sum of ``value`` over ``phases`` (long frame, one row per
    rank and phase)."""
    part = frame[frame["phase"].isin(phases)]
    return part.groupby(PLAN_KEYS + ["rank"], sort=False)[value].sum().groupby(PLAN_KEYS, sort=False).max()


def stragglers_ms(frame: pd.DataFrame, value: str, phases) -> pd.Series:
    """Per (trace, policy, step): the sum over ``phases`` of each phase's slowest rank (the simulator's statistic,
    DESIGN.md §5.3)."""
    part = frame[frame["phase"].isin(phases)]
    return part.groupby(PLAN_KEYS + ["phase"], sort=False)[value].max().groupby(PLAN_KEYS, sort=False).sum()


def ratio_table(predicted: pd.DataFrame, measured: pd.DataFrame, reference: str = REFERENCE) -> pd.DataFrame:
    """Per (trace, policy, span of :data:`SPANS`): the slowest rank's time per step, median over steps, measured
    (CPU clock) and modelled on the same plans, each ÷ ``reference``'s in the same trace; the measured ratio's
    quartiles over the steps (each step's ratio: the policies ran it on the same tokens, in turn); the modelled
    ratio by the simulator's statistic (the sum of per-phase stragglers) beside it. ValueError unless both sides
    hold the same (trace, policy, step) plans and the reference ran in every trace."""
    plans = {side: set(map(tuple, frame[PLAN_KEYS].drop_duplicates().to_numpy().tolist()))
             for side, frame in (("predicted", predicted), ("measured", measured))}
    if plans["predicted"] != plans["measured"]:
        raise ValueError(f"modelled and measured cover different plans: "
                         f"{sorted(plans['predicted'] ^ plans['measured'])[:5]}")
    rows = []
    for span, phases in SPANS.items():
        per_step = pd.DataFrame({"measured": slowest_rank_ms(measured, "measured_ms", phases),
                                 "modelled": slowest_rank_ms(predicted, "predicted_ms", phases),
                                 "stragglers": stragglers_ms(predicted, "predicted_ms", phases)}).reset_index()
        for trace, df in per_step.groupby("trace", sort=False):
            ref = df[df["policy"] == reference].set_index("step")
            if ref.empty:
                raise ValueError(f"{reference} did not run in trace {trace!r}: no unit for the ratios")
            for policy, mine in df.groupby("policy", sort=False):
                mine = mine.set_index("step")
                step_ratio = mine["measured"] / ref["measured"].reindex(mine.index)
                med, ref_med = mine.median(numeric_only=True), ref.median(numeric_only=True)
                rows.append({"trace": trace, "policy": policy, "span": span, "steps": len(mine),
                             "measured_ms": med["measured"], "modelled_ms": med["modelled"],
                             "measured_ratio": med["measured"] / ref_med["measured"],
                             "modelled_ratio": med["modelled"] / ref_med["modelled"],
                             "measured_ratio_q25": step_ratio.quantile(0.25),
                             "measured_ratio_q75": step_ratio.quantile(0.75),
                             "stragglers_ratio": med["stragglers"] / ref_med["stragglers"]})
    table = pd.DataFrame(rows)
    table["difference"] = table["modelled_ratio"] - table["measured_ratio"]
    return table


def in_order(table: pd.DataFrame, policies, column: str, values) -> pd.DataFrame:
    """``table`` sorted by ``column`` in the order of ``values``, then by policy in the order of ``policies``."""
    order = {column: {v: i for i, v in enumerate(values)}, "policy": {p: i for i, p in enumerate(policies)}}
    return table.sort_values([column, "policy"], key=lambda c: c.map(order[c.name]), kind="stable").reset_index(
        drop=True)


# where the layer's time goes, measured beside modelled (the groups partition the layer's and the model's phases)
PHASE_GROUPS = {"expert GEMMs": ("expert_fwd", "expert_bwd", "shared_fwd", "shared_bwd"),
                "all-to-alls": ("early_keep_a2a", "dispatch_a2a", "combine_a2a", "combine_a2a_bwd", "bwd_index_a2a",
                                "dispatch_a2a_bwd", "weight_push"),
                "plan": ("plan",), "recalibrate": ("recalibrate",),
                "not modelled": ("route", "permute", "unpermute", "unpermute_bwd"),
                "optimizer step": STEP_PHASES}


def phase_group_ms(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Per (trace, policy, group of :data:`PHASE_GROUPS`): the slowest rank's ms in the group per step, median over
    steps, measured and modelled."""
    frames = []
    for group, phases in PHASE_GROUPS.items():
        both = pd.DataFrame({"measured_ms": slowest_rank_ms(measured, "measured_ms", phases),
                             "modelled_ms": slowest_rank_ms(predicted, "predicted_ms", phases)})
        med = both.fillna(0.0).groupby(["trace", "policy"], sort=False).median()
        frames.append(med.reset_index().assign(group=group))
    return pd.concat(frames, ignore_index=True)


def plan_facts(raw: pd.DataFrame) -> pd.DataFrame:
    """Per (trace, policy): slots per rank, the retained share of the forward pairs (%), and static EP's slowest
    rank ÷ mean forward pairs (median over steps), from what the benchmark counted."""
    rows = []
    for (trace, policy), df in raw.groupby(["trace", "policy"], sort=False):
        per_step = df.groupby("step")
        rows.append({"trace": trace, "policy": policy, "slots_per_rank": int(df["slots_per_rank"].iloc[0]),
                     "retained_pct": 100.0 * df["pairs_retained"].sum() / max(df["pairs_fwd"].sum(), 1),
                     "fwd_imbalance": float((per_step["pairs_fwd"].max() / per_step["pairs_fwd"].mean()).median())})
    return pd.DataFrame(rows)


def regime_point(config: dict, raw: pd.DataFrame, calibration: Path, cal: dict) -> tuple[pd.DataFrame, dict]:
    """One regime's measured point: the replayed plans (checked against what the bench counted), the cost model's
    prediction of every phase for them on the CPU calibration, the ratio table with the plans' facts, and the
    per-phase error of the covered phases (CPU clock). SystemExit when the replay is not the run."""
    replay = replay_plans(config)
    mismatches = check_replay(raw, replay, config)
    if len(mismatches):
        raise SystemExit(f"validate_sim.py: error: the replayed plans of regime {config['regime']} differ from the "
                         f"bench's in {len(mismatches)} counted quantities:\n{fmt(mismatches.head(5))}")
    clock = "cpu" if "clocks" in cal else None
    predicted = predict(replay, config, calibration, clock, phases=MODEL_PHASES)
    measured = measured_phase_ms(raw, "cpu", phases=LAYER_PHASES)
    table = ratio_table(predicted, measured).merge(plan_facts(raw), on=["trace", "policy"], how="left")
    table = in_order(table, config["policies"], "span", SPANS)
    groups = in_order(phase_group_ms(predicted, measured), config["policies"], "group", PHASE_GROUPS)
    groups = groups.assign(regime=config["regime"])
    cells = compare(predicted[predicted["phase"].isin(COVERED)], measured[measured["phase"].isin(COVERED)])
    match = config["regime_match"]
    info = {"regime": config["regime"], "zipf_s": match["zipf_s"], "runs": match["runs"], "trace": match["trace"],
            "spare_slots": config["spare_slots"], "eps": config["eps"], "gamma": config["gamma"],
            "rhos": match["rhos"], "steps": int(config["steps"]), "rank_steps": len(raw),
            "covered_median_abs_error": float(cells["error"].abs().median())}
    return table.assign(regime=config["regime"]), groups, info


def regime_plot(table: pd.DataFrame, infos: dict):
    """Per regime: each arm's layer time ÷ SYMI-dropless's, measured (median, bar: quartiles over the steps)
    beside modelled for the same plans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lrmoe.paper_figures import style

    style.apply()
    layer = table[table["span"] == "layer"]
    regimes = list(dict.fromkeys(layer["regime"]))
    fig, axes = plt.subplots(1, len(regimes), figsize=(6.0 * len(regimes) + 2.0, 4.4), sharey=True, squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        df = layer[layer["regime"] == regime].reset_index(drop=True)
        y = range(len(df))
        # the quartiles are the per-step ratios', the point the ratio of the medians: it may lie outside them
        ax.hlines(list(y), df["measured_ratio_q25"], df["measured_ratio_q75"], color="0.4", lw=1.2,
                  label="measured, quartiles of the per-step ratio")
        ax.scatter(df["measured_ratio"], y, marker="o", s=26, color="black", zorder=3,
                   label="measured (CPU, medians)")
        ax.scatter(df["modelled_ratio"], y, marker="D", s=28, color="#d62728", zorder=3,
                   label="modelled (cost model, same plans)")
        ax.axvline(1, color="0.6", lw=0.8, ls=":")
        ax.set_yticks(list(y), df["policy"])
        info = infos[regime]
        ax.set(xlabel="÷ SYMI-dropless's",
               title=f"regime {regime}: Zipf s {info['zipf_s']:.3f}\nstatic EP slowest rank ÷ mean "
                     f"{info['trace']['rank_max_over_mean']:.3f} (runs {info['runs']['rank_max_over_mean']:.3f})")
        ax.title.set_fontsize(9)
    axes[0][0].invert_yaxis()  # the axes share y: inverting one inverts all
    style.legend_outside(axes[0][-1])
    fig.supxlabel("slowest-rank layer CPU time (forward + backward) ÷ SYMI-dropless's, median over steps", fontsize=9)
    fig.tight_layout()
    return fig


def regime_report(table: pd.DataFrame, groups: pd.DataFrame, infos: dict, cal_path: Path, config: dict,
                  figure: str) -> str:
    model, n, base, _ = bench_shapes(config)
    lines = [f"# Measured points of the frontier protocol: the real layer on {n} gloo ranks (CPU)", "",
             f"![measured vs modelled]({figure})", "",
             f"The layer of `experiments/layer_bench.py --regime R` ({model.name}, E = {model.num_experts}, "
             f"k = {model.top_k}, D = {model.hidden}, F = {model.expert_ffn}, {config['tokens_per_rank']} tokens per "
             f"rank, {config['dtype']}), every arm of the regime in turn inside each step on the same tokens; the "
             f"cost model priced with this machine's CPU calibration (`{cal_path.name}`) on the same plans (replayed "
             "and checked against every pair and byte the bench counted). Times are CPU times of a 2-core machine "
             "shared with other work: ratios, never GPU results.", "",
             "Statistic: per step, the slowest rank's CPU time summed over the layer's forward and backward phases "
             "(the bench's headline), median over steps, ÷ SYMI-dropless's; the model's the same on its predicted "
             "per-rank phase times. `q25`–`q75`: quartiles of the per-step measured ratio. `stragglers`: the "
             "simulator's statistic (the sum over phases of each phase's slowest rank) of the model. `difference`: "
             "modelled − measured ratio.", ""]
    for regime, info in infos.items():
        df = table[table["regime"] == regime]
        runs, trace = info["runs"], info["trace"]
        lines += [f"## Regime {regime}", "",
                  f"{REGIMES[regime].description}. Settings: {info['spare_slots']} spare slot(s) per rank beside "
                  f"{base} home slots, ε {info['eps']:g}, γ {info['gamma']:g}, ρ ∈ {info['rhos']}; Zipf s "
                  f"{info['zipf_s']:.4f}, matched to the runs' static-EP slowest rank ÷ mean "
                  f"{runs['rank_max_over_mean']:.3f} ({runs['runs']} runs) at the bench's own trace: the replayed "
                  f"trace has {trace['rank_max_over_mean']:.3f} "
                  f"(per-expert Gini {trace['gini']:.3f} against the runs' {runs['gini']:.3f}; hottest ÷ mean "
                  f"{trace['expert_max_over_mean']:.2f} against {runs['expert_max_over_mean']:.2f}, not matched). "
                  f"{info['steps']} measured steps per arm. Median |error| of the model over the covered phases' "
                  f"cells: {info['covered_median_abs_error']:.1%}.", ""]
        layer = df[df["span"] == "layer"]
        cols = ["policy", "slots_per_rank", "retained_pct", "measured_ms", "measured_ratio", "measured_ratio_q25",
                "measured_ratio_q75", "modelled_ratio", "difference", "stragglers_ratio"]
        lines += ["Layer (forward + backward), slowest rank:", "", fmt(layer[cols]), ""]
        wide = df.pivot_table(index="policy", columns="span", values=["measured_ratio", "modelled_ratio"],
                              sort=False)
        wide.columns = [f"{span} {side.replace('_ratio', '')}" for side, span in wide.columns]
        order = [f"{span} {side}" for span in ("covered", "iteration") for side in ("measured", "modelled")]
        lines += ["The covered phases only (both sides the same phases) and the iteration (with the optimizer "
                  "step), ÷ SYMI-dropless's:", "", wide[order].reset_index().to_markdown(index=False, floatfmt=".3f"),
                  ""]
        g = groups[groups["regime"] == regime]
        cells = g.assign(ms=[f"{a:.2f} / {b:.2f}" for a, b in zip(g["measured_ms"], g["modelled_ms"])])
        cells = cells.pivot_table(index="policy", columns="group", values="ms", aggfunc="first", sort=False)
        lines += ["Where the time goes: slowest rank's ms per step in each group of phases, median over steps, "
                  "measured / modelled:", "", cells[list(PHASE_GROUPS)].reset_index().to_markdown(index=False), ""]
    return "\n".join(lines)


def regimes_main(args) -> pd.DataFrame:
    """--regimes: run layer_bench at each regime's settings, calibrate once, price the same plans, report."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    benches = {r: read_bench(bench_path(args, r) if args.reuse_benches else run_bench(args, out.parent, r))
               for r in tqdm(args.regimes, desc="regimes", unit="regime")}
    shapes = {json.dumps({k: c[k] for k in ("model", "hidden", "ffn", "tokens_per_rank", "dtype", "world_size",
                                            "spare_slots")}, sort_keys=True) for c, _ in benches.values()}
    if len(shapes) != 1:
        raise SystemExit(f"validate_sim.py: error: the regimes' benches differ in shape ({shapes}): one calibration "
                         "cannot price them")
    first = next(iter(benches.values()))[0]
    cal_path, cal = calibration_file(args, first, out.parent)
    tables, groups, infos = [], [], {}
    for regime, (config, raw) in benches.items():
        table, group, infos[regime] = regime_point(config, raw, cal_path, cal)
        tables.append(table)
        groups.append(group)
    table, groups = pd.concat(tables, ignore_index=True), pd.concat(groups, ignore_index=True)
    config_out = {**vars(args), "benches": {r: str(bench_path(args, r)) for r in benches},
                  "calibration": str(cal_path)}
    with Tracker("validate_sim", config_out, results=out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        run.log_table("calibration", constants_table(cal), calibration_file=str(cal_path))
        run.log_table("regime_ratio", table)
        run.log_table("regime_phase_group", groups)
        run.log_summary({"regimes": infos, "reference": REFERENCE, "calibration": str(cal_path),
                         **{f"{r['regime']}/{r['policy']}/{r['span']}/{side}": r[f"{side}_ratio"]
                            for r in table.to_dict("records") for side in ("measured", "modelled")}})
        import matplotlib.pyplot as plt

        fig = regime_plot(table, infos)
        figs = run.log_figure("ratios", fig)
        plt.close(fig)
    text = regime_report(table, groups, infos, cal_path, first, figs[0].name)
    if isinstance(args.reuse_benches, str):  # a re-pricing: say whose measurements these are
        names = ", ".join(f"`{bench_path(args, r).name}`" for r in benches)
        source = Path(args.reuse_benches).name
        text = text.replace("\n", f"\n\nRe-priced: the measured side is the benchmarks of `{source}` ({names}), "
                            "measured earlier; the modelled side is the cost model of this commit.\n", 1)
    report = write_report(out, text)
    print(text)
    print(f"results: {out}; figure: {figs[0]}; report: {report}")
    return table


# -- the script --------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default=None, help="a layer_bench results file (default: run a small one first)")
    p.add_argument("--calibration", default=None,
                   help="reuse this CPU calibration file (default: measure, and write <out>_cpu_calibration.json)")
    p.add_argument("--quick", action="store_true", help="small benchmark and calibration, about a minute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=None,
                   help="measured points of the frontier protocol: layer_bench --regime R for each (its arms at its "
                        "settings), one calibration, and per regime every arm's slowest-rank CPU time ÷ "
                        "SYMI-dropless's, measured beside modelled for the same plans (a Markdown report beside --out)")
    p.add_argument("--steps", type=positive_int_arg, default=REGIME_STEPS,
                   help="--regimes: measured iterations per arm (--quick: layer_bench's quick size)")
    p.add_argument("--runs", default=None,
                   help="--regimes: the protocol's collected runs the skew is matched to (default: layer_bench's)")
    p.add_argument("--reuse-benches", nargs="?", const=True, default=False, metavar="RESULTS",
                   help="--regimes: price the benchmarks an earlier run wrote beside its results file RESULTS "
                        "(default --out; <results>_layer_bench_<regime>.jsonl) instead of measuring again, e.g. "
                        "to re-price a committed measured point after a change to the cost model")
    add_tracking_args(p, "outputs/validate_sim.jsonl")
    args = p.parse_args(argv)
    outputs = {}
    if args.regimes:
        if args.bench:
            p.error("--regimes runs its own benchmarks: no --bench")
        args.regimes = list(dict.fromkeys(args.regimes))
        if args.reuse_benches:
            missing = [str(bench_path(args, r)) for r in args.regimes if not bench_path(args, r).is_file()]
            if missing:
                p.error(f"--reuse-benches: no earlier benchmark {', '.join(missing)}")
        else:
            outputs = {f"the {r} benchmark": bench_path(args, r) for r in args.regimes}
        if not args.calibration:
            outputs["the calibration"] = calibration_path(args)
    check_tracking_args(p, args, "validate_sim", outputs=outputs, report=bool(args.regimes))
    return args


def bench_path(args, regime: str | None = None) -> Path:
    """Where the layer benchmark this script runs writes its results: beside --out, named for it (and the regime);
    with --reuse-benches RESULTS, where an earlier run wrote them beside RESULTS."""
    out = Path(args.reuse_benches if isinstance(args.reuse_benches, str) else args.out)
    return out.with_name(f"{out.stem}_layer_bench{f'_{regime}' if regime else ''}.jsonl")


def calibration_path(args) -> Path:
    out = Path(args.out)
    return out.with_name(f"{out.stem}_cpu_calibration.json")


def run_bench(args, out_dir: Path, regime: str | None = None) -> Path:
    """Run layer_bench (small, or at a regime's settings) into the output folder; returns its results file."""
    path = bench_path(args, regime)
    if regime:
        argv = ["--regime", regime, "--no-grad-error",
                *(["--quick"] if args.quick else ["--steps", str(args.steps), "--warmup", str(REGIME_WARMUP)]),
                *(["--runs", args.runs] if args.runs else [])]
    else:
        argv = QUICK_BENCH if args.quick else FULL_BENCH
    argv = [*argv, "--seed", str(args.seed), "--out", str(path)]
    argv += ["--overwrite"] if args.overwrite else ["--resume"] if args.resume else []
    argv += ["--no-wandb"] if args.no_wandb else []
    print(f"== layer_bench {' '.join(argv)}", flush=True)
    code = subprocess.run([sys.executable, str(LAYER_BENCH), *argv]).returncode
    if code:
        raise SystemExit(f"validate_sim.py: error: layer_bench.py {' '.join(argv)} exited with {code}")
    return path


def calibration_file(args, config: dict, out_dir: Path) -> tuple[Path, dict]:
    if args.calibration:
        path = Path(args.calibration)
        if not path.is_file():
            raise ValueError(f"--calibration {str(path)!r} is not a file")
        return path, json.loads(path.read_text())
    model, n, base, _ = bench_shapes(config)
    spec = spec_for_bench(n, model.hidden, model.expert_ffn, model.num_experts, model.top_k,
                          int(config["tokens_per_rank"]), base + int(config["spare_slots"]), config["dtype"],
                          quick=args.quick, seed=args.seed)
    t0 = time.time()
    data = calibrate(spec)
    data["provenance"]["seconds"] = round(time.time() - t0, 1)
    data["provenance"]["for_bench"] = {k: config[k] for k in ("model", "hidden", "ffn", "tokens_per_rank", "dtype",
                                                              "world_size")}
    path = calibration_path(args)
    write_calibration(data, path, overwrite=args.overwrite or args.resume)
    return path, data


def plot(cells: pd.DataFrame, table: pd.DataFrame, clock: str, title: str):
    """Left: predicted vs measured ms of every (trace, policy, phase) cell by ``clock``; right: the error per phase,
    both clocks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})
    mine = cells[cells["clock"] == clock]
    sns.scatterplot(mine, x="measured_ms", y="predicted_ms", hue="phase", style="phase", ax=ax, s=40)
    positive = pd.concat([mine["measured_ms"], mine["predicted_ms"]])
    positive = positive[positive > 0]
    xs = [float(positive.min()) * 0.7, float(positive.max()) * 1.4]
    ax.plot(xs, xs, color="black", lw=1, label="predicted = measured")
    for f in (1 + TARGET, 1 - TARGET):
        ax.plot(xs, [x * f for x in xs], color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", yscale="log", xlim=xs, ylim=xs, xlabel=f"measured ms, {clock} clock (median over steps)",
           ylabel="predicted ms (cost model)", title="each (trace, policy, phase); dashed: ±20 %")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    with warnings.catch_warnings():  # seaborn's boxplot uses an argument matplotlib deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        sns.boxplot(cells, x="phase", y="error", hue="clock", hue_order=list(CLOCKS), order=list(table["phase"]),
                    ax=bx, fliersize=2)
    bx.axhspan(-TARGET, TARGET, color="green", alpha=0.1)
    bx.axhline(0, color="black", lw=0.8)
    bx.set(ylabel="predicted / measured - 1", xlabel="", title="prediction error per phase")
    bx.tick_params(axis="x", rotation=50)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def fmt(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    return df.to_markdown(index=False, floatfmt=floatfmt)


def constants_table(cal: dict) -> pd.DataFrame:
    """The calibrated constants of each clock, in readable units, with the fits' median relative errors."""
    rows = []
    for clock in CLOCKS:
        c = cal.get("clocks", {}).get(clock, cal if clock == cal.get("clock", "cpu") else None)
        if c is None:
            continue
        fits = c.get("fits", {})
        rows.append({"clock": clock, "GEMM GFLOP/s": c["peak_flops"] / 1e9, "m_half rows": c["gemm"]["m_half"],
                     "launch us": c["gemm"]["launch_s"] * 1e6, "a2a latency us": c["a2a_latency"] * 1e6,
                     "a2a GB/s": c["a2a_bw"] / 1e9, "mem copy GB/s": c["mem_bw"] / 1e9,
                     "GEMM fit err": fits.get("gemm", {}).get("median_rel_error", float("nan")),
                     "GEMM fwd err": fits.get("gemm", {}).get("median_rel_error_fwd", float("nan")),
                     "GEMM bwd err": fits.get("gemm", {}).get("median_rel_error_bwd", float("nan")),
                     "a2a fit err": fits.get("a2a", {}).get("median_rel_error", float("nan"))})
        sized = [m for m in c.get("measurements", {}).get("a2a", []) if m["bytes_sent"] > 0 and "p2p_seconds" in m]
        if sized:  # the diagnostic: the layer's point-to-point exchange against the all-to-all, same bytes
            rows[-1]["a2a ms (median)"] = statistics.median(m["seconds"] for m in sized) * 1e3
            rows[-1]["p2p ms (median, not used)"] = statistics.median(m["p2p_seconds"] for m in sized) * 1e3
    return pd.DataFrame(rows)


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    if args.regimes:
        return regimes_main(args)
    out = Path(args.out)
    if out.exists() and not (args.overwrite or args.resume):  # fail before any benchmark runs
        raise FileExistsError(f"results file {out} exists; pass --overwrite to replace it or --resume to append")
    out.parent.mkdir(parents=True, exist_ok=True)
    bench_path = Path(args.bench) if args.bench else run_bench(args, out.parent)
    config, raw = read_bench(bench_path)
    cal_path, cal = calibration_file(args, config, out.parent)
    replay = replay_plans(config)
    mismatches = check_replay(raw, replay, config)
    clocks = [c for c in CLOCKS if c in cal.get("clocks", {})] or [cal.get("clock", "cpu")]
    primary = clocks[0]
    cells = pd.concat([compare(predict(replay, config, cal_path, c if "clocks" in cal else None).assign(clock=c),
                               measured_phase_ms(raw, c)) for c in clocks], ignore_index=True)
    table = phase_table(cells, primary)
    med = {c: float(cells.loc[cells["clock"] == c, "error"].abs().median()) for c in clocks}
    med_slowest = {c: float(cells.loc[cells["clock"] == c, "error_step_slowest"].abs().median()) for c in clocks}
    mine = cells[cells["clock"] == primary]
    model, n, _, _ = bench_shapes(config)
    totals = cells.groupby(["clock", "trace", "policy"], sort=False)[["predicted_ms", "measured_ms"]].sum()
    totals = totals.reset_index()
    totals["error"] = relative_error(totals["predicted_ms"], totals["measured_ms"])
    consts = constants_table(cal)
    config_out = {**vars(args), "bench": str(bench_path), "calibration": str(cal_path)}
    with Tracker("validate_sim", config_out, results=out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        run.log_table("calibration", consts, calibration_file=str(cal_path))
        run.log_table("replay_mismatch", mismatches)
        run.log_table("cell", cells)
        run.log_table("covered_total", totals)
        run.log_table("phase", table, clock=primary)
        for phase, why in EXCLUDED.items():
            run.log({"table": "excluded", "phase": phase, "reason": why})
        run.log_summary({"clock": primary, "median_abs_error": med[primary],
                         "median_abs_error_by_clock": med, "median_abs_error_slowest_rank_by_clock": med_slowest,
                         "target": TARGET, "target_met": med[primary] <= TARGET,
                         "replay_mismatches": len(mismatches), "cells": len(mine), "bench": str(bench_path),
                         "calibration": str(cal_path)})
        fig = plot(cells, table, primary, f"cost model vs measured layer: {n} gloo ranks, {model.name} "
                                          f"D={model.hidden} F={model.expert_ffn}, {config['tokens_per_rank']} "
                                          f"tokens/rank")
        figs = run.log_figure("predicted_vs_measured", fig)
        import matplotlib.pyplot as plt

        plt.close(fig)

    prov = cal.get("provenance", {})
    print(f"\nCPU calibration: {cal_path} ({prov.get('date', '?')}, {prov.get('device', '?')}, torch "
          f"{prov.get('torch', '?')}); fit errors are median relative errors over the micro-benchmark sizes")
    print(fmt(consts, ".3g"))
    print("(a2a / p2p ms: medians over the micro-benchmark's packet sizes of the layer's all-to-all and of its "
          "point-to-point exchange; the cost model charges gradient collection and redistribution, which run as "
          "point-to-point exchanges, as all-to-alls)")
    if len(mismatches):
        print(f"\nReplay: {len(mismatches)} counted quantities differ from the replayed plans (first ones below); "
              f"the predictions are for plans the benchmark did not run.")
        print(fmt(mismatches.head(10)))
    else:
        print(f"\nReplay: the replayed plans reproduce every pair and byte the benchmark counted "
              f"({raw.shape[0]} rank-steps).")
    print("\nExcluded phases (not covered by the cost model, or not timed by the layer):")
    for phase, why in EXCLUDED.items():
        print(f"* {phase}: {why}")
    print("\nSum of the covered phases per (trace, policy), medians over steps:")
    print(fmt(totals))
    steps = int(cells["steps"].max())
    for c in clocks:
        print(f"\nMedian |error| over the {int((cells['clock'] == c).sum())} (trace, policy, phase) cells, {c} "
              f"clock: {med[c]:.1%} (target <= {TARGET:.0%}: {'met' if med[c] <= TARGET else 'not met'}); against "
              f"the literal slowest rank of every phase: {med_slowest[c]:.1%}.")
    print(f"Times are medians over {steps} noisy steps on a shared CPU. results: {out}; figure: {figs[0]}")
    print(f"\nPrediction error per covered phase, {primary} clock (medians over "
          f"{mine.groupby(['trace', 'policy']).ngroups} trace x policy cells):")
    print(fmt(table))
    return table


if __name__ == "__main__":
    main()
