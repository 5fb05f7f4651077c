"""Byte-level data (deterministic split by file) and the small MoE transformer."""

import pytest
import torch

from lrmoe.config import model_preset
from lrmoe.integrations.data import decode, encode, get_batch, is_validation, load_corpus
from lrmoe.integrations.model import MoETransformer
from lrmoe.runtime.reference import ReferenceMoE


def test_tokenizer_round_trips_utf8():
    text = "def f(x):\n    return x  # café"
    assert decode(encode(text)) == text and encode("A").tolist() == [65]


def test_split_is_by_file_and_stable(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text(f"file {i}\n" * 20)
    a, b = load_corpus(str(tmp_path), val_fraction=0.25), load_corpus(str(tmp_path / "*.txt"), val_fraction=0.25)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    val_files = [f"f{i}.txt" for i in range(40) if is_validation(f"f{i}.txt", 0.25)]
    assert a.num_files == (40 - len(val_files), len(val_files))
    assert f"file {val_files[0][1:-4]}\n" in decode(a.val) and f"file {val_files[0][1:-4]}\n" not in decode(a.train)


def test_a_corpus_of_one_or_a_few_files_is_split_by_bytes_and_one_of_many_files_as_before(tmp_path):
    """A single file, or a few files none of which hashes to validation, has a validation split: each file's last
    val_fraction of bytes (train.py trains on a one-file --data); a corpus the split by file serves keeps it."""
    from lrmoe.experiments import train

    one = tmp_path / "one.txt"
    one.write_text("".join(f"line {i}\n" for i in range(400)))
    corpus = load_corpus(str(one))
    text = one.read_bytes()
    assert corpus.split == "bytes" and corpus.num_files == (1, 1)
    assert decode(corpus.train) + decode(corpus.val) == text.decode()  # train, then its tail
    assert corpus.val.numel() == round(0.05 * len(text))
    args = train.parse_args(["--data", str(one), "--ranks", "2", "--seq-len", "32", "--out", "", "--ckpt-every", "0"])
    train.check_args(args)  # no "too small to split"

    few = tmp_path / "few"
    few.mkdir()
    names = [n for n in (f"f{i}.txt" for i in range(20)) if not is_validation(n, 0.05)][:3]
    for name in names:
        (few / name).write_text(f"{name}\n" * 50)
    corpus = load_corpus(str(few))
    assert corpus.split == "bytes" and corpus.num_files == (3, 3)
    assert all(f"{name}\n" in decode(corpus.val) for name in names)

    many = tmp_path / "many"
    many.mkdir()
    for i in range(40):
        (many / f"f{i}.txt").write_text(f"file {i}\n" * 20)
    corpus = load_corpus(str(many), val_fraction=0.25)
    val = sorted(f"f{i}.txt" for i in range(40) if is_validation(f"f{i}.txt", 0.25))
    assert corpus.split == "file" and corpus.num_files == (40 - len(val), len(val))
    assert decode(corpus.val) == "\n".join((many / n).read_text() for n in val)


def test_a_process_reads_a_corpus_once(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}.txt").write_text(f"file {i}\n" * 20)
    first = load_corpus(str(tmp_path), val_fraction=0.5)
    for path in tmp_path.iterdir():
        path.unlink()
    assert load_corpus(str(tmp_path), val_fraction=0.5) is first  # not listed or read again
    with pytest.raises(ValueError, match="no text files"):
        load_corpus(str(tmp_path), val_fraction=0.25)  # other arguments: read, and the folder is empty now


def test_default_corpus_is_the_standard_library():
    corpus = load_corpus(max_bytes=200_000)
    assert corpus.train.numel() == 200_000 and corpus.val.numel() > 0
    assert "def " in decode(corpus.train[:20_000])


def test_bad_data_input_raises(tmp_path):
    with pytest.raises(ValueError, match="no text files"):
        load_corpus(str(tmp_path / "*.nothing"))
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(str(tmp_path), val_fraction=1.5)
    with pytest.raises(ValueError, match="too short"):
        get_batch(torch.arange(10), 2, 16, torch.Generator())


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-debug", "glm-4.5-air-debug"])
def test_a_few_steps_lower_the_loss_and_are_deterministic(name):
    cfg = model_preset(name)

    def run():
        model = MoETransformer(cfg, lambda i: ReferenceMoE.from_config(cfg, seed=10 + i), seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = torch.arange(4000) % 97  # a periodic sequence is learnable in a few steps
        gen = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(8):
            x, y = get_batch(data, 4, 32, gen)
            _, infos, loss, total = model(x, y, aux_coef=1e-2)
            opt.zero_grad()
            total.backward()
            opt.step()
            losses.append(loss.item())
        return losses, infos

    losses, infos = run()
    assert losses[-1] < losses[0] - 0.5
    assert len(infos) == cfg.num_moe_layers and infos[0].counts_E.sum() == 4 * 32 * cfg.top_k
    assert run()[0] == losses


def test_a_pruned_listing_equals_the_whole_listing_less_the_pruned_folders(tmp_path):
    """list_files(prune=...) walks a ``base/**/pattern`` glob without entering the pruned folders, and yields what
    the whole listing yields once the caller drops their files; where every file lies inside a pruned folder (the
    root is then that folder, so its name is not an excluded part), it lists the source whole."""
    from lrmoe.integrations.data import list_files

    for rel in ("a.py", "pkg/b.py", "pkg/test/c.py", "site-packages/x/d.py", "pkg/e.txt", "deep/er/f.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    source, prune = str(tmp_path / "**" / "*.py"), ("test", "site-packages")
    root, whole = list_files(source)
    root_p, pruned = list_files(source, prune=prune)
    keep = [p for p in whole if not any(part in prune for part in p.relative_to(root).parts)]
    assert root_p == root and pruned == keep == sorted(tmp_path / r for r in ("a.py", "deep/er/f.py", "pkg/b.py"))
    only = tmp_path / "only" / "test"
    only.mkdir(parents=True)
    (only / "g.py").write_text("y = 2\n")
    assert list_files(str(tmp_path / "only" / "**" / "*.py"), prune=prune) == (only, [only / "g.py"])
    # every kept file in one folder, the pruned ones beside it: the root stays the whole listing's (above both), so
    # the files' relative paths, which decide the split, are the same; likewise a single kept file
    for kept in (("sub/x.py", "sub/y.py"), ("sub/x.py",)):
        case = tmp_path / f"case{len(kept)}"
        for rel in (*kept, "test/t.py", "site-packages/deep/u.py"):
            (case / rel).parent.mkdir(parents=True, exist_ok=True)
            (case / rel).write_text("z = 3\n")
        assert list_files(str(case / "**" / "*.py"), prune=prune) == (case, sorted(case / r for r in kept))
    # the default corpus, the standard library: the same files as its whole listing (about a second) less the excluded
    from lrmoe.integrations.data import default_corpus

    exclude = ("test", "idlelib", "site-packages")
    root, whole = list_files(default_corpus())
    assert list_files(default_corpus(), prune=exclude) == (
        root, [p for p in whole if not any(part in exclude for part in p.relative_to(root).parts)])
