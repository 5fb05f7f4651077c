"""One rank's training loop: the model of its architecture, its batches, the steps with their records and
validation losses, the checkpoints every --ckpt-every steps, and the recorded trace. The launch (the fork launcher,
torchrun or the emulated engine) is the script's."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lrmoe.harness.rss import peak_bytes, reset_peak
from lrmoe.integrations.data import get_batch, load_corpus
from lrmoe.runtime.distributed.mesh import build_mesh
from lrmoe.traces.trace import Trace
from lrmoe.training.models import HFModel, build
from lrmoe.training.records import evaluate, step_record
from lrmoe.training.resume import checkpoint_dir
from lrmoe.training.schedule import lr_scheduler


def worker(rank: int, args) -> list[dict]:
    """Rank ``rank``'s run of ``args`` (a parsed, checked train.py command line, ``args.run_id`` and
    ``args.start_step`` set by :func:`lrmoe.training.resume.plan_resume`): its per-step records, those a resumed run
    read from its checkpoint first."""
    torch.manual_seed(args.seed)
    world = dist.get_world_size()
    # NCCL ranks own one GPU each (torchrun on a GPU cluster); gloo ranks compute on the CPU
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = build_mesh(args.ep_size)  # collective; LOCAL_WORLD_SIZE (torchrun) says what a node is
    cfg, run, cost = build(args, world, device, mesh)
    corpus = load_corpus(args.data, max_bytes=args.max_bytes)
    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    counts: list[torch.Tensor] = []  # per step: [layers, N, E] routed pairs (the recorded trace)
    history: list[dict] = []
    layers = run.ep.layers if isinstance(run, HFModel) else run.layers
    ckpt = checkpoint_dir(args) if args.ckpt_dir else None
    start = args.start_step  # plan_resume's choice, made before the ranks started
    if start:
        history, counts = ckpt.load(start, run.model, run.opt, layers, {"data": gen}, run.architecture)
    scheduler = lr_scheduler(run.core, args, start)  # after the checkpoint: it continues from the step
    tracker = None
    if rank == 0 and args.out:
        from lrmoe.integrations.tracking import Tracker

        tracker = Tracker("train", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                          resume=args.resume, resume_step=start,  # records past the checkpoint are redone
                          wandb=not args.no_wandb, group=args.preset, quiet=args.quiet, run_id=args.run_id,
                          restore=history if start else None)  # rows the file lost, from the checkpoint
    progress = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start, desc=f"{args.policy}", disable=None)
    try:
        for step in range(start, args.steps):
            base = reset_peak() if args.record_peak_rss else 0  # before the clock starts
            t0 = time.perf_counter()
            x, y = get_batch(corpus.train, args.batch, args.seq_len, gen)
            loss, plans, counts_LNE = run.train_step(x.to(device), y.to(device))
            scheduler.step()
            peak = torch.tensor([peak_bytes() - base if args.record_peak_rss else 0], dtype=torch.float64)
            elapsed = time.perf_counter() - t0
            loss_sum = loss.double().reshape(1)
            if world > 1:
                dist.all_reduce(loss_sum)
            counts.append(counts_LNE)
            evaluating = (step + 1) % args.eval_every == 0 or step + 1 == args.steps
            # the row (its pricing and load statistics) is rank 0's alone: every rank holds the same plans, and only
            # rank 0's records reach the results file and the checkpoint; the others keep the step and its loss
            record = step_record(args, step + 1, float(loss_sum), plans, counts_LNE, elapsed, world, cost,
                                 per_layer=evaluating) if rank == 0 else \
                {"policy": args.policy, "step": step + 1, "loss": float(loss_sum) / world}
            if run.grad_norm is not None:  # --clip-grad: the global norm before clipping (the same on every rank)
                record["grad_norm"] = float(run.grad_norm)
            if args.record_peak_rss:  # the step's peak resident memory above its start, the largest rank's
                if world > 1:
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                record["peak_rss_mib"] = float(peak) / 2**20
            if evaluating:
                record["val_loss"] = evaluate(run, corpus.val, args, world)
            history.append(record)
            if tracker is not None:
                tracker.log(record, step=step + 1)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.3f}",
                                     **({"grad_norm": f"{record['grad_norm']:.3f}"} if "grad_norm" in record else {}))
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                ckpt.save(step + 1, run.model, run.opt, layers, {"data": gen}, history, counts, run.architecture)
            if args.stop_after and step + 1 >= args.stop_after:  # simulate an interruption (tests)
                break
        if rank == 0 and args.trace_out:
            trace = Trace(torch.stack(counts), {"source": "recorded", "model": cfg.name, "seed": args.seed,
                                                 "policy": args.policy, "architecture": run.architecture,
                                                 "steps": len(counts),
                                                 "tokens_per_rank": args.batch * args.seq_len,
                                                 "micro_batches": args.micro_batches})  # counts: summed over them
            trace.save(args.trace_out, overwrite=args.overwrite or args.resume)
    finally:
        if progress is not None:
            progress.close()
        if tracker is not None:
            tracker.finish()
    return history
