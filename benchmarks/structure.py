"""The package's shape, for before → after comparisons of a restructuring (docs/architecture.md, "Layout").

    python benchmarks/structure.py [SRC]        # default: src/unbubble of this checkout

Prints modules and lines per package, import edges between packages (module-level and inside
functions), the imports that go upward in the layer order below, the longest functions and classes,
and the lines of docs/api.md. Reads the source with ``ast``; imports nothing from the package.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter, defaultdict
from pathlib import Path

#: The layer of each package or top-level module (docs/architecture.md, "Layers"): an import from a lower
#: layer to a higher one is "upward" (the lower layer then depends on what is built on it).
LAYERS = {
    "errors": 0, "lr": 0, "_figures": 0, "schedules": 1, "data": 1, "models": 1, "optim": 1, "safety": 2,
    "sim": 2, "analysis": 3, "runtime": 4, "pipeline": 4, "config": 5, "pipelining": 5, "testing": 5,
    "export": 5, "loggers": 6, "metrics": 7, "progress": 7, "switch": 8, "train": 8, "experiments": 9,
    "cli": 10, "__init__": 11, "__main__": 11,
}


def unit_of(path: Path, root: Path) -> str:
    """The package (first folder) or top-level module a file belongs to."""
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(imported unbubble unit, at module level?) for every import of the package in ``tree``."""
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "unbubble":
                names = [a.name for a in node.names]
            elif node.module.startswith("unbubble."):
                names = [node.module.split(".")[1]]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("unbubble.")]
        found += [(n, id(node) in top) for n in names]
    return found


def main(src: Path) -> None:
    files = sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts)
    lines, modules = Counter(), Counter()
    edges: dict[tuple[str, str], set[bool]] = defaultdict(set)
    longest: list[tuple[int, str]] = []
    for path in files:
        text = path.read_text()
        unit = unit_of(path, src)
        lines[unit] += text.count("\n")
        modules[unit] += 1
        tree = ast.parse(text)
        for target, top_level in imports(tree):
            if target != unit:
                edges[(unit, target)].add(top_level)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                longest.append((node.end_lineno - node.lineno + 1,
                                f"{kind} {path.relative_to(src)}:{node.lineno} {node.name}"))
    print(f"{'unit':<12} {'modules':>7} {'lines':>7}")
    for unit in sorted(lines, key=lambda u: (LAYERS.get(u, 99), u)):
        print(f"{unit:<12} {modules[unit]:>7} {lines[unit]:>7}")
    print(f"{'total':<12} {sum(modules.values()):>7} {sum(lines.values()):>7}")
    module_level = sum(1 for v in edges.values() if True in v)
    print(f"\nimport edges between units: {len(edges)} ({module_level} at module level)")
    upward = sorted(e for e in edges if LAYERS.get(e[0], 99) < LAYERS.get(e[1], 99))
    print(f"upward imports: {len(upward)}")
    for a, b in upward:
        where = "module level" if True in edges[(a, b)] else "inside functions"
        print(f"  {a} -> {b} ({where})")
    print("\nlongest functions and classes:")
    for n, name in sorted(longest, reverse=True)[:12]:
        print(f"  {n:>5}  {name}")
    api = src.parents[1] / "docs" / "api.md"
    if api.is_file():
        print(f"\ndocs/api.md: {api.read_text().count(chr(10))} lines")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src" / "unbubble")
