"""Sharded checkpoints (lrmoe.integrations.checkpoint_state, lrmoe.integrations.checkpoint): a state saved by 2
ranks loads on 4 with every expert shard, Adam moment and dense tensor equal bit for bit to the saved ones (each
rank now holding its new shard, its slots filled from them); a crafted checkpoint cannot run code. Whole runs
(resume, corruption, pruning, locks): tests/test_resume.py."""

import pickle

import pytest
import torch
import torch.distributed as dist
from _scripts import load_experiment

from lrmoe.integrations.checkpoint_state import SHARDED, SafeReader, dense_state
from lrmoe.runtime.distributed.launch import launch
from lrmoe.training.models import build
from lrmoe.training.resume import checkpoint_dir

train = load_experiment("train")
ARGV = ["--policy", "lrmoe", "--batch", "2", "--seq-len", "16", "--ckpt-every", "1",
        "--no-wandb"]


def state_on_ranks(rank: int, args, save: bool) -> dict:
    """Build the run's model on this world; ``save``: train one step and checkpoint it as step 1, else load step 1.
    Then the whole state gathered: every layer's full [E, P] shards, the dense tensors, the optimizer's state, the
    rank's data generator (each slot checked to hold its expert's master weights)."""
    world = dist.get_world_size()
    torch.manual_seed(args.seed)
    cfg, run, _ = build(args, world, torch.device("cpu"))
    layers = run.ep.layers if args.hf_config else run.layers
    gen = torch.Generator().manual_seed(100 + rank)
    ckpt = checkpoint_dir(args)
    if save:
        x = torch.randint(cfg.vocab_size, (args.batch, args.seq_len + 1), generator=gen)
        run.train_step(x[:, :-1], x[:, 1:])
        ckpt.save(1, run.model, run.opt, layers, {"data": gen}, [{"step": 1}], [torch.zeros(2)], run.architecture)
    else:
        ckpt.load(1, run.model, run.opt, layers, {"data": gen}, run.architecture)
    state = {"dense": dense_state(run.model, layers), "opt": run.opt.state_dict()["state"], "gen": gen.get_state()}
    for i, layer in enumerate(layers):
        store = layer.store
        for name in SHARDED:
            state[f"{i}/{name}"] = store.gather_full(getattr(store, name))
        state[f"{i}/adam_steps"] = store.adam_steps
        for j, e in enumerate(store.local_slot_expert()):
            if e >= 0:
                assert torch.equal(store.slots_SW[j], state[f"{i}/master_EW"][e].to(store.dtype)), (i, j, e)
    return state


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", [pytest.param([], id="lrmoe"),  # HF's: about a minute on a busy machine
                                  pytest.param(["--hf-config", "glm"], id="hf-glm", marks=pytest.mark.slow)])
def test_a_two_rank_checkpoint_loads_on_four_ranks_with_every_tensor_equal(tmp_path, arch):
    """lrmoe's model and HF's GLM-4.5 (whose state dict also holds its experts whole, gathered, HF's layout)."""
    args = train.parse_args([*ARGV, *arch, "--out", str(tmp_path / "r.jsonl")])
    args.run_id, args.start_step = "train-test", 0
    saved = launch(state_on_ranks, 2, args, True, timeout_s=240)
    loaded = launch(state_on_ranks, 4, args, False, timeout_s=240)
    assert saved[0]["0/adam_steps"] == 1 and saved[0]["0/exp_avg_sq_EW"].abs().sum() > 0  # a step was taken
    for rank in range(4):  # the gathered state: the same whatever the world, bit for bit
        assert same({k: v for k, v in loaded[rank].items() if k != "gen"},
                    {k: v for k, v in saved[0].items() if k != "gen"})
    assert [torch.equal(loaded[r]["gen"], saved[r]["gen"]) for r in range(2)] == [True, True]  # continued
    fresh = [torch.Generator().manual_seed(100 + r).get_state() for r in (2, 3)]
    assert all(torch.equal(loaded[r]["gen"], f) for r, f in zip((2, 3), fresh))  # new ranks start from the seed


class RunsCode:
    """What a crafted checkpoint holds: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_crafted_checkpoint_metadata_is_refused_without_running_code(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(pickle.UnpicklingError, match="not DCP metadata"):
        SafeReader(tmp_path).read_metadata()
    assert not marker.exists(), "reading a checkpoint's metadata ran code"
