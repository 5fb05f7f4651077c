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
# # Convergence: does trimming the backward still train?
#
# LRMoE drops token-expert pairs from the backward pass, so its gradient is not the full gradient. This notebook
# reads the results of `experiments/convergence.py` (the same debug model, seed and data order under each
# policy) and compares validation loss at equal steps and at equal modelled time, beside how many backward
# pairs LRMoE cut on the hottest rank and how many tokens SYMI-cf1 dropped.
#
# It reads `outputs/full/convergence.jsonl` or `outputs/quick/...` (written by `make reproduce`) if present, else the
# committed results of the quick main job (`paper_figures/results/convergence.jsonl`, the tests' small mode reads
# these too); with none of them it runs a short comparison itself.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

from lrmoe.analysis.runs import summarise
from lrmoe.paper_figures import figures
from lrmoe.paper_figures import REPO_ROOT as ROOT, RESULTS_DIR, style

# %matplotlib inline

QUICK = os.environ.get("LRMOE_NOTEBOOK_QUICK") == "1"
OUT = Path(os.environ.get("LRMOE_NOTEBOOK_OUT", ROOT / "outputs" / "notebooks"))
COMMITTED = RESULTS_DIR / "convergence.jsonl"
candidates = [ROOT / "outputs" / "full" / "convergence.jsonl", ROOT / "outputs" / "quick" / "convergence.jsonl"]
OWN = OUT / "convergence_notebook.jsonl"  # this notebook's own short runs, made once when no results exist
results = next((p for p in [*([] if QUICK else candidates), COMMITTED, OWN] if p.exists()), None)
if results is None:  # nothing to read: train once, in-process, through the script's entry point
    from lrmoe.experiments import convergence

    results = OWN
    convergence.main(["--policies", "static-ep", "symi-cf1", "lrmoe", "--ranks", "2", "--steps", "6",
                      "--batch", "2", "--seq-len", "32", "--eval-every", "3", "--out", str(results), "--no-wandb"])
print("results:", os.path.relpath(results, ROOT))  # relative to the checkout

# %% [markdown]
# ## Curves

# %%
style.apply()
fig, data = figures.convergence(results)
plt.show()

# %% [markdown]
# ## At equal steps and at equal modelled time
#
# `vs_dropless_pct`: final validation loss relative to dropless static expert parallelism (the target is
# within 1 %). `hot_rank_bwd_cut_pct`: backward pairs cut on the rank with the most forward pairs (target
# ≥ 30 %). `dropped_pct`: forward tokens dropped (SYMI-cf1 only).

# %%
curves = figures.records(results).dropna(subset=["loss"]).drop_duplicates(["policy", "step"], keep="last")
table = summarise(curves)
table.round(3)

# %%
ax = sns.barplot(table, x="policy", y="hot_rank_bwd_cut_pct", palette=style.palette(table.policy), hue="policy")
ax.set(ylabel="backward pairs cut on the hottest rank (%)", xlabel="")
ax.tick_params(axis="x", rotation=30)
plt.show()
