"""The time-to-quality protocol of docs/protocols/time_to_quality.md §11 as data: stages, seeds, regimes, the eleven
runs of a seed, the train.py arguments of each run, and what a finished run is collected as (its endpoint, curve and, at
the full budget, its modelled iteration time from its own routing, :mod:`lrmoe.sim.replay`).

    runs = stage_runs("pilot")                       # [TQRun], regime-major (weak first), seed by seed
    argv = run.train_argv(work)                      # experiments/train.py's arguments, --engine emulated
    row = collect(run, work)                         # one results line: endpoint, curve, time, shape statistics

The quantities and the claims (the dropless curve, r*, q, the Holm family) are :mod:`lrmoe.analysis.time_to_quality`;
the report over collected lines is :mod:`lrmoe.analysis.tq_report`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lrmoe.analysis import protocol
from lrmoe.config import cluster_preset, model_preset

# docs/protocols/time_to_quality.md §11.1: the emulated engine, Qwen3-30B-A3B's routing shape (128 experts, top-8, 16
# ranks)
ENGINE = "emulated"
RANKS = 16
PRESET = "qwen3-30b-a3b-routing-debug"  # the ladder's smallest rung; the model pilot's record names the one chosen
LADDER = tuple(f"qwen3-30b-a3b-routing-h{h}-f{f}-l{layers}" if (h, f, layers) != (64, 32, 2) else PRESET
               for layers in (2, 4) for h in (64, 128) for f in (32, 64))  # smallest first (fewest parameters)
STEPS = 300
BATCH = 4
SEQ_LEN = 64
WARMUP = 10  # the cosine schedule's warm-up steps; the time replays every recorded step after them
EVAL_EVERY = 15  # every step budget (255, 270, 285, 300) ends on an evaluation
EVAL_BATCHES = 16
ENDPOINT_EVALS = 3
CKPT_EVERY = 75  # a stopped run resumes from its last checkpoint (75 divides none of the shorter budgets' ends)
BUDGETS = {0.85: 255, 0.90: 270, 0.95: 285, 1.0: 300}  # step fraction -> steps, each with its own schedule

# docs/protocols/time_to_quality.md §11.1: the model pilot's rule, read at steps 25 and 300 (its evaluation every 25
# steps has both)
MODEL_PILOT_SEEDS = (2100, 2101)
MODEL_PILOT_EVAL_EVERY = 25
MODEL_PILOT_REGIME = "weak"  # aux-loss 1e-3
MODEL_PILOT_LOSS_DROP = 0.20
MODEL_PILOT_GINI_MOVE = 0.02
# docs/protocols/time_to_quality.md §11.5
PILOT_SEEDS = (2000, 2001, 2002, 2003)
SWEEP_SEED0 = 3000
MAX_SEEDS = 32
REGIMES = ("weak", "production")  # weak first
STAGES = ("model-pilot", "pilot", "sweep")

DROPLESS_BUDGETS = (("static-ep", 0.85), ("static-ep", 0.90), ("static-ep", 0.95), ("static-ep", 1.0),
                    ("symi-dropless", 1.0))
LRMOE_ARMS = ("lrmoe-rho0.75-early-unbiased", "lrmoe-rho0.9-unbiased", "lrmoe-rho0.75-unbiased", "lrmoe")
CONTROLS = ("symi-dropless-rho0.75-unbiased", "lrmoe-rho0.75-random-unbiased")
SEED_RUNS = (*DROPLESS_BUDGETS, *((a, 1.0) for a in (*LRMOE_ARMS, *CONTROLS)))  # the eleven runs of a seed

# train.py flags that do not change what a run computes (a run's identity leaves them out)
NOT_IDENTITY = ("--out", "--trace-out", "--ckpt-dir", "--resume", "--quiet", "--no-wandb", "--ckpt-every",
                "--timeout", "--replica-grad")
# §11.6 Record 3: the replica-gradient mode of each stage's runs (bitwise the same maths; not part of a run's identity)
REPLICA_GRAD = {"model-pilot": "range", "pilot": "range", "sweep": "shard"}


@dataclass(frozen=True)
class TQRun:
    """One training run of the protocol: its stage, regime, seed, system (``arm``), step budget and model preset."""

    stage: str
    regime: str
    seed: int
    arm: str
    budget: float
    preset: str = PRESET

    @property
    def steps(self) -> int:
        return BUDGETS[self.budget]

    @property
    def eval_every(self) -> int:
        return MODEL_PILOT_EVAL_EVERY if self.stage == "model-pilot" else EVAL_EVERY

    @property
    def key(self) -> dict:
        return {"stage": self.stage, "regime": self.regime, "seed": self.seed, "arm": self.arm,
                "budget": self.budget, "preset": self.preset}

    @property
    def name(self) -> str:
        return f"{self.arm}-r{self.budget:g}"

    def folder(self, work: Path) -> Path:
        return Path(work) / self.stage / self.preset / self.regime / f"seed{self.seed}"

    def results(self, work: Path) -> Path:
        return self.folder(work) / f"{self.name}.jsonl"

    def trace(self, work: Path) -> Path:
        return self.folder(work) / f"{self.name}.trace.npz"

    def identity_argv(self) -> list[str]:
        """train.py's arguments that decide what the run computes (docs/protocols/time_to_quality.md §11.1-11.2)."""
        regime = protocol.get_regime(self.regime)
        spare = regime.spare_slots(model_preset(self.preset).num_experts, RANKS)
        return ["--engine", ENGINE, "--preset", self.preset, "--policy", self.arm, "--ranks", str(RANKS),
                "--seed", str(self.seed), "--steps", str(self.steps), "--batch", str(BATCH),
                "--seq-len", str(SEQ_LEN), "--lr-schedule", "cosine", "--warmup", str(WARMUP),
                "--eval-every", str(self.eval_every), "--eval-batches", str(EVAL_BATCHES),
                "--aux-coef", repr(regime.aux_coef), "--extra-slots", str(spare), "--eps", repr(regime.eps),
                "--gamma", repr(regime.gamma)]

    def train_argv(self, work: Path, resume: bool = False, timeout_s: float | None = None) -> list[str]:
        """The whole command line: the identity, the run's own files (results, trace, checkpoints), quiet, no W&B,
        the stage's replica-gradient mode (:data:`REPLICA_GRAD`), and ``timeout_s`` as train.py's --timeout (the
        emulated engine's bound on the whole run) when given."""
        return [*self.identity_argv(), "--out", str(self.results(work)), "--trace-out", str(self.trace(work)),
                "--ckpt-every", str(CKPT_EVERY), "--quiet", "--no-wandb", "--replica-grad", REPLICA_GRAD[self.stage],
                *(["--resume"] if resume else []),
                *(["--timeout", f"{timeout_s:.0f}"] if timeout_s is not None else [])]


