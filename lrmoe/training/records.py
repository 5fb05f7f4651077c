"""One step's results row and the validation loss of a training run (every rank computes both; the loss and the
validation loss are all-reduced, the plans' loads are the rank's own, the same on every rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lrmoe.integrations.data import get_batch
from lrmoe.integrations.load_stats import flat_log, load_stats
from lrmoe.planner.plan import LayerPlan


def evaluate(run, data, args, world: int) -> float:
    """Mean validation loss over fixed batches (the same for every policy); leaves the layers' state as it was."""
    gen = torch.Generator().manual_seed(10_000 + dist.get_rank())
    total = torch.zeros(1, dtype=torch.float64, device=run.device)
    for _ in range(args.eval_batches):
        x, y = get_batch(data, args.batch, args.seq_len, gen)
        total += run.eval_loss(x.to(run.device), y.to(run.device)).double()
    if world > 1:
        dist.all_reduce(total)
    return float(total) / (args.eval_batches * world)


def step_record(args, step: int, loss_sum: float, plans_M: list[list[LayerPlan]], counts_LNE: torch.Tensor,
                elapsed: float, world: int, cost, per_layer: bool) -> dict:
    """One step's results row: loss, dropped pairs, forward / retained backward pairs per rank, the hot rank's
    backward cut (of the last micro-batch), throughput, modelled time (every micro-batch's exchanges and GEMMs, the
    sync phases once), load statistics (each layer's only when ``per_layer``)."""
    plans = plans_M[-1]
    fwd_N = torch.stack([p.fwd_load_N for p in plans]).sum(0).double()
    bwd_N = torch.stack([p.bwd_load_N for p in plans]).sum(0).double()
    hot = int(fwd_N.argmax())
    record = {
        "policy": args.policy, "step": step, "loss": loss_sum / world,
        "dropped_frac": float(sum(p.dropped_NE.sum() for ps in plans_M for p in ps)) / float(counts_LNE.sum()),
        "fwd_pairs_max": float(fwd_N.max()), "fwd_pairs_mean": float(fwd_N.mean()),
        "bwd_pairs_max": float(bwd_N.max()), "bwd_pairs_mean": float(bwd_N.mean()),
        "hot_rank_bwd_cut": 1.0 - float(bwd_N[hot] / fwd_N[hot]),
        "tokens_per_s": args.batch * args.seq_len * world / elapsed,
        "micro_batches": args.micro_batches, "activation_checkpointing": args.activation_checkpointing,
        "clip_grad": args.clip_grad,
    }
    if cost is not None:
        times = [[cost.cost(p) for p in ps] for ps in plans_M]
        record["modelled_s"] = (sum(t.total_s - t.category_s()["sync"] for ts in times for t in ts)
                                + sum(t.category_s()["sync"] for t in times[-1]))
    record.update(flat_log(load_stats(plans=plans), prefix="load/", per_layer=per_layer))
    return record
