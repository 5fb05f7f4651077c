# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Memory pressure: replicas against token buffers
#
# Replicating hot experts (SYMI) costs each replica its weights and gradients. On a memory-constrained node that
# memory competes with the token buffers (dispatch / combine rows, saved activations), so as the budget shrinks
# fewer replicas fit and the imbalance stays. LRMoE bounds the *backward* buffers by its retention quotas, so the
# same budget holds more replica slots, or the same slots with less memory.
#
# Here the simulator (`experiments/ablate.py`: the real planner, the cost model's memory accounting) sweeps the
# per-rank memory budget of the MoE layers, for Qwen3-30B-A3B on 8 A100-class GPUs at high skew, and shows for
# SYMI and LRMoE: slots per rank, peak memory, imbalance, time and whether the layers still fit.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

ROOT = Path.cwd().resolve().parent if Path.cwd().name == "notebooks" else Path.cwd().resolve()
from lrmoe.experiments import ablate
from lrmoe.paper_figures import figures
from lrmoe.paper_figures import style

# %matplotlib inline

QUICK = os.environ.get("LRMOE_NOTEBOOK_QUICK") == "1"
OUT = Path(os.environ.get("LRMOE_NOTEBOOK_OUT", ROOT / "outputs" / "notebooks"))
BUDGETS = ["80", "40", "30"] if QUICK else ["120", "80", "60", "40", "30", "25"]
path = OUT / "memory_pressure.jsonl"
ablate.main(["--models", "qwen3-30b-a3b", "--ranks", "8", "--skews", "0.8", "--mem-gb", *BUDGETS,
             "--steps", "3" if QUICK else "10", "--layers", "2" if QUICK else "8",
             "--systems", "symi-cf1", "symi-dropless", "lrmoe", "lrmoe-no-quotas", "static-ep",
             "--out", str(path), "--no-wandb", "--overwrite"])
style.apply()

# %%
data = figures.records(path)
cols = ["mem_gb", "system", "fits", "slots_per_rank", "peak_mem_gb", "fwd_imbalance", "rho", "time_ms_per_layer",
        "drop_rate", "note"]
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
fig.suptitle("Shrinking memory: replicas vs token buffers (Qwen3-30B-A3B, 8 GPUs, Zipf s = 0.8, simulated)")
fig.tight_layout()
plt.show()
