"""Every run starts through one function, `bamboo.api.start.launch`: the command line and the
Python API build the job's config and call it, and none of them runs a check of the job or a
run-directory step of its own. Read from the source (its calls and imports), so a second copy
of the sequence fails here; nothing imports the command layer but its entry points."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src" / "bamboo"

LAUNCH = "api/start.py"
STEPS = {"resolve_stages", "check_fits", "check_step_length", "check_trace", "check_job_data",
         "_prepare", "_load_resume", "_resolve_auto_resume"}
"""The sequence before a run: called from `launch`'s module alone (outside their own)."""
CALLERS = ("cli/train.py", "api/run.py")
"""Who starts a run: each calls `launch` (bamboo.Trainer through `api/run.py`'s `prepared`)."""


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        yield path.relative_to(SRC).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _called(tree: ast.AST) -> list[str]:
    """The names called in `tree` (`f(...)` and `x.f(...)` both as `f`)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.append(f.id if isinstance(f, ast.Name) else f.attr if
                       isinstance(f, ast.Attribute) else "")
    return out


def _defined(tree: ast.Module) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def test_the_run_directories_objects_are_registered_in_one_place() -> None:
    calls = [where for where, tree in _modules() for name in _called(tree)
             if name == "add_run_dirs"]
    assert calls == ["config/job.py"], calls


def test_the_checks_before_a_run_are_called_from_launch_alone() -> None:
    outside = sorted({(where, name) for where, tree in _modules()
                      for name in set(_called(tree)) & STEPS
                      if where != LAUNCH and name not in _defined(tree)})
    assert outside == [], outside


def test_the_command_line_and_the_api_both_call_launch() -> None:
    trees = dict(_modules())
    for where in CALLERS:
        assert "launch" in _called(trees[where]), where
    assert "prepared" in _called(trees["api/trainer.py"])


def test_nothing_imports_the_command_layer_but_its_entry_point() -> None:
    importers = []
    for where, tree in _modules():
        if where.startswith("cli/"):
            continue
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "bamboo.cli" or n.startswith("bamboo.cli.") for n in names):
                importers.append(where)
    assert importers == ["__main__.py"], importers


def test_the_package_root_wires_no_layer_into_another() -> None:
    """The root imports nothing of bamboo when it runs (its public names load on first use):
    no hook is installed into the configuration."""
    root = ast.parse((SRC / "__init__.py").read_text(encoding="utf-8"))
    run_time = [n for n in root.body if not (isinstance(n, ast.If) and
                                             ast.unparse(n.test) == "TYPE_CHECKING")]
    imported = [node.module for stmt in run_time for node in ast.walk(stmt)
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bamboo")]
    assert imported == [], imported


def test_the_configuration_sizes_your_model_only_with_the_sizer_it_is_given() -> None:
    from bamboo.config import ConfigError, JobConfig
    from bamboo.data.sizing import SIZING
    job = JobConfig.of(model="tests.support.your_model:tabular_model", nodes=2, stages=2,
                       dataset="tests.support.your_model:Tabular(n=48)")
    with pytest.raises(ConfigError, match="no sizer was given here"):
        job.validate()
    assert job.validate(SIZING).model_preset(SIZING).family == "custom"
