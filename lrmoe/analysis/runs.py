"""Convergence runs read back: one row per (system, seed) and per system over seeds, and the equal-quality table
(the step and modelled time at which a validation curve first reaches the reference's loss).

Reads the per-step records of experiments/train.py runs (``step``, ``val_loss``, ``modelled_s`` and the load
columns) gathered by experiments/convergence.py, a ``policy`` and a ``seed`` column per record, and a cumulative
``time_s``. Used by experiments/convergence.py, experiments/frontier.py and the convergence notebook.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

BASELINE = "static-ep"


def argv_flags(argv: list[str]) -> dict[str, str | bool]:
    """A command line's flags: ``--name value`` as ``{"--name": "value"}``, a flag without a value as True (the
    last of a repeated flag wins; a flag's several values, as for --policies, are joined by spaces)."""
    flags: dict[str, str | bool] = {}
    flag = None
    for arg in argv:
        if arg.startswith("--"):
            flag = arg
            flags[flag] = True
        elif flag is not None:
            flags[flag] = arg if flags[flag] is True else f"{flags[flag]} {arg}"
    return flags


def _same(stored, given: str | bool) -> bool:
    if given is True:
        return stored is True
    if isinstance(stored, bool) or stored is None:
        return False
    try:
        return float(stored) == float(given)
    except (TypeError, ValueError):
        return " ".join(map(str, stored)) == given if isinstance(stored, list) else str(stored) == given


def config_differences(config: dict, argv: list[str], ignore=(), switches=()) -> list[str]:
    """How a run's stored configuration (its results header's ``config``: the script's parsed arguments) differs
    from the command line ``argv`` that would make it now: one "--flag: was X, now Y" per difference. Only the
    flags the configuration knows are compared (``ignore``: paths and modes that do not change a run's results);
    ``switches``: valueless flags compared also when ``argv`` leaves them out (off)."""
    flags = argv_flags(argv)
    diffs = []
    for flag in dict.fromkeys([*flags, *switches]):
        key = flag[2:].replace("-", "_")
        if flag in ignore or key not in config:
            continue
        given = flags.get(flag, False)
        if given is False:
            if config[key] not in (False, None):
                diffs.append(f"{flag}: was on, now off")
        elif not _same(config[key], given):
            diffs.append(f"{flag}: was {config[key]}, now {'on' if given is True else given}")
    return diffs


def last_per_step(records: list[dict]) -> list[dict]:
    """One record per step (a resumed run may have logged a step twice: the later one wins)."""
    by_step = {}
    for rec in records:
        by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def spread(values) -> dict:
    """Mean, standard deviation (0 for one value), min and max of the finite values, and how many there were."""
    v = np.asarray([x for x in values if x == x], dtype=float)
    if not len(v):
        return {"mean": np.nan, "std": np.nan, "min": np.nan, "max": np.nan, "n": 0}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "n": int(len(v))}


def loss_at_step(steps, val_loss, step: float) -> float:
    """The validation curve at ``step``, linearly interpolated between evaluations (NaN outside them)."""
    steps, val_loss = np.asarray(steps, float), np.asarray(val_loss, float)
    if not len(steps) or step < steps[0] or step > steps[-1]:
        return np.nan
    return float(np.interp(step, steps, val_loss))


def time_to_loss(steps, times, val_loss, target: float) -> tuple[float, float]:
    """(step, time) at which the validation curve first reaches ``target`` (loss <= target), linearly
    interpolated between the evaluation before and the one at the crossing; (NaN, NaN) if it never does.
    ``times`` is the cumulative time at each evaluation's step."""
    steps, times, val_loss = (np.asarray(a, float) for a in (steps, times, val_loss))
    for i, loss in enumerate(val_loss):
        if loss <= target:
            if i == 0 or val_loss[i - 1] == loss:
                return float(steps[i]), float(times[i])
            f = (val_loss[i - 1] - target) / (val_loss[i - 1] - loss)  # 0 at the previous evaluation, 1 at this
            return (float(steps[i - 1] + f * (steps[i] - steps[i - 1])),
                    float(times[i - 1] + f * (times[i] - times[i - 1])))
    return np.nan, np.nan


