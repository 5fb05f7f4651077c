"""A training run's identity and where it starts: the arguments that define it, its checkpoint folder
(lrmoe.integrations.checkpoint; docs/checkpoints.md), which run --resume continues and from which step, decided once
before any rank starts, and the folder's lock for the run."""

from __future__ import annotations

from pathlib import Path

from lrmoe.integrations.checkpoint import CheckpointDir
from lrmoe.runtime.distributed.torchrun import torchrun_env

# The arguments that define a run: a checkpoint written under other values belongs to another run, and --resume
# refuses it. Add an argument here when it changes what a run computes. The world size is not one: a checkpoint
# resumes re-sharded on another (lrmoe.integrations.checkpoint_state).
RUN_ARGS = ("preset", "hf_config", "policy", "seed", "batch", "seq_len", "steps", "lr", "lr_schedule",
            "warmup", "min_lr_frac", "aux_coef", "bias_rate", "extra_slots", "eps", "gamma", "push_cost_rows",
            "replica_grad", "micro_batches", "data", "max_bytes", "clip_grad", "ep_size")
# Run arguments added after checkpoints were written: a checkpoint without one ran with this value.
RUN_ARG_DEFAULTS = {"clip_grad": 0.0, "ep_size": None}


def checkpoint_dir(args) -> CheckpointDir:
    """The run's checkpoint folder (--ckpt-dir), its identity the script, the run id, the results file and the
    defining arguments."""
    identity = {"script": "train", "run_id": getattr(args, "run_id", None), "results": args.out or None,
                "args": {name: getattr(args, name) for name in RUN_ARGS}}
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
    args.run_id, args.start_step, manifest = checkpoint_dir(args).plan(
        args.resume, args.overwrite, [h["run_id"] for h in headers], args.run_id, probe=probe)
    if manifest is not None and manifest["world"] != world:
        if args.trace_out:
            raise ValueError(f"--trace-out: the checkpoint of step {args.start_step} ran on {manifest['world']} "
                             f"ranks, this run on {world}; a recorded trace holds one world size's counts")
        print(f"resuming the {manifest['world']}-rank checkpoint of step {args.start_step} on {world} ranks "
              f"(re-sharded)", flush=True)


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
