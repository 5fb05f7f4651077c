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
# # The recalibration metric, interactively
#
# LRMoE keeps only some token-expert pairs in the backward pass. Which ones? A **recalibration metric** scores
# every pair at its token's home rank, from what that rank already holds, and the **selection** keeps the best
# inside each (source rank, expert) quota:
#
# | metric | score | cost |
# |---|---|---|
# | `m1` | g · ‖δ‖ | free |
# | `m2` | g · ‖δ‖ · ‖h‖ — the exact norm of the pair's down-projection gradient term | one scalar per pair |
# | `m3` | g · \|⟨δ, o⟩\| — first-order loss change | ⟨δ, o⟩ is needed by the router gradient anyway |
# | `gate` | g | free |
# | `random` | uniform | free |
#
# Each metric is an object of `lrmoe.recal.scoring` (`METRIC_REGISTRY`) that declares what it needs besides g·δ; to try
# a new one, subclass `lrmoe.recal.scoring.Metric` and pass the object as `metric` to `run` below.
#
# Selection is `topk` (biased, lowest variance) or `unbiased` (keep with probability p ∝ score, scale by 1/p).
#
# Move the controls: retention ρ, the routing skew (Zipf s of the expert popularity), metric and mode. The
# panels show the score distribution, which pairs are kept, how close the recalibrated expert-weight gradients
# stay to the full ones, and the per-rank backward load before and after recalibration.
# The layer is a debug preset's MoE layer at random initialisation, on random data (synthetic).

# %%
import functools
import os

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.patches import Patch
import seaborn as sns
import torch

from lrmoe.analysis.fidelity import expert_errors, layer_gradients, relative_error
from lrmoe.config import model_preset
from lrmoe.recal.recalibrate import Recalibration, pair_groups, pair_hook, proportional_quotas
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.recal.scoring import METRICS
from lrmoe.traces.synthetic import zipf_popularity
from lrmoe.paper_figures import style

QUICK = os.environ.get("LRMOE_NOTEBOOK_QUICK") == "1"  # the tests run every notebook in a small mode
PRESET = "qwen3-30b-a3b-debug"
TOKENS = 256 if QUICK else 2048
RANKS = 4  # simulated source ranks (and expert-parallel ranks for the load panel)
SEED = 0
sns.set_theme(style="whitegrid", context="notebook")
KEPT_COLORS = {"dropped": "#9bb7d4", "kept": "#d62728"}
LOAD_COLORS = {"forward (dropless)": "#7f7f7f", "backward (retained)": "#1f77b4"}
cfg = model_preset(PRESET)
print(f"{PRESET}: D={cfg.hidden}, F={cfg.expert_ffn}, E={cfg.num_experts}, top-{cfg.top_k}; {TOKENS} tokens, "
      f"{RANKS} ranks")


# %% [markdown]
# ## The experiment behind every panel
#
# Skew is imposed on the router: inputs get a shared offset b solving W_router · b = log p, so every token's
# logits are its own plus log p (p: Zipf popularity). The upstream gradient δ has a log-normal per-token scale,
# as tokens with different losses have in training.

