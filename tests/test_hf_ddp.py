"""The drop-in under torch's DistributedDataParallel, tiny Qwen3-MoE and GLM-4.5, fp32, 2 and 3 gloo ranks.

The expert slots are parameters of the swapped model (``<block>.experts.slots_SW``) that DDP is told to leave alone
(``_ddp_params_and_buffers_to_ignore``, set by the swap on the model and every module above a block): DDP carries
the dense gradients (averaged in its backward, with ``no_sync`` for all micro-batches but the last), the replica
store the experts'. Properties: DDP-wrapped, with gradient accumulation and clipping, the swapped model trains as
the unmodified model on one process (the mean loss over every rank's micro-batches, torch's clipping over all its
parameters, AdamW): the same losses and weights, experts included; the step then all-reduces the dense gradients
no second time (only the non-finite flags); a DDP around a module above the model, which would all-reduce the
slots, is refused at the first training forward on every rank.
"""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from lrmoe.integrations.hf import DDP_REDUCES_EXPERTS, DataParallelError, swap_moe_blocks  # noqa: E402
from lrmoe.runtime.distributed.launch import launch  # noqa: E402
from _hf_helpers import tiny_config, tiny_hf_model, weight_mismatches  # noqa: E402

TINY = tiny_config(6)
BATCH, SEQ, MICRO, STEPS, LR = 2, 8, 2, 3, 1e-2
MAX_NORM = 0.5  # the mean loss's gradient norm is about 2-3 here: every step clips
# as tests/test_hf_optimizer.py: Adam moves a weight whose gradient is near zero by a fraction of lr on float noise
WEIGHTS = dict(rtol=1e-4, atol=LR / 100)
LOSS = dict(rtol=1e-5, atol=1e-6)



def ids(step: int, m: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
    return torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=gen)


class _Counting:
    """Counts the elements that go through ``dist.all_reduce`` while it is installed (the real call still runs)."""

    def __init__(self):
        self.elements, self._real = 0, dist.all_reduce

    def __enter__(self):
        def counted(tensor, *args, **kwargs):
            self.elements += tensor.numel()
            return self._real(tensor, *args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def _ddp_trains_as_one_process(rank: int, family: str, system: str) -> dict:
    world = dist.get_world_size()
    model = tiny_hf_model(family, TINY.num_experts)
    ref = copy.deepcopy(model)
    ep = swap_moe_blocks(model, system)
    ddp = DistributedDataParallel(model)
    slots = {n for n, _ in model.named_parameters() if n.endswith("experts.slots_SW")}
    reduced_by_ddp = {id(p) for p in ddp._module_parameters}
    opt = ep.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.0, max_grad_norm=MAX_NORM, bias_rate=0.0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    out = {"loss": [], "ref_loss": [], "flags": [], "step_elements": [],
           "ignored": ddp.parameters_to_ignore == slots and len(slots) == 2,
           "slots_left_out": not any(id(layer.store.slots_SW) in reduced_by_ddp for layer in ep.layers),
           "dense": sum(p.numel() for p in ep.dense_parameters())}
    for step in range(STEPS):
        total = 0.0
        for m in range(MICRO):  # DDP's gradient accumulation: no all-reduce before the last micro-batch
            with ddp.no_sync() if m < MICRO - 1 else nullcontext():
                loss = ddp(ids(step, m, rank), labels=ids(step, m, rank)).loss
                loss.backward()
            out["flags"].append(ep.dense_reduced_by_ddp)
            total += float(loss) / MICRO
        with _Counting() as counting:
            opt.step()
        out["step_elements"].append(counting.elements)
        opt.zero_grad()
        mean = torch.tensor(total)
        dist.all_reduce(mean)
        out["loss"].append(float(mean) / world)
        ref_loss = sum(ref(x, labels=x).loss for m in range(MICRO) for r in range(world)
                       for x in [ids(step, m, r)]) / (world * MICRO)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_loss"].append(float(ref_loss))
    got, want = model.state_dict(), ref.state_dict()  # collective: the experts gathered from every rank
    out["same_keys"] = got.keys() == want.keys()
    out["weights"] = weight_mismatches(got, want, **WEIGHTS)
    return out


def _cases(rank: int, cases: list[tuple[str, str]]) -> list[dict]:
    return [_ddp_trains_as_one_process(rank, *case) for case in cases]


@pytest.mark.parametrize("ranks,cases", [(2, [("qwen", "symi-dropless"), ("glm", "lrmoe-no-quotas")]),
                                         (3, [("qwen", "online-greedy")])])
def test_ddp_wrapped_drop_in_trains_as_the_unswapped_model_on_one_process(ranks, cases):
    for rank_out in launch(_cases, ranks, cases, timeout_s=300):
        for case, out in zip(cases, rank_out):
            assert out["ignored"] and out["slots_left_out"], case
            assert out["flags"] == [False, True] * STEPS, (case, out["flags"])  # no_sync, then the synced one
            torch.testing.assert_close(out["loss"], out["ref_loss"], **LOSS, msg=lambda m: f"{case}: {m}")
            assert out["same_keys"] and not out["weights"], (case, out["weights"])
            # the step's all-reduces: the flags and the clipping's norm, never the dense gradients again
            assert all(n < out["dense"] for n in out["step_elements"]), (case, out["step_elements"], out["dense"])


class _Above(nn.Module):
    """A module above the model: DDP reads its ignore list, which names nothing."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor):
        return self.lm(x, labels=x)


def _ddp_above_the_model(rank: int) -> tuple:
    model = tiny_hf_model("qwen", TINY.num_experts)
    ep = swap_moe_blocks(model, "static-ep")
    ddp = DistributedDataParallel(_Above(model))
    x = ids(0, 0, rank)
    try:
        ddp(x)
    except DataParallelError as exc:
        return str(exc), ep.layers[0].micro_batches
    return "ran", ep.layers[0].micro_batches


def test_a_ddp_that_would_reduce_the_experts_is_refused_at_the_first_training_forward():
    for message, micro_batches in launch(_ddp_above_the_model, 2, timeout_s=60):
        assert message == DDP_REDUCES_EXPERTS and micro_batches == 0, message
