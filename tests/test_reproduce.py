"""The main job's scheduling (experiments/reproduce.py) with stand-in stages: a background stage runs beside the
stages after it, a measured stage waits for it, the summary keeps the stages' order, and a failing background stage
fails the job at once (the real stages: test_resume.py, test_systems.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _scripts import load_experiment

from lrmoe.harness.job_stages import Stage, markdown_tables

reproduce = load_experiment("reproduce")

def stand_in(argv):
    """A stage's entry point: sleeps --sleep seconds, then exits with status 3 (--fail 1) or writes when it ran to
    --out and prints a table."""
    args = dict(zip(argv[::2], argv[1::2]))
    t0 = time.time()
    time.sleep(float(args["--sleep"]))
    if args.get("--fail") == "1":
        sys.exit(3)
    with open(args["--out"], "w") as f:
        f.write(json.dumps({"start": t0, "end": time.time()}) + "\n")
    print("| stage | s |\n|---|---|\n| " + args["--out"].rsplit("/", 1)[-1] + " | " + args["--sleep"] + " |")


def stages(fail_background=False):
    stage = Stage
    return [stage("first", stand_in, quick=["--sleep", "0.1"]),
            stage("simulate", stand_in, quick=["--sleep", "2", "--fail", str(int(fail_background))],
                  background=True),
            stage("train", stand_in, quick=["--sleep", "0.5"]),
            stage("bench", stand_in, quick=["--sleep", "0.1"], measured=True)]


def times(out, name):
    return json.loads((out / f"{name}.jsonl").read_text())


def test_a_background_stage_runs_beside_the_next_and_a_measured_stage_waits_for_it(tmp_path):
    out = tmp_path / "job"
    assert reproduce.main(["--out-dir", str(out), "--only", "first", "simulate", "train", "bench"],
                          stages=stages()) == 0
    first, sim, train, bench = (times(out, n) for n in ("first", "simulate", "train", "bench"))
    assert sim["start"] >= first["end"]
    assert train["start"] < sim["end"]  # beside the background stage
    assert bench["start"] >= sim["end"]  # nothing runs beside a measurement
    summary = (out / "SUMMARY.md").read_text()
    assert [line[3:] for line in summary.splitlines() if line.startswith("## ")] == \
        ["first", "simulate", "train", "bench"]
    assert all((out / f"{n}.done").exists() for n in ("first", "simulate", "train", "bench"))
    assert not list(out.glob(".*.stdout"))


def test_a_failing_background_stage_fails_the_job_at_once(tmp_path):
    out = tmp_path / "job"
    slow = stages(fail_background=True)
    slow[2].quick = ["--sleep", "60"]  # the foreground stage would outlast the background one by far
    t0 = time.monotonic()
    assert reproduce.main(["--out-dir", str(out), "--only", "first", "simulate", "train", "bench"],
                          stages=slow) == 3
    assert time.monotonic() - t0 < 30
    assert not (out / "SUMMARY.md").exists() and not (out / "simulate.done").exists()
    assert not (out / "train.done").exists() and not (out / "bench.jsonl").exists()


def test_the_main_job_measures_nothing_beside_the_simulator():
    """The real stage list: only deterministic stages are in the background, and every benchmark waits."""
    by_name = {s.name: s for s in reproduce.STAGES}
    assert [s.name for s in reproduce.STAGES if s.background] == ["ablate"]
    assert all(by_name[n].measured for n in ("layer_bench", "validate_sim", "layer_bench_constrained"))


def test_a_background_stage_is_timed_to_its_own_end_not_to_the_next_stage_boundary(tmp_path):
    out = tmp_path / "job"
    quick = stages()
    quick[1].quick = ["--sleep", "1"]  # the background stage ends long before the foreground one
    quick[2].quick = ["--sleep", "4"]
    assert reproduce.main(["--out-dir", str(out), "--only", "first", "simulate", "train"], stages=quick) == 0
    seconds = int(re.search(r"\((\d+) s; results", (out / "simulate.done").read_text()).group(1))
    assert seconds <= 2, seconds


def test_unknown_stage_names_are_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        reproduce.main(["--out-dir", str(tmp_path / "job"), "--only", "trace_stat"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "no stage named trace_stat" in err and "trace_stats" in err
    assert not (tmp_path / "job").exists()


def test_overwrite_removes_only_what_the_job_wrote(tmp_path):
    out = tmp_path / "job"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "corpus.txt").write_text("mine too")
    assert reproduce.main(["--out-dir", str(out), "--only", "first"], stages=stages()) == 0  # beside them
    first = times(out, "first")
    with pytest.raises(SystemExit):  # the job's own results: not replaced unless asked
        reproduce.main(["--out-dir", str(out), "--only", "first"], stages=stages())
    assert reproduce.main(["--out-dir", str(out), "--only", "first", "--overwrite"], stages=stages()) == 0
    assert times(out, "first") != first
    assert (out / "notes.md").read_text() == "mine" and (out / "data" / "corpus.txt").read_text() == "mine too"


RANKED_STAGE = textwrap.dedent("""
    import os, time
    from lrmoe.runtime.distributed.launch import launch

    def work(rank, folder):
        open(os.path.join(folder, f"rank{rank}.pid"), "w").write(str(os.getpid()))
        time.sleep(600)

    def main(argv):
        folder = os.path.dirname(argv[argv.index("--out") + 1])
        open(os.path.join(folder, "stage.pid"), "w").write(str(os.getpid()))
        launch(work, 2, folder, timeout_s=600)
