"""The code's shape: lines per module and functions over 60 lines in `bamboo/`.

    .venv/bin/python benchmarks/code_shape.py [ROOT]        # ROOT: a checkout (default .)
    git worktree add /tmp/old 6905bbe && .venv/bin/python benchmarks/code_shape.py /tmp/old

Lines are `wc -l` lines; a function's length is its extent in the source (`ast`), nested
functions counted inside their parent as well.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", default=".", help="a checkout of the project")
    p.add_argument("--limit", type=int, default=60, help="report functions longer than this")
    args = p.parse_args()
    root, limit = Path(args.root), args.limit
    modules: dict[str, int] = {}
    long: list[tuple[int, str, str]] = []
    for path in sorted((root / "bamboo").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = str(path.relative_to(root))
        modules[rel] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    long.append((length, rel, node.name))
    sizes = sorted(modules.values())
    print(f"{len(modules)} modules, {sum(sizes)} lines, median {sizes[len(sizes) // 2]}, "
          f"largest {sizes[-1]}; over 400 lines: {sum(s > 400 for s in sizes)}, "
          f"over 500: {sum(s > 500 for s in sizes)}")
    for rel, n in sorted(modules.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {n:5d}  {rel}")
    print(f"{len(long)} functions over {limit} lines")
    for length, rel, name in sorted(long, reverse=True):
        print(f"  {length:5d}  {rel}:{name}")


if __name__ == "__main__":
    main()
