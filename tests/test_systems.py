"""The registry of systems (lrmoe.systems): every name builds a policy that plans validly, every name a script,
notebook, figure or committed results file uses is the registry's (or an explicitly mapped older name), unknown
names fail with the known ones listed, and the scripts check their arguments before any rank starts."""

import json
import re
from pathlib import Path

import pytest
import torch
from _scripts import load_experiment

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.planner.placement import MemoryModel
from lrmoe.bytemodel.sync_model import REPLICA_GRAD_MODES
from lrmoe.analysis.runs import BASELINE
from lrmoe.planner.plan import PlacingPolicy
from lrmoe.sim.simulated_systems import cost_options, plan_twins, simulator_system
from lrmoe.systems import (ALIASES, SYSTEMS, SystemContext, canonical, check_systems, get_system,
                           system_arg)

ROOT = Path(__file__).resolve().parent.parent

# Two worlds: no memory model (train.py, bench_planner.py) and a per-layer budget with SYMI sized from it
# (ablate.py): slots of 1e5 bytes, 1e3 bytes per pair, 64 pairs per rank; the budget holds the 4 home slots and
# 1.7 slots' worth of bytes more.
PLAIN = SystemContext(num_experts=16, num_ranks=4, spare_slots=1, pairs_per_rank=64, push_cost_rows=2.0)
MEMORY = SystemContext(num_experts=16, num_ranks=4, spare_slots=2, memory=MemoryModel(5.7e5, 1e5, 1e3),
                       pairs_per_rank=64, symi_headroom=1.5, push_cost_rows=2.0)


@pytest.mark.parametrize("ctx", [PLAIN, MEMORY], ids=["plain", "memory"])
@pytest.mark.parametrize("name", list(SYSTEMS))
def test_every_system_builds_a_policy_whose_plans_are_valid(name, ctx):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    policy = get_system(name).make_policy(ctx)
    assert isinstance(policy, PlacingPolicy) and policy.name  # the one interface the layer and the simulator take
    prev = None
    for _ in range(3):  # a few iterations, each placed from the previous one's counts
        counts_NE = torch.randint(0, 9, (ctx.num_ranks, ctx.num_experts), generator=gen)
        counts_NE[:, 0] += 20  # one hot expert, so quotas and replicas have work
        plan = policy.plan(counts_NE, prev).validate(counts_NE)
        assert plan.placement_NS.shape[0] == ctx.num_ranks
        assert int(plan.placement_NS.shape[1]) >= ctx.base_slots
        prev = counts_NE.sum(0)


def test_the_spec_carries_what_the_layer_and_the_simulator_need():
    lrmoe = get_system("lrmoe")
    assert lrmoe.family == "lrmoe" and lrmoe.recalibrated
    assert lrmoe.backward == BackwardConfig(metric="m2", mode="topk", compact=True)
    assert lrmoe.layer_backward(seed=7).seed == 7 and lrmoe.layer_backward(seed=7).metric == "m2"
    symi = get_system("symi-dropless")
    assert symi.layer_backward(seed=7) is None  # plain autograd is exact for its plans
    assert symi.layer_backward(always=True) == BackwardConfig()  # benchmarks run every system on one backward
    assert get_system("lrmoe-m2-unbiased").backward.mode == "unbiased"
    assert get_system("lrmoe-random").backward.metric == "random"
    padded = simulator_system(get_system("lrmoe-padded"), MEMORY)
    assert padded.name == "lrmoe-padded" and padded.compaction is False and padded.sharded_optimizer
    static = simulator_system(get_system("static-ep"), MEMORY)
    assert static.sharded_optimizer is False and static.compaction is True
    assert cost_options(get_system("lrmoe-host-groups")) == {"planner": "lrmoe", "quota_stage": False, "metric": "m2",
                                                             "mode": "topk", "sync_groups": "hosts"}
    # the cost options come from the entry, never from its name
    assert cost_options(get_system("symi-cf1"))["planner"] == "symi-cf"
    assert cost_options(get_system("symi-cf1"))["capacity_cf"] == 1.0
    trim = cost_options(get_system("symi-dropless-rho0.75"))
    assert (trim["planner"], trim["quota_stage"], trim["metric"]) == ("symi-dropless", True, "random")
    assert cost_options(get_system("online-rho0.75"))["planner"] == "lrmoe"
    assert padded.costs == cost_options(get_system("lrmoe-padded"))
    # the simulator's policy factory builds a fresh policy per layer from the same context
    assert padded.make_policy() is not padded.make_policy()


