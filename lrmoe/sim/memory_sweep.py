"""The memory-pressure sweep's logic: which per-rank budgets to simulate, where memory binds, which placement wins.

LRMoE's claim is about memory-constrained nodes: replicas compete with token buffers for a GPU's memory. The sweep
(``experiments/memory_sweep.py``) simulates every system at a grid of per-rank MoE budgets, from the smallest at
which the E/N home slots fit beside the buffers of the mean load up to a generous one, and this module

* builds that grid (:func:`budget_grid`): one point per replica slot's worth of memory (every MoE layer's weights
  and gradients of one more slot) from the smallest budget to the one where every system holds its most spare slots
  beside buffers for twice the mean load, then coarse points up to the top; and picks one model's budgets from the
  script's flags (:func:`budgets`);
* reads the sweep's records (the ablation's, :mod:`lrmoe.experiments.ablate`): where memory binds, i.e. the budgets
  at which some system holds fewer slots than it does at the largest budget (:func:`binding_range`), each system's
  out-of-memory line (the smallest budget it fits), and, per budget, each placement with and without the retention
  budget ρ side by side (:func:`placement_table`).

Pure: no clocks, no files; records are dicts (one per system and cell, as the ablation writes them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace

from lrmoe.config import ClusterConfig, MoEConfig, cluster_preset, model_preset
from lrmoe.sim.cells import TOKENS
from lrmoe.sim.cost import CostModel

GB = 1e9
QUICK_SPARE = (1, 3, 6)  # quick mode: the budgets that hold the home slots and this many spare slots at the mean load
# The placements compared, each without and with LRMoE's retention budget rho = 0.75 (registry names). SYMI's trimmed
# variant trims at random (the control); the others with m2 top-k.
PLACEMENTS = {"LRMoE": ("lrmoe", "lrmoe-rho0.75"), "online": ("online", "online-rho0.75"),
              "SYMI": ("symi-dropless", "symi-dropless-rho0.75")}
# LRMoE's placement with early selection at the same ρ (the gate chooses in the forward): top-k, and with 1/p
# reweighting (the frontier protocol's early arm, docs/protocols/frontier.md §10.6)
EARLY = {"LRMoE + ρ early": "lrmoe-rho0.75-early", "LRMoE + ρ early unbiased": "lrmoe-rho0.75-early-unbiased"}


def slot_gb(model: MoEConfig, cluster: ClusterConfig) -> float:
    """GB per rank of one more replica slot in every MoE layer (weights and gradients)."""
    return CostModel(model, cluster).slot_bytes * model.num_moe_layers / GB


def fit_gb(model: MoEConfig, cluster: ClusterConfig, tokens_per_rank: int, spare_slots: int = 0,
           load: float = 1.0) -> float:
    """The smallest per-rank budget (GB, every MoE layer) that holds the E/N home slots plus ``spare_slots`` and the
    buffers of ``load`` times the mean load, in the one memory model (:mod:`lrmoe.bytemodel.memory`)."""
    if not load > 0 or spare_slots < 0 or tokens_per_rank < 1:
        raise ValueError(f"fit_gb needs load > 0, spare_slots >= 0 and tokens_per_rank >= 1, got {load!r}, "
                         f"{spare_slots!r}, {tokens_per_rank!r}")
    mm = CostModel(model, cluster).memory_model()
    pairs = tokens_per_rank * model.top_k
    base = model.num_experts // cluster.num_ranks
    return float(mm.peak_bytes(base + spare_slots, math.ceil(load * pairs), pairs)) / GB


def budget_grid(model: MoEConfig, cluster: ClusterConfig, tokens_per_rank: int, max_spare: int | None = None,
                max_gb: float = 80.0, fine_step_gb: float | None = None, coarse_step_gb: float = 10.0,
                saturate_load: float = 2.0) -> list[float]:
    """The budgets (GB per rank, ascending, rounded to 0.01) of the sweep: from the smallest that fits the home slots
    at the mean load, in steps of ``fine_step_gb`` (default: one slot's worth, :func:`slot_gb`) up to the budget
    that holds ``max_spare`` spare slots (default E/N) beside buffers for ``saturate_load`` times the mean load,
    then every ``coarse_step_gb`` up to ``max_gb`` (which is always included)."""
    base = model.num_experts // cluster.num_ranks
    max_spare = base if max_spare is None else max_spare
    step = slot_gb(model, cluster) if fine_step_gb is None else fine_step_gb
    if not (step > 0 and coarse_step_gb > 0):
        raise ValueError(f"budget steps must be positive, got fine {step!r}, coarse {coarse_step_gb!r}")
    lo = math.ceil(fit_gb(model, cluster, tokens_per_rank) * 100) / 100  # round up: the home slots must fit
    if lo > max_gb:
        raise ValueError(f"{model.name} on {cluster.name}: the home slots and the mean load's buffers need "
                         f"{lo:.1f} GB per rank, above max_gb={max_gb:g}")
    saturated = min(fit_gb(model, cluster, tokens_per_rank, max_spare, saturate_load), max_gb)
    grid = [lo + i * step for i in range(int((saturated - lo) / step) + 2)]
    top = grid[-1]
    grid += [top + (i + 1) * coarse_step_gb for i in range(int((max_gb - top) / coarse_step_gb - 0.5))]
    return sorted({round(min(b, max_gb), 2) for b in grid} | {round(max_gb, 2)})


def budgets(args, model_name: str) -> list[float]:
    """The budgets of one model of experiments/memory_sweep.py (``args``: its flags): ``--mem-gb``, quick mode's three
    (:data:`QUICK_SPARE`), or the grid (:func:`budget_grid`) on ``--nodes`` nodes of ``--cluster``."""
    model, cluster = model_preset(model_name), cluster_preset(args.cluster).with_nodes(args.nodes)
    tokens = TOKENS.get(model_name, 2048)
    if args.mem_gb:
        return sorted(args.mem_gb)
    if args.quick:
        return [round(fit_gb(model, cluster, tokens, spare, 1.2) + 0.005, 2) for spare in QUICK_SPARE]
    return budget_grid(model, cluster, tokens, max_gb=args.max_gb, fine_step_gb=args.step_gb,
                       coarse_step_gb=args.coarse_step_gb, saturate_load=args.saturate_load)


def _cells(records: Iterable[dict]) -> dict[tuple, dict[float, dict[str, dict]]]:
    """{(model, ranks, skew label): {budget: {system: record}}}."""
    out: dict[tuple, dict[float, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for rec in records:
        if "system" in rec and "mem_gb" in rec:
            out[(rec["model"], rec["ranks"], rec["skew_label"])][float(rec["mem_gb"])][rec["system"]] = rec
    return out


def _fits(rec: dict | None) -> bool:
    return rec is not None and bool(rec.get("fits")) and rec.get("iter_s") is not None


def binding_range(records: Iterable[dict]) -> list[dict]:
    """Per (model, ranks, skew): the budgets where memory binds (some fitting system holds fewer slots per rank
    than at the largest budget, or some system does not fit), and per system the smallest budget at which it fits
    (its out-of-memory line) and the smallest at which it holds its most slots."""
    rows = []
    for (model, ranks, skew), by_budget in sorted(_cells(records).items()):
        budgets = sorted(by_budget)
        top = by_budget[budgets[-1]]
        systems = sorted({s for cell in by_budget.values() for s in cell})
        binds = []
        for b in budgets:
            cell = by_budget[b]
            short = [s for s in systems if not _fits(cell.get(s)) or (
                _fits(top.get(s)) and cell[s]["slots_per_rank"] < top[s]["slots_per_rank"] - 1e-9)]
            if short:
                binds.append(b)
        row = {"model": model, "ranks": ranks, "skew": skew, "budgets": len(budgets),
               "binds_from_gb": binds[0] if binds else None, "binds_to_gb": binds[-1] if binds else None}
        for s in systems:
            fitting = [b for b in budgets if _fits(by_budget[b].get(s))]
            row[f"{s}:fits_from_gb"] = fitting[0] if fitting else None
            most = top[s]["slots_per_rank"] if _fits(top.get(s)) else None
            full = [b for b in fitting if most is not None and by_budget[b][s]["slots_per_rank"] >= most - 1e-9]
            row[f"{s}:most_slots_from_gb"] = full[0] if full else None
        rows.append(row)
    return rows


def placement_table(records: Iterable[dict], reference: str = "symi-dropless") -> list[dict]:
    """Per (model, ranks, skew, budget): each placement of :data:`PLACEMENTS` without and with the retention
    budget, as time / ``reference``'s (None where either does not fit or did not run), its seconds per iteration
    (`` s``; None where it does not fit), its slots per rank, and which of them is fastest.
    :data:`EARLY`'s labels are LRMoE's placement with early selection at the same ρ (where they ran).
    """
    rows = []
    for (model, ranks, skew), by_budget in sorted(_cells(records).items()):
        for b in sorted(by_budget):
            cell = by_budget[b]
            ref = cell.get(reference)
            row = {"model": model, "ranks": ranks, "skew": skew, "mem_gb": b,
                   "reference_fits": _fits(ref)}
            best, best_t = None, math.inf
            for label, names in PLACEMENTS.items():
                for name, suffix in zip(names, ("", " + ρ")):
                    rec = cell.get(name)
                    ok = _fits(rec)
                    t = rec["iter_s"] if ok else None
                    row[f"{label}{suffix}"] = t / ref["iter_s"] if ok and _fits(ref) else None
                    row[f"{label}{suffix} s"] = t
                    row[f"{label}{suffix} slots"] = rec.get("slots_per_rank") if ok else None
                    if ok and t < best_t:
                        best, best_t = f"{label}{suffix}", t
            for label, name in EARLY.items():
                rec = cell.get(name)
                if rec is None:
                    continue
                ok = _fits(rec)
                row[label] = rec["iter_s"] / ref["iter_s"] if ok and _fits(ref) else None
                row[f"{label} s"] = rec["iter_s"] if ok else None
                row[f"{label} slots"] = rec.get("slots_per_rank") if ok else None
                if ok and rec["iter_s"] < best_t:
                    best, best_t = label, rec["iter_s"]
            row["fastest"] = best
            rows.append(row)
    return rows


def early_selection_gain(model: MoEConfig, cluster: ClusterConfig, tokens_per_rank: int, mem_gb: float,
                         rho: float = 0.75, load: float = 1.1) -> dict:
    """What early selection at ``rho`` frees on a rank planned for ``load`` times the mean load, at a per-rank
    budget of ``mem_gb``: the saved activations it no longer keeps per layer (MB), and the spare slots that fit
    beside the buffers without and with it (uncapped: how many replicas the saving buys, before any system's
    cap on spare slots)."""
    cm = CostModel(model, cluster, mem_budget_bytes=mem_gb * GB / model.num_moe_layers)
    late = cm.memory_model()
    early = replace(late, early_rho=rho)
    pairs = tokens_per_rank * model.top_k
    planned = math.ceil(load * pairs - 1e-9)
    base = model.num_experts // cluster.num_ranks
    freed = (planned - math.ceil(rho * pairs - 1e-9)) * cm.footprint.expert_pair

    def spare(mm) -> int | None:
        try:
            return mm.extra_slots(planned, base, 10 * model.num_experts, pairs)
        except ValueError:
            return None

    return {"model": model.name, "mem_gb": mem_gb, "rho": rho, "load": load,
            "freed_mb_per_layer": freed / 1e6, "freed_gb_all_layers": freed * model.num_moe_layers / GB,
            "slot_gb": slot_gb(model, cluster), "spare_without": spare(late), "spare_with": spare(early)}


# The demand-side systems: LRMoE's, which shape the work (placement with the backward's budget, early selection)
DEMAND_SIDE = ("lrmoe", "lrmoe-rho0.75", "lrmoe-rho0.75-unbiased", "lrmoe-rho0.75-early",
               "lrmoe-rho0.75-early-unbiased")


def headline(records: Iterable[dict], demand: tuple[str, ...] = DEMAND_SIDE,
             references: tuple[str, ...] = ("symi-dropless", "online")) -> list[dict]:
    """Per (model, ranks, skew): the headline cell where memory binds, the smallest budget of the binding range
    (:func:`binding_range`) at which every reference fits (the tightest budget with a ratio to show), and there the
    fastest of ``demand`` (None where none fits), its time ÷ each reference's (``vs_<reference>``) with the band
    of the sensitivity corners where the records carry it (``vs_<reference>_lo`` / ``_hi``, the ablation's), and
    the slots of each. No row for a cell where memory never binds at a budget every reference fits."""
    bind = {(r["model"], r["ranks"], r["skew"]): r for r in binding_range(records)}
    rows = []
    for key, by_budget in sorted(_cells(records).items()):
        lo, hi = bind[key]["binds_from_gb"], bind[key]["binds_to_gb"]
        if lo is None:
            continue
        cells = [(b, by_budget[b]) for b in sorted(by_budget)
                 if lo <= b <= hi and all(_fits(by_budget[b].get(ref)) for ref in references)]
        if not cells:
            continue
        b, cell = cells[0]
        fitting = [s for s in demand if _fits(cell.get(s))]
        best = min(fitting, key=lambda s: cell[s]["iter_s"]) if fitting else None
        row = {"model": key[0], "ranks": key[1], "skew": key[2], "mem_gb": b, "best": best,
               "best_slots": cell[best]["slots_per_rank"] if best else None}
        for ref in references:
            tag = "vs_" + ref.replace("-", "_")
            rec = cell.get(best, {})
            row[tag] = rec["iter_s"] / cell[ref]["iter_s"] if best else None
            row[f"{tag}_lo"], row[f"{tag}_hi"] = rec.get(f"{tag}_lo"), rec.get(f"{tag}_hi")
            row[f"{ref} slots"] = cell[ref]["slots_per_rank"]
        rows.append(row)
    return rows
