"""The code's shape: module lines, long functions and the package imports that run back.

    .venv/bin/python benchmarks/code_shape.py [ROOT]        # ROOT: a checkout (default .)
    git worktree add /tmp/old 6905bbe && .venv/bin/python benchmarks/code_shape.py /tmp/old

Three tables about `bamboo/` under ROOT:

- modules: the largest, and how many are over 500 lines (`wc -l` lines; the standard is
  500, tests/unit/test_code_shape.py fails past 600);
- functions over 60 lines (a function's extent in the source by `ast`, a nested function
  counted inside its parent as well), each with whether its docstring gives the reason;
- package arrows that run back: an import (at any level, also inside a function) from a
  package to one above it in the layers of ROOT/.importlinter, or between two packages of
  one layer (independent); the imports the contract's `ignore_imports` allows are listed
  apart.

**The convention for a long function.** A function may be over 60 lines only when its
docstring has a line that starts with "Long because" and says why it is not split:

    def replay(...) -> Timeline:
        \"\"\"The timeline of one step.

        Long because: one event loop whose branches share every clock; ...
        \"\"\"

tests/unit/test_code_shape.py holds the code to the caps with the functions here.
"""
from __future__ import annotations

import argparse
import ast
import configparser
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LongFunction", "REASON", "module_lines", "long_functions", "layers", "package_imports",
           "back_arrows", "main"]

REASON = "Long because"
"""How the docstring line that justifies a function over the limit starts."""


@dataclass(frozen=True)
class LongFunction:
    module: str
    name: str
    lines: int
    reason: str
    """The docstring's "Long because" line, or "" when it gives none."""


def _package_root(root: Path) -> Path:
    """The folder that holds the package `bamboo`: src/ in a src layout, else `root`."""
    return root / "src" if (root / "src" / "bamboo").is_dir() else root


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of bamboo/ under `root`."""
    out, base = {}, _package_root(root)
    for path in sorted((base / "bamboo").rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def module_lines(root: Path) -> dict[str, int]:
    """Path relative to `root` -> its lines, for every module of bamboo/."""
    return {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines())
            for p in _modules(root).values()}


def _reason(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    doc = ast.get_docstring(node) or ""
    return next((line.strip() for line in doc.splitlines()
                 if line.strip().startswith(REASON)), "")


def long_functions(root: Path, limit: int = 60) -> list[LongFunction]:
    """Every function of bamboo/ longer than `limit` lines, longest first."""
    out = []
    for path in _modules(root).values():
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out.append(LongFunction(rel, node.name, length, _reason(node)))
    return sorted(out, key=lambda f: (-f.lines, f.module, f.name))


def layers(root: Path) -> tuple[list[list[str]], set[tuple[str, str]]]:
    """The layers contract of ROOT/.importlinter, top first, each a list of packages; and the
    (importer, imported) module pairs its `ignore_imports` allows."""
    config = configparser.ConfigParser()
    config.read(root / ".importlinter")
    section = next(config[s] for s in config.sections() if config[s].get("type") == "layers")
    order = [[name.strip() for name in line.split("|")]
             for line in section["layers"].split("\n") if line.strip()]
    ignored = set()
    for line in section.get("ignore_imports", "").split("\n"):
        if "->" in line:
            a, b = (s.strip() for s in line.split("->"))
            ignored.add((a, b))
    return order, ignored


def _imports(module: str, path: Path, known: dict[str, Path]) -> dict[str, int]:
    """The bamboo modules `module` imports (at any level) -> the first line of each."""
    is_package = path.name == "__init__.py"
    base_parts = module.split(".") if is_package else module.split(".")[:-1]
    found: dict[str, int] = {}

    def resolve(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = base_parts[:len(base_parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        for name in names:
            target = resolve(name) if name.startswith("bamboo") else ""
            if target and target != module:
                found.setdefault(target, node.lineno)
    return found


def package_imports(root: Path) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> "module -> module (l.N)" for every import
    between two packages of bamboo (a package: bamboo's child, e.g. `plan`)."""
    known = _modules(root)
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in known.items():
        here = module.split(".")[1] if module.count(".") else ""
        for target, line in _imports(module, path, known).items():
            there = target.split(".")[1] if target.count(".") else ""
            if here and there and here != there:
                out[(here, there)].append(f"{module} -> {target} (l.{line})")
    return dict(out)


def back_arrows(root: Path) -> tuple[dict[tuple[str, str], list[str]],
                                     dict[tuple[str, str], list[str]]]:
    """The package imports that run back (up the layers, or across one layer), and apart
    those the contract's `ignore_imports` allows; each (importer, imported) -> its imports."""
    order, ignored = layers(root)
    rank = {name: i for i, layer in enumerate(order) for name in layer}
    back: dict[tuple[str, str], list[str]] = {}
    allowed: dict[tuple[str, str], list[str]] = {}
    for (a, b), sites in sorted(package_imports(root).items()):
        if a not in rank or b not in rank or rank[b] > rank[a]:
            continue  # down the layers (or a package the contract does not place)
        for site in sites:
            pair = tuple(s.strip() for s in site.rsplit(" (", 1)[0].split("->"))
            (allowed if pair in ignored else back).setdefault((a, b), []).append(site)
    return back, allowed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", default=".", help="a checkout of the project")
    p.add_argument("--limit", type=int, default=60, help="report functions longer than this")
    p.add_argument("--top", type=int, default=8, help="largest modules to list")
    args = p.parse_args()
    root = Path(args.root)
    modules = module_lines(root)
    sizes = sorted(modules.values())
    print(f"modules: {len(modules)}, {sum(sizes)} lines, median {sizes[len(sizes) // 2]}, "
          f"largest {sizes[-1]}; over 400 lines: {sum(s > 400 for s in sizes)}, "
          f"over 500: {sum(s > 500 for s in sizes)}")
    for rel, n in sorted(modules.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {n:5d}  {rel}")
    long = long_functions(root, args.limit)
    print(f"\nfunctions over {args.limit} lines: {len(long)}, "
          f"{sum(not f.reason for f in long)} without a reason in the docstring")
    for f in long:
        print(f"  {f.lines:5d}  {f.module}:{f.name}  {f.reason or 'NO REASON'}")
    if not (root / ".importlinter").is_file():
        print("\nno .importlinter here: no layers to measure arrows against")
        return
    back, allowed = back_arrows(root)
    print(f"\npackage arrows that run back: {len(back)} "
          f"({sum(len(s) for s in back.values())} imports)")
    for (a, b), sites in back.items():
        print(f"  {a} -> {b}: " + "; ".join(sites))
    print(f"allowed by the contract's ignore_imports: {len(allowed)}")
    for (a, b), sites in allowed.items():
        print(f"  {a} -> {b}: " + "; ".join(sites))


if __name__ == "__main__":
    main()