def stage_runs(stage: str, seeds_count: int | None = None, regimes=REGIMES, preset: str = PRESET) -> list[TQRun]:
    """The runs of a stage in the order they run: the model pilot's static-EP runs on ``preset``; the variance
    pilot's and the sweep's eleven runs per seed, regime-major (weak first), seed by seed (whole seeds first)."""
    if stage == "model-pilot":
        return [TQRun(stage, MODEL_PILOT_REGIME, s, "static-ep", 1.0, preset) for s in MODEL_PILOT_SEEDS]
    if stage == "pilot":
        seeds = list(PILOT_SEEDS)
    elif stage == "sweep":
        if seeds_count is None or not 1 <= seeds_count <= MAX_SEEDS:
            raise ValueError(f"the sweep runs 1 to {MAX_SEEDS} seeds per regime (the pilot's seed count), got "
                             f"{seeds_count}")
        seeds = list(range(SWEEP_SEED0, SWEEP_SEED0 + seeds_count))
    else:
        raise ValueError(f"unknown stage {stage!r}; known: {', '.join(STAGES)}")
    for regime in regimes:
        protocol.get_regime(regime)
    return [TQRun(stage, regime, seed, arm, budget, preset) for regime in regimes for seed in seeds
            for arm, budget in SEED_RUNS]


TIMEOUT_FACTOR = 3.0  # a run's --timeout: this many times its measured cost (a loaded machine stays inside it)
MIN_TIMEOUT_S = 1800.0


def sibling_rows(out: Path) -> list[dict]:
    """The collected lines of the protocol's other results files beside ``out`` (tq_protocol_*.jsonl): measured
    costs of the same arms, for a stage that has collected none of its own yet."""
    from lrmoe.results import read_records

    out = Path(out)
    rows = []
    for path in sorted(out.parent.glob("tq_protocol_*.jsonl")):
        if path.resolve() != out.resolve():
            rows += [r for r in read_records(path) if "arm" in r]
    return rows


def run_costs(rows: list[dict], preset: str) -> dict:
    """(arm, budget) -> the largest wall time (s) of a collected run of ``preset`` (``wall_s``, the runner's
    measure; runs collected without it are left out), and (arm, None) -> the arm's largest over its budgets."""
    costs: dict = {}
    for r in rows:
        if r.get("preset") != preset or not r.get("wall_s"):
            continue
        for key in ((r["arm"], r["budget"]), (r["arm"], None)):
            costs[key] = max(costs.get(key, 0.0), float(r["wall_s"]))
    return costs


