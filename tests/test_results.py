"""Results files on disk (lrmoe.results): reading one imports nothing heavy, a collected file is appended whole with
a newline guard and a bad record is named by file and line, and a manifest removes exactly what its job wrote."""

import json
import subprocess
import sys
import textwrap

import pytest

from lrmoe.results import Manifest, append_record, read_records, read_results


def test_reading_a_results_file_imports_neither_wandb_nor_torch_distributed(tmp_path):
    path = tmp_path / "r.jsonl"
    records = [{"kind": "run", "run_id": "x"}, {"kind": "record", "step": 0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code = textwrap.dedent(f"""
        import sys
        from lrmoe.results import read_results, read_records
        assert len(read_results({str(path)!r})) == 1
        read_records({str(path)!r})
        heavy = sorted(m for m in sys.modules if m == "wandb" or m.startswith(("wandb.", "torch")))
        print(heavy)
        assert not heavy, heavy
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_torn_last_line_is_named_skipped_and_never_glued_onto(tmp_path, capsys):
    path = tmp_path / "collected.jsonl"
    append_record(path, {"seed": 0})
    with open(path, "a") as f:  # an append killed half-way through its line
        f.write('{"seed": 1, "arm": "sta')
    assert read_records(path) == [{"seed": 0}]
    assert "line 2: a torn last record" in capsys.readouterr().err
    append_record(path, {"seed": 2})
    assert read_records(path) == [{"seed": 0}, {"seed": 2}]
    assert path.read_text().endswith("\n")


def test_an_unterminated_whole_record_is_kept_and_terminated(tmp_path):
    path = tmp_path / "collected.jsonl"
    path.write_text('{"seed": 0}\n{"seed": 1}')  # e.g. edited by hand, no newline at the end
    assert read_records(path) == [{"seed": 0}, {"seed": 1}]
    append_record(path, {"seed": 2})
    assert read_records(path) == [{"seed": 0}, {"seed": 1}, {"seed": 2}]


def test_a_bad_record_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "collected.jsonl"
    path.write_text('{"seed": 0}\n{"seed": 1,\n{"seed": 2}\n')
    with pytest.raises(ValueError, match=r"collected.jsonl, line 2: not a JSON record"):
        read_records(path)
    with pytest.raises(ValueError, match=r"collected.jsonl, line 2"):
        read_results(path)


def test_appenders_in_several_processes_never_interleave(tmp_path):
    path = tmp_path / "collected.jsonl"
    code = textwrap.dedent(f"""
        import sys
        from lrmoe.results import append_record
        for i in range(50):
            append_record({str(path)!r}, {{"who": int(sys.argv[1]), "i": i, "pad": "x" * 5000}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(w)]) for w in range(3)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    rows = read_records(path)
    assert sorted((r["who"], r["i"]) for r in rows) == [(w, i) for w in range(3) for i in range(50)]


def test_a_manifest_removes_exactly_what_its_job_wrote(tmp_path):
    (tmp_path / "work").mkdir()
    ours = [tmp_path / "a.jsonl", tmp_path / "work" / "b.npz"]
    theirs = [tmp_path / "a_notes.txt", tmp_path / "work" / "mine.txt"]
    for p in ours + theirs:
        p.write_text("x")
    run_dir = tmp_path / "wandb" / "offline-run-20260101_000000-job-1"
    other_run = tmp_path / "wandb" / "offline-run-20260101_000000-other-7"
    run_dir.mkdir(parents=True)
    other_run.mkdir()
    (tmp_path / "wandb" / "latest-run").symlink_to(run_dir.name)
    manifest = Manifest(tmp_path, "job")
    manifest.add(*ours, tag="s")
    manifest.add_wandb_run("job-1", tmp_path / "wandb", tag="s")
    again = Manifest(tmp_path, "job")  # read back from disk
    assert again.foreign([tmp_path / "a.jsonl", tmp_path / "a_notes.txt", tmp_path / "work"]) == theirs
    again.remove(tags=["other-stage"])
    assert all(p.exists() for p in ours) and run_dir.exists()
    again.remove(tags=["s"])
    assert not any(p.exists() for p in ours) and not run_dir.exists()
    assert all(p.exists() for p in theirs) and other_run.exists()
    assert not (tmp_path / "wandb" / "latest-run").is_symlink()
    assert Manifest(tmp_path, "job").files == {}


def test_tracking_re_exports_none_of_the_files_names():
    """The reader, writer and lock live in lrmoe.results alone: no stale second name for them in tracking or the
    modules beside it."""
    from lrmoe.integrations import provenance, reports, tracking, tracking_args, wandb_policy

    stale = [f"{module.__name__}.{name}" for module in (tracking, tracking_args, reports, provenance, wandb_policy)
             for name in ("read_results", "atomic_write", "atomic_write_text", "FileLock", "_FileLock", "Manifest",
                          "complete_lines", "_complete_lines", "_parse", "parse_lines", "read_headers")
             if hasattr(module, name)]
    assert not stale, stale
