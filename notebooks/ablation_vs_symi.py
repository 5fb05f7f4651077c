# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Each LRMoE component against SYMI
#
# LRMoE is four mechanisms on one replica substrate: memory-aware placement, dropless forward routing spread over
# replicas, retention quotas that trim the backward, backward replica routing, and compaction of the backward
# packets. This notebook removes one at a time and compares the MoE-layer time with SYMI (paper-faithful
# SYMI-cf1, which drops overflow tokens, and SYMI-dropless, the fair comparison for a dropless forward).
#
# * **Simulator** (paper scale: Qwen3-30B-A3B and GLM-4.5-Air on A100-40GB nodes): `experiments/ablate.py`, the
#   same planner code as the real layer on synthetic routing traces, priced by the cost model.
# * **Measured** (4 gloo ranks on this CPU): `experiments/layer_bench.py`, the real distributed layer.
#
# Both are read from `outputs/quick/` (written by `make reproduce`) when present; the simulator's otherwise from the
# committed quick ablation (`paper_figures/results/ablate_rev_sizing.jsonl`, the README's table; the tests' small
# mode reads it too), and with neither a small simulator sweep runs here.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

from lrmoe.paper_figures import figures
from lrmoe.paper_figures import REPO_ROOT as ROOT, RESULTS_DIR, style

# %matplotlib inline

QUICK = os.environ.get("LRMOE_NOTEBOOK_QUICK") == "1"
OUT = Path(os.environ.get("LRMOE_NOTEBOOK_OUT", ROOT / "outputs" / "notebooks"))
RESULTS = ROOT / "outputs" / "quick"
COMMITTED = RESULTS_DIR / "ablate_rev_sizing.jsonl"
OWN = OUT / "ablate_notebook.jsonl"  # this notebook's own small sweep, run once when no results exist
sim_path = next((p for p in [*([] if QUICK else [RESULTS / "ablate.jsonl"]), COMMITTED, OWN] if p.exists()), None)
if sim_path is None:  # nothing to read: run the sweep once, in-process, through the script's entry point
    from lrmoe.experiments import ablate

    sim_path = OWN
    ablate.main(["--models", "qwen3-30b-a3b", "--ranks", "16", "--skews", "zipf:0.4", "zipf:0.8", "--mem-gb", "40",
                 "--steps", "2" if QUICK else "3", *(["--layers", "2", "--no-band"] if QUICK else []),
                 "--out", str(sim_path), "--no-wandb"])
style.apply()
print("simulator results:", os.path.relpath(sim_path, ROOT))  # relative to the checkout

# %% [markdown]
# ## Simulator: every system, time per MoE layer and its split
#
# The skew is reported as measured on the trace (per-rank max/mean under static EP, Gini) beside the generator's
# parameter; every overhead on the critical path is charged (planning, the counts all-gather, scoring and
# selection, compaction, SYMI-cf1's fixed-size buffers); ratios carry their sensitivity band (`_lo`, `_hi`).

# %%
sim = figures.ablation_slice(sim_path)
split = [f"{c}_ms_per_layer" for c in ("forward", "backward", "communication", "sync", "overhead")]
cols = ["model", "skew_label", "trace_rank_max_over_mean", "trace_gini", "system", "time_ms_per_layer", *split,
        "drop_rate", "vs_symi_dropless", "vs_symi_dropless_lo", "vs_symi_dropless_hi", "vs_symi_cf1"]
sim[[c for c in cols if c in sim]].sort_values(["model", "skew_label", "time_ms_per_layer"]).round(3)

# %%
fig, _ = figures.layer_time(sim_path)
plt.show()

# %% [markdown]
# ## From SYMI-dropless to LRMoE, and what each component buys (highest measured skew)
#
# Left: the difference in each category of time, adding up exactly from SYMI-dropless to LRMoE. Right: the time
# LRMoE loses when one component is switched off, each on its own (not additive). The metric and the selection mode
# do not change counts, so they do not change time: their effect is on the gradient (see the
# `recalibration_metric` notebook).

# %%
for model in sim.model.unique():
    fig, table = figures.ablation_waterfall(sim_path, model)
    plt.show()
    display(table.round(2))  # noqa: F821 - IPython's display

# %% [markdown]
# ## Ratio to SYMI across skew

# %%
main = sim[sim.system.str.startswith("lrmoe")]
ax = sns.lineplot(main, x="skew_label", y="vs_symi_dropless", hue="system", style="model", marker="o")
ax.axhline(1.0, color="k", lw=0.8)
ax.set(ylabel="time / SYMI-dropless (< 1: faster)", xlabel="skew (generator)")
ax.legend(fontsize=7, bbox_to_anchor=(1, 1))
plt.show()

# %% [markdown]
# ## Measured on the real distributed layer (CPU, gloo)
#
# Read from `outputs/quick/layer_bench.jsonl` when the main job has produced it.

# %%
bench_path = RESULTS / "layer_bench.jsonl"
if bench_path.exists() and not QUICK:
    bench = figures.records(bench_path)
    numeric = bench.select_dtypes("number").columns
    display(bench.groupby("policy")[list(numeric)].median().round(3).T)  # noqa: F821
else:
    print("no layer-benchmark results yet: run `make reproduce` (or experiments/layer_bench.py)")
