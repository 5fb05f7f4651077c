"""Results files on disk: atomic writes, the writer's lock, reading JSON-lines files, appending to a shared one, and
the manifest of what a job wrote.

Plain standard library (no W&B, no torch), on the lowest layer (DESIGN.md §7), so that reading a results file
imports nothing heavy and every layer can use it.

* a *results file* (lrmoe.integrations.tracking) is fsynced record by record; a run killed while writing leaves at
  most one unterminated last line, which readers skip;
* a *collected file* (one line per finished run, appended by several processes) is appended whole, under a lock,
  with fsync and a newline guard: :func:`append_record`, read back by :func:`read_records`;
* a :class:`Manifest` lists what a job wrote (files and W&B run ids), so that ``--overwrite`` removes exactly
  those and refuses when a file that the job did not write lies where it would write.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import IO, Callable, Iterable


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` so that readers see either the old file or the whole new one, never a part, and the new one
    survives a power cut once this returns: ``write(f)`` fills a temporary file in the same folder, which is fsynced,
    renamed over ``path``, and the folder fsynced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def complete_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the non-blank lines of ``path`` that were written completely (each ends with a
    newline): a writer killed mid-record leaves at most one unterminated last line, which is not a record."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    return [(i, line) for i, line in enumerate(lines[:-1], 1) if line.strip()]


def parse_lines(path: Path, lines: list[tuple[int, str]]) -> list[dict]:
    """The JSON objects of ``lines``; ``ValueError`` naming the file and line of the first that is not one."""
    records = []
    for i, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {i}: not a JSON record ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {i}: not a JSON object")
        records.append(record)
    return records


def read_results(path: str | os.PathLike, kind: str = "record") -> list[dict]:
    """The records of one kind ("run", "record", "summary", "figure") from a results file, in file order.

    A resumed run has already superseded the records of its killed attempt (lrmoe.integrations.tracking), so each
    step appears once; a run still being written (or killed while writing) may end in an unterminated line,
    which is skipped."""
    path = Path(path)
    return [rec for rec in parse_lines(path, complete_lines(path)) if rec.get("kind") == kind]


def read_headers(path: Path) -> list[dict]:
    """The run headers of a results file (none where it does not parse as one)."""
    try:
        return read_results(path, "run")
    except (ValueError, OSError, UnicodeDecodeError):
        return []


class FileLock:
    """An exclusive lock on a hidden file beside ``path`` (``flock``: the kernel drops it when its holder dies,
    even by SIGKILL). ``wait``: block until it is free (appenders), else fail at once (a second writer)."""

    def __init__(self, path: Path, wait: bool = False):
        path = Path(path)
        self.path = path.with_name(f".{path.name}.lock")
        self._file = open(self.path, "a")
        try:
            import fcntl

            fcntl.flock(self._file, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except ImportError:  # no flock on this platform: no protection
            pass
        except OSError as exc:
            self._file.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise RuntimeError(f"results file {path} is being written by another live process (lock "
                                   f"{self.path}); wait for it or stop it before resuming") from None
            raise

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()  # closing the only descriptor releases the flock

    def __enter__(self) -> "FileLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# -- collected files: one JSON line per record, appended by several processes --------------------------------------
def append_record(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` to ``path`` as one whole JSON line, fsynced, under the file's lock (appenders in several
    processes wait for each other). Newline guard: a last line left unterminated by a killed appender is completed
    when it holds a whole record, else (a torn record) cut off, and said so, so nothing is glued onto it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record) + "\n").encode("utf-8")
    with FileLock(path, wait=True), open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size:
            f.seek(0)
            data = f.read()
            if not data.endswith(b"\n"):
                start = data.rfind(b"\n") + 1
                try:
                    json.loads(data[start:])
                    f.write(b"\n")
                except ValueError:
                    print(f"{path}: the last line ({size - start} bytes) is a torn record, left by an append that "
                          f"was killed: removed", file=sys.stderr)
                    f.truncate(start)
        f.seek(0, os.SEEK_END)
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str | os.PathLike) -> list[dict]:
    """Every record of a collected file (none where it does not exist). A bad line is a ``ValueError`` naming the
    file and the line; an unterminated last line that is not a whole record (an append killed mid-write) is
    skipped with a warning (the next :func:`append_record` removes it)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    if tail.strip():
        try:
            json.loads(tail)
            numbered.append((len(lines) + 1, tail))
        except json.JSONDecodeError:
            print(f"warning: {path}, line {len(lines) + 1}: a torn last record (an append that was killed), "
                  f"skipped", file=sys.stderr)
    return parse_lines(path, numbered)


