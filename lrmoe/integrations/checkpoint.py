"""A run's checkpoint folder: whose it is, which checkpoints in it are whole, and what each holds.

Layout of a folder (``--ckpt-dir``)::

    owner.json            the run that owns the folder (script, results file, run id); another run is refused
    .lock                 held (flock) by the live process of that run: a second live run is refused
    step000050/           one sharded checkpoint (lrmoe.integrations.checkpoint_state: DCP files, one per rank)
      complete.json       written last, by rank 0: step, world size, run identity, every file's size and SHA-256
    records/
      steps000000-000050.pt   the records and routing counts of steps 1-50, written once

**Whole or not at all.** A step folder without ``complete.json`` is a save cut short and is never resumed from.
Before a run resumes, every file the manifest names is checked against its SHA-256; a checkpoint corrupted inside
is named, file by file, and the one before it is used (:meth:`CheckpointDir.latest`).

**Bounded size.** A checkpoint holds the model and optimizer state only; each step's record and routing counts are
written once, in the records segment of the checkpoint that first follows it, and a checkpoint's manifest lists
the segments up to its step. Only the newest ``keep`` checkpoints stay (the older ones and the segments no kept
checkpoint lists are removed after each save), so a run's folder holds ``keep`` states plus O(steps) records.

**Where it lives.** Every rank writes its own files into the folder and rank 0 writes the manifest after checking
that it sees every rank's files: on several nodes the folder must be on a filesystem they all share (a save on
node-local disks fails, naming the rank whose files rank 0 cannot see). docs/checkpoints.md has the user's view.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from lrmoe.integrations import checkpoint_state
from lrmoe.results import atomic_write, atomic_write_text

FORMAT = "lrmoe-checkpoint-2"
MANIFEST, OWNER, LOCK, RECORDS = "complete.json", "owner.json", ".lock", "records"
STORAGE = ("every rank reads and writes this folder: on several nodes it must be on a filesystem that all of "
           "them share")


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step{step:06d}"


def checkpoint_steps(root: str | os.PathLike) -> list[int]:
    """The steps with a step folder in ``root`` (whole or not), newest first."""
    root = Path(root)
    found = root.glob("step[0-9][0-9][0-9][0-9][0-9][0-9]") if root.is_dir() else []
    return sorted((int(p.name[4:]) for p in found if p.is_dir()), reverse=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: Path) -> dict | None:
    """A step folder's manifest, or None when the save did not finish (or the manifest is unreadable)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def corruption(folder: Path, manifest: dict) -> str | None:
    """Which file of the checkpoint in ``folder`` is missing, of another size or another SHA-256 than its manifest
    records (its records segments included), or None when all match."""
    root = folder.parent
    listed = [(folder / name, entry) for name, entry in manifest["files"].items()]
    listed += [(root / RECORDS / seg["name"], seg) for seg in manifest["records"]]
    for path, entry in listed:
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{path} holds {path.stat().st_size} bytes, its manifest {entry['bytes']}"
        if sha256(path) != entry["sha256"]:
            return f"{path} is corrupted (its SHA-256 differs from the one recorded when it was written)"
    return None


def identity_mismatch(path: Path, saved: dict, here: dict, defaults: dict | None = None) -> str | None:
    """Why the checkpoint at ``path`` (``saved``: its identity) is not this run's (``here``), naming both sides.
    ``defaults``: values of arguments added after older checkpoints were written."""
    if saved.get("script") != here["script"]:
        return f"checkpoint {path} was written by {saved.get('script')!r}, not by {here['script']!r}"
    there = {**(defaults or {}), **saved["args"]}
    diffs = [f"--{k.replace('_', '-')} {there.get(k)!r} there, {v!r} here" for k, v in here["args"].items()
             if there.get(k) != v]
    if diffs:
        return f"checkpoint {path} belongs to another run (results file {saved['results']}): " + "; ".join(diffs)
    if saved.get("run_id") != here["run_id"]:
        return (f"checkpoint {path} belongs to run {saved.get('run_id')} (results file {saved['results']}), but the "
                f"results file {here['results']} holds run {here['run_id']}")
    return None


def _resolved(path) -> str | None:
    return None if path in (None, "", "None") else str(Path(path).resolve())


