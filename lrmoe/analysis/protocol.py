"""The frontier protocol of docs/protocols/frontier.md §10 as data: regimes, arms, seeds, the training settings, and the
endpoint.

A :class:`Regime` fixes one set of system settings that both axes of a frontier use: the training runs that give
the loss (aux-loss coefficient, replica slots, balance slack, the retention budgets) and the simulator that gives
the time (the same slots per home slot, slack and budgets, at a skew matched to what the runs measured:
:mod:`lrmoe.analysis.skew`). Everything here is fixed before the sweep runs; nothing is tuned per cell.

    regime = REGIMES["production"]
    argv = regime.convergence_argv(arms=ARMS, seeds=[1000], out="outputs/frontier_protocol/production.jsonl")
    endpoint(records)     # mean validation loss over the last ENDPOINT_EVALS evaluations of one run
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRESET = "qwen3-30b-a3b-debug"  # lrmoe's own transformer of Qwen3's shape: one model family, decided in advance
RANKS = 4
STEPS = 300
BATCH = 4
SEQ_LEN = 64
EVAL_EVERY = 25
EVAL_BATCHES = 16  # per rank: 16 x 4 sequences x 64 bytes x 4 ranks = 16,384 bytes, four times the old 4,096
ENDPOINT_EVALS = 3  # the endpoint: mean validation loss over the last three evaluations (steps 250, 275, 300)
CKPT_EVERY = 100

# the time axis (docs/protocols/frontier.md §10.1): Qwen3-30B-A3B on 2 x 8 A100-40GB, 8 micro-batches of 2,048 tokens
# per rank
SIM_MODEL, SIM_CLUSTER, SIM_NODES, SIM_TOKENS_PER_RANK, SIM_MICRO_BATCHES = "qwen3-30b-a3b", "a100-40gb-x8", 2, 2048, 8
SIM_SEEDS = 5

PILOT_SEEDS = (100, 101, 102, 103)  # the variance pilot: fresh seeds, never part of the confirmatory analysis
SWEEP_SEED0 = 1000  # the sweep's seeds are 1000, 1001, ...: fresh, not 0-2 (which generated the hypotheses)
# the most seeds the sweep runs per regime, whatever the power calculation asks (docs/protocols/frontier.md §10.4)
MAX_SEEDS = 16
SWEEP_SEEDS = MAX_SEEDS  # the sweep's planned seeds per regime: the pilot's power calculation, capped

REFERENCES = ("static-ep", "symi-dropless")  # the same maths: the reference is their mean, seed by seed
ARMS = (
    "static-ep", "symi-dropless",
    "lrmoe-rho0.9-unbiased", "lrmoe-rho0.75-unbiased", "lrmoe-rho0.5-unbiased",  # the frontier's shape
    "lrmoe-rho0.75-random-unbiased",  # the control of the metric: uniform inclusion, 1/p scaled
    "lrmoe-rho0.75-random",  # random top-k (no reweighting): with the line above it isolates the reweighting
    "symi-dropless-rho0.75",  # SYMI-dropless trimmed at random to the same budget (the "less work" control)
    "symi-dropless-rho0.75-unbiased",  # the same trim, 1/p scaled
    "lrmoe",  # cap mode
)
# docs/protocols/frontier.md §10.6 (an amendment registered before any of its runs): early selection joins the sweep,
# one arm per regime and seed, with a family of claims of its own, so that the Holm family of §10.4 is unchanged
EARLY_ARMS = ("lrmoe-rho0.75-early-unbiased",)
SWEEP_ARMS = ARMS + EARLY_ARMS  # what experiments/frontier_sweep.py runs per regime and seed
PILOT_ARMS = ("static-ep", "symi-dropless", "lrmoe-rho0.75-unbiased", "lrmoe-rho0.75-random-unbiased")
CLAIM_RHO = 0.75  # the budget at which the controls run


@dataclass(frozen=True)
class Regime:
    """One frontier's system settings, the same on both axes (docs/protocols/frontier.md §10.1).

    aux_coef        the load-balancing loss weight of the training runs (the regime's routing skew).
    spare_per_home  replica slots per rank per home slot, for SYMI and LRMoE alike: the debug model's 16 experts
                    on 4 ranks (4 home slots) get 1 spare slot per rank; the paper-scale simulation (128 experts
                    on 16 ranks, 8 home slots) gets 2.
    eps, gamma      LRMoE's balance slack (cap mode) and per-expert floor.
    rhos            the retention budgets of the frontier.
    """

    name: str
    description: str
    aux_coef: float
    spare_per_home: float = 0.25
    eps: float = 0.1
    gamma: float = 0.1
    rhos: tuple[float, ...] = (0.9, 0.75, 0.5)

    def spare_slots(self, num_experts: int, num_ranks: int) -> int:
        """Replica slots per rank at a scale: the regime's share of the E/N home slots, rounded (at least 0)."""
        if num_experts % num_ranks:
            raise ValueError(f"{num_experts} experts do not divide over {num_ranks} ranks")
        return int(round(self.spare_per_home * (num_experts // num_ranks)))

    def convergence_argv(self, arms, seeds, out: str, num_experts: int = 16) -> list[str]:
        """experiments/convergence.py's arguments for these arms and seeds in this regime."""
        spare = str(self.spare_slots(num_experts, RANKS))
        return ["--preset", PRESET, "--policies", *arms, "--seeds", *map(str, seeds), "--ranks", str(RANKS),
                "--steps", str(STEPS), "--batch", str(BATCH), "--seq-len", str(SEQ_LEN),
                "--eval-every", str(EVAL_EVERY), "--ckpt-every", str(CKPT_EVERY), "--lr-schedule", "cosine",
                "--aux-coef", repr(self.aux_coef), "--extra-slots", spare, "--lrmoe-extra-slots", spare,
                "--lrmoe-eps", repr(self.eps), "--quiet", "--no-wandb", "--out", out]


REGIMES: dict[str, Regime] = {
    r.name: r for r in (
        Regime("production", "aux-loss balancing as pre-training runs it (coefficient 0.1, the earlier sweeps')",
               aux_coef=0.1),
        Regime("weak", "weakly balanced, as in fine-tuning or post-training: aux-loss coefficient 1e-3 (Qwen3's "
                       "value at scale), where the debug model's routing concentrates", aux_coef=1e-3),
    )
}


def get_regime(name: str) -> Regime:
    if name not in REGIMES:
        raise ValueError(f"unknown regime {name!r}; known: {', '.join(REGIMES)}")
    return REGIMES[name]


def sweep_seeds(count: int) -> list[int]:
    """The sweep's first ``count`` seeds."""
    if count < 1:
        raise ValueError(f"the sweep needs at least one seed, got {count}")
    return list(range(SWEEP_SEED0, SWEEP_SEED0 + count))


def endpoint(steps, val_loss, evals: int = ENDPOINT_EVALS, last_step: int = STEPS) -> float:
    """The protocol's endpoint of one run: the mean validation loss over its last ``evals`` evaluations, NaN
    unless the run reached ``last_step`` (an unfinished run has no endpoint)."""
    pairs = sorted((int(s), float(v)) for s, v in zip(steps, val_loss) if v == v)
    if not pairs or pairs[-1][0] != last_step or len(pairs) < evals:
        return float("nan")
    return float(np.mean([v for _, v in pairs[-evals:]]))


# what a collected run keeps of its evaluation records: the curve and the routing's imbalance (load_stats' names)
LOAD_KEYS = ("load/rank_max_over_mean_mean", "load/gini_mean", "load/expert_max_over_mean_mean")


def collect_run(results, **identity) -> dict:
    """One finished run of a per-run results file (experiments/train.py) as one results line: ``identity``
    (regime, seed, arm, stage), its endpoint, its validation curve, the mean over its evaluations of the routing
    imbalance statistics, and the mean over its steps of the hottest rank's forward and retained backward pairs
    (both ÷ the mean forward pairs) and of the dropped fraction."""
    from lrmoe.results import read_results

    records = {r["step"]: r for r in read_results(results)}  # a resumed step: the later record wins
    rows = [records[s] for s in sorted(records)]
    evals = [r for r in rows if r.get("val_loss") is not None]
    if not rows or rows[-1]["step"] != STEPS:
        raise ValueError(f"{results} has not finished ({rows[-1]['step'] if rows else 0} of {STEPS} steps)")
    steps, val = [r["step"] for r in evals], [r["val_loss"] for r in evals]
    return {**identity, "endpoint": endpoint(steps, val), "steps": STEPS, "eval_steps": steps, "val_loss": val,
            **{k: float(np.mean([r[k] for r in evals if k in r])) for k in LOAD_KEYS if any(k in r for r in evals)},
            "fwd_max_over_mean": float(np.mean([r["fwd_pairs_max"] / r["fwd_pairs_mean"] for r in rows])),
            "bwd_max_over_mean_fwd": float(np.mean([r["bwd_pairs_max"] / r["fwd_pairs_mean"] for r in rows])),
            "dropped_frac": float(np.mean([r["dropped_frac"] for r in rows]))}


def collected_keys(path) -> set[tuple[str, int, str]]:
    """The (regime, seed, arm) of every run already in a collected results file (none if it does not exist)."""
    from lrmoe.results import read_records

    return {(row["regime"], int(row["seed"]), row["arm"]) for row in read_records(path)}  # bad lines: file, line
