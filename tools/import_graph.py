"""The import graph of hf_cascade's modules: cycles and floors.

A module's floor is 0 when it imports no other module of the package, else one more than the highest floor
it imports. Every import counts, module-level and inside functions (a lazy import is still a dependency).
A cycle has no floor; it is reported instead.

    python tools/import_graph.py            # table of floors, cycles; exit 1 if there is a cycle
    python tools/import_graph.py --json     # the same as JSON
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "hf_cascade"


def modules() -> dict[str, Path]:
    """Module name -> file, for hf_cascade/ and patches/ (installed as hf_cascade.patches)."""
    found = {}
    for base, prefix in ((ROOT / PACKAGE, PACKAGE), (ROOT / "patches", f"{PACKAGE}.patches")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _resolve(name: str, level: int, current: str, is_package: bool) -> str:
    if not level:
        return name
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (``from . import x`` resolves to the module x where it is one)."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, is_package)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:      # a.b.c where only a.b is a module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor; modules in a cycle (and those above them) share the cycle's floor."""
    memo: dict[str, int] = {}
    visiting: set = set()

    def floor(v):
        if v in memo:
            return memo[v]
        if v in visiting:
            return 0
        visiting.add(v)
        memo[v] = 1 + max((floor(w) for w in edges[v]), default=-1)
        visiting.discard(v)
        return memo[v]

    return {v: floor(v) for v in edges}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    edges = graph()
    found, levels = cycles(edges), floors(edges)
    report = {"modules": len(edges), "floors": 1 + max(levels.values()), "cycles": found,
              "floor_of": dict(sorted(levels.items(), key=lambda kv: (kv[1], kv[0])))}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for level in range(report["floors"]):
            names = [n.removeprefix(PACKAGE + ".") or PACKAGE for n, f in report["floor_of"].items() if f == level]
            print(f"floor {level:2d}: {', '.join(names)}")
        print(f"{report['modules']} modules on {report['floors']} floors; "
              f"{len(found)} cycle(s){': ' if found else ''}{'; '.join(' <-> '.join(c) for c in found)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