def test_plan_twins_share_a_simulation_only_when_they_run_the_same_work():
    """The metric and selection-mode variants make LRMoE's plans but score and select differently: each is priced on
    its own (no two systems share a simulated time unless they run the same work)."""
    names = ["lrmoe", "lrmoe-random", "lrmoe-gate", "lrmoe-m2-unbiased", "lrmoe-padded", "lrmoe-host-groups",
             "lrmoe-no-quotas", "symi-dropless", "symi-dropless-lrmoe-slots", "symi-dropless-rho0.75",
             "lrmoe-rho0.75", "lrmoe-rho0.75-unbiased", "lrmoe-rho0.75-random"]
    assert plan_twins(names) == {}
    assert plan_twins(["lrmoe", "lrmoe-m2"]) == {"lrmoe-m2": "lrmoe"}  # an older name of the same entry
    counts_NE = torch.randint(0, 9, (4, 16), generator=torch.Generator().manual_seed(3))
    a = get_system("lrmoe").make_policy(MEMORY).plan(counts_NE)
    b = get_system("lrmoe-random").make_policy(MEMORY).plan(counts_NE)
    assert torch.equal(a.keep_NG, b.keep_NG) and torch.equal(a.placement_NS, b.placement_NS)


def test_symi_slots_come_from_memory_only_when_the_context_says_so():
    assert get_system("symi-dropless").make_policy(PLAIN).slots_per_rank == PLAIN.base_slots + 1
    # 1.7 slots free beside the home slots; buffers for 1.5 x 64 pairs take 0.96 of a slot, for 64 pairs 0.64
    assert get_system("symi-dropless").make_policy(MEMORY).slots_per_rank == MEMORY.base_slots  # 0.74 left
    assert get_system("symi-cf1").make_policy(MEMORY).slots_per_rank == MEMORY.base_slots + 1  # 1.06 left
    roomy = SystemContext(16, 4, spare_slots=2, memory=MemoryModel(6.2e5, 1e5, 1e3), pairs_per_rank=64,
                          symi_headroom=1.5)
    assert get_system("symi-dropless").make_policy(roomy).slots_per_rank == roomy.base_slots + 1
    assert get_system("symi-cf1").make_policy(roomy).slots_per_rank == roomy.base_slots + 1
    # LRMoE without memory-aware placement gets SYMI-dropless's slots, and SYMI's note
    assert get_system("lrmoe-no-memplace").make_policy(roomy).extra_slots == 1
    tight = SystemContext(16, 4, spare_slots=2, memory=MemoryModel(4.5e5, 1e5, 1e3), pairs_per_rank=64,
                          symi_headroom=1.5)
    assert "do not fit beside the home slots" in get_system("symi-dropless").note(tight)
    assert get_system("lrmoe-no-memplace").note(tight) == get_system("symi-dropless").note(tight)
    assert get_system("lrmoe").note(tight) == ""


def test_unknown_names_and_bad_worlds_fail_clearly():
    with pytest.raises(ValueError, match=r"unknown system 'deepspeed'; known: static-ep, .*lrmoe"):
        get_system("deepspeed")
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        SystemContext(num_experts=16, num_ranks=3)
    with pytest.raises(ValueError, match="system 'lrmoe-tight': .*pairs_per_rank"):
        check_systems(["static-ep", "lrmoe-tight"], SystemContext(16, 4))
    assert canonical("nope", strict=False) == "nope"
    assert system_arg("ep-dropless") == "static-ep"


def test_older_names_map_onto_registry_names():
    assert not set(ALIASES) & set(SYSTEMS)
    assert set(ALIASES.values()) <= set(SYSTEMS)
    assert get_system("lrmoe-m2") is get_system("lrmoe") and get_system("ep-dropless") is SYSTEMS["static-ep"]


# -- one set of names everywhere ------------------------------------------------------------------------------------
def names_after_flags(argv, flags=("--policies", "--systems", "--policy")) -> list[str]:
    """The values of the name flags in an argument list."""
    out, taking = [], False
    for arg in argv:
        if arg in flags:
            taking = True
        elif arg.startswith("--"):
            taking = False
        elif taking:
            out.append(arg)
    return out


def test_names_used_by_scripts_figures_and_notebooks_are_registry_names():
    from lrmoe.paper_figures import figures, sim_figures, style

    train, bench, planner = load_experiment("train"), load_experiment("layer_bench"), load_experiment("bench_planner")
    ablate, convergence, reproduce = (load_experiment("ablate"), load_experiment("convergence"),
                                      load_experiment("reproduce"))
    used = {train.parse_args([]).policy, *bench.DEFAULT_POLICIES, *planner.POLICY_NAMES, *ablate.SYSTEMS,
            *sim_figures.ABLATE_PLOTTED, *sim_figures.SPLIT, *sim_figures.BANDED, *convergence.POLICIES, BASELINE,
            *figures.MAIN_SYSTEMS, *figures.COMPONENTS}
    for stage in reproduce.STAGES:
        used.update(names_after_flags([*stage.quick, *stage.full]))
    for path in (ROOT / "notebooks").glob("*.py"):
        for call in re.findall(r"\.main\(\[(.*?)\]\)", path.read_text(), flags=re.S):
            used.update(names_after_flags(re.findall(r'"([^"]*)"', call)))
    assert used and used <= set(SYSTEMS), sorted(used - set(SYSTEMS))
    assert set(style.SYSTEM_COLOR_TABLE) <= set(SYSTEMS), sorted(set(style.SYSTEM_COLOR_TABLE) - set(SYSTEMS))


