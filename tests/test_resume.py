"""A killed run resumes as if it had never died: one rank of train.py killed by SIGKILL, and the main job killed in
the middle of a stage. After --resume each step is in the results file once, the losses are bit-identical to an
unbroken run's, the W&B run is one run, and the main job's SUMMARY.md equals an uninterrupted run's up to timings.

train.py's checkpoint folder: one run owns it (another run's --out is refused, --overwrite included, and so is a
second live run); it keeps the newest checkpoints and each step's record once; a checkpoint corrupted inside is
named and the one before it resumed from; a run resumes on another number of ranks (re-sharded).

The mechanism these rely on (the tracker's rewrite on resume) is tested in test_tracking.py; the sharded state's
re-sharding, tensor by tensor, in test_checkpoint.py."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _scripts import load_experiment

from lrmoe.integrations.tracking import Tracker
from lrmoe.results import read_results
from lrmoe.training.models import build
from lrmoe.training.resume import checkpoint_dir

ROOT = Path(__file__).resolve().parent.parent
train = load_experiment("train")

# The fewest steps that leave the kill room to land after a checkpoint and before the end: a checkpoint at step 4, the
# kill once step 5 is logged, three steps (and a checkpoint's save) of slack before the next checkpoint at step 8
# would leave nothing past it to redo, two more before the end.
STEPS, CKPT_EVERY = 10, 4
TRAIN = ["--preset", "qwen3-30b-a3b-debug", "--policy", "symi-cf1", "--ranks", "2", "--batch", "2", "--seq-len", "32",
         "--eval-every", "100", "--eval-batches", "1", "--max-bytes", "300000", "--steps", str(STEPS),
         "--ckpt-every", str(CKPT_EVERY), "--timeout", "120", "--quiet"]


def offline_run_ids(wandb_dir: Path) -> list[str]:
    """The run id of every offline W&B run folder (one per attempt of a run) under ``wandb_dir``."""
    return sorted(f.name[len("run-"):-len(".wandb")] for f in (wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def steps_in(path: Path) -> list[int]:
    try:
        return [r["step"] for r in read_results(path)]
    except FileNotFoundError:
        return []


def wait_until(ready, proc: subprocess.Popen, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit status {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def holds_open(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(fd) == str(path) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def job_env(**extra) -> dict:
    """The environment of a job started from a shell: not attached to the W&B service of this test process (which
    would outlive the job, holding a killed attempt's run open)."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    return {**env, **extra}


def spawn(argv: list[str], env: dict) -> subprocess.Popen:
    """A process in its own session, so a test can kill it and everything it started."""
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def reap(proc: subprocess.Popen) -> str:
    """Kill whatever is left of a spawned process's session; its output."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.mark.timeout(900)  # about 30 s on an idle 2-core machine; much more on a loaded one
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_a_rank_killed_mid_run_resumes_with_each_step_once_and_the_same_losses(tmp_path):
    unbroken = train.main([*TRAIN, "--out", str(tmp_path / "unbroken.jsonl"), "--ckpt-dir", str(tmp_path / "ck0"),
                           "--no-wandb"])
    out, ckpt = tmp_path / "killed.jsonl", tmp_path / "ck"
    argv = ["-m", "lrmoe.experiments.train", *TRAIN, "--out", str(out), "--ckpt-dir", str(ckpt)]
    env = job_env(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wb"))
    proc = spawn(argv, env)
    try:
        wait_until(lambda: any(s > CKPT_EVERY for s in steps_in(out)), proc, f"step {CKPT_EVERY + 1} was logged")
        ranks = children(proc.pid)
        victim = next((r for r in ranks if not holds_open(r, out)), ranks[-1])  # a rank that does not log
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=120)
        failed_after = time.monotonic() - killed_at
    finally:
        log = reap(proc)
    assert proc.returncode != 0 and "died" in log, log[-2000:]
    assert failed_after < 30, f"the launch took {failed_after:.0f} s to fail after a rank died"
    left = steps_in(out)
    args = train.parse_args([*TRAIN, "--out", str(out), "--ckpt-dir", str(ckpt)])
    args.run_id = read_results(out, "run")[0]["run_id"]
    found = checkpoint_dir(args).latest()
    checkpoint = found[0] if found else None
    assert checkpoint is not None and checkpoint < max(left) < STEPS, (checkpoint, left)  # steps past it to redo

    resumed = spawn([*argv, "--resume"], env)
    try:
        resumed.wait(timeout=240)
    finally:
        log = reap(resumed)
    assert resumed.returncode == 0, log[-3000:]
    records = read_results(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "each step exactly once"
    assert [r["loss"] for r in records] == [h["loss"] for h in unbroken], "bit-identical losses"
    headers = read_results(out, "run")
    assert [h.get("resumed_from_step") for h in headers] == [None, checkpoint]
    assert len({r["run_id"] for r in headers + records}) == 1
    assert offline_run_ids(tmp_path / "wb") == [headers[0]["run_id"]] * 2, "one W&B run (two attempts)"


# -- train.py's checkpoint folder -------------------------------------------------------------------------------
SMALL = ["--preset", "qwen3-30b-a3b-debug", "--ranks", "2", "--batch", "2", "--seq-len", "32", "--eval-every", "100",
         "--eval-batches", "1", "--max-bytes", "300000", "--no-wandb", "--quiet", "--timeout", "120"]


def train_run(*argv) -> list[dict]:
    return train.main([*SMALL, *argv])


def refused(capsys, *argv) -> str:
    """The argparse-style error with which train.py refuses ``argv`` before any rank starts."""
    with pytest.raises(SystemExit) as exc:
        train_run(*argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def files_in(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def step_folders(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.glob("step*"))


@pytest.mark.timeout(300)
def test_resume_continues_only_its_own_run_from_checkpoints_beside_its_results(tmp_path, capsys):
    out, ckpt = tmp_path / "a.jsonl", tmp_path / "a.ckpt"
    base = ["--policy", "symi-cf1", "--steps", "3", "--ckpt-every", "1", "--seed", "1"]
    train_run(*base, "--stop-after", "2", "--out", str(out))
    assert step_folders(ckpt) == ["step000001", "step000002"]  # beside its results file
    before = out.read_text()

    # another policy, another batch: both sides named
    err = refused(capsys, *base, "--resume", "--out", str(out), "--policy", "static-ep")
    assert "--policy 'symi-cf1' there, 'static-ep' here" in err and str(ckpt) in err
    assert "--batch 2 there, 4 here" in refused(capsys, *base, "--resume", "--out", str(out), "--batch", "4")
    # run B's results file with run A's checkpoints
    other = tmp_path / "b.jsonl"
    with Tracker("train", results=other, wandb=False) as b:
        b.log({"loss": 1.0}, step=1)
    err = refused(capsys, *base, "--resume", "--out", str(other), "--ckpt-dir", str(ckpt))
    assert "belongs to another run" in err and str(out) in err and str(other) in err
    # a fresh run of the same results file into its folder of checkpoints
    assert "--overwrite" in refused(capsys, *base, "--out", str(out))
    # another script's results file is never rewritten
    bench = tmp_path / "bench.jsonl"
    with Tracker("layer_bench", results=bench, wandb=False) as b:
        b.log({"time_ms": 1.0}, step=0)
    kept = bench.read_text()
    assert "'layer_bench'" in refused(capsys, *base, "--resume", "--out", str(bench))
    assert bench.read_text() == kept
    # checkpoints whose results file is gone
    out.rename(tmp_path / "moved.jsonl")
    assert "missing" in refused(capsys, *base, "--resume", "--out", str(out))
    (tmp_path / "moved.jsonl").rename(out)
    assert out.read_text() == before

    # --overwrite removes the run's own checkpoints (a stopped run then resumes from its own), nothing else
    (ckpt / "notes.txt").write_text("mine")
    train_run(*base, "--stop-after", "1", "--overwrite", "--out", str(out))
    assert step_folders(ckpt) == ["step000001"] and (ckpt / "notes.txt").read_text() == "mine"
    resumed = train_run(*base, "--resume", "--out", str(out))
    assert [h["step"] for h in resumed] == [1, 2, 3]
    assert [r["step"] for r in read_results(out)] == [1, 2, 3]
    assert [h.get("resumed_from_step") for h in read_results(out, "run")] == [None, 1]


@pytest.mark.timeout(300)
def test_a_checkpoint_folder_belongs_to_one_run(tmp_path, capsys):
    """Two runs with different --out and one --ckpt-dir: the second is refused, with --overwrite too, naming the
    owner's results file, and the first run's checkpoints stay as they were (it resumes from them). A second live
    process of the owning run itself is refused while the first holds the folder."""
    a, ckpt = tmp_path / "a.jsonl", tmp_path / "shared.ckpt"
    base = ["--policy", "symi-cf1", "--steps", "3", "--ckpt-every", "1", "--ckpt-dir", str(ckpt)]
    first = train_run(*base, "--stop-after", "2", "--out", str(a))
    kept = files_in(ckpt)
    for extra in (["--overwrite"], [], ["--resume"]):
        err = refused(capsys, *base, *extra, "--out", str(tmp_path / "b.jsonl"))
        assert str(ckpt) in err and str(a) in err, err
    assert files_in(ckpt) == kept, "a refused run touched the folder"
    resumed = train_run(*base, "--resume", "--out", str(a))
    assert [h["loss"] for h in resumed[:2]] == [h["loss"] for h in first] and len(resumed) == 3

    held = checkpoint_dir(train.parse_args([*SMALL, *base, "--out", str(a)]))
    held.lock()  # a live process of this run holds the folder
    try:
        err = refused(capsys, *base, "--overwrite", "--out", str(a))
        assert "in use by another live run" in err, err
    finally:
        held.release()


def record_steps(ckpt: Path) -> list[int]:
    """The steps of every record stored in the folder, in file order."""
    return [h["step"] for p in sorted(ckpt.rglob("*")) if p.is_file() and p.suffix == ".pt"
            for h in torch.load(p, weights_only=True).get("history", [])]


@pytest.mark.timeout(300)
def test_a_checkpoint_folder_keeps_the_newest_checkpoints_and_each_record_once(tmp_path):
    """--ckpt-every 1, stopped after 4 of 5 steps: two checkpoints stay (--ckpt-keep's default), of equal size (no
    history inside), every step's record is stored once, and a resume from the newest restores the whole history."""
    out, ckpt = tmp_path / "r.jsonl", tmp_path / "r.ckpt"
    base = ["--policy", "symi-cf1", "--steps", "5", "--ckpt-every", "1", "--out", str(out)]
    train_run(*base, "--stop-after", "4")
    assert step_folders(ckpt) == ["step000003", "step000004"]
    sizes = [sum(p.stat().st_size for p in (ckpt / f).iterdir() if p.suffix == ".distcp") for f in step_folders(ckpt)]
    assert sizes[0] == sizes[1], sizes
    assert record_steps(ckpt) == [1, 2, 3, 4]
    resumed = train_run(*base, "--resume")
    assert [h["step"] for h in resumed] == list(range(1, 6))
    assert step_folders(ckpt) == ["step000004", "step000005"] and record_steps(ckpt) == list(range(1, 6))


@pytest.mark.timeout(120)
def test_resume_refuses_another_cost_model_or_evaluation_naming_the_flag_and_both_values(tmp_path, capsys):
    """Every argument but the few that change nothing a run computes or records (resume.NOT_RUN_ARGS) defines the
    run: --resume with another --cost-model, --eval-every or --eval-batches would mix two definitions in one results
    file and is refused, naming the flag and both values, the file untouched; a changed --timeout or --ckpt-keep is
    not. A checkpoint older than an argument is judged by the value its run's header recorded."""
    out, ckpt = tmp_path / "r.jsonl", tmp_path / "r.ckpt"
    base = ["--ranks", "1", "--policy", "symi-cf1", "--steps", "2", "--ckpt-every", "1", "--out", str(out)]
    train_run(*base, "--stop-after", "1")
    before = out.read_text()
    for flag, value, there in (("--cost-model", "", "'h200x8'"), ("--eval-every", "5", "100"),
                               ("--eval-batches", "2", "1")):
        err = refused(capsys, *base, "--resume", flag, value)
        assert f"{flag} {there} there, {value if value else repr(value)} here" in err, err
    assert out.read_text() == before
    manifest = ckpt / "step000001" / "complete.json"  # as a version that did not record --eval-every wrote it
    saved = json.loads(manifest.read_text())
    del saved["identity"]["args"]["eval_every"]
    manifest.write_text(json.dumps(saved))
    resumed = train_run(*base, "--resume", "--timeout", "60", "--ckpt-keep", "3")
    assert [h["step"] for h in resumed] == [1, 2]


@pytest.mark.timeout(120)
def test_resume_restores_the_rows_a_results_file_lost_from_the_checkpoints_records(tmp_path, capsys):
    """A finished run's results file that lost rows outside the run (a step's row deleted by hand, then the file cut
    to fewer rows): --resume writes each lost row back, as it was, from the records its checkpoint holds, and the file
    holds every step once. Where the checkpoint does not hold a lost step either, --resume refuses naming it."""
    out, ckpt = tmp_path / "r.jsonl", tmp_path / "r.ckpt"
    base = ["--ranks", "1", "--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "2", "--out", str(out)]
    train_run(*base)
    whole = read_results(out)
    assert [r["step"] for r in whole] == [1, 2, 3, 4]
    lines = out.read_text().splitlines(keepends=True)  # the header, then steps 1-4
    for cut in (lines[:2] + lines[3:], lines[:2]):  # step 2's row deleted; the file cut to step 1
        out.write_text("".join(cut))
        train_run(*base, "--resume")
        assert read_results(out) == whole

    out.write_text("".join(lines[:2] + lines[3:]))
    manifest = ckpt / "step000004" / "complete.json"  # a checkpoint without the records of steps 1-2
    saved = json.loads(manifest.read_text())
    saved["records"] = [seg for seg in saved["records"] if seg["first"] > 2]
    manifest.write_text(json.dumps(saved))
    err = refused(capsys, *base, "--resume")
    assert "lacks the records of steps 2," in err and str(out) in err, err


@pytest.mark.timeout(300)
def test_a_checkpoint_corrupted_inside_is_named_and_the_one_before_resumed(tmp_path, capsys):
    """Bytes flipped in the middle of the newest checkpoint's largest file (its size unchanged): --resume names
    the file and continues from the checkpoint before, redoing the step after it to the same loss; a save cut short
    (no manifest) is skipped the same way."""
    base = ["--policy", "symi-cf1", "--steps", "4", "--ckpt-every", "1"]
    out, ckpt = tmp_path / "b.jsonl", tmp_path / "b.ckpt"
    stopped = train_run(*base, "--stop-after", "3", "--out", str(out))
    victim = max((p for p in (ckpt / "step000003").iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 8] = bytes(255 - b for b in data[middle: middle + 8])
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = train_run(*base, "--resume", "--out", str(out))
    log = capsys.readouterr().out
    assert str(victim) in log and "corrupted" in log, log
    assert [h["loss"] for h in resumed[:3]] == [h["loss"] for h in stopped]  # step 3 redone from step 2's state
    assert [h.get("resumed_from_step") for h in read_results(out, "run")] == [None, 2]

    args = train.parse_args([*SMALL, *base, "--out", str(out)])
    args.run_id = read_results(out, "run")[0]["run_id"]
    (ckpt / "step000004" / "complete.json").unlink()  # as a save killed before its manifest leaves it
    assert checkpoint_dir(args).latest()[0] == 3


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_two_rank_run_resumed_on_four_ranks_equals_one_resumed_from_the_re_sharded_state(tmp_path):
    """2 -> 4 ranks. Run A stops after its step-2 checkpoint (2 ranks); B is a copy of it whose checkpoint is
    re-saved by 4 ranks after loading (the re-sharded state as a native 4-rank checkpoint). A and B resumed on 4
    ranks give bit-identical losses (tolerance 0), steps 1-2 those of the 2-rank run. That the re-sharded state
    equals the saved one tensor for tensor: test_checkpoint.py."""
    import shutil

    from lrmoe.runtime.distributed.launch import launch

    base = ["--policy", "lrmoe", "--steps", "4", "--ckpt-every", "2"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first = train_run(*base, "--stop-after", "2", "--out", str(a))
    shutil.copy(a, b)
    shutil.copytree(tmp_path / "a.ckpt", tmp_path / "b.ckpt")
    owner = tmp_path / "b.ckpt" / "owner.json"
    owner.write_text(owner.read_text().replace(str(a), str(b)))
    args = train.parse_args([*SMALL, *base, "--ranks", "4", "--out", str(b)])
    args.run_id, args.start_step = read_results(b, "run")[0]["run_id"], 2
    launch(resave, 4, args, timeout_s=600)
    resumed = {name: train_run(*base, "--ranks", "4", "--resume", "--out", str(path)) for name, path in
               (("a", a), ("b", b))}
    assert [h["loss"] for h in resumed["a"]] == [h["loss"] for h in resumed["b"]]
    assert [h["loss"] for h in resumed["a"][:2]] == [h["loss"] for h in first]
    assert all(math.isfinite(h["loss"]) for h in resumed["a"])


def resave(rank: int, args) -> None:
    """Load the run's checkpoint of ``args.start_step`` on this world and save it again, as this world's."""
    world = dist.get_world_size()
    torch.manual_seed(args.seed)
    _, run, _ = build(args, world, torch.device("cpu"))
    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    ckpt = checkpoint_dir(args)
    history, counts = ckpt.load(args.start_step, run.model, run.opt, run.layers, {"data": gen}, run.architecture)
    ckpt.save(args.start_step, run.model, run.opt, run.layers, {"data": gen}, history, counts, run.architecture)


# -- every experiment with --resume: killed midway, resumed, the records of an unbroken run ------------------------
SWEEPS = {  # (the smallest useful run, records compared exactly: False where they hold measured times)
    "ablate": (["--quick", "--models", "qwen3-30b-a3b", "--ranks", "8", "--skews", "0.8", "--mem-gb", "40",
                "--steps", "2", "--layers", "1"], True),
    "metric_fidelity": (["--quick", "--presets", "qwen3-30b-a3b-debug", "--data", "gaussian", "--metrics", "m2",
                         "random", "--rhos", "0.5"], True),
    "layer_bench": (["--ranks", "2", "--tokens-per-rank", "32", "--steps", "2", "--warmup", "0", "--hidden", "32",
                     "--ffn", "16", "--policies", "static-ep", "symi-dropless", "--no-grad-error"], False),
}


def comparable(records: list[dict], exact: bool, stem: str) -> list:
    """Records without their run id, with "out" for ``stem`` (the results file's path, which names files beside it);
    where they hold measured times, only their step and labels."""
    records = [{k: v.replace(stem, "out") if isinstance(v, str) else v for k, v in r.items() if k != "run_id"}
               for r in records]
    if exact:
        return records
    return [(r["step"], sorted((k, v) for k, v in r.items() if isinstance(v, str))) for r in records]


def kill_midway(clean: Path, killed: Path) -> int:
    """What a SIGKILL halfway through writing ``clean`` leaves: its header, the first half of its records and half
    of the next line; no summary. Returns how many records it kept."""
    lines = clean.read_text().splitlines(keepends=True)
    half = 1 + (len(lines) - 1) // 2
    killed.write_text("".join(lines[:half]) + lines[half][: len(lines[half]) // 2])
    return half - 1


def check_resumed_sweep(name: str, args: list[str], exact: bool, tmp_path: Path) -> None:
    script = load_experiment(name)
    clean, killed = tmp_path / "clean.jsonl", tmp_path / "killed.jsonl"
    script.main([*args, "--no-wandb", "--out", str(clean)])
    assert kill_midway(clean, killed) >= 1
    script.main([*args, "--no-wandb", "--resume", "--out", str(killed)])
    assert (comparable(read_results(killed), exact, str(killed.with_suffix(""))) ==
            comparable(read_results(clean), exact, str(clean.with_suffix(""))))
    for kind in ("summary", "figure"):
        assert len(read_results(killed, kind)) == len(read_results(clean, kind)), kind
    assert len({r["run_id"] for r in read_results(killed, "run")}) == 1


@pytest.mark.parametrize("name", SWEEPS)
def test_an_experiment_killed_midway_resumes_to_the_records_of_an_unbroken_run(name, tmp_path):
    """Experiments without checkpoints redo their work on --resume; what the killed attempt left is superseded, so
    the file holds the unbroken run's records, once (train and convergence: the kill tests here)."""
    args, exact = SWEEPS[name]
    check_resumed_sweep(name, args, exact, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_validate_sim_killed_midway_resumes_to_the_records_of_an_unbroken_run(tmp_path):
    """validate_sim runs a small layer_bench and a CPU calibration first (about a minute), both resumed too."""
    check_resumed_sweep("validate_sim", ["--quick"], False, tmp_path)


# -- the main job --------------------------------------------------------------------------------------------------
DRIVER = textwrap.dedent("""
    import sys
    from lrmoe.experiments import reproduce
    from lrmoe.harness.job_stages import Stage

    STAGES = [  # the main job's first stage and its simulator stage, each a few seconds
        Stage("trace_stats", "trace_stats",
              quick=["--steps", "2", "--layers", "1", "--tokens-per-rank", "64", "--no-wandb"]),
        Stage("ablate", "ablate",
              quick=["--models", "qwen3-30b-a3b", "--ranks", "16", "--skews", "zipf:0.2", "zipf:0.8",
                     "--mem-gb", "40", "--steps", "2", "--layers", "1", "--no-band"]),
    ]
    sys.exit(reproduce.main(sys.argv[1:], stages=STAGES))
""")


def up_to_timings(summary: str, timed_stages=()) -> str:
    """SUMMARY.md without its wall times (and, in the sections of ``timed_stages``, without any number)."""
    summary = re.sub(r"\(\d+ s; results", "(N s; results", summary)
    summary = re.sub(r"Total wall time: \d+ s", "Total wall time: N s", summary)
    parts = re.split(r"(?m)^(## .*)$", summary)
    for i in range(1, len(parts) - 1, 2):
        if parts[i][3:].strip() in timed_stages:
            parts[i + 1] = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "#", parts[i + 1])
    return "".join(parts)


def kill_during_stage(argv: list[str], out: Path, stage: str, started) -> None:
    """Start the main job, SIGKILL it (and everything it started, as a cluster's job kill does) once ``started()``
    says ``stage`` is under way, and check that it was killed mid-stage."""
    proc = spawn(argv, job_env())
    try:
        wait_until(started, proc, f"stage {stage} was under way", timeout=1800)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        reap(proc)
    assert not (out / f"{stage}.done").exists() and not (out / "SUMMARY.md").exists()


@pytest.mark.slow  # 40 s: make test-all; the stages' own kill-and-resume tests stay in make test
@pytest.mark.timeout(900)  # about 25 s on an idle 2-core machine; much more on a loaded one
def test_the_main_job_killed_during_a_stage_resumes_to_the_same_summary(tmp_path):
    """Killed (SIGKILL of the whole process group, as a cluster's job kill) while its second stage, the simulator,
    has logged part of its cells: the resumed job skips the finished stage, the stage supersedes what the killed
    attempt left (every cell once) and continues its W&B run, and the summary is the unbroken job's. A stage's
    ranks killed mid-training resume from their checkpoints: test_a_rank_killed_mid_run_..., above; the whole quick
    main job killed and resumed: the slow test below."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    only = ["--only", "trace_stats", "ablate"]  # no figures: their sources are the full job's
    assert subprocess.run([sys.executable, str(driver), "--out-dir", str(clean), *only], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True).returncode == 0
    cells = len(steps_in(clean / "ablate.jsonl"))

    argv = [str(driver), "--out-dir", str(killed), *only]
    kill_during_stage(argv, killed, "ablate", lambda: len(steps_in(killed / "ablate.jsonl")) >= 10)
    assert (killed / "trace_stats.done").exists() and 10 <= len(steps_in(killed / "ablate.jsonl")) < cells
    proc = subprocess.run([sys.executable, *argv, "--resume"], cwd=ROOT, env=job_env(), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trace_stats: complete, skipped" in proc.stdout

    assert up_to_timings((killed / "SUMMARY.md").read_text()) == up_to_timings((clean / "SUMMARY.md").read_text())
    for name in ("trace_stats.jsonl", "ablate.jsonl"):
        mine, theirs = read_results(killed / name), read_results(clean / name)
        assert [r["step"] for r in mine] == [r["step"] for r in theirs], name  # nothing twice, nothing missing
    # one W&B run: the resumed stage continued its run (two attempts' folders)
    assert len(offline_run_ids(killed)) == 2 and len(set(offline_run_ids(killed))) == len(offline_run_ids(clean)) == 1


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_the_quick_main_job_killed_during_a_stage_resumes_to_the_same_summary(tmp_path):
    """The whole quick main job (minutes): killed while the simulated ablation sweep is half logged."""
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    job = ["-m", "lrmoe.experiments.reproduce", "--mode", "quick"]
    assert subprocess.run([sys.executable, *job, "--out-dir", str(clean)], cwd=ROOT, env=job_env()).returncode == 0
    argv = [*job, "--out-dir", str(killed)]
    kill_during_stage(argv, killed, "ablate", lambda: len(steps_in(killed / "ablate.jsonl")) >= 5)
    assert subprocess.run([sys.executable, *argv, "--resume"], cwd=ROOT, env=job_env()).returncode == 0
    timed = ("layer_bench", "validate_sim", "layer_bench_constrained")  # measured CPU times: only the layout compares
    assert (up_to_timings((killed / "SUMMARY.md").read_text(), timed) ==
            up_to_timings((clean / "SUMMARY.md").read_text(), timed))
    assert [r["step"] for r in read_results(killed / "ablate.jsonl")] == \
        [r["step"] for r in read_results(clean / "ablate.jsonl")]
