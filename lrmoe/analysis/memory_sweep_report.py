"""The memory-pressure sweep's report (``experiments/memory_sweep.py``), from its records (the ablation's, one per
system, cell and budget): where memory binds and each system's out-of-memory line, each placement with and without
the retention budget ρ per budget, the headline where memory binds (with each arm's quality under the frontier
protocol), and what early selection frees (:mod:`lrmoe.sim.memory_sweep` reads the records; this module writes them
out as Markdown).

``args`` is the script's argparse namespace (the attribute names of its flags, and ``quality``: regime label -> arm ->
its quality claim, :func:`lrmoe.analysis.claims.arm_quality`).
"""

from __future__ import annotations

import pandas as pd

from lrmoe.analysis import protocol
from lrmoe.analysis.claims import quality_text
from lrmoe.config import cluster_preset, model_preset
from lrmoe.sim.cells import TOKENS
from lrmoe.sim.memory_sweep import (DEMAND_SIDE, EARLY, PLACEMENTS, binding_range, budgets, early_selection_gain,
                                    headline, placement_table)

HEADLINE_GB = 40.0  # the ablation's headline budget (an A100-40GB's memory)
NOT_TRAINED = f"not measured: the protocol trains {protocol.SIM_MODEL}'s shape only"


def fmt(value) -> str:
    return "—" if value is None or (isinstance(value, float) and pd.isna(value)) else (
        f"{value:.3g}" if isinstance(value, float) else str(value))


def ratio_cell(row: dict, tag: str, band: bool = True) -> str:
    """A ratio with its band, e.g. ``0.61 [0.56–0.80]`` (``band=False``: the corners were not priced)."""
    if row.get(tag) is None:
        return "—"
    lo, hi = (row.get(f"{tag}_lo"), row.get(f"{tag}_hi")) if band else (None, None)
    return f"{row[tag]:.3f}" + (f" [{lo:.2f}–{hi:.2f}]" if lo is not None and hi is not None else "")


def quality(system: str | None, claims: dict[str, dict] | None) -> str:
    """The system's quality under the frontier protocol (docs/protocols/frontier.md §10) in the skew's regime: its gap
    claim's word and estimate, final once the sweep's planned seeds are in (``claims``:
    lrmoe.analysis.claims.arm_quality; None for a model the protocol does not train)."""
    if system is None:
        return "—"
    if system not in protocol.SWEEP_ARMS:
        return "not an arm of the protocol: unmeasured"
    if claims is None:
        return NOT_TRAINED
    return quality_text(claims.get(system)) if claims else "no sweep run of this regime: unmeasured"


def early_table(args, extra_gb: dict[str, set[float]] | None = None) -> list[str]:
    """Markdown: what early selection at rho = 0.75 frees per layer and the spare slots it buys (uncapped), at the
    ablation's headline budget, at each model's smallest budget and at ``extra_gb`` (per model: the headline cells')."""
    lines = ["## Early selection (ρ = 0.75, buffers planned for 1.1 x the mean load)\n",
             "| model | GB | freed MB per layer | freed GB, all layers | one slot, GB | spare slots without / with |",
             "|---|---|---|---|---|---|"]
    cluster = cluster_preset(args.cluster).with_nodes(args.nodes)
    for name in args.models:
        for gb in sorted({budgets(args, name)[0], HEADLINE_GB} | (extra_gb or {}).get(name, set())):
            g = early_selection_gain(model_preset(name), cluster, TOKENS.get(name, 2048), gb)
            lines.append(f"| {name} | {gb:g} | {g['freed_mb_per_layer']:.1f} | {g['freed_gb_all_layers']:.2f} | "
                         f"{g['slot_gb']:.2f} | {fmt(g['spare_without'])} / {fmt(g['spare_with'])} |")
    return lines


