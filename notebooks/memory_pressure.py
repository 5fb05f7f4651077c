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
# # Memory pressure: replicas against token buffers
#
# Replicating hot experts (SYMI) costs each replica its weights and gradients. On a memory-constrained node that
# memory competes with the token buffers and saved activations, so as the budget shrinks fewer replicas fit and
# the imbalance stays.
#
# Every number here comes from **one memory model** (`lrmoe.bytemodel.memory`), the one the planners size their replica
# slots with and the one the simulator checks for out-of-memory: each buffer counted once (the received input row
# *is* the saved input), in-flight exchange buffers for the layer in flight only, saved activations for every
# layer, weights and gradients per allocated slot. Every dropless system sizes its slots by the same rule: buffers
# for its own planned peak load (its plans of the warm-up iteration), never a constant per system.
#
# The simulator (`experiments/ablate.py`: the real planner, the cost model) then sweeps the per-rank memory budget
# of the MoE layers, for Qwen3-30B-A3B on 2 x 8 A100-class GPUs at high skew (Zipf 0.8), and shows for SYMI and
# LRMoE: slots per rank, peak memory, imbalance, time and whether the layers still fit. Opening the notebook runs
# nothing: it reads the committed memory sweep (`experiments/memory_sweep.py`, `memory_pressure_sweep.jsonl`). Set
# `RERUN = True` below to run a sweep of your own here (a minute or two; it is kept and read again next time).

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from lrmoe.config import cluster_preset, model_preset
from lrmoe.paper_figures import figures
from lrmoe.paper_figures import REPO_ROOT as ROOT, RESULTS_DIR, style
from lrmoe.sim.cost import CostModel

# %matplotlib inline

QUICK = os.environ.get("LRMOE_NOTEBOOK_QUICK") == "1"
OUT = Path(os.environ.get("LRMOE_NOTEBOOK_OUT", ROOT / "outputs" / "notebooks"))

# %% [markdown]
# ## The memory model, term by term (Qwen3-30B-A3B, bf16)
#
# Bytes per unit of each buffer, and what a rank holds when it computes the mean load of 4096 tokens x top-8 in
# every one of the 48 MoE layers with its 16 home slots. The planner's `MemoryModel` and the simulator's accounting
# are the same object (`CostModel.memory_model()`).

# %%
model, cluster = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8")
cm = CostModel(model, cluster)
fp, mm = cm.footprint, cm.memory_model()
display(pd.DataFrame({"bytes": vars(fp)}).T)  # noqa: F821 - IPython's display
pairs = 4096 * model.top_k
resident = {"slots (16, weights + gradients)": 16 * fp.slot * mm.num_layers,
            "saved at the expert (input row, gate, up, h)": pairs * fp.expert_pair * mm.num_layers,
            "saved at home (the combine's output rows)": pairs * fp.home_pair * mm.num_layers}
peak = float(mm.peak_bytes(16, pairs, pairs))
resident["in flight (one layer)"] = peak - sum(resident.values())
pd.Series(resident).div(1e9).round(2).rename("GB per rank").to_frame().assign(of_budget=lambda d: d["GB per rank"]
                                                                                / (mm.budget_bytes / 1e9))

# %% [markdown]
# ## Shrinking the budget

# %%
RERUN = False  # True: simulate the budgets below here (in-process), instead of reading the committed sweep
SYSTEMS = ["symi-cf1", "symi-dropless", "lrmoe", "lrmoe-rho0.75-early", "static-ep"]
COMMITTED = RESULTS_DIR / "memory_pressure_sweep.jsonl"
path = OUT / "memory_pressure.jsonl"
if RERUN and not path.exists():
    from lrmoe.experiments import ablate

    BUDGETS = ["80", "40", "30"] if QUICK else ["120", "80", "60", "40", "30", "25"]
    ablate.main(["--models", "qwen3-30b-a3b", "--ranks", "16", "--skews", "zipf:0.8", "--mem-gb", *BUDGETS,
                 "--steps", "2" if QUICK else "3", *(["--layers", "2", "--no-band"] if QUICK else []),
                 "--systems", *SYSTEMS, "--out", str(path), "--no-wandb"])
source = path if RERUN else COMMITTED
print("memory sweep:", os.path.relpath(source, ROOT))  # relative to the checkout
style.apply()

# %%
data = figures.records(source)
data = data[(data.model == "qwen3-30b-a3b") & ((data.skew_label == "zipf:0.8"))
            & data.system.isin(SYSTEMS)]
cols = ["mem_gb", "system", "fits", "slots_per_rank", "peak_mem_gb", "planned_headroom_symi", "planned_headroom_lrmoe",
        "fwd_imbalance", "rho", "time_ms_per_layer", "drop_rate", "note"]
data[[c for c in cols if c in data]].sort_values(["mem_gb", "system"], ascending=[False, True]).round(3)

# %%
fitting = data[data.fits.astype(bool)]
fig, axes = plt.subplots(1, 3, figsize=(14, 3.5))
colors = style.palette(fitting.system.unique())
for ax, col, label in zip(axes, ["slots_per_rank", "peak_mem_gb", "time_ms_per_layer"],
                          ["replica slots per rank", "peak memory per rank (GB, all MoE layers)", "ms per MoE layer"]):
    sns.lineplot(fitting, x="mem_gb", y=col, hue="system", marker="o", ax=ax, palette=colors,
                 legend=col == "time_ms_per_layer")
    ax.set(xlabel="MoE memory budget per rank (GB)", ylabel=label)
    ax.invert_xaxis()
skew = data.iloc[0]
fig.suptitle(f"Shrinking memory: replicas vs token buffers (Qwen3-30B-A3B, {int(skew.ranks)} GPUs, "
             f"{skew.skew_label}: per-rank max/mean {skew.trace_rank_max_over_mean:.2f}, simulated)")
fig.tight_layout()
plt.show()