class CheckpointDir:
    """The checkpoint folder ``root`` of the run ``identity`` (``{"script", "run_id", "results", "args"}``; the
    arguments that define the run, without the world size, which may change on resume), keeping the newest
    ``keep`` checkpoints (0: all). The folder methods run in the launching process, before any rank starts; save
    and load run in the ranks (collective)."""

    def __init__(self, root: str | os.PathLike, identity: dict, keep: int = 2, defaults: dict | None = None):
        if keep < 0:
            raise ValueError(f"keep must be non-negative, got {keep}")
        self.root, self.identity, self.keep, self.defaults = Path(root), identity, keep, defaults or {}
        self._lock_file = None
        self._records: list[dict] = []  # the segments up to the last checkpoint saved or loaded
        self._last = 0  # that checkpoint's step

    # -- ownership (before the ranks start) ----------------------------------------------------------------------
    def owner(self) -> dict | None:
        try:
            return json.loads((self.root / OWNER).read_text())
        except (OSError, ValueError):
            return None

    def owner_problem(self) -> str | None:
        """Why this run may not use the folder: another run's results file owns it, or it holds step folders no
        run of this package claims (an older version's)."""
        owner = self.owner()
        if owner is None:
            if checkpoint_steps(self.root):
                return (f"--ckpt-dir {self.root} holds checkpoints but no {OWNER} (an older version wrote them): "
                        f"move them away or choose another --ckpt-dir")
            return None
        if owner.get("script") != self.identity["script"] or \
                _resolved(owner.get("results")) != _resolved(self.identity["results"]):
            return (f"--ckpt-dir {self.root} belongs to another run (script {owner.get('script')!r}, results file "
                    f"{owner.get('results')}, run {owner.get('run_id')}), not to this run's results file "
                    f"{self.identity['results']}; give this run its own --ckpt-dir")
        return None

    def lock(self) -> None:
        """Take the folder for this run: an exclusive lock held until :meth:`release` (or this process's death),
        then the owner record. RuntimeError when another live process holds it or another run owns the folder."""
        if problem := self.owner_problem():
            raise RuntimeError(problem)
        self._flock()
        if problem := self.owner_problem():  # checked again under the lock: a run that started meanwhile
            self.release()
            raise RuntimeError(problem)
        atomic_write_text(self.root / OWNER, json.dumps(
            {"script": self.identity["script"], "results": _resolved(self.identity["results"]),
             "run_id": self.identity["run_id"], "host": socket.gethostname(), "pid": os.getpid()}, indent=1))

    def _flock(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / LOCK, "a")
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock on this platform: the owner record still guards sequential runs
            pass
        except OSError as exc:
            f.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise RuntimeError(f"--ckpt-dir {self.root} is in use by another live run (lock {self.root / LOCK}); "
                                   f"give this run its own --ckpt-dir, or wait for that run") from None
            raise
        self._lock_file = f

    def probe(self) -> str | None:
        """Why :meth:`lock` would fail now (for an argument check before any work), writing nothing."""
        if problem := self.owner_problem():
            return problem
        if not (self.root / LOCK).is_file():
            return None
        try:
            self._flock()
        except RuntimeError as exc:
            return str(exc)
        self.release()
        return None

    def release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the only descriptor releases the flock
            self._lock_file = None

    # -- which checkpoint (before the ranks start) ---------------------------------------------------------------
    def plan(self, resume: bool, overwrite: bool, run_ids: list[str], new_run_id: str,
             probe: bool = True) -> tuple[str, int, dict | None]:
        """Which run this is and where it starts, decided before any rank starts: (the run id, the step to resume
        from or 0, that checkpoint's manifest or None). ``run_ids``: the run headers' ids in the results file
        (--resume continues the last); ``new_run_id``: a fresh run's. ValueError when the folder is another run's
        or in use (``probe``), when a fresh run would start over checkpoints without --overwrite, when checkpoints
        have lost their results file, or when :meth:`latest` refuses."""
        if probe and (problem := self.probe()):
            raise ValueError(problem)
        steps = checkpoint_steps(self.root)
        if not resume:
            if steps and not overwrite:
                raise ValueError(f"--ckpt-dir {self.root} holds an earlier run's checkpoints; pass --overwrite to "
                                 f"replace them or --resume to continue that run")
            return new_run_id, 0, None
        if not steps:  # nothing to continue from: the run starts again (its records are superseded)
            return (run_ids[-1] if run_ids else new_run_id), 0, None
        if not run_ids:
            raise ValueError(f"--resume: {self.root} holds checkpoints but their results file "
                             f"{self.identity['results']} is missing; restore it, or pass --overwrite to start a new "
                             f"run")
        self.identity["run_id"] = run_ids[-1]
        step, manifest = self.latest() or (0, None)
        return run_ids[-1], step, manifest

    def latest(self, warn=print) -> tuple[int, dict] | None:
        """The newest whole, intact checkpoint of this run: (its step, its manifest), or None when there is none.
        Cut-short saves are skipped; a corrupted one is named (``warn``) and the one before used. ValueError when
        a checkpoint belongs to another run, or when every whole checkpoint is corrupted."""
        bad = []
        for step in checkpoint_steps(self.root):
            folder = step_folder(self.root, step)
            manifest = read_manifest(folder)
            if manifest is None:
                continue
            if why := identity_mismatch(folder, manifest["identity"], self.identity, self.defaults):
                raise ValueError(f"--resume: {why}")
            if why := corruption(folder, manifest):
                bad.append(why)
                warn(f"warning: checkpoint {folder}: {why}; trying an earlier one", flush=True)
                continue
            return step, manifest
        if bad:
            raise ValueError(f"--resume: no intact checkpoint in {self.root}: {'; '.join(bad)}")
        return None

    def remove_own(self) -> None:
        """--overwrite: remove the checkpoints and records this run's script wrote in the folder (the files of its
        own format), nothing else; folders left empty go too. Refused (RuntimeError) when another run owns it."""
        if problem := self.owner_problem():
            raise RuntimeError(problem)
        for step in checkpoint_steps(self.root):
            _remove_step(step_folder(self.root, step))
        records = self.root / RECORDS
        if records.is_dir():
            for path in records.glob("steps[0-9]*-[0-9]*.pt"):
                path.unlink()
            if not any(records.iterdir()):
                records.rmdir()

    # -- save and load (in the ranks) ----------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, layers, generators: dict, history: list[dict],
             counts: list[torch.Tensor], architecture: str) -> None:
        """Write the checkpoint of ``step`` (collective): each rank its state (checkpoint_state.save_state), rank 0
        the records of the steps since the last checkpoint (``history`` and ``counts``: rank 0's, one per step from
        step 1), then the manifest, last; then the checkpoints beyond the newest ``keep`` go."""
        rank, world = dist.get_rank(), dist.get_world_size()
        folder = step_folder(self.root, step)
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / MANIFEST).unlink(missing_ok=True)  # an earlier attempt's: it would describe other files
        if world > 1:
            dist.barrier()
        checkpoint_state.save_state(folder, model, optimizer, layers, generators)
        mine = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in folder.glob(f"__{rank}_*.distcp")}
        every: list = [None] * world
        if world > 1:
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        if rank == 0:
            files = {}
            for r, part in enumerate(every):
                unseen = [name for name in part if not (folder / name).is_file()]
                if unseen:
                    raise RuntimeError(f"rank {r} wrote {unseen} into {folder}, which rank 0 cannot see: the "
                                       f"checkpoint folder must be on a filesystem all ranks share")
                files.update(part)
            files[".metadata"] = {"bytes": (folder / ".metadata").stat().st_size,
                                  "sha256": sha256(folder / ".metadata")}
            if step > self._last:  # the records of steps last+1 .. step
                self._records.append(self._write_records(self._last, step, history, counts))
            manifest = {"format": FORMAT, "step": step, "world": world, "architecture": architecture,
                        "identity": self.identity, "storage": STORAGE, "files": files, "records": self._records}
            atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1))
            self._prune(step)
        self._last = step

    def load(self, step: int, model, optimizer, layers, generators: dict, architecture: str):
        """Load the checkpoint of ``step`` into this run (collective; re-sharded when the world size changed:
        lrmoe.integrations.checkpoint_state). Returns (history, counts) of steps 1..step."""
        folder = step_folder(self.root, step)
        manifest = read_manifest(folder)
        if manifest is None:
            raise RuntimeError(f"rank {dist.get_rank()} sees no whole checkpoint in {folder}: the checkpoint folder "
                               f"must be on a filesystem all ranks share")
        if manifest["architecture"] != architecture:  # defining arguments checked equal: a second safeguard
            raise ValueError(f"{folder} holds a {manifest['architecture']} model; this run trains a {architecture} "
                             f"model")
        checkpoint_state.load_state(folder, model, optimizer, layers, manifest["world"], generators)
        history, counts = [], []
        for seg in manifest["records"]:
            part = torch.load(self.root / RECORDS / seg["name"], map_location="cpu", weights_only=True)
            history += part["history"]
            counts += list(part["counts_ILNE"].unbind(0))
        self._records, self._last = list(manifest["records"]), step
        return history[:step], counts[:step]

    def _write_records(self, first: int, last: int, history: list[dict], counts: list[torch.Tensor]) -> dict:
        """Write the records of steps first+1 .. last once; the segment's manifest entry."""
        path = self.root / RECORDS / f"steps{first:06d}-{last:06d}.pt"
        path.parent.mkdir(exist_ok=True)
        part = {"history": history[first:last], "counts_ILNE": torch.stack([c.cpu() for c in counts[first:last]])}
        atomic_write(path, lambda f: torch.save(part, f))
        return {"name": path.name, "first": first + 1, "last": last, "bytes": path.stat().st_size,
                "sha256": sha256(path)}

    def _prune(self, newest: int) -> None:
        """Keep the newest ``keep`` whole checkpoints of this run and the records they list; remove the older ones
        and the cut-short saves before ``newest``."""
        kept, listed = 0, set()
        for step in checkpoint_steps(self.root):
            folder = step_folder(self.root, step)
            manifest = read_manifest(folder)
            ours = manifest is not None and manifest["identity"].get("run_id") == self.identity["run_id"]
            if step > newest:  # a later save of an attempt this run resumed before: left for its step to rewrite
                continue
            if ours and (self.keep == 0 or kept < self.keep):
                kept += 1
                listed.update(seg["name"] for seg in manifest["records"])
            elif manifest is None or ours:
                _remove_step(folder)
        for path in (self.root / RECORDS).glob("steps[0-9]*-[0-9]*.pt"):
            if path.name not in listed and int(path.stem.split("-")[1]) <= newest:
                path.unlink()


def _remove_step(folder: Path) -> None:
    """Remove a step folder's checkpoint files (DCP's and the manifest), and the folder when that empties it."""
    for path in [*folder.glob("__[0-9]*_[0-9]*.distcp"), folder / ".metadata", folder / MANIFEST]:
        path.unlink(missing_ok=True)
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