# -- what a job wrote ----------------------------------------------------------------------------------------------
class Manifest:
    """What one job wrote in a folder: the files (relative to the folder), each under a tag (a stage's name, or
    the job's), and its W&B run ids. Kept in ``<folder>/.<job>.manifest.json``, rewritten atomically at each
    addition, so that a job killed half-way still names what it wrote until then.

    ``--overwrite`` removes exactly these (:meth:`remove`) and refuses when a file that matches the job's output
    names is not in it (:meth:`foreign`): such a file was put there by someone else."""

    def __init__(self, folder: str | os.PathLike, job: str):
        self.folder = Path(folder)
        self.path = self.folder / f".{job}.manifest.json"
        self.files: dict[str, str] = {}  # relative path -> tag
        self.wandb_runs: dict[str, list[str]] = {}  # run id -> [tag, the W&B folder holding its run folder]
        self.identity: dict[str, object] = {}  # tag -> the configuration that wrote its files
        self.open: list[str] = []  # tags whose writer started and has not been accounted for (killed?)
        if self.path.is_file():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                self.files = dict(data.get("files", {}))
                self.wandb_runs = dict(data.get("wandb_runs", {}))
                self.identity = dict(data.get("identity", {}))
                self.open = list(data.get("open", []))
            except (ValueError, AttributeError):
                raise ValueError(f"{self.path}: not a manifest of written files; move it away") from None

    @classmethod
    def of(cls, results: str | os.PathLike) -> "Manifest":
        """The manifest of the job that writes the results file ``results`` (beside it)."""
        results = Path(results)
        return cls(results.parent, results.name)

    def _rel(self, path: str | os.PathLike) -> str:
        path = Path(path)
        try:
            return str(path.absolute().relative_to(self.folder.absolute()))
        except ValueError:
            return str(path.absolute())

    def _abs(self, rel: str) -> Path:
        return self.folder / rel if not Path(rel).is_absolute() else Path(rel)

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({"files": self.files, "wandb_runs": self.wandb_runs,
                                                 "identity": self.identity, "open": self.open}, indent=0))

    def add(self, *paths: str | os.PathLike, tag: str = "", save: bool = True) -> None:
        """Record ``paths`` (files, or folders: every file under them now) as written by the job."""
        for path in paths:
            path = Path(path)
            for file in (p for p in path.rglob("*") if not p.is_dir()) if path.is_dir() else [path]:
                self.files[self._rel(file)] = tag
        if save:
            self.save()

    def add_wandb_run(self, run_id: str, wandb_dir: str | os.PathLike, tag: str = "") -> None:
        """Record the W&B run ``run_id``, whose local folder lies in ``wandb_dir`` (``<dir>/wandb``)."""
        self.wandb_runs[run_id] = [tag, self._rel(wandb_dir)]
        self.save()

    def written(self, path: str | os.PathLike) -> bool:
        return self._rel(path) in self.files

    def tag_of(self, path: str | os.PathLike) -> str | None:
        """The tag ``path`` was recorded under (None: the job did not write it)."""
        return self.files.get(self._rel(path))

    def foreign(self, candidates: Iterable[str | os.PathLike]) -> list[Path]:
        """The files among ``candidates`` (files, or folders searched whole) that exist and the job did not write."""
        found = []
        for cand in candidates:
            cand = Path(cand)
            if cand.is_dir() and not cand.is_symlink():
                found += [p for p in sorted(cand.rglob("*")) if not p.is_dir() and not self.written(p)]
            elif (cand.exists() or cand.is_symlink()) and not self.written(cand) and cand != self.path:
                found.append(cand)
        return found

    def remove(self, tags: Iterable[str] | None = None, keep_wandb: Iterable[str] = ()) -> list[Path]:
        """Remove every file the job recorded (``tags``: only those under these tags) and its W&B runs' local
        folders (except the runs ``keep_wandb``), then the folders this left empty; returns what went."""
        tags = None if tags is None else set(tags)
        removed = []
        for rel, tag in list(self.files.items()):
            if tags is not None and tag not in tags:
                continue
            path = self._abs(rel)
            if path.is_symlink() or path.is_file():
                path.unlink()
                removed.append(path)
            del self.files[rel]
        for run_id, (tag, wandb_dir) in list(self.wandb_runs.items()):
            if (tags is not None and tag not in tags) or run_id in keep_wandb:
                continue
            removed += remove_wandb_run(self._abs(wandb_dir), run_id)
            del self.wandb_runs[run_id]
        for tag in list(self.identity):
            if tags is None or tag in tags:
                del self.identity[tag]
        for folder in sorted({p.parent for p in removed}, key=lambda p: -len(p.parts)):
            while folder != self.folder and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
                folder = folder.parent
        self.save()
        return removed


def remove_wandb_run(wandb_dir: Path, run_id: str) -> list[Path]:
    """Remove the local folders of the W&B run ``run_id`` in ``wandb_dir`` (``offline-run-<time>-<id>``,
    ``run-<time>-<id>``: the id names the run), and the links there that pointed into them."""
    if not wandb_dir.is_dir():
        return []
    runs = [p for p in wandb_dir.iterdir() if p.is_dir() and not p.is_symlink()
            and p.name.startswith(("offline-run-", "run-")) and p.name.endswith(f"-{run_id}")]
    names = [p.name for p in runs]
    for path in runs:
        shutil.rmtree(path)
    for link in [p for p in wandb_dir.iterdir() if p.is_symlink()]:  # latest-run, debug.log: into a removed run
        if not link.exists() and any(name in os.readlink(link) for name in names):
            link.unlink()
    return runs
