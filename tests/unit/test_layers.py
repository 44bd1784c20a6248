"""The dependency contract between bamboo's packages (`.importlinter` at the repository root):
the layers from `cli` down to `util`, and torch kept out of `plan`, `traces` and `config`.

Runs import-linter in this process (its Python API, as `lint-imports` does), so it is part of
the fast tier; a broken contract fails naming every import that breaks it, e.g.

    bamboo.config is not allowed to import bamboo.model:
    - bamboo.config.job -> bamboo.model.presets (l.25)
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

from importlinter import configuration
from importlinter.application import use_cases

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / ".importlinter"


def _report():
    configuration.configure()
    use_cases._register_built_in_contract_types()
    options = use_cases.read_user_options(str(CONFIG))
    return use_cases.create_report(options, cache_dir=None)


def test_the_contract_names_every_package_once() -> None:
    """Every package of bamboo sits in exactly one layer, so a new package must be placed."""
    text = CONFIG.read_text(encoding="utf-8")
    layers = text.split("layers =", 1)[1].split("\n\n", 1)[0].split("ignore_imports", 1)[0]
    named = [name.strip() for line in layers.splitlines() for name in line.split("|")
             if name.strip() and not name.strip().startswith("#")]
    packages = sorted(p.name for p in (REPO / "src" / "bamboo").iterdir()
                      if (p / "__init__.py").is_file())
    assert sorted(named) == packages


def test_every_contract_is_kept() -> None:
    report = _report()
    broken = []
    for contract, check in report.get_contracts_and_checks():
        if not check.kept:
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                contract.render_broken_contract(check)
            broken.append(f"{contract.name}:\n{text.getvalue().strip()}")
    assert [c.name for c, _ in report.get_contracts_and_checks()], "no contract was checked"
    assert not broken, "\n\n".join(broken)


def _import_cycles(graph) -> list[list[str]]:
    """Groups of modules that import each other in a circle (Tarjan's strongly connected
    components of the import graph, with more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_modules_import_each_other_in_a_circle() -> None:
    """Every import counts, also one inside a function or under TYPE_CHECKING: a module that
    needs the type of one above it declares the Protocol it uses instead."""
    import grimp
    graph = grimp.build_graph("bamboo")
    assert len(graph.modules) > 100
    assert _import_cycles(graph) == []
