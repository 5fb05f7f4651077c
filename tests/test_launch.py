"""The fork launcher returns every rank's result, and fails fast and loudly when a rank fails or hangs."""

import os
import subprocess
import sys
import textwrap
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
        if sig == "SIGKILL":  # nothing ran on the launcher's way out: the next launch removes its folder
            assert folders[0].exists()
            launch(_rank_info, 1, 0)
        assert not folders[0].exists()
    finally:
        kill_leftovers(proc, pids_in(tmp_path, "rank*"))