def run_cost(costs: dict, run: TQRun) -> float | None:
    """A run's measured cost (s): its arm's at its budget, else its arm's at any budget; None when unmeasured."""
    return costs.get((run.arm, run.budget), costs.get((run.arm, None)))


def run_timeout(cost: float | None) -> float | None:
    """A run's --timeout from its measured cost (None: train.py's default)."""
    return None if cost is None else max(TIMEOUT_FACTOR * cost, MIN_TIMEOUT_S)


def progress_table(rows: list[dict], runs: list[TQRun]) -> str:
    """The interim state of a stage as Markdown: runs collected of runs planned, per regime and arm (and budget)."""
    planned: dict = {}
    for run in runs:
        planned.setdefault((run.regime, run.name), [0, 0])[1] += 1
        if any(same_run(r, run) for r in rows):
            planned[(run.regime, run.name)][0] += 1
    regimes = list(dict.fromkeys(k[0] for k in planned))
    names = list(dict.fromkeys(k[1] for k in planned))
    out = ["| run | " + " | ".join(regimes) + " |", "|---|" + "---:|" * len(regimes)]
    for name in names:
        out.append(f"| {name} | " + " | ".join(
            "{} of {}".format(*planned[(g, name)]) if (g, name) in planned else "" for g in regimes) + " |")
    done = {g: sum(v[0] for k, v in planned.items() if k[0] == g) for g in regimes}
    total = {g: sum(v[1] for k, v in planned.items() if k[0] == g) for g in regimes}
    out.append("| **all** | " + " | ".join(f"**{done[g]} of {total[g]}**" for g in regimes) + " |")
    return "\n".join(out)


def paper_scale():
    """The time axis: (model, cluster, tokens per rank, micro-batches), the §10 protocol's SIM_* constants."""
    return (model_preset(protocol.SIM_MODEL), cluster_preset(protocol.SIM_CLUSTER, protocol.SIM_NODES),
            protocol.SIM_TOKENS_PER_RANK, protocol.SIM_MICRO_BATCHES)


def price(trace, run: TQRun, band: bool = True, warmup_steps: int = WARMUP):
    """The run's modelled iteration at paper scale from its own routing (:func:`lrmoe.sim.replay.price_run`) at its
    regime's slots, eps and gamma, every step from ``warmup_steps`` on."""
    from lrmoe.sim.replay import price_run

    model, cluster, tokens, mb = paper_scale()
    regime = protocol.get_regime(run.regime)
    return price_run(trace, run.arm, model, cluster, tokens, mb,
                     spare_slots=regime.spare_slots(model.num_experts, cluster.num_ranks), eps=regime.eps,
                     gamma=regime.gamma, warmup_steps=warmup_steps, band=band)


def shape_stats(trace, warmup: int = WARMUP) -> dict:
    """The routing's shape as static EP at paper scale would see it (the steps after the warm-up): slowest rank ÷
    mean, per-expert Gini, hottest expert ÷ mean (:func:`lrmoe.analysis.skew.trace_imbalance`)."""
    from lrmoe.analysis.skew import trace_imbalance  # torch: loaded when a trace is read, not for tq_sweep's --help

    return trace_imbalance(trace.counts_ILNE[warmup:])