def per_run(curves: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """One row per (policy, seed): final validation loss, its gap to the baseline of the same seed (%), how much
    the validation loss still fell over the last 20 % of the steps (%: near 0 once the curve has flattened), and the
    run's mean hottest-rank backward cut, drop rate and modelled time per step."""
    val = curves.dropna(subset=["val_loss"]).sort_values("step")
    final = val.groupby(["policy", "seed"], sort=False).val_loss.last()
    rows = []
    for (policy, seed), group in curves.groupby(["policy", "seed"], sort=False):
        base = final.get((baseline, seed), np.nan)
        loss = float(final.get((policy, seed), np.nan))
        v = val[(val.policy == policy) & (val.seed == seed)]
        at_80 = loss_at_step(v.step, v.val_loss, 0.8 * int(group.step.max()))
        rows.append({
            "policy": policy, "seed": int(seed), "steps": int(group.step.max()), "val_loss": loss,
            "gap_pct": 100 * (loss / base - 1) if base == base else np.nan,
            "last20_drop_pct": 100 * (1 - loss / at_80) if at_80 == at_80 else np.nan,
            "hot_rank_bwd_cut_pct": 100 * float(group.hot_rank_bwd_cut.mean()),
            "bwd_max_over_mean": float((group.bwd_pairs_max / group.fwd_pairs_mean).mean()),
            "dropped_pct": 100 * float(group.dropped_frac.mean()),
            "modelled_ms_per_step": 1e3 * float(group.modelled_s.mean()),
        })
    return pd.DataFrame(rows)


def summarise(curves: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """One row per policy over its seeds: final validation loss mean ± std (and min/max), the gap to dropless static
    EP in % (taken seed by seed, then averaged), the hottest rank's backward pairs cut, and the drop rate."""
    runs = per_run(curves, baseline)
    rows = []
    for policy, group in runs.groupby("policy", sort=False):
        loss, gap = spread(group.val_loss), spread(group.gap_pct)
        rows.append({
            "policy": policy, "seeds": loss["n"], "steps": int(group.steps.max()),
            "val_loss": loss["mean"], "val_loss_std": loss["std"], "val_loss_min": loss["min"],
            "val_loss_max": loss["max"], "gap_pct": gap["mean"], "gap_pct_std": gap["std"],
            "gap_pct_min": gap["min"], "gap_pct_max": gap["max"],
            "last20_drop_pct": float(group.last20_drop_pct.mean()),
            "hot_rank_bwd_cut_pct": float(group.hot_rank_bwd_cut_pct.mean()),
            "bwd_max_over_mean": float(group.bwd_max_over_mean.mean()),
            "dropped_pct": float(group.dropped_pct.mean()),
            "modelled_ms_per_step": float(group.modelled_ms_per_step.mean()),
        })
    return pd.DataFrame(rows)


def time_to_reach(curves: pd.DataFrame, target_step: int | None = None, baseline: str = BASELINE) -> pd.DataFrame:
    """Equal quality: per policy, the step and the modelled time (its own cumulative ``time_s``) at which its
    validation curve first reaches the baseline's loss at ``target_step`` (default: the baseline's last step),
    seed by seed against the same seed's baseline; means over the seeds that reach it, and how many did."""
    val = curves.dropna(subset=["val_loss"]).sort_values("step")
    rows = []
    for policy, group in val.groupby("policy", sort=False):
        reached = []
        for seed, run in group.groupby("seed"):
            base = val[(val.policy == baseline) & (val.seed == seed)]
            if base.empty:
                continue
            t = int(base.step.max()) if target_step is None else target_step
            target = loss_at_step(base.step, base.val_loss, t)
            reached.append((t, target, *time_to_loss(run.step, run.time_s, run.val_loss, target)))
        if not reached:
            continue
        t, target, step, time_s = zip(*reached)
        rows.append({"policy": policy, "target_step": int(max(t)), "target_loss": float(np.mean(target)),
                     "seeds_reached": int(sum(s == s for s in step)), "seeds": len(step),
                     "step_to_reach": spread(step)["mean"], "step_to_reach_max": spread(step)["max"],
                     "modelled_ms_to_reach": 1e3 * spread(time_s)["mean"]})
    return pd.DataFrame(rows)
