"""The caps on the code's shape, measured by benchmarks/code_shape.py: no module of bamboo/
past 600 lines (the standard is 500), and no function over 60 lines without its reason (a
docstring line that starts "Long because", the convention the benchmark's docstring states)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULE_CAP = 600
FUNCTION_CAP = 60


def _shape():
    path = REPO / "benchmarks" / "code_shape.py"
    spec = importlib.util.spec_from_file_location("code_shape", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("code_shape", module)
    spec.loader.exec_module(module)
    return module


def test_no_module_is_past_the_cap() -> None:
    lines = _shape().module_lines(REPO)
    assert len(lines) > 100, "bamboo/ was not found"
    assert {m: n for m, n in lines.items() if n > MODULE_CAP} == {}


def test_every_long_function_says_why() -> None:
    long = _shape().long_functions(REPO, FUNCTION_CAP)
    unexplained = {f"{f.module}:{f.name}" for f in long if not f.reason}
    assert sorted(unexplained) == [], (
        f"functions over {FUNCTION_CAP} lines: split them, or give the docstring a line "
        f"'Long because ...'")


def test_the_measure_counts_what_it_should(tmp_path: Path) -> None:
    """The benchmark's own rules, on a tiny package: a function's extent, the reason line,
    and an import inside a function that runs up the layers."""
    shape = _shape()
    (tmp_path / "bamboo" / "low").mkdir(parents=True)
    (tmp_path / "bamboo" / "high").mkdir()
    for package in ("", "low", "high"):
        (tmp_path / "bamboo" / package / "__init__.py").write_text('"""x"""\n')
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "bamboo" / "low" / "a.py").write_text(
        f'def long():\n{body}\n\n\ndef why():\n    """Long because it is a test."""\n{body}\n\n\n'
        f"def up():\n    from bamboo.high import b\n")
    (tmp_path / "bamboo" / "high" / "b.py").write_text("from bamboo.low import a\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter:contract:layers]\ntype = layers\nlayers =\n    high\n    low\n")
    found = {f.name: f for f in shape.long_functions(tmp_path, FUNCTION_CAP)}
    assert found["long"].lines == 62 and found["long"].reason == ""
    assert found["why"].lines == 63 and "up" not in found
    assert found["why"].reason == "Long because it is a test."
    back, allowed = shape.back_arrows(tmp_path)
    assert back == {("low", "high"): ["bamboo.low.a -> bamboo.high.b (l.131)"]}
    assert allowed == {}


CONSTRUCTOR_CAP = 8
WIDE_BY_DESIGN = {"api/job_options.py:JobOptions"}
"""`bamboo.Job`'s typed signature: one keyword a job option, generated from their declaration."""


def test_no_constructor_takes_more_than_eight_arguments() -> None:
    """A class whose `__init__` takes more than 8 arguments (self aside) groups them into small
    typed objects instead (`RunOptions`, `StageOptimizer`, the commit round's holdings)."""
    import ast
    wide = []
    for path in sorted((REPO / "src" / "bamboo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    a = f.args
                    count = (len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
                             + (a.vararg is not None) + (a.kwarg is not None))
                    name = f"{path.relative_to(REPO / 'src' / 'bamboo')}:{node.name}"
                    if count > CONSTRUCTOR_CAP and name not in WIDE_BY_DESIGN:
                        wide.append(f"{name} ({count})")
    assert wide == []
