"""Every check before the work: the experiment scripts refuse bad values, existing or unwritable outputs and an
unusable W&B setting with argparse's message (exit status 2) before any rank starts or any record is written, and
leave no file behind."""

import pytest
from _scripts import load_experiment

from lrmoe.integrations.tracking import Tracker

pytestmark = pytest.mark.timeout(120)
train = load_experiment("train")
layer_bench = load_experiment("layer_bench")
metric_fidelity = load_experiment("metric_fidelity")

TRAIN = ["--ranks", "2", "--batch", "2", "--seq-len", "32", "--steps", "2", "--max-bytes", "300000", "--quiet",
         "--no-wandb"]


def refuses(capsys, main, argv) -> str:
    """``main(argv)`` exits with argparse's status 2; its message."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, exc.value.code
    return capsys.readouterr().err


def test_train_checks_paths_data_and_wandb_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    out, taken = tmp_path / "r.jsonl", tmp_path / "taken.npz"
    taken.write_text("an earlier trace")
    assert "--trace-out" in refuses(capsys, train.main, [*TRAIN, "--out", str(out), "--trace-out", str(taken)])
    (tmp_path / "file").write_text("")
    assert "is a file" in refuses(capsys, train.main, [*TRAIN, "--out", str(out), "--ckpt-dir",
                                                        str(tmp_path / "file" / "ck")])
    err = refuses(capsys, train.main, [*TRAIN, "--out", str(out), "--seq-len", "400000"])
    assert "split of the corpus" in err and "--seq-len 400000" in err
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    argv = [a for a in TRAIN if a != "--no-wandb"]
    assert "WANDB_API_KEY" in refuses(capsys, train.main, [*argv, "--out", str(out)])
    assert not out.exists() and not (tmp_path / "r.ckpt").exists(), "a failed start left files"
    out.write_text("")
    assert "--overwrite" in refuses(capsys, train.main, [*TRAIN, "--out", str(out)])


def test_layer_bench_and_metric_fidelity_check_before_measuring(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    out.write_text("earlier measurements\n")
    assert "--overwrite" in refuses(capsys, layer_bench.main, ["--out", str(out), "--no-wandb"])
    assert out.read_text() == "earlier measurements\n"
    for bad in (["--ranks", "0"], ["--steps", "-1"], ["--tokens-per-rank", "x"], ["--skew-param", "inf"]):
        assert "error: argument --" in refuses(capsys, layer_bench.main, [*bad, "--out", str(tmp_path / "new.jsonl")])
    for bad in (["--rhos", "1.5"], ["--rhos", "nan"]):
        assert "error: argument --rhos" in refuses(capsys, metric_fidelity.main, bad)
    assert not (tmp_path / "new.jsonl").exists()


def test_a_run_that_fails_before_its_first_record_leaves_no_file(tmp_path):
    results = tmp_path / "r.jsonl"
    with pytest.raises(RuntimeError), Tracker("exp", results=results, wandb=False):
        raise RuntimeError("the ranks failed to start")
    assert not results.exists()
    results.write_text('{"kind": "run", "run_id": "old", "name": "exp"}\n')
    with pytest.raises(RuntimeError), Tracker("exp", results=results, overwrite=True, wandb=False):
        raise RuntimeError("a failed --overwrite start")
    assert results.read_text() == '{"kind": "run", "run_id": "old", "name": "exp"}\n', "the old results were lost"


def test_a_report_never_shares_a_path_with_results_nor_replaces_an_unrelated_file(tmp_path, capsys):
    frontier = load_experiment("frontier")
    err = refuses(capsys, frontier.main, ["--out", str(tmp_path / "x.md"), "--no-wandb"])
    assert "overwrite the results file" in err
    notes = tmp_path / "notes.md"
    notes.write_text("mine")
    err = refuses(capsys, frontier.main, ["--out", str(tmp_path / "notes.jsonl"), "--overwrite", "--no-wandb"])
    assert "not a report" in err and notes.read_text() == "mine"
    assert not (tmp_path / "notes.jsonl").exists()


def test_a_report_beside_its_own_results_file_is_replaced_only_when_asked(tmp_path):
    from lrmoe.integrations.reports import report_problem, write_report

    results = tmp_path / "f.jsonl"
    with Tracker("frontier", results=results, wandb=False) as run:
        run.log({"x": 1.0}, step=0)
    (tmp_path / "f.md").write_text("# an earlier report, unmarked\n")
    assert "--overwrite" in report_problem(results, False, "frontier")
    assert report_problem(results, True, "frontier") is None
    assert "not a report" in report_problem(results, True, "ablate")  # another script's results: not its report
    write_report(tmp_path / "g.jsonl", "text\n")  # marked: its own, even without a results file
    assert report_problem(tmp_path / "g.jsonl", True, "frontier") is None


def test_trace_stats_reads_every_recorded_trace_before_writing(tmp_path, capsys):
    """Issue 38 (16): a bad --recorded failed after the synthetic traces were logged, leaving half-written
    results."""
    trace_stats = load_experiment("trace_stats")
    bad = tmp_path / "bad.npz"
    bad.write_text("not a trace")
    out = tmp_path / "ts.jsonl"
    err = refuses(capsys, trace_stats.main, ["--steps", "1", "--layers", "1", "--ranks", "2", "--tokens-per-rank",
                                             "8", "--recorded", str(bad), "--out", str(out), "--no-wandb"])
    assert "--recorded" in err and "bad.npz" in err
    assert not out.exists() and not out.with_suffix("").exists()


def bench_trace(tmp_path, zero=False):
    """A recorded trace of layer_bench's quick shape (2 ranks, the debug model's 16 experts, top-4), 2 layers."""
    from lrmoe.traces.synthetic import generate_trace
    from lrmoe.traces.trace import Trace

    trace = generate_trace(5, 2, 2, 16, 4, 128, seed=0, exact=True)
    if zero:
        trace = Trace(trace.counts_ILNE * 0, trace.meta)
    return trace.save(tmp_path / ("zero.npz" if zero else "rec.npz"), overwrite=True)


def test_layer_bench_refuses_a_trace_layer_it_lacks_and_an_all_zero_trace(tmp_path, capsys):
    """Issue 38 (16, 18): --trace-layer 99 was an IndexError traceback; an all-zero trace passed and wrote NaN
    rows."""
    quick = ["--quick", "--ranks", "2", "--out", str(tmp_path / "b.jsonl"), "--no-wandb"]
    err = refuses(capsys, lambda argv: layer_bench.check_args(layer_bench.parse_args(argv)),
                  [*quick, "--trace", str(bench_trace(tmp_path)), "--trace-layer", "99"])
    assert "--trace-layer 99" in err and "layers 0 to 1" in err
    err = refuses(capsys, lambda argv: layer_bench.check_args(layer_bench.parse_args(argv)),
                  [*quick, "--trace", str(bench_trace(tmp_path, zero=True))])
    assert "routes no token" in err
    layer_bench.check_args(layer_bench.parse_args([*quick, "--trace", str(bench_trace(tmp_path)),
                                                   "--trace-layer", "1"]))  # a layer it has: fine


def test_validate_sim_reads_its_bench_before_any_work(tmp_path, capsys):
    """Issue 38 (16): a bad --bench was a traceback (after the cost model's set-up)."""
    validate_sim = load_experiment("validate_sim")
    out = ["--out", str(tmp_path / "v.jsonl"), "--no-wandb"]
    assert "is not a file" in refuses(capsys, validate_sim.main, ["--bench", str(tmp_path / "none.jsonl"), *out])
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"a": 1}\n{"b": \n')
    assert "notes.jsonl, line 2" in refuses(capsys, validate_sim.main, ["--bench", str(notes), *out])
    notes.write_text('{"a": 1}\n')
    assert "holds no layer_bench run" in refuses(capsys, validate_sim.main, ["--bench", str(notes), *out])


def test_a_bad_line_of_the_collected_runs_is_named_by_every_reader(tmp_path, capsys):
    """Issue 38 (14): frontier.py --regime and layer_bench --regime parsed the collected file with a bare
    json.loads (a JSONDecodeError naming neither file nor line)."""
    runs = tmp_path / "runs.jsonl"
    runs.write_text('{"regime": "weak", "seed": 1}\n{"regime": "we\n{"regime": "weak", "seed": 2}\n')
    frontier = load_experiment("frontier")
    with pytest.raises(SystemExit, match=r"runs.jsonl, line 2: not a JSON record"):
        frontier.main(["--regime", "weak", "--runs", str(runs), "--out", str(tmp_path / "f.jsonl"), "--no-wandb"])
    err = refuses(capsys, layer_bench.parse_args, ["--regime", "weak", "--runs", str(runs), "--out",
                                                   str(tmp_path / "b.jsonl"), "--no-wandb"])
    assert "runs.jsonl, line 2" in err