def collect(run: TQRun, work: Path, band: bool = True, wall_s: float | None = None) -> dict:
    """One finished run as one results line: its identity (key and train.py arguments), endpoint over its last
    three evaluations, validation curve, routing-shape statistics of its trace, its training steps' seconds (and
    ``wall_s``, the whole run's as its runner measured it), the replica-gradient mode it trained in
    (``train_replica_grad``, its results header's; docs/protocols/time_to_quality.md §11.6 Record 3), and at the full
    budget its modelled iteration time (central, MoE, dense, the constants band's corners at every micro-batch count of
    the band, and ``time_select``: at the selection's charge times 0.5, 1, 2, 4) with the mode it is priced in
    (``replica_grad``)."""
    from lrmoe.analysis.skew import trace_imbalance
    from lrmoe.results import read_headers, read_results
    from lrmoe.traces.trace import load_trace

    records = {r["step"]: r for r in read_results(run.results(work))}  # a resumed step: the later record wins
    rows = [records[s] for s in sorted(records)]
    if not rows or rows[-1]["step"] != run.steps:
        raise ValueError(f"{run.results(work)} has not finished ({rows[-1]['step'] if rows else 0} of "
                         f"{run.steps} steps)")
    evals = [r for r in rows if r.get("val_loss") is not None]
    steps, val = [r["step"] for r in evals], [r["val_loss"] for r in evals]
    trace = load_trace(run.trace(work))
    if trace.num_steps != run.steps:
        raise ValueError(f"{run.trace(work)} holds {trace.num_steps} steps, the run {run.steps}")
    row = {**run.key, "argv": run.identity_argv(), "steps": run.steps,
           "endpoint": protocol.endpoint(steps, val, ENDPOINT_EVALS, run.steps), "eval_steps": steps,
           "val_loss": val, "shape": shape_stats(trace),
           "train_s": float(sum(BATCH * SEQ_LEN * RANKS / r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))),
           **({"wall_s": wall_s} if wall_s is not None else {})}
    headers = read_headers(run.results(work))
    row["train_replica_grad"] = ((headers[-1].get("config") or {}) if headers else {}).get("replica_grad", "range")
    if run.stage == "model-pilot":
        row["gini_first_last"] = [trace_imbalance(trace.counts_ILNE[i:i + 1])["gini"] for i in (24, run.steps - 1)]
    elif run.budget == 1.0:
        t = price(trace, run, band=band)
        row |= {"time_s": t.time_s, "moe_s": t.moe_s, "dense_s": t.dense_s, "replica_grad": t.replica_grad,
                "steps_priced": t.steps_priced, "time_corners": t.corners, "time_select": t.select_times,
                "sim": {k: t.summary[k] for k in ("drop_rate", "fwd_imbalance", "rho", "slots_per_rank",
                                                  "peak_mem_bytes")}}
    return row


def same_run(row: dict, run: TQRun) -> bool:
    """Whether a collected line is this run: the same key and the same train.py identity."""
    return all(row.get(k) == v for k, v in run.key.items()) and row.get("argv") == run.identity_argv()


def clashing(rows: list[dict], run: TQRun) -> dict | None:
    """A collected line with this run's key but other train.py arguments (a run of other settings), if any."""
    return next((r for r in rows if all(r.get(k) == v for k, v in run.key.items()) and
                 r.get("argv") != run.identity_argv()), None)


RUN_KEY = ("stage", "regime", "seed", "arm", "budget", "preset")  # a collected run's key (TQRun.key)


def unique_rows(rows: list[dict], where: str = "the collected lines") -> list[dict]:
    """Each collected run once, as every report and figure counts them: a line that repeats an earlier one exactly
    (a copy of a collected line appended again) is dropped; two different lines of one run (:data:`RUN_KEY`) are a
    ValueError naming the run and the fields they differ in. Lines that are no collected run pass as they are."""
    first: dict[tuple, dict] = {}
    out = []
    for row in rows:
        if "arm" not in row:
            out.append(row)
            continue
        key = tuple(row.get(k) for k in RUN_KEY)
        if key not in first:
            first[key] = row
            out.append(row)
        elif first[key] != row:
            fields = sorted(k for k in first[key].keys() | row.keys() if first[key].get(k) != row.get(k))
            raise ValueError(f"{where} holds two different lines of run {dict(zip(RUN_KEY, key))} (they differ in "
                             f"{', '.join(fields)}): keep the one that is right")
    return out


def collected_rows(path: str | Path) -> list[dict]:
    """The lines of a protocol results file, each collected run once (:func:`unique_rows`)."""
    from lrmoe.results import read_records

    return unique_rows(read_records(path), str(path))


def model_pilot_verdict(rows: list[dict]) -> dict:
    """docs/protocols/time_to_quality.md §11.1's rule on one rung's collected model-pilot runs: the validation loss
    falls by at least 20 % from step 25 to step 300, and the per-expert Gini moves by at least 0.02 between them (means
    over the seeds)."""
    drops, moves = [], []
    for r in rows:
        val = dict(zip(r["eval_steps"], r["val_loss"]))
        if 25 not in val or STEPS not in val:
            raise ValueError(f"the model pilot's run of seed {r['seed']} has no evaluation at step 25 and 300")
        drops.append(1 - val[STEPS] / val[25])
        moves.append(abs(r["gini_first_last"][1] - r["gini_first_last"][0]))
    drop, move = float(np.mean(drops)), float(np.mean(moves))
    return {"preset": rows[0]["preset"] if rows else None, "seeds": len(rows), "loss_drop": drop,
            "gini_move": move, "learns_to_route": drop >= MODEL_PILOT_LOSS_DROP and move >= MODEL_PILOT_GINI_MOVE}