""")


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the processes through /proc")
def test_sigterm_of_the_main_job_stops_its_stage_and_the_stage_s_ranks(tmp_path):
    from test_launch import kill_leftovers, pids_in, survivors, wait_for_pids

    script = tmp_path / "ranked.py"
    script.write_text(RANKED_STAGE)
    out = tmp_path / "job"
    driver = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import ranked\n"
              f"from lrmoe.experiments import reproduce\n"
              f"from lrmoe.harness.job_stages import Stage\n"
              f"reproduce.main(['--out-dir', {str(out)!r}, '--only', 'ranked'], "
              f"stages=[Stage('ranked', ranked.main)])\n")
    job = subprocess.Popen([sys.executable, "-c", driver], start_new_session=True)
    try:
        pids = wait_for_pids(out, "*.pid", 3, job)  # the stage and its two ranks
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=30)
        assert not survivors(pids), "the stage or its ranks outlived the main job"
    finally:
        kill_leftovers(job, pids_in(out, "*.pid"))


def test_a_stage_summary_can_name_its_table_by_section_title():
    """A stage that prints other tables before its headline (the memory sweep prints each ablation group's) names
    its table by the section title: the summary shows where memory binds, not an ablation group's empty table."""
    text = ("| a | b |\n|---|---|\n| 1 | 2 |\n\n## Where memory binds\n\n| binds from GB |\n|---|\n| 31.7 |\n\n"
            "## Next\n| x |")
    assert markdown_tables(text, "Where memory binds") == "| binds from GB |\n|---|\n| 31.7 |"
    assert markdown_tables(text, "Nowhere") == "" and markdown_tables(text, 0).startswith("| a")
    (stage,) = [s for s in reproduce.STAGES if s.name == "memory_sweep"]
    # the title is the one the memory sweep's report prints (its committed report), and its table says where
    from lrmoe.paper_figures import RESULTS_DIR

    report = (RESULTS_DIR / "memory_pressure_regimes.md").read_text()
    table = markdown_tables(report, stage.table)
    assert "binds from GB" in table and len(table.splitlines()) > 2


def wandb_stand_in(argv):
    """A stage's entry point that writes what a tracked stage writes: a results file with its run header, its W&B
    run's folder, its work folder."""
    args = dict(zip(argv[::2], argv[1::2]))
    out = args["--out"]
    name = os.path.basename(out).split(".")[0]
    run_id = f"{name}-{os.getpid()}"
    with open(out, "w") as f:  # a results file with its run header, as a stage's Tracker writes it
        f.write(json.dumps({"kind": "run", "run_id": run_id, "name": name}) + "\n")
    # the run's local W&B folder, named as W&B names it (WANDB_DIR is the job's folder)
    os.makedirs(os.path.join(os.environ["WANDB_DIR"], "wandb", f"offline-run-20260101_000000-{run_id}"))
    os.makedirs(os.path.join(os.path.dirname(out), name), exist_ok=True)  # its work folder
    open(os.path.join(os.path.dirname(out), name, "ckpt.pt"), "w").write("x")
    print("| stage |\n|---|\n| " + name + " |")


def wandb_stages(tmp_path):
    return [Stage("first", wandb_stand_in), Stage("second", wandb_stand_in)]


def run_folders(out, stage):
    return sorted(p.name for p in (out / "wandb").glob(f"offline-run-*-{stage}-*"))


def test_overwrite_refuses_foreign_files_named_like_a_stage_s_outputs_and_removes_nothing(tmp_path, capsys):
    """Issue 38 (1): a user's trace_stats_v1.jsonl, trace_stats.py and trace_stats/ folder matched the old globs
    and were deleted; now the job names them and stops, before removing anything."""
    out = tmp_path / "job"
    stages = wandb_stages(tmp_path)
    assert reproduce.main(["--out-dir", str(out), "--only", "first"], stages=stages) == 0
    theirs = [out / "first_v1.jsonl", out / "first.py", out / "first" / "notes.txt"]
    for path in theirs:
        path.write_text("mine")
    ours = sorted(p for p in out.rglob("*") if p.is_file() and p not in theirs)
    with pytest.raises(SystemExit) as exc:
        reproduce.main(["--out-dir", str(out), "--only", "first", "--overwrite"], stages=stages)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "first_v1.jsonl" in err and "not written by it" in err
    assert all(p.read_text() == "mine" for p in theirs)
    assert all(p.exists() for p in ours)


def test_overwrite_removes_its_own_wandb_runs_by_id_and_keeps_another_project_s(tmp_path):
    """Issue 38 (1): every wandb/offline-run-* was removed, another project's unsynced run too."""
    out = tmp_path / "job"
    stages = wandb_stages(tmp_path)
    assert reproduce.main(["--out-dir", str(out), "--only", "first"], stages=stages) == 0
    (old_run,) = run_folders(out, "first")
    other = out / "wandb" / "offline-run-20250101_000000-someone-else"
    other.mkdir()
    (other / "run.wandb").write_text("unsynced")
    assert reproduce.main(["--out-dir", str(out), "--only", "first", "--overwrite"], stages=stages) == 0
    assert old_run not in run_folders(out, "first") and len(run_folders(out, "first")) == 1
    assert (other / "run.wandb").read_text() == "unsynced"


def test_only_one_stage_overwrite_keeps_the_other_stages_outputs_and_summary(tmp_path):
    """Issue 38 (1): ``--only X --overwrite`` removed every stage's W&B runs and SUMMARY.md and redrew none."""
    out = tmp_path / "job"
    stages = wandb_stages(tmp_path)
    assert reproduce.main(["--out-dir", str(out), "--only", "first", "second"], stages=stages) == 0
    second = [run_folders(out, "second"), (out / "second.jsonl").read_text(), (out / "second.done").read_text()]
    assert reproduce.main(["--out-dir", str(out), "--only", "first", "--overwrite"], stages=stages) == 0
    assert [run_folders(out, "second"), (out / "second.jsonl").read_text(),
            (out / "second.done").read_text()] == second
    assert (out / "second" / "ckpt.pt").exists()
    summary = (out / "SUMMARY.md").read_text()
    assert "## first" in summary and "## second" in summary


def test_resume_refuses_a_stage_that_ran_with_other_arguments(tmp_path, capsys):
    """Issue 38 (3), the main job's part: a completed stage is reused only for the arguments it ran with."""
    out = tmp_path / "job"
    stages = wandb_stages(tmp_path)
    assert reproduce.main(["--out-dir", str(out), "--only", "first"], stages=stages) == 0
    stages[0].quick = ["--steps", "20"]
    with pytest.raises(SystemExit) as exc:
        reproduce.main(["--out-dir", str(out), "--only", "first", "--resume"], stages=stages)
    assert exc.value.code == 2 and "--steps 20" in capsys.readouterr().err


def test_only_with_no_names_is_an_error(tmp_path, capsys):
    """Issue 38 (17): ``--only`` alone ran the whole job."""
    with pytest.raises(SystemExit) as exc:
        reproduce.main(["--out-dir", str(tmp_path / "job"), "--only"], stages=wandb_stages(tmp_path))
    assert exc.value.code == 2
    assert not (tmp_path / "job").exists()


def test_an_out_dir_that_cannot_be_written_is_an_error(tmp_path, capsys):
    """Issue 38 (16): a traceback instead of exit 2 (here, under a file; a read-only folder too, where the user is
    not root)."""
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        reproduce.main(["--out-dir", str(tmp_path / "a_file" / "job")], stages=wandb_stages(tmp_path))
    assert exc.value.code == 2 and "is a file" in capsys.readouterr().err
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        with pytest.raises(SystemExit) as exc:
            reproduce.main(["--out-dir", str(locked / "job")], stages=wandb_stages(tmp_path))
        assert exc.value.code == 2 and "not writable" in capsys.readouterr().err


def test_a_stage_runs_its_entry_point_in_a_process_forked_from_the_job_and_its_exception_names_it(tmp_path, capfd):
    """A stage is its script's entry point called in a process forked from the job (no script started by its
    path; a local function could not be): its process is the job's child, its exception fails the job with the
    stage's status, its traceback noting the stage, and nothing after it runs."""
    job = os.getpid()

    def diverges(argv):
        assert os.getppid() == job and os.getpid() != job
        raise RuntimeError("loss is nan at step 7")

    out = tmp_path / "job"
    staged = [Stage("train", diverges, quick=["--steps", "9"]), *stages()[3:]]
    assert reproduce.main(["--out-dir", str(out), "--only", "train", "bench"], stages=staged) == 1
    err = capfd.readouterr().err
    assert "RuntimeError: loss is nan at step 7" in err
    assert f"reproduce.py: in the stage diverges --out {out / 'train.jsonl'} --steps 9" in err
    assert "error: stage train failed with exit status 1" in err
    assert not (out / "train.done").exists() and not (out / "bench.jsonl").exists()


def test_every_stage_of_the_main_job_runs_its_script_s_entry_point():
    """The real stage list names scripts of lrmoe.experiments; each stage runs the script's cli where it has one,
    else its main."""
    for stage in reproduce.STAGES:
        module = load_experiment(stage.entry)
        assert reproduce.entry_point(stage) is getattr(module, "cli", module.main), stage.name
    assert reproduce.entry_point(Stage("ablate", "ablate")) is load_experiment("ablate").cli
    with pytest.raises(ValueError, match="no script named 'trian'"):
        reproduce.entry_point(Stage("train", "trian"))


def test_the_job_and_its_stages_work_in_the_working_directory_not_the_script_s_folder(tmp_path, monkeypatch):
    """Issue 36: the default output folder and the stages' working directory were the checkout found from the
    script's own file (inside site-packages in an installed package). From an unrelated working directory: the
    job writes outputs/<mode> there, its stages run there, and a relative --out-dir is relative to it."""
    from pathlib import Path

    def where(argv):
        args = dict(zip(argv[::2], argv[1::2]))
        Path(args["--out"]).write_text(json.dumps({"cwd": os.getcwd()}) + "\n")

    monkeypatch.chdir(tmp_path)
    assert reproduce.output_dir(None, "quick") == Path("outputs/quick")
    assert reproduce.output_dir("elsewhere", "full") == Path("elsewhere")
    staged = [Stage("where", where)]
    for argv, out in ((["--only", "where"], tmp_path / "outputs" / "quick"),
                      (["--only", "where", "--out-dir", "mine"], tmp_path / "mine")):
        assert reproduce.main(argv, stages=staged) == 0
        assert Path(json.loads((out / "where.jsonl").read_text())["cwd"]).resolve() == tmp_path.resolve()
        assert (out / "SUMMARY.md").is_file() and (out / "where.done").is_file()
