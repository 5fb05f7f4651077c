"""The fork launcher returns every rank's result, and fails fast and loudly when a rank fails or hangs, naming a
rank that never arrives at a collective; a healthy run is bounded by its collectives' waits, not by its length."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lrmoe.runtime.distributed.launch import LaunchError, launch


def _rank_info(rank, offset, scale=1):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": dist.get_world_size(), "sum": t.item() * scale + offset,
            "threads": torch.get_num_threads()}


def _raise_on_rank(rank, bad_rank):
    if rank == bad_rank:
        raise RuntimeError(f"planted failure on rank {rank}")
    dist.barrier()  # the healthy ranks block here until they are killed
    return rank


def _die_on_rank(rank, bad_rank):
    if rank == bad_rank:
        os._exit(3)
    dist.barrier()
    return rank


def _sleep_forever(rank):
    time.sleep(3600)


@pytest.mark.parametrize("world_size", [2, 4])
def test_launch_returns_each_rank_value_in_rank_order(world_size):
    out = launch(_rank_info, world_size, 10, scale=2)
    expected_sum = sum(range(world_size)) * 2 + 10
    assert [o["rank"] for o in out] == list(range(world_size))
    assert all(o["world"] == world_size and o["sum"] == expected_sum for o in out)
    assert all(o["threads"] == 1 for o in out)  # ranks share the cores: one intra-op thread each


def test_a_raising_rank_fails_the_launch_quickly_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_raise_on_rank, 4, 2, timeout_s=60)
    assert time.monotonic() - start < 20  # far below both the launch and the process-group timeout
    assert info.value.rank == 2
    assert "planted failure on rank 2" in str(info.value) and "Traceback" in str(info.value)


def test_a_dying_rank_fails_the_launch():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 of 2 died with exit code 3"):
        launch(_die_on_rank, 2, 1, timeout_s=60)
    assert time.monotonic() - start < 20


def test_a_hanging_launch_times_out():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timed out"):
        launch(_sleep_forever, 2, timeout_s=2)
    assert time.monotonic() - start < 10


def _sleep_instead_of_all_reduce(rank, sleeper):
    if rank == sleeper:
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # a background thread, dumped first
        time.sleep(3600)  # hangs here, outside any collective
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _return_or_sleep(rank, sleeper):
    if rank == sleeper:
        time.sleep(3600)  # its peers return their results and wait for it in the launcher's closing barrier
    return rank


def _sleep_or_barrier(rank, sleeper):
    if rank == sleeper:
        time.sleep(3600)
    dist.barrier()


def _steps_longer_than_the_collective_timeout(rank, steps, step_s):
    start = time.monotonic()
    for _ in range(steps):
        time.sleep(step_s)  # every rank works as long: none waits long for the others in the collective
        t = torch.ones(1)
        dist.all_reduce(t)
    return time.monotonic() - start


def test_a_rank_that_never_arrives_at_a_collective_is_named_within_the_collective_timeout():
    """Its peers time out in the collective after pg_timeout_s; the launcher asks the ranks that did not report
    where they are and names the one outside any collective, with its stack, instead of blaming the peers that
    waited for it (before: "rank 0 of 3 failed", or the whole launch's timeout and every rank)."""
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_sleep_instead_of_all_reduce, 3, 1, timeout_s=120, pg_timeout_s=3)
    assert time.monotonic() - start < 60  # the collective timeout and a moment, far below the launch's bound
    assert info.value.rank == 1 and info.value.ranks == [1]
    message = str(info.value)
    assert message.startswith("rank 1 of 3 did not arrive at a collective: ranks [0, 2] failed waiting"), message
    assert "rank 0 in all_reduce" in message and "rank 2 in all_reduce" in message
    assert "rank 1: not in a collective, at" in message and "in _sleep_instead_of_all_reduce" in message


def _stop_instead_of_all_reduce(rank, stopped):
    if rank == stopped:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: it can neither arrive nor say where it is
    dist.all_reduce(torch.ones(1))
    return rank


def test_a_stopped_rank_is_named_not_the_peer_that_waited_for_it():
    """A rank frozen by SIGSTOP never arrives and cannot answer the request for its stack: the launcher finds it
    stopped (/proc/<pid>/stat) and names it (before: "rank 0 of 2 failed", the peer's collective timeout)."""
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_stop_instead_of_all_reduce, 2, 1, timeout_s=60, pg_timeout_s=2)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert info.value.ranks == [1], message
    assert message.startswith("rank 1 of 2 did not arrive at a collective: rank 0 failed waiting"), message
    assert "rank 1: stopped (process" in message


def test_a_rank_that_hangs_after_its_peers_returned_is_named():
    """The peers that returned wait for it in the launcher's closing barrier; when that times out, the rank still
    working is named (before: the launch waited for it until its own timeout)."""
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_return_or_sleep, 2, 1, timeout_s=120, pg_timeout_s=3)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1 and "rank 1 of 2 did not arrive at a collective" in str(info.value)
    assert "in _return_or_sleep" in str(info.value)


def test_a_healthy_run_longer_than_the_collective_timeout_is_not_stopped():
    """The collective timeout bounds inactivity (a wait for peers), not the run: with no bound on the launch
    (timeout_s None) a run of 4 s whose collectives complete passes a 2.5 s collective timeout."""
    spent = launch(_steps_longer_than_the_collective_timeout, 2, 4, 1.0, timeout_s=None, pg_timeout_s=2.5)
    assert min(spent) > 2.5  # it did run past the bound


