"""A training run's identity and where it starts: the arguments that define it, its checkpoint folder
(lrmoe.integrations.checkpoint; docs/checkpoints.md), which run --resume continues and from which step, decided once
before any rank starts, and the folder's lock for the run."""

from __future__ import annotations

from pathlib import Path

from lrmoe.integrations.checkpoint import CheckpointDir
from lrmoe.runtime.distributed.torchrun import torchrun_env

# The arguments that do not define a run: where its outputs go, how it is launched, watched, checkpointed and stopped,
# and the values plan_resume sets. Every other argument of train.py defines the run (what it computes and what its
# results file holds: the cost model and the evaluation included): a checkpoint written under other values belongs
# to another run, and --resume refuses it, naming the flag and both values. A new argument defines the run unless it
# is added here. The world size (--ranks) is not one: a checkpoint resumes re-sharded on another
# (lrmoe.integrations.checkpoint_state); nor is --engine: both engines compute the same run, bit for bit.
NOT_RUN_ARGS = frozenset({"out", "overwrite", "resume", "no_wandb", "wandb_project", "wandb_group", "quiet",
                          "timeout", "ckpt_dir", "ckpt_every", "ckpt_keep", "stop_after", "trace_out", "ranks",
                          "torchrun", "engine", "run_id", "start_step"})
# Run arguments added after checkpoints were written: a checkpoint without one ran with this value (train.py's
# default then, the only value those versions had or recorded).
RUN_ARG_DEFAULTS = {"clip_grad": 0.0, "ep_size": None, "cost_model": "h200x8", "eval_every": 25, "eval_batches": 4,
                    "activation_checkpointing": False, "record_peak_rss": False}


def run_args(args) -> dict:
    """The arguments that define the run of ``args`` (all but :data:`NOT_RUN_ARGS`), by name."""
    return {name: value for name, value in sorted(vars(args).items()) if name not in NOT_RUN_ARGS}


def checkpoint_dir(args) -> CheckpointDir:
    """The run's checkpoint folder (--ckpt-dir), its identity the script, the run id, the results file and the
    defining arguments."""
    identity = {"script": "train", "run_id": getattr(args, "run_id", None), "results": args.out or None,
                "args": run_args(args)}
    return CheckpointDir(args.ckpt_dir, identity, keep=args.ckpt_keep, defaults=RUN_ARG_DEFAULTS)


def plan_resume(args, world: int) -> None:
    """Decide, before any rank starts, which run this is and where it starts (CheckpointDir.plan): sets
    ``args.run_id`` and ``args.start_step`` (0, or the step of the checkpoint --resume continues from). ValueError
    when the folder is another run's or in use, when --resume would mix runs, or when a fresh run would start over
    an earlier run's checkpoints without --overwrite."""
    from lrmoe.integrations.provenance import new_run_id
    from lrmoe.results import read_results

    args.run_id, args.start_step = new_run_id("train"), 0
    if not args.ckpt_dir:
        return
    out = Path(args.out) if args.out else None
    headers = read_results(out, "run") if args.resume and out is not None and out.is_file() else []
    env = torchrun_env()
    probe = env is None or env.rank == 0  # under torchrun rank 0 takes the folder (main)
    ckpt = checkpoint_dir(args)
    if headers:  # a checkpoint older than an argument: the run's header recorded the value it ran with
        ckpt.defaults = {**RUN_ARG_DEFAULTS, **{k: v for k, v in headers[-1].get("config", {}).items()
                                               if k in ckpt.identity["args"]}}
    args.run_id, args.start_step, manifest = ckpt.plan(
        args.resume, args.overwrite, [h["run_id"] for h in headers], args.run_id, probe=probe)
    if manifest is not None and (gap := records_gap(read_results(out), manifest)):
        raise ValueError(f"--resume: results file {out} lacks the records of steps {gap}, and the checkpoint of step "
                         f"{args.start_step} in {args.ckpt_dir} does not hold them either; pass --overwrite to start "
                         f"the run again")
    if manifest is not None and manifest["world"] != world:
        if args.trace_out:
            raise ValueError(f"--trace-out: the checkpoint of step {args.start_step} ran on {manifest['world']} "
                             f"ranks, this run on {world}; a recorded trace holds one world size's counts")
        print(f"resuming the {manifest['world']}-rank checkpoint of step {args.start_step} on {world} ranks "
              f"(re-sharded)", flush=True)


def records_gap(records: list[dict], manifest: dict) -> str | None:
    """The steps up to a checkpoint's (``manifest``) that neither the results file's ``records`` nor the checkpoint's
    records segments hold, as ranges ('3-4, 7'), or None: a resume writes the file's lost rows back from the
    checkpoint (lrmoe.integrations.tracking.Tracker's ``restore``), and cannot where both lack a step."""
    from lrmoe.integrations.tracking import step_ranges

    held = {r.get("step") for r in records}
    held |= {s for seg in manifest["records"] for s in range(seg["first"], seg["last"] + 1)}
    missing = [s for s in range(1, manifest["step"] + 1) if s not in held]
    return step_ranges(missing) if missing else None


def hold_checkpoints(args) -> CheckpointDir | None:
    """The checkpoint folder locked for this run (released by the caller), or None when the run keeps none."""
    if not args.ckpt_dir or not (args.ckpt_every or args.start_step):
        return None
    held = checkpoint_dir(args)
    try:
        held.lock()
    except RuntimeError as exc:
        raise SystemExit(f"train.py: error: {exc}") from None
    return held