def report(records: list[dict], run, args) -> str:
    """The Markdown tables: where memory binds (and each system's out-of-memory line), each placement with and
    without rho as time / SYMI-dropless per budget, fastest named, and what early selection frees. Logs the binding
    ranges and the headline rows as the run's summary (``run.log_summary``: the script's tracker)."""
    bind = binding_range(records)
    lines = ["## Where memory binds\n", "| model | ranks | skew | budgets | binds from GB | to GB | "
             "fits from GB (per system) |", "|---|---|---|---|---|---|---|"]
    for r in bind:
        oom = "; ".join(f"{k.split(':')[0]} {fmt(v)}" for k, v in r.items() if k.endswith(":fits_from_gb"))
        lines.append(f"| {r['model']} | {r['ranks']} | {r['skew']} | {r['budgets']} | {fmt(r['binds_from_gb'])} | "
                     f"{fmt(r['binds_to_gb'])} | {oom} |")
    rows = placement_table(records)
    labels = [f"{p}{s}" for p in PLACEMENTS for s in ("", " + ρ")]
    labels += [label for label in EARLY if any(label in r for r in rows)]
    lines += ["", "## Which placement wins: time / SYMI-dropless (slots per rank; where SYMI-dropless does not fit, "
              "seconds per iteration)\n",
              "| model | skew | GB | " + " | ".join(labels) + " | fastest |",
              "|---|---|---|" + "---|" * (len(labels) + 1)]
    for r in rows:
        cells = [f"{fmt(r[k])} ({fmt(r[k + ' slots'])})" if r.get(k) is not None else
                 f"{fmt(r[k + ' s'])} s ({fmt(r[k + ' slots'])})" if r.get(k + " s") is not None else "does not fit"
                 for k in labels]
        lines.append(f"| {r['model']} | {r['skew']} | {r['mem_gb']:g} | " + " | ".join(cells)
                     + f" | {fmt(r['fastest'])} |")
    arms = tuple(name for name in DEMAND_SIDE if name in protocol.SWEEP_ARMS)
    heads = headline(records)
    arm_heads = {(h["model"], h["skew"]): h for h in headline(records, demand=arms)}
    # the answer users come for: the fastest arm whose gap claim holds in the skew's regime (equal quality, decided)
    held = {label: tuple(a for a in arms if q.get(a, {}).get("word") == "holds")
            for label, q in args.quality.items()}
    held_heads = {(h["model"], h["skew"]): h for label, demand in held.items() if demand
                  for h in headline([r for r in records if r.get("skew_label") == label
                                     and r.get("model") == protocol.SIM_MODEL], demand=demand)}
    lines += ["", "## Headline: where memory binds, the fastest demand-side system ÷ SYMI-dropless and ÷ cost-aware "
              "online [band over the sensitivity corners], at the smallest budget of the binding range where both "
              "fit\n", f"Demand-side: LRMoE's systems ({', '.join(DEMAND_SIDE)}); among the frontier protocol's arms "
              f"only: {', '.join(arms)} (the others' quality is not measured under it); and among the arms whose "
              "gap claim holds in the skew's regime (equal quality, decided).\n",
              "| model | skew | GB | among | fastest demand-side (slots) | ÷ SYMI-dropless (slots) | ÷ online (slots) "
              "| quality (frontier protocol) |", "|---|---|---|---|---|---|---|---|"]
    for h in heads:
        key = (h["model"], h["skew"])
        for among, row in (("all", h), ("arms", arm_heads.get(key)), ("holds", held_heads.get(key))):
            if row is None:
                if among == "holds" and key[1] in args.quality:
                    why = "no arm's gap claim holds in this regime" if key[0] == protocol.SIM_MODEL else NOT_TRAINED
                    lines.append(f"| {key[0]} | {key[1]} | — | holds | {why} | — | — | — |")
                continue
            claims = args.quality.get(key[1], {}) if key[0] == protocol.SIM_MODEL else None
            lines.append(f"| {row['model']} | {row['skew']} | {row['mem_gb']:g} | {among} | {fmt(row['best'])} "
                         f"({fmt(row['best_slots'])}) | {ratio_cell(row, 'vs_symi_dropless', not args.no_band)} "
                         f"({fmt(row['symi-dropless slots'])}) | {ratio_cell(row, 'vs_online', not args.no_band)} "
                         f"({fmt(row['online slots'])}) | {quality(row['best'], claims)} |")
    lines += [""] + early_table(args, {m: {h["mem_gb"] for h in heads if h["model"] == m} for m in args.models})
    run.log_summary({"binding": bind, "headline": heads, "headline_arms": list(arm_heads.values()),
                     "headline_holds": list(held_heads.values())})
    return "\n".join(lines)