def test_a_launch_timeout_says_where_each_rank_is():
    """The whole launch's timeout names the rank outside the collective the others wait in, with its stack."""
    with pytest.raises(LaunchError) as info:
        launch(_sleep_or_barrier, 2, 1, timeout_s=3, pg_timeout_s=120)
    message = str(info.value)
    assert "launch timed out after 3 s; ranks [0, 1] had not finished; rank 1 did not arrive" in message, message
    assert "rank 0: waits in barrier" in message and "in _sleep_or_barrier" in message
    assert info.value.rank == 1


def test_stack_dumps_tell_a_rank_in_a_collective_from_one_outside():
    from lrmoe.runtime.distributed.stacks import parse_stack

    dist_file = os.path.join(os.path.dirname(dist.__file__), "distributed_c10d.py")
    logger = os.path.join(os.path.dirname(dist.__file__), "c10d_logger.py")
    dump = textwrap.dedent(f"""\
        Thread 0x00007f01 (most recent call first):
          File "/usr/lib/python3/threading.py", line 331 in wait
          File "/usr/lib/python3/threading.py", line 1002 in _bootstrap

        Current thread 0x00007f02 (most recent call first):
          File "{dist_file}", line 3252 in all_reduce
          File "{logger}", line 83 in wrapper
          File "job.py", line 7 in step
          File "/x/launch.py", line 96 in _child
          File "/usr/lib/python3/multiprocessing/process.py", line 108 in run
        """)
    stack = parse_stack(dump, "_child")
    assert stack.collective == "all_reduce"  # past torch's logging wrapper
    assert stack.frames[-1].endswith("in _child") and len(stack.frames) == 4  # the process's start is cut
    outside = parse_stack(dump.replace(f'File "{dist_file}", line 3252 in all_reduce', 'File "/j.py", line 1 in f'),
                          "_child")
    assert outside.collective is None and outside.where == 'File "/j.py", line 1 in f'
    assert parse_stack("", "_child") is None
    assert parse_stack(dump.split("Current thread")[0], "_child") is None  # not the main thread: keep asking


def test_ranks_inherit_the_modules_torch_would_import_in_each_of_them():
    """Building any torch optimizer imports torch._dynamo (3 s on this machine's cores): preloaded, the launcher
    imports it once, before forking, so no rank repeats it. Checked in a fresh process, where nothing has imported it
    yet."""
    code = textwrap.dedent("""
        import sys
        from lrmoe.runtime.distributed.launch import launch
        before = "torch._dynamo" in sys.modules
        print(before, launch(lambda rank: "torch._dynamo" in sys.modules, 2, preload=("torch._dynamo",)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "[True,", "True]"], out.stdout + out.stderr[-2000:]


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="world_size"):
        launch(_rank_info, 0, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        launch(_rank_info, 2, 0, timeout_s=0)
    with pytest.raises(ValueError, match="pg_timeout_s"):
        launch(_rank_info, 2, 0, pg_timeout_s=float("nan"))


def test_a_script_whose_rank_fails_exits_non_zero(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        from lrmoe.runtime.distributed.launch import launch

        def work(rank):
            if rank == 1:
                raise ValueError("rank one is broken")
            import torch.distributed as dist
            dist.barrier()

        if __name__ == "__main__":
            launch(work, 2, timeout_s=60)
    """))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0
    assert "rank one is broken" in proc.stderr
    assert time.monotonic() - start < 60


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


LAUNCHER = textwrap.dedent("""
    import os, sys, time
    from lrmoe.runtime.distributed.launch import launch

    def work(rank):
        open(os.path.join(sys.argv[1], f"rank{rank}"), "w").write(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        launch(work, 2, timeout_s=600)
""")


def pids_in(folder: Path, pattern: str) -> list[int]:
    """The process ids written into the files ``pattern`` of ``folder`` (a process writes its own on start)."""
    return [int(p.read_text()) for p in folder.glob(pattern) if p.read_text()]


def wait_for_pids(folder: Path, pattern: str, count: int, proc: subprocess.Popen) -> list[int]:
    """Wait (at most a minute) until ``count`` processes have written their ids; those ids."""
    deadline = time.monotonic() + 60
    while len(pids := pids_in(folder, pattern)) < count:
        assert proc.poll() is None and time.monotonic() < deadline, "the processes did not start"
        time.sleep(0.05)
    return pids


def survivors(pids: list[int], within_s: float = 10.0) -> list[int]:
    """Those of ``pids`` still running after at most ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_leftovers(proc: subprocess.Popen, pids: list[int]) -> None:
    """SIGKILL ``proc``'s session and ``pids`` (whatever a failed test left), and reap ``proc``."""
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_ranks_die_with_their_launcher_and_leave_no_launch_folder(tmp_path, sig):
    import signal
    import tempfile

    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True)
    try:
        ranks = wait_for_pids(tmp_path, "rank*", 2, proc)
        folders = list(Path(tempfile.gettempdir()).glob(f"lrmoe-launch-{proc.pid}-*"))
        assert len(folders) == 1
        os.kill(proc.pid, getattr(signal, sig))  # the launcher only, not its process group
        proc.wait(timeout=30)
        assert not survivors(ranks), f"ranks outlived their launcher's {sig}"
        if sig == "SIGKILL":  # nothing ran on the launcher's way out: the next launch removes its folder (this one,
            launch(_rank_info, 1, 0)  # or a launch of a test running beside this one, which may have come first)
        assert not folders[0].exists()
    finally:
        kill_leftovers(proc, pids_in(tmp_path, "rank*"))