def test_committed_results_name_registry_systems_or_mapped_older_names():
    names = set()
    for path in (ROOT / "paper_figures" / "results").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            names.update(record[k] for k in ("system", "policy") if isinstance(record.get(k), str))
    # layer_bench labels a system run in each replica-gradient mode "name (mode)"
    names = {re.sub(r" \((%s)\)$" % "|".join(REPLICA_GRAD_MODES), "", n) for n in names}
    assert names and all(canonical(n) in SYSTEMS for n in names)


# -- scripts check their arguments in the parent process ------------------------------------------------------------
def test_train_rejects_bad_arguments_before_any_rank_starts(tmp_path, capsys):
    train = load_experiment("train")
    with pytest.raises(SystemExit):
        train.parse_args(["--policy", "deepspeed"])
    assert "unknown system 'deepspeed'" in capsys.readouterr().err
    assert train.parse_args(["--policy", "lrmoe-m2"]).policy == "lrmoe"  # older names recorded as the registry's
    for argv, why in [(["--preset", "nope"], "unknown model preset 'nope'"),
                      (["--ranks", "3"], "not divisible by 3 ranks"),
                      (["--cost-model", "nope"], "unknown cluster preset"),
                      (["--data", str(tmp_path / "missing")], "no text files"),
                      (["--gamma", "2"], "gamma")]:
        with pytest.raises(SystemExit):  # argparse's message (status 2)
            train.check_args(train.parse_args([*argv, "--out", str(tmp_path / "r.jsonl")]))
        assert why in capsys.readouterr().err
    train.check_args(train.parse_args(["--ranks", "2", "--out", str(tmp_path / "r.jsonl")]))  # fine


def test_train_with_an_unknown_preset_exits_with_one_message_and_no_rank_traceback(tmp_path, capfd):
    """train.py's command line (its cli, in this process: a rank started would write to the same file descriptors;
    the script's real launches are test_train's and test_resume's)."""
    train = load_experiment("train")
    with pytest.raises(SystemExit) as exc:
        train.cli(["--preset", "nope", "--ranks", "2", "--steps", "1", "--no-wandb",
                   "--out", str(tmp_path / "x.jsonl")])
    assert exc.value.code not in (0, None)
    err = capfd.readouterr().err
    assert "unknown model preset 'nope'" in err
    assert "Traceback" not in err and "failed" not in err  # no rank started, none failed
    assert not (tmp_path / "x.jsonl").exists()


def test_layer_bench_rejects_bad_arguments_before_any_rank_starts(tmp_path, capsys):
    bench = load_experiment("layer_bench")
    for argv, why in [(["--ranks", "3"], "not divisible by 3 ranks"),
                      (["--model", "nope"], "unknown model preset"),
                      (["--trace", str(tmp_path / "missing.npz")], "missing.npz"),
                      (["--skew", "dirichlet", "--skew-param", "0"], "alpha must be positive"),
                      (["--policies", "lrmoe", "lrmoe-tight", "--spare-slots", "0", "--gamma", "-1"], "gamma")]:
        with pytest.raises(SystemExit) as exc:  # argparse's message, or check_args' one
            bench.check_args(bench.parse_args(["--quick", *argv, "--out", str(tmp_path / "b.jsonl")]))
        assert why in str(exc.value) + capsys.readouterr().err
    bench.check_args(bench.parse_args(["--quick", "--ranks", "2", "--out", str(tmp_path / "b.jsonl")]))


def test_planner_benchmark_ablation_and_convergence_check_their_arguments(tmp_path, capsys):
    planner = load_experiment("bench_planner")
    for argv, why in [(["--policies", "nope"], "unknown system 'nope'"),
                      (["--experts", "16", "--ranks", "3"], "no --ranks"),
                      (["--skew-param", "-1"], "--skew-param")]:
        with pytest.raises(SystemExit):
            planner.main([*argv, "--no-wandb", "--out", str(tmp_path / "p.jsonl")])
        assert why in capsys.readouterr().err
    ablate = load_experiment("ablate")
    with pytest.raises(SystemExit):
        ablate.parse_args(["--systems", "nope"])
    assert "unknown system 'nope'" in capsys.readouterr().err
    assert ablate.parse_args(["--quick", "--systems", "ep-dropless"]).systems == ["static-ep"]
    for argv, why in [(["--skews", "-1"], "--skews"), (["--models", "nope"], "unknown model preset"),
                      (["--ranks", "8", "--models", "qwen3-30b-a3b", "--mem-gb", "0"], "--mem-gb")]:
        with pytest.raises(SystemExit):
            ablate.parse_args(["--quick", *argv])
        assert why in capsys.readouterr().err
    convergence = load_experiment("convergence")
    with pytest.raises(SystemExit, match="unknown model preset 'nope'"):  # before the first policy trains
        convergence.main(["--preset", "nope", "--ranks", "2", "--no-wandb", "--out", str(tmp_path / "c.jsonl")])
    assert not (tmp_path / "c").exists()
