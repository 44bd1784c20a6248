"""The docs against the tree: docs/architecture.md's table of every module."""
from __future__ import annotations

import re

from conftest import REPO

ROW = re.compile(r"^\| `([\w/]+\.py)` \| (\d+) \| (.+) \|$")


def _table() -> dict[str, int]:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Every module"):]
    rows = [ROW.match(line) for line in section.splitlines()]
    return {m.group(1): int(m.group(2)) for m in rows if m}


def test_the_module_table_matches_the_tree() -> None:
    table = _table()
    tree = {str(p.relative_to(REPO / "bamboo")): len(p.read_text().splitlines())
            for p in (REPO / "bamboo").rglob("*.py")}
    assert sorted(set(tree) - set(table)) == [], "modules missing from docs/architecture.md"
    assert sorted(set(table) - set(tree)) == [], "docs/architecture.md lists modules that are gone"
    off = {m: (table[m], tree[m]) for m in tree
           if abs(table[m] - tree[m]) > max(5, 0.1 * tree[m])}
    assert off == {}, f"(listed, actual) lines differ by more than 10%: {off}"
