"""paper_figures/results/MANIFEST.md names what produced every committed result, and is current."""

from pathlib import Path

from lrmoe.paper_figures.manifest import NAME, manifest

RESULTS = Path(__file__).resolve().parent.parent / "paper_figures" / "results"


def test_the_committed_manifest_is_current_and_names_a_producer_for_every_file():
    text = manifest(RESULTS)
    assert (RESULTS / NAME).read_text(encoding="utf-8") == text, \
        "paper_figures/results/MANIFEST.md is stale: run `python -m lrmoe.paper_figures.manifest`"
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    listed = {line.split("`")[1] for line in rows}
    assert listed == {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != NAME
                      and not p.name.startswith(".")}
    assert not [line for line in rows if "without a results file" in line]