# %%
@functools.lru_cache(maxsize=64)  # a control moved back to an earlier value redraws at once
def run(metric="m2", rho=0.7, skew=0.8, mode="topk", seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    layer = ReferenceMoE.from_config(cfg, seed=seed, dtype=torch.float64)
    log_p = torch.log(zipf_popularity(cfg.num_experts, skew, gen))
    offset_D = torch.linalg.lstsq(layer.w_router_ED.detach(), log_p[:, None]).solution[:, 0]
    x_TD = torch.randn(TOKENS, cfg.hidden, generator=gen, dtype=torch.float64) + offset_D
    delta_TD = torch.randn(TOKENS, cfg.hidden, generator=gen, dtype=torch.float64)
    delta_TD *= torch.exp(torch.randn(TOKENS, 1, generator=gen, dtype=torch.float64))

    # the fidelity sweep's computation (lrmoe.analysis.fidelity): full and recalibrated gradients, compared
    with torch.no_grad():
        _, aux = layer(x_TD)
    full = layer_gradients(layer, x_TD, delta_TD)
    group_P, counts_Q = pair_groups(aux.idx_TK, cfg.num_experts, RANKS)
    rec = Recalibration(metric, mode, group_P, proportional_quotas(counts_Q, rho),
                        generator=torch.Generator().manual_seed(seed + 1))
    recal = layer_gradients(layer, x_TD, delta_TD, pair_hook=pair_hook(rec))
    cos_E, rel_E = expert_errors(recal, full, aux.counts_E > 0)
    return dict(aux=aux, rec=rec, group_P=group_P, counts_Q=counts_Q, cos_E=cos_E, rel_E=rel_E,
                rel_all=float(relative_error(recal.expert_EV, full.expert_EV)))


def per_rank_load(result):
    """Pairs per expert-parallel rank (static placement: E/N consecutive experts per rank), computed in the
    forward and retained for the backward."""
    expert_P = result["aux"].idx_TK.reshape(-1)
    rank_P = expert_P // (cfg.num_experts // RANKS)
    keep_P = result["rec"].keep_P
    return pd.DataFrame({"rank": list(range(RANKS)) * 2,
                         "pairs": torch.cat([torch.bincount(rank_P, minlength=RANKS),
                                             torch.bincount(rank_P[keep_P], minlength=RANKS)]).tolist(),
                         "pass": ["forward (dropless)"] * RANKS + ["backward (retained)"] * RANKS})


def show(metric="m2", rho=0.7, skew=0.8, mode="topk"):
    rho, skew = round(rho, 2), round(skew, 2)  # a slider's value is a multiple of its step (0.30000000000000004: 0.3)
    result = run(metric, rho, skew, mode)
    rec = result["rec"]
    kept = pd.Series(rec.keep_P.numpy()).map({True: "kept", False: "dropped"})
    if metric == "random":  # no score: the top row says so instead of drawing noise (topk) or one spike (unbiased)
        layout = [["note", "note"], ["cos", "load"]]
    else:
        layout = [["scores", "gate"], ["cos", "load"]]
    fig, axes = plt.subplot_mosaic(layout, figsize=(10, 6.4), layout="constrained")
    if metric == "random":
        style.note(axes["note"], "random ranks nothing: each (source rank, expert) group keeps a uniform random "
                   "subset of its pairs at its quota,\nso there is no score distribution to show")
    else:
        scores = rec.scores_P.detach().double()
        gate = result["aux"].gate_TK.detach().reshape(-1).double()
        sns.histplot(x=torch.log10(scores.clamp_min(1e-12)).numpy(), hue=kept, hue_order=list(KEPT_COLORS),
                     palette=KEPT_COLORS, bins=40, multiple="stack", ax=axes["scores"], legend=False)
        axes["scores"].set(title=f"{metric} scores", xlabel="log10 score", ylabel="pairs")
        style.integer_ticks(axes["scores"])
        axes["gate"].scatter(gate, scores, c=kept.map(KEPT_COLORS), s=6)
        axes["gate"].set(xscale="log", yscale="log", title="which pairs are kept, by gate and score",
                         xlabel="gate g", ylabel="score")
    sns.histplot(x=result["cos_E"].numpy(), bins=20, ax=axes["cos"])
    axes["cos"].set(title="per-expert cosine to the full gradient\n"
                    f"(relative error, all experts: {result['rel_all']:.2f})", xlabel="cosine", ylabel="experts")
    style.integer_ticks(axes["cos"])
    sns.barplot(per_rank_load(result), x="rank", y="pairs", hue="pass", palette=LOAD_COLORS, ax=axes["load"],
                legend=False)
    axes["load"].set(title="per-rank load, static placement\n(any metric: the quotas fix how many pairs are kept)")
    style.integer_ticks(axes["load"])
    legend = [("per-rank load", LOAD_COLORS, "outside lower right")]
    if metric != "random":
        legend.append(("pairs", KEPT_COLORS, "outside lower left"))
    for title, colors, where in legend:
        fig.legend([Patch(color=c) for c in colors.values()], list(colors), title=title, loc=where, ncols=2)
    fig.suptitle(f"{metric}, {mode}, retention ρ = {rho:.2f}, Zipf s = {skew:.2f}")
    plt.show()
    return result


# %% [markdown]
# ## Explore
#
# The sliders re-run the experiment when they are released (not on every step of a drag), and every view already
# seen is kept, so coming back to earlier values redraws at once (a new view takes a few seconds). Headless, as in
# the tests, the widgets are created and the default view is drawn once, into the widget.

# %%
import ipywidgets as widgets

controls = dict(
    metric=widgets.Dropdown(options=list(METRICS), value="m2", description="metric"),
    rho=widgets.FloatSlider(value=0.7, min=0.1, max=1.0, step=0.05, description="retention ρ",
                            continuous_update=False),
    skew=widgets.FloatSlider(value=0.8, min=0.0, max=1.2, step=0.1, description="Zipf s", continuous_update=False),
    mode=widgets.ToggleButtons(options=["topk", "unbiased"], value="topk", description="mode"),
)
explorer = widgets.interactive(show, **controls)
explorer

# %%
default = explorer.result  # the explorer's current view (under Run All: the defaults)
print(f"kept {int(default['rec'].keep_P.sum())} of {default['rec'].keep_P.numel()} pairs; "
      f"relative error of all expert gradients: {default['rel_all']:.3f}")

# %% [markdown]
# ## LRMoE's quotas instead of a uniform retention
#
# Above, every (source rank, expert) group keeps the same fraction ρ. LRMoE's quotas are not uniform: they cap
# each rank's backward load at (1 + ε) × the mean forward load and trim only the hot ranks (with a per-expert
# floor γ). Here the planner's LRMoE policy plans the same routed counts with no spare replica slot.

# %%
from lrmoe.planner.policies import LRMoE

result = run(skew=0.8)
counts_NE = result["counts_Q"].view(RANKS, cfg.num_experts)
rows = []
for eps in [0.0, 0.1, 0.3]:
    plan = LRMoE(eps=eps, gamma=0.1, extra_slots=0).plan(counts_NE)
    for rank, (fwd, bwd) in enumerate(zip(plan.fwd_load_N.tolist(), plan.bwd_load_N.tolist())):
        rows += [{"eps": eps, "rank": rank, "pass": "forward", "pairs": fwd},
                 {"eps": eps, "rank": rank, "pass": "backward (kept)", "pairs": bwd}]
loads = pd.DataFrame(rows)
grid = sns.catplot(loads, x="rank", y="pairs", hue="pass", col="eps", kind="bar", height=2.8, aspect=1.0)
grid.set_titles("ε = {col_name}")
for ax in grid.axes.flat:
    style.integer_ticks(ax)
grid.figure.suptitle("LRMoE quotas: per-rank load before and after (Zipf s = 0.8)", y=1.05)
plt.show()

# %% [markdown]
# ## Does the metric beat random at the same retention?
#
# The same batch under every metric, topk selection: mean relative error of the expert-weight gradients.

# %%
rows = []
for metric in METRICS:
    for rho in ([0.5, 0.85] if QUICK else [0.5, 0.7, 0.85]):
        r = run(metric, rho, 0.8, "topk")
        rows.append({"metric": metric, "rho": rho, "rel_err_all": r["rel_all"], "cos_mean": float(r["cos_E"].mean())})
table = pd.DataFrame(rows)
ax = plt.figure(figsize=(6.4, 3.6)).gca()
style.metric_lines(ax, table, x="rho", y="rel_err_all")
ax.set(title="gradient error against retention (topk)", xlabel="retention ρ", ylabel="relative error, all experts")
style.legend_outside(ax, "metric")
plt.show()
table.pivot(index="metric", columns="rho", values="rel_err_all").round(3)
