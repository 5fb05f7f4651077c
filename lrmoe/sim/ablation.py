"""The ablation's sweep (``experiments/ablate.py``): every (cell, system) simulated on one synthetic trace per cell,
one record per pair with whole-model seconds per iteration, per-layer times by category, bytes, memory, the skew the
trace measurably has, and (for the headline's systems) the seconds at every sensitivity corner.

The script parses and checks its flags and hands its argparse namespace to :func:`run_cells` (the attribute names
of its flags); the tables that read the records back are :mod:`lrmoe.analysis.ablation_report`'s.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from lrmoe.config import MICRO_BATCH_BAND, cluster_preset, model_preset
from lrmoe.config import sensitivity_corners as corners

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from lrmoe.config import MoEConfig

CATS = ["forward", "backward", "communication", "sync", "overhead"]
# The headline's systems, priced again at every corner of the uncertain constants (the sensitivity band).
BANDED = ["lrmoe", "symi-dropless", "symi-cf1", "symi-dropless-lrmoe-slots", "online", "online-rho0.75",
          "online-greedy", "lrmoe-rho0.75", "lrmoe-rho0.75-early", "symi-dropless-rho0.75",
          "lrmoe-rho0.75-unbiased", "lrmoe-rho0.75-early-unbiased"]  # the frontier protocol's budgeted arms too
# The uncertain constants and their ranges (DESIGN.md §5.4; issue 15): GEMM efficiency 0.5-0.9 of peak,
# half-efficiency rows 32-512, links at 70-100 % of the datasheet, 1-32 micro-batches per iteration
# (lrmoe.config.SENSITIVITY and MICRO_BATCH_BAND; the corners: lrmoe.config.sensitivity_corners).


def skew_label(skew: tuple[str, float]) -> str:
    return f"{skew[0]}:{skew[1]:g}"


def skew_stats(counts_ILNE: torch.Tensor, warmup: int = 1) -> dict[str, float]:
    """The skew a trace measurably has, means over its iterations after warm-up and its layers: the per-rank
    max / mean of the pairs static expert parallelism would compute (expert e on rank e // (E/N)), the hottest
    expert over the mean, and the Gini coefficient of the per-expert pairs."""
    from lrmoe.traces.stats import gini, max_over_mean

    counts = counts_ILNE[warmup:] if counts_ILNE.shape[0] > warmup else counts_ILNE
    per_expert_ILE = counts.sum(2).double()
    n = counts.shape[2]
    rank_SLN = per_expert_ILE.view(*per_expert_ILE.shape[:2], n, -1).sum(-1)
    return {"rank_max_over_mean": float(max_over_mean(rank_SLN).mean()),
            "expert_max_over_mean": float(max_over_mean(per_expert_ILE).mean()),
            "gini": float(gini(per_expert_ILE).mean())}


def mode_variants(args, corners_: dict[str, dict]) -> dict[str, dict]:
    """The variants a system is priced at: the sensitivity corners, and with ``--replica-grad best`` the same in the
    shard mode (``shard`` and ``<corner>|shard``)."""
    if args.replica_grad != "best":
        return dict(corners_)
    return {**corners_, "shard": {"replica_grad": "shard"},
            **{f"{k}|shard": {**v, "replica_grad": "shard"} for k, v in corners_.items()}}


def record(common: dict, name: str, res, layers: int, model: MoEConfig, note: str, banded: bool,
           replica_grad: str = "range") -> dict:
    """One system's record: whole-model seconds per iteration, per-layer ms by category, bytes, memory, and (for
    the headline's systems) the seconds at every sensitivity corner; with ``replica_grad="best"`` in the faster of the
    two replica-gradient modes (both recorded)."""
    s = res.summary()
    scale = model.num_moe_layers / layers  # whole model from the simulated layers (1 when all are simulated)
    mode, suffix = replica_grad, ""
    if replica_grad == "best":
        by_mode = {"range": s["time_s"], "shard": res.time_s("shard")}
        mode = min(by_mode, key=by_mode.get)
        suffix = "|shard" if mode == "shard" else ""
        s = {**s, "time_s": by_mode[mode], **{f"{k}_s": v for k, v in res.category_s(suffix[1:] or None).items()}}
    rec = {**common, "system": name, "fits": not s["oom"], "note": note,
           "iter_s": s["time_s"] * scale,
           # per MoE layer and iteration (all micro-batches)
           **{f"{k}_ms_per_layer": s[f"{k}_s"] / layers * 1e3 for k in ["time"] + CATS},
           "a2a_gb_per_layer": s["a2a_bytes"] / layers / 1e9,
           "sync_gb_per_layer": s["sync_bytes"] / layers / 1e9,
           "peak_mem_gb": s["peak_mem_bytes"] / 1e9, "oom": s["oom"], "drop_rate": s["drop_rate"],
           "fwd_imbalance": s["fwd_imbalance"], "rho": s["rho"],
           "slots_per_rank": s["slots_per_rank"], "layer_over_share": s["layer_over_share"], "replica_grad": mode}
    if replica_grad == "best":  # both modes, whole model, and the sync phases per layer in each
        for m_, v in (("range", None), ("shard", "shard")):
            rec[f"iter_s_{m_}"] = res.time_s(v) * scale
            rec[f"sync_ms_per_layer_{m_}"] = res.category_s(v)["sync"] / layers * 1e3
    if banded:  # the corners in the system's own mode
        band = {}
        corner_names = [v for v in res.variant_ILH if v != "shard" and not v.endswith("|shard")]
        for variant in [None, *corner_names]:
            for mb in (res.micro_batches, *MICRO_BATCH_BAND):
                key = f"{variant or 'base'}|mb={mb}"
                priced = (variant + suffix if variant else suffix[1:] or None)
                band[key] = res.time_s(priced, mb) * scale
        rec["iter_s_corners"] = band
    return rec


def run_cells(args, run) -> pd.DataFrame:
    """Simulate every (cell, system); one record per pair, logged as it completes (``run.log``: the script's
    tracker). The errors of the simulations that failed (the sweep goes on past them) in ``attrs["errors"]``."""
    import pandas as pd
    from tqdm import tqdm

    from lrmoe.sim.cells import TOKENS, Cell, build_systems, charged_overheads, cost_kwargs
    from lrmoe.sim.simulator import simulate
    from lrmoe.sim.simulated_systems import plan_twins
    from lrmoe.traces.synthetic import generate_trace

    base = cluster_preset(args.cluster)
    plan = []
    for name in args.models:
        model = model_preset(name)
        layers = min(args.layers or model.num_moe_layers, model.num_moe_layers)
        tokens = args.tokens_per_rank or TOKENS.get(name, 2048)
        for ranks in args.ranks:
            cluster = base.with_nodes(ranks // base.ranks_per_node)
            for skew in args.skews:
                for mem_gb in args.mem_gb:
                    plan.append((Cell(model, cluster, skew, mem_gb, tokens), layers))
    twins = plan_twins(args.systems)  # {name: the system it shares its plans with}: simulated once
    per_cell = sum(1 for s in args.systems if s not in twins)
    total = sum(per_cell * args.steps * layers for _, layers in plan)
    variants = mode_variants(args, {} if args.no_band else corners())
    modes_only = mode_variants(args, {})
    rows = []
    traces = {}
    errors: list[str] = []
    with tqdm(total=total, desc="layer-steps", unit="ls", disable=None, mininterval=1.0) as bar:
        for cell, layers in plan:
            m, c = cell.model, cell.cluster
            key = (m.name, c.num_ranks, cell.skew, cell.tokens, layers)
            if key not in traces:  # one iteration more than simulated: the first is the planners' reference
                traces[key] = generate_trace(args.steps + 1, layers, c.num_ranks, m.num_experts, m.top_k,
                                             cell.tokens, skew=cell.skew[0], skew_param=cell.skew[1],
                                             seed=args.seed, model=m.name)
            counts_ILNE = traces[key].counts_ILNE
            measured = skew_stats(counts_ILNE[1:])
            common = {"model": m.name, "cluster": c.name, "ranks": c.num_ranks, "nodes": c.num_nodes,
                      "skew": cell.skew[1], "skew_family": cell.skew[0], "skew_label": skew_label(cell.skew),
                      "mem_gb": cell.mem_gb, "tokens_per_rank": cell.tokens, "layers_simulated": layers,
                      "steps": args.steps, "micro_batches": args.micro_batches,
                      "trace_gini": measured["gini"], "trace_max_over_mean": measured["expert_max_over_mean"],
                      "trace_rank_max_over_mean": measured["rank_max_over_mean"],
                      "trace": f"synthetic {cell.skew[0]}", "headroom_rule": args.headroom_rule,
                      "headroom_margin": args.headroom_margin, "overheads": list(charged_overheads(args))}
            # every system sizes its slots from its plans of the simulation's warm-up iteration (which no summary
            # includes), placed from the iteration before it
            systems, skipped, notes, headrooms = build_systems(cell, args.systems, args,
                                                               (counts_ILNE[0], counts_ILNE[1]))
            common.update({f"planned_headroom_{k}": v for k, v in headrooms.items()})
            cell_rows = {}
            for name in args.systems:
                if name in twins:
                    continue
                if name in skipped:
                    rec = {**common, "system": name, "fits": False, "note": skipped[name]}
                    bar.update(args.steps * layers)
                else:
                    banded = name in BANDED and (args.band_every_budget or cell.mem_gb == args.headline_mem_gb)
                    try:
                        res = simulate(counts_ILNE[1:], systems[name], m, c,
                                       cost_kwargs=cost_kwargs(name, cell, args), micro_batches=args.micro_batches,
                                       progress=bar.update, variants=variants if banded else modes_only)
                    except Exception as exc:  # noqa: BLE001 - one failing cell must not lose an hours-long sweep
                        why = f"error: {type(exc).__name__}: {exc}"
                        tqdm.write(f"{m.name} {c.name} {skew_label(cell.skew)} {cell.mem_gb:g} GB {name}: {why}",
                                   file=sys.stderr)
                        errors.append(why)
                        cell_rows[name] = {**common, "system": name, "fits": False, "note": why}
                        continue
                    rec = record(common, name, res, layers, m, notes.get(name, ""), banded, args.replica_grad)
                cell_rows[name] = rec
            for twin, source in twins.items():
                if source in cell_rows:
                    src = cell_rows[source]
                    cell_rows[twin] = {**src, "system": twin, "note": src["note"] if "iter_s" not in src else
                                       f"same plan as {source} by construction"}
                    cell_rows[twin].pop("iter_s_corners", None)
            for name in args.systems:
                rec = cell_rows.get(name)
                if rec is None:
                    continue
                for ref in ("symi-dropless", "symi-cf1", "online"):
                    other = cell_rows.get(ref, {})
                    if "iter_s" in rec and "iter_s" in other:
                        rec[f"vs_{ref.replace('-', '_')}"] = rec["iter_s"] / other["iter_s"]
                        lo_hi = band(rec, other)
                        if lo_hi is not None:
                            rec[f"vs_{ref.replace('-', '_')}_lo"], rec[f"vs_{ref.replace('-', '_')}_hi"] = lo_hi
                run.log(rec)
                rows.append(rec)
    table = pd.DataFrame(rows)
    table.attrs["errors"] = errors
    return table


def band(rec: dict, ref: dict) -> tuple[float, float] | None:
    """(lowest, highest) ratio of ``rec``'s time to ``ref``'s over the sensitivity corners both were priced at
    (each corner on both sides alike), the base point included; None without corners."""
    a, b = rec.get("iter_s_corners"), ref.get("iter_s_corners")
    if not a or not b:
        return None
    ratios = [a[k] / b[k] for k in a if k in b and b[k] > 0]
    return (min(ratios), max(ratios)) if ratios else None
