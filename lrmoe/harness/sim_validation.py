"""The cost model against a measured layer benchmark: replay the exact plans a ``experiments/layer_bench.py`` run
executed, price them with the cost model on a CPU "cluster" calibrated on this machine
(:mod:`lrmoe.harness.calibrate_cpu`), and compare per phase and per system (``experiments/validate_sim.py`` runs it
and writes the reports).

*Replay the plans*: the benchmark's synthetic traces are regenerated from its run header (same arguments, same seed)
and fed through fresh policy objects built by :func:`lrmoe.harness.layer_bench_setup.make_policy`, step by step as
the layer feeds them (``prev_counts_E`` = the previous step's global counts). :func:`check_replay` holds the replay
against what the benchmark counted: every rank's pairs and bytes of every phase, each step, must equal the formulas
of :mod:`lrmoe.runtime.distributed.accounting` on the replayed plan (the benchmark checked the same formulas on the
plan it ran).

*Predict and compare*: ``CostModel.cost(plan)`` per step and rank; per phase the predicted time against the measured
one; error = predicted / measured - 1, per (trace, policy, phase) cell (:func:`compare`), then its median over cells
per phase (:func:`phase_table`). Per system (:func:`ratio_table`): the slowest rank's time per step over a span of
phases, ÷ the reference system's, measured beside modelled on the same plans.

Clocks. The layer records each rank's elapsed (``wall``) and CPU (``cpu``) time per phase; the calibration measures
both, and the model is compared with each. With 4 ranks on 2 shared cores, elapsed time is mostly waiting for a
core, for peers, and for other processes, none of which a per-rank cost model describes, and a rank waiting in a
collective uses no CPU: the CPU clock is the headline.

Which rank's time is "the phase's time": each rank's median over the measured steps (a rank's times have rare spikes
of a few ms, from the Python runtime and the scheduler, that a per-step maximum over ranks picks up about every other
step), then the **slowest rank**, the same statistic on the predicted per-rank times. By the wall clock a
collective's slowest rank also waited for the peers that arrived late (the previous phase's imbalance, which the
model charges to that phase), so the all-to-alls, the gradient collection and the redistribution take the **fastest
rank** there, the last one to arrive, which waits for nobody (the replica sync starts right after the dense
gradients' all-reduce over all ranks, and ranks outside every replica range skip it: the slowest rank). The literal
statistic, the median over steps of each step's slowest rank, is reported beside it
(``step_slowest_median_abs_error``).
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pandas as pd
import torch

from lrmoe.bytemodel.layout import BACKWARD_PHASES, FORWARD_PHASES, STEP_PHASES
from lrmoe.bytemodel.layout import PHASES as LAYER_PHASES
from lrmoe.config import model_preset
from lrmoe.harness.calibrate_cpu import CLOCKS
from lrmoe.harness.layer_bench_setup import make_policy, make_traces, memory_model, system_context
from lrmoe.results import read_results
from lrmoe.runtime.distributed.accounting import expected_layer, expected_step
from lrmoe.sim.cost import PHASES as MODEL_PHASES
from lrmoe.sim.cost import CostModel, cpu_gloo_preset
from lrmoe.sim.simulator import iter_plans
from lrmoe.sim.simulated_systems import cost_options
from lrmoe.systems import get_system

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
        for name in ns.policies:
            policy, backward = make_policy(
                name, system_context(ns, n, model.num_experts, memory, tokens, model.top_k))
            plans = [plan for _, _, plan in iter_plans(counts_INE[:, None], lambda: policy)]  # as the simulator
            nxt = [plan.next_placement_NS for plan in plans]
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
    (:func:`lrmoe.sim.simulated_systems.cost_options`: planner, quota stage, metric and mode, sync groups, early
    selection)
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
