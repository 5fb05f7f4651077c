"""Text data for the small training runs: a byte-level tokenizer and a deterministic train/validation split.

The default corpus is the running Python's standard-library source: real text, present on every machine,
offline and deterministic for a given Python version. Any folder or glob of text files works instead.
The split is by file, decided by a hash of the file's path relative to the corpus root, so it is stable across
machines and independent of listing order. A corpus of one file, or of so few that no file (or every file) hashes
to the validation split, is split by bytes instead: the last ``val_fraction`` of each file's bytes is validation
text, the rest training text. A corpus the file split serves keeps exactly the split it always had.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as token ids (uint8 values in a long tensor)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(ids: torch.Tensor) -> str:
    return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def default_corpus() -> str:
    """The standard library's Python files of the running interpreter, as a glob."""
    return os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")


def _walk(base: str, pattern: str, prune: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """``glob("base/**/pattern")`` without entering the directories named in ``prune``: the matching files outside
    them, and one matching file from each pruned directory that holds any (its probe, found by walking it only
    until the first match). The probes stand in for the pruned files where the listing's root is decided."""
    found, probes = [], []
    for folder, dirs, names in os.walk(base):
        found += [os.path.join(folder, n) for n in fnmatch.filter(names, pattern)]
        for d in [d for d in dirs if d in prune]:
            probe = next((os.path.join(f, m[0]) for f, _, ns in os.walk(os.path.join(folder, d))
                          if (m := fnmatch.filter(ns, pattern))), None)
            probes += [probe] if probe else []
        dirs[:] = [d for d in dirs if d not in prune]
    return found, probes


def _root(files: list[str]) -> Path:
    """The folder relative to which a listing's files are named: their common folder (a lone file's own)."""
    if len(files) == 1:
        return Path(files[0]).parent
    return Path(os.path.commonpath(files)) if files else Path(".")


def list_files(source: str, prune: tuple[str, ...] = ()) -> tuple[Path, list[Path]]:
    """Resolve a folder or a glob to (root, sorted files). ``prune``: names of directories whose files the caller
    skips anyway (relative to the root); a glob of the form ``base/**/pattern`` is then walked without listing them
    (the standard library's site-packages and tests are most of its tree), and the files returned are the whole
    listing's less those inside a pruned directory. The root is the whole listing's: one file found in each pruned
    directory takes part in deciding it, which is exact (the common folder of files outside a directory and one
    inside it already lies above that directory). Where every file lies inside a pruned directory (the root may
    then be inside it, where its name no longer excludes anything), the source is listed whole."""
    path = Path(source)
    if path.is_dir():
        root, files = path, sorted(p for p in path.rglob("*") if p.is_file())
    else:
        base, sep, pattern = source.rpartition(os.sep + "**" + os.sep)
        simple = prune and sep and not glob.has_magic(base) and not any(c in pattern for c in "/" + os.sep)
        listed, probes = _walk(base, pattern, prune) if simple else ([], [])
        listed = [p for p in listed if os.path.isfile(p)]
        if not listed:
            listed, probes = [p for p in glob.glob(source, recursive=True) if os.path.isfile(p)], []
        files = sorted(Path(p) for p in listed)
        root = _root(listed + [p for p in probes if os.path.isfile(p)])
    if not files:
        raise ValueError(f"no text files found at {source!r}")
    return root, files


def is_validation(relpath: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # long [n_train]: byte ids of the training files, concatenated
    val: torch.Tensor  # long [n_val]
    source: str
    num_files: tuple[int, int]  # (train, validation): the files read into each split
    split: str = "file"  # "file": by a hash of each file's path; "bytes": each file's tail is validation text


@functools.lru_cache(maxsize=4)
def load_corpus(source: str | None = None, val_fraction: float = 0.05, max_bytes: int | None = 8_000_000,
                exclude: tuple[str, ...] = ("test", "idlelib", "site-packages")) -> Corpus:
    """Read a corpus, split it by file (by bytes within each file when it has too few files for that: module doc)
    and tokenise it. ``max_bytes`` caps each split (in file order).

    The excluded folders are never listed (the standard library's site-packages and tests are most of its tree:
    listing it whole took about a second, pruned a fiftieth), and a process reads a corpus once: later calls with
    the same arguments return the same :class:`Corpus`, whose tensors the caller must not modify."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    source = source or default_corpus()
    root, files = list_files(source, prune=exclude)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    sizes = {False: 0, True: 0}
    counts = {False: 0, True: 0}
    for path in files:
        rel = path.relative_to(root).as_posix()
        if any(part in exclude for part in Path(rel).parts):
            continue
        split = is_validation(rel, val_fraction)
        if max_bytes is not None and sizes[split] >= max_bytes:
            continue
        data = path.read_bytes()
        parts[split].append(data)
        sizes[split] += len(data)
        counts[split] += 1
    how = "file"
    if not parts[False] or not parts[True]:  # too few files for the hash to give each split one: split by bytes
        how, parts, counts = "bytes", *_split_bytes(root, files, exclude, val_fraction, max_bytes)
    if not parts[False] or not parts[True]:
        raise ValueError(f"corpus {source!r} is too small to split: {counts[False]} train and {counts[True]} "
                         f"validation files")

    def tokens(chunks: list[bytes]) -> torch.Tensor:
        blob = b"\n".join(chunks)
        if max_bytes is not None:
            blob = blob[:max_bytes]
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()

    return Corpus(tokens(parts[False]), tokens(parts[True]), source, (counts[False], counts[True]), how)


def _split_bytes(root: Path, files: list[Path], exclude: tuple[str, ...], val_fraction: float,
                 max_bytes: int | None) -> tuple[dict[bool, list[bytes]], dict[bool, int]]:
    """The split of a corpus of too few files for the split by file: each file's last ``val_fraction`` of bytes
    (at least one) to validation, the rest to training, in file order, ``max_bytes`` capping each split. (chunks,
    files read) per split, keyed as :func:`load_corpus`'s (True: validation)."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    for path in files:
        if any(part in exclude for part in Path(path.relative_to(root).as_posix()).parts):
            continue
        data = path.read_bytes()
        cut = len(data) - max(1, round(len(data) * val_fraction)) if len(data) > 1 else len(data)
        for split, chunk in ((False, data[:cut]), (True, data[cut:])):
            if chunk and (max_bytes is None or sum(map(len, parts[split])) < max_bytes):
                parts[split].append(chunk)
                counts[split] += 1
    return parts, counts


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
    """Random windows: inputs [B, T] and next-byte targets [B, T], drawn with ``generator`` (deterministic)."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"data of {data.numel()} tokens is too short for seq_len={seq_len}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts[:, None] + offsets]
    return windows[:, :-1], windows[:, 1:]
