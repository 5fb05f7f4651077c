"""The layer benchmark's tables from its per-rank records (lrmoe.harness.layer_bench_rank): per phase, per policy,
and the three LRMoE targets of DESIGN.md §5.8 (item 5), measured against SYMI-dropless on one trace; and their
printout.
"""

from __future__ import annotations

import pandas as pd

from lrmoe.bytemodel.layout import BYTE_PHASES, PHASES

FWD_BYTES = ("dispatch_a2a", "combine_a2a")
BWD_BYTES = ("combine_a2a_bwd", "bwd_index_a2a", "dispatch_a2a_bwd")


def summarise(raw: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (trace, policy, phase): the slowest rank and the mean over ranks, mean over steps; and per (trace,
    policy): medians over steps of the per-rank times, the slowest rank, bytes, pairs, memory, errors."""
    rows = []
    for (trace, policy), df in raw.groupby(["trace", "policy"], sort=False):
        per_step = df.groupby("step")
        for phase in PHASES:
            if f"{phase}.wall_ms" not in df or df[f"{phase}.wall_ms"].isna().all():
                continue
            row = {"trace": trace, "policy": policy, "phase": phase,
                   "wall_ms_mean": per_step[f"{phase}.wall_ms"].mean().mean(),
                   "wall_ms_max": per_step[f"{phase}.wall_ms"].max().mean(),
                   "cpu_ms_mean": per_step[f"{phase}.cpu_ms"].mean().mean()}
            if phase in BYTE_PHASES:
                row["sent_KiB_mean"] = per_step[f"{phase}.sent_bytes"].mean().mean() / 1024
                row["sent_KiB_max"] = per_step[f"{phase}.sent_bytes"].max().mean() / 1024
                row["recv_KiB_max"] = per_step[f"{phase}.recv_bytes"].max().mean() / 1024
            rows.append(row)
    phases = pd.DataFrame(rows)
    totals = []
    for (trace, policy), df in raw.groupby(["trace", "policy"], sort=False):
        df = df.assign(layer_wall_ms=df["fwd_wall_ms"] + df["bwd_wall_ms"],
                       layer_cpu_ms=df["fwd_cpu_ms"] + df["bwd_cpu_ms"],
                       bwd_bytes=sum(df.get(f"{p}.sent_bytes", 0) for p in BWD_BYTES),
                       fwd_bytes=sum(df.get(f"{p}.sent_bytes", 0) for p in FWD_BYTES),
                       buffer_bytes=df["token_buffer_bytes"] + df.get("bwd_buffer_bytes", 0))
        per_step = df.groupby("step")
        routed = df["pairs_fwd"].sum() + df["pairs_dropped"].sum()
        row = {
            "trace": trace, "policy": policy, "replica_slots": int(df["replica_slots"].iloc[0]),
            "fwd_ms": per_step["fwd_wall_ms"].mean().median(), "bwd_ms": per_step["bwd_wall_ms"].mean().median(),
            "fwd_cpu_ms": per_step["fwd_cpu_ms"].mean().median(),
            "bwd_cpu_ms": per_step["bwd_cpu_ms"].mean().median(),
            "slowest_ms": per_step["layer_wall_ms"].max().median(),
            "slowest_cpu_ms": per_step["layer_cpu_ms"].max().median(),
            "step_ms": per_step["step_wall_ms"].max().median(),
            "fwd_imbalance": (per_step["pairs_fwd"].max() / per_step["pairs_fwd"].mean()).median(),
            "bwd_pairs_max": per_step["pairs_retained"].max().median(),
            "bwd_pairs_mean": per_step["pairs_retained"].mean().median(),
            "bwd_max_over_fwd_mean": (per_step["pairs_retained"].max() / per_step["pairs_fwd"].mean()).median(),
            "retained_pct": 100.0 * df["pairs_retained"].sum() / max(df["pairs_fwd"].sum(), 1),
            "dropped_pct": 100.0 * df["pairs_dropped"].sum() / routed,
            "fwd_a2a_KiB": per_step["fwd_bytes"].sum().median() / 1024,
            "bwd_a2a_KiB": per_step["bwd_bytes"].sum().median() / 1024,
            "buffer_KiB_max": per_step["buffer_bytes"].max().median() / 1024,
            "memory_over_budget": (per_step["memory_bytes"].max() / df["budget_bytes"].iloc[0]).median(),
        }
        for key in ("grad_rel_err", "grad_cos", "dx_rel_err"):
            if key in df:
                row[key] = per_step[key].first().median()  # all ranks hold the same all-reduced value
        totals.append(row)
    return phases, pd.DataFrame(totals)


TARGETS = [  # (name, DESIGN.md §5.8's words, how it is measured, bound)
    ("bwd_balance", "slowest rank carries <= 1.1 x the mean backward pairs", "bwd_pairs_max / bwd_pairs_mean", 1.1),
    ("bwd_bytes", "backward all-to-all bytes <= 0.7 x SYMI-dropless's", "bwd_a2a_KiB / symi-dropless's", 0.7),
    ("cpu_time", "slowest-rank layer CPU time <= 0.75 x SYMI-dropless's", "slowest_cpu_ms / symi-dropless's",
     0.75),
]


def targets(totals: pd.DataFrame, trace: str) -> pd.DataFrame:
    """The LRMoE targets of DESIGN.md §5.8 on ``trace``, for every LRMoE variant that ran (SYMI-dropless present)."""
    df = totals[totals["trace"] == trace].set_index("policy")
    rows = []
    for policy in [p for p in df.index if p.startswith("lrmoe")]:
        me = df.loc[policy]
        mode = policy[policy.index(" ("):] if " (" in policy else ""  # "lrmoe (shard)": SYMI-dropless in that mode
        reference = f"symi-dropless{mode}"
        symi = df.loc[reference] if reference in df.index else None
        values = {"bwd_balance": me["bwd_pairs_max"] / me["bwd_pairs_mean"],
                  "bwd_bytes": me["bwd_a2a_KiB"] / symi["bwd_a2a_KiB"] if symi is not None else float("nan"),
                  "cpu_time": me["slowest_cpu_ms"] / symi["slowest_cpu_ms"] if symi is not None else float("nan")}
        for name, words, how, bound in TARGETS:
            v = values[name]
            rows.append({"trace": trace, "policy": policy, "target": words, "measured_as": how,
                         "measured": v, "bound": bound, "met": bool(v <= bound) if v == v else None})
    return pd.DataFrame(rows)


def target_trace(labels: list[str], skew_params: list[float], skew: str) -> str:
    """The trace the targets are read on: Zipf 0.8 when it ran, else the most skewed synthetic one."""
    for label in labels:
        if label == f"synthetic {skew} 0.8":
            return label
    synthetic = [lab for lab in labels if lab.startswith("synthetic")]
    return synthetic[-1] if synthetic else labels[0]


def tables(records: list[dict], policies: list[str], skew: str, skew_params: list[float]):
    """(raw, phases, totals, target trace, targets) of the per-rank records of one benchmark run: the records as a
    frame in the run's order (traces as they ran, policies as given, then step and rank; a phase a policy never
    ran counted as 0 bytes and pairs), the two summaries of :func:`summarise`, and the targets on the trace of
    :func:`target_trace`."""
    raw = pd.DataFrame(records)
    counted = [c for c in raw if c.endswith("_bytes") or c.startswith("pairs_")]
    raw[counted] = raw[counted].fillna(0)  # a phase a policy never ran moved no bytes
    labels = list(dict.fromkeys(raw["trace"]))
    order = {"policy": {name: i for i, name in enumerate(policies)},
             "trace": {name: i for i, name in enumerate(labels)}}
    raw = raw.sort_values(["trace", "policy", "step", "rank"], kind="stable",
                          key=lambda c: c.map(order[c.name]) if c.name in order else c)
    phases, totals = summarise(raw)
    on = target_trace(labels, skew_params, skew)
    return raw, phases, totals, on, targets(totals, on)


def print_tables(phases: pd.DataFrame, totals: pd.DataFrame, goals: pd.DataFrame, on: str) -> None:
    """The target trace's phases, the per-policy table and the LRMoE targets, as Markdown on stdout."""
    shown = phases[phases["trace"] == on]
    shown = shown.astype(object).where(shown.notna(), None)  # no "nan" for phases that move no bytes
    print(f"Per phase on {on} (all traces in the results file):")
    print(shown.to_markdown(index=False, floatfmt=".3f", missingval=""))
    print()
    print(totals.to_markdown(index=False, floatfmt=".3f"))
    print()
    print(f"LRMoE targets on {on} (benchmarks, not tests):")
    print(goals.to_markdown(index=False, floatfmt=".3f") if len(goals) else "(no LRMoE policy ran)")
