"""The import graph of the ``lrmoe`` package, grouped by package, checked against the import contracts.

Prints the modules of each package (``lrmoe.<name>``, or a top-level module), the import edges between packages
(how many module-to-module imports each one stands for), and every edge that runs against the contracts of the
configuration's ``[tool.importlinter]``: a ``layers`` contract (a package importing one in a higher layer, or a
sibling of an independent ``a | b`` layer) and an ``independence`` contract (two of its modules importing each
other). Read with grimp, the graph library import-linter itself uses, so it sees what ``make lint`` sees.

    make import-graph                                       # the installed tree, as `make lint` reads it
                                                            # (run as a script: a Python session started in the
                                                            # checkout would read the checkout's lrmoe/ instead)
    python lrmoe/harness/import_graph.py --root /tmp/old    # another checkout's lrmoe/ (e.g. a git worktree),
                                                            # against this checkout's contracts (--config)
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

import grimp

ROOT = "lrmoe"


def package_of(module: str, packages: set[str]) -> str:
    """``lrmoe.<name>`` when that is a package, else the module itself (a top-level module of lrmoe)."""
    parts = module.split(".")
    if len(parts) == 1:
        return module
    top = ".".join(parts[:2])
    return top if top in packages or len(parts) > 2 else module


def read_contracts(config: Path) -> list[dict]:
    data = tomllib.loads(config.read_text())
    return data.get("tool", {}).get("importlinter", {}).get("contracts", [])


def layer_index(layers: list[str]) -> dict[str, tuple[int, bool]]:
    """{package: (layer, independent siblings)}: layer 0 is the top."""
    out = {}
    for i, layer in enumerate(layers):
        names = [n.strip() for n in layer.replace(":", "|").split("|")]
        for name in names:
            out[name] = (i, "|" in layer)
    return out


def find_layer(module: str, index: dict[str, tuple[int, bool]]) -> tuple[str, int, bool] | None:
    """(the layer entry holding ``module``, its index, whether its siblings are independent), or None."""
    best = None
    for name, (i, indep) in index.items():
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[0])):
            best = (name, i, indep)
    return best


def graph_report(root: str | None, config: Path) -> tuple[str, int]:
    """(the report, the number of edges against the contracts)."""
    if root is not None:
        sys.path.insert(0, str(Path(root).resolve()))
    graph = grimp.build_graph(ROOT, include_external_packages=False, cache_dir=None)
    modules = sorted(m for m in graph.modules if m.startswith(ROOT + ".") or m == ROOT)
    squashable = {m for m in modules if any(o.startswith(m + ".") for o in modules)}
    by_pkg = defaultdict(list)
    for m in modules:
        if m != ROOT:
            by_pkg[package_of(m, squashable)].append(m)
    edges = Counter()
    module_edges = []
    for importer in modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            if not imported.startswith(ROOT + "."):
                continue
            module_edges.append((importer, imported))
            a, b = package_of(importer, squashable), package_of(imported, squashable)
            if a != b and importer != ROOT:
                edges[(a, b)] += 1
    contracts = read_contracts(config)
    against, allowed = [], []
    layered = set()
    for c in contracts:
        if c.get("type") == "layers":
            index = layer_index(c["layers"])
            for importer, imported in module_edges:
                la, lb = find_layer(importer, index), find_layer(imported, index)
                if la is None or lb is None or la[0] == lb[0]:
                    continue
                if la[1] > lb[1] or (la[1] == lb[1] and la[2]):
                    against.append(f"{importer} -> {imported} ({c['name']}: {la[0]} may not import {lb[0]})")
            layered |= {m for m in modules if find_layer(m, index) is not None}
        elif c.get("type") == "independence":
            pats = c["modules"]
            ignored = {tuple(s.strip() for s in rule.split("->")) for rule in c.get("ignore_imports", [])}

            def member(m: str) -> str | None:
                for p in pats:
                    for cand in (m, *(".".join(m.split(".")[:k]) for k in range(1, m.count(".") + 1))):
                        if fnmatch.fnmatchcase(cand, p):
                            return cand
                return None

            for importer, imported in module_edges:
                a, b = member(importer), member(imported)
                if a and b and a != b:
                    (allowed if (importer, imported) in ignored else against).append(
                        f"{importer} -> {imported} ({c['name']})")
    lines = [f"{ROOT} import graph (grimp {grimp.__version__}, from {root or 'the installed package'}; "
             f"contracts of {config}):",
             f"{len(modules)} modules in {len(by_pkg)} packages and top-level modules; {len(module_edges)} import "
             f"edges between {ROOT} modules, {len(edges)} between packages", "", "## packages", ""]
    for pkg in sorted(by_pkg):
        short = [m[len(pkg) + 1:] or "(itself)" for m in by_pkg[pkg]]
        lines.append(f"{pkg} ({len(short)}): {', '.join(short)}")
    lines += ["", "## edges between packages (importer -> imported: module imports)", ""]
    for (a, b), n in sorted(edges.items()):
        lines.append(f"{a} -> {b}: {n}")
    unlayered = [m for m in modules if m != ROOT and m not in layered]
    lines += ["", "## against the contracts", ""]
    lines += against or ["none"]
    if allowed:
        lines += ["", "## allowed by name in the contracts (ignore_imports)", "", *allowed]
    if unlayered:
        lines += ["", f"## modules in no layer ({len(unlayered)})", "", ", ".join(unlayered)]
    return "\n".join(lines), len(against)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None,
                        help="a checkout whose lrmoe/ to read (default: the installed package, as `make lint`)")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "pyproject.toml"),
                        help="the import-linter configuration whose contracts the edges are checked against")
    args = parser.parse_args(argv)
    report, bad = graph_report(args.root, Path(args.config))
    print(report)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
