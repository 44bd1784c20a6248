"""`bamboo.Job`: options by the command line's names, checked by the flags' declarations,
each bad one refused in one line before anything starts; the model's import path derived
from a function; `import bamboo` loading the API only on first use."""
from __future__ import annotations

import ast
import functools
import sys
import types
from pathlib import Path

import pytest

import bamboo
from bamboo.api.job import config_of, option_names
from bamboo.api.paths import import_path, reference
from bamboo.config import ConfigError, KillSpec, all_options, objects
from support.models import EXAMPLE

REPO = Path(__file__).resolve().parents[3]


def module_level_builder(vocab_size: int = 256):
    """A function of this module: importable as tests' module name:module_level_builder."""
    from examples.custom_model import build
    return build(vocab_size=vocab_size)


def test_options_are_the_command_lines_keys_and_flags() -> None:
    job = bamboo.Job(model="gpt2-tiny", nodes=4, stages=2, micro_batches=3, micro_batch_size=2,
                     steps=12, seed=3, kill=["0:1@5", "1:0@7+notice"], notice_s=1.0,
                     redundancy="lazy", checkpoint_every=0, lease=5.0)
    c = job.config
    assert (c.layout.nodes, c.layout.stages, c.layout.micro_batches) == (4, 2, 3)
    assert (c.layout.micro_batch_size, c.training.steps, c.training.seed) == (2, 12, 3)
    assert c.cluster.kills == [KillSpec(0, 1, 5), KillSpec(1, 0, 7, notice=True)]
    assert (c.redundancy.mode, c.checkpoints.every, c.runtime.lease_s) == ("lazy", 0, 5.0)
    assert job.options()["model"] == "gpt2-tiny"


def test_every_option_can_be_named_by_its_key_and_its_flag() -> None:
    names = option_names()
    for f in all_options():
        assert names[f.key] == f.key
        assert names[f.flag.removeprefix("--").replace("-", "_")] == f.key
    assert names["pipeline_schedule"] == "schedule"


def test_a_single_kill_a_tuple_and_a_path_are_taken_as_the_flag_would(tmp_path: Path) -> None:
    c = bamboo.Job(nodes=2, stages=2, steps=3, kill="0:1@1", out=tmp_path / "run").config
    assert c.cluster.kills == [KillSpec(0, 1, 1)]
    assert c.logging.out == str(tmp_path / "run")
    assert bamboo.Job(nodes=2, stages=2, steps=3, kills=("0:0@2",)).config.cluster.kills == \
        [KillSpec(0, 0, 2)]


def test_the_pipeline_schedule_by_its_own_name_or_as_schedule() -> None:
    assert bamboo.Job(pipeline_schedule="zb-h1").config.layout.schedule == "zb-h1"
    assert bamboo.Job(schedule="zb-h1").config.layout.schedule == "zb-h1"


def test_the_same_values_make_the_same_job_as_the_command_line() -> None:
    from bamboo.cli.train import job_config, train_parser
    argv = ["--nodes", "4", "--stages", "2", "--steps", "7", "--kill", "0:1@3", "--seed", "5"]
    args = train_parser().parse_args(argv)
    from_flags = job_config(args, argv, train_parser(given_only=True))
    from_python = bamboo.Job(nodes=4, stages=2, steps=7, kill=["0:1@3"], seed=5).config
    assert from_flags == from_python


@pytest.mark.parametrize("options, expected", [
    ({"nodez": 3}, "Job: unknown option 'nodez': did you mean 'nodes'?"),
    ({"nodes": 0}, "Job: --nodes must be a positive integer (got 0)"),
    ({"steps": "12"}, "Job: steps: expected an integer, got a string ('12')"),
    ({"lr": True}, "Job: lr: expected a number, got a boolean (True)"),
    ({"kill": ["0:1"]}, "Job: --kill '0:1' is malformed: write PIPELINE:STAGE@STEP"),
    ({"kill": ["3:0@1"], "nodes": 2, "stages": 2}, "Job: --kill 3:0@1 names no node"),
    ({"nodes": 1, "stages": 2}, "Job: --nodes 1 cannot hold one pipeline of 2 stages"),
    ({"redundancy": "sometimes"}, "Job: --redundancy 'sometimes' is not one of eager, lazy"),
    ({"model": "gpt5"}, "Job: --model: unknown model 'gpt5'"),
    ({"model": "no_such_module_here:build"}, "no module 'no_such_module_here'"),
    ({"model": 42}, "Job: model= takes a preset name ('gpt2-mini'), 'MODULE:FUNCTION', a "
                    "function that returns a model, or the model itself"),
    ({"dataset": 42}, "Job: dataset= takes a map-style Dataset, or a function or class that "
                      "returns one"),
    ({"loss": 3.5}, "Job: loss= takes a function (outputs, labels) -> scalar tensor"),
    ({"eval_dataset": object()}, "Job: eval_dataset= takes a map-style Dataset"),
])
def test_a_bad_job_is_one_line(options: dict, expected: str) -> None:
    with pytest.raises(bamboo.JobError) as e:
        bamboo.Job(**options)
    text = str(e.value)
    assert expected in text and "\n" not in text, text
    assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)


def test_a_function_of_an_importable_module_is_named_module_colon_name() -> None:
    assert import_path(module_level_builder, "model") == f"{__name__}:module_level_builder"
    assert import_path(functools.reduce, "f") == "_functools:reduce"
    job = bamboo.Job(model=module_level_builder, nodes=2, stages=2, steps=2)
    assert job.config.model.name == f"{__name__}:module_level_builder"
    from examples.custom_model import build
    assert bamboo.Job(model=build, nodes=2, stages=2).config.model.name == EXAMPLE


def test_a_function_of_the_running_script_is_named_by_the_scripts_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers import the script as a module by its file (what `--model FILE.py:NAME`
    takes); under `python -m package.script` by the module's own name."""
    script = tmp_path / "train_mine.py"
    script.write_text("def build(vocab_size=256):\n    pass\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(compile(script.read_text(), str(script), "exec"), main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert import_path(main.build, "model") == f"{script.resolve()}:build"
    main.__spec__ = types.SimpleNamespace(name="mypackage.train_mine")
    assert import_path(main.build, "model") == "mypackage.train_mine:build"


def test_a_notebooks_function_is_sent_by_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers cannot import it (import_path says so in one line); the Job sends it by
    value (tests/unit/api/test_by_value.py)."""
    main = types.ModuleType("__main__")  # a notebook's or a REPL's: no file
    exec("def build(vocab_size=256):\n    pass\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    with pytest.raises(ConfigError, match="defined in an interactive session or a notebook, "
                       "which the workers cannot import: put it in a .py file"):
        import_path(main.build, "model")
    assert reference(main.build, "model").startswith(objects.PREFIX)


def test_a_lambda_a_closure_and_a_shadowed_name_have_no_import_path() -> None:
    def inner(vocab_size: int = 256):
        return None

    shadowed = functools.wraps(module_level_builder)(lambda vocab_size=256: None)
    for model, expected in ((lambda vocab_size=256: None, "a lambda cannot be imported"),
                            (inner, "defined inside a function or class"),
                            (shadowed, "is not found as")):
        with pytest.raises(ConfigError, match=expected) as e:
            import_path(model, "model")
        assert "define it at module level" in str(e.value)
        assert reference(model, "model").startswith(objects.PREFIX)  # so: sent by value
    assert reference(module_level_builder, "model") == f"{__name__}:module_level_builder"
    with pytest.raises(ConfigError, match="has no importable name"):
        import_path(functools.partial(module_level_builder), "model")


def test_train_refuses_what_is_not_a_job() -> None:
    with pytest.raises(bamboo.JobError, match="bamboo.train takes a bamboo.Job"):
        bamboo.train({"nodes": 4}, out="/nonexistent")


def test_train_refuses_a_directory_that_holds_a_run(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text("{}")
    job = bamboo.Job(nodes=2, stages=2, steps=2)
    with pytest.raises(bamboo.JobError, match="already holds a run") as e:
        bamboo.train(job, out=tmp_path)
    assert str(e.value) == (f'bamboo.train: out={tmp_path} already holds a run (summary.json): '
                            f'give the Job resume="auto" to continue it (or to extend it with '
                            f'more steps=), or choose a new directory')  # the API's words
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_the_commands_checks_take_no_prefix() -> None:
    with pytest.raises(ConfigError) as e:
        config_of({"nodes": 0}, where=None)
    assert str(e.value) == "--nodes must be a positive integer (got 0)"


def test_import_bamboo_loads_the_api_only_on_first_use() -> None:
    """bamboo/__init__.py imports nothing of the package at its top level but the torch-free
    presets it hands the model sizer (so `import bamboo.config` stays torch-free;
    tests/integration/test_api_runs.py checks it in a fresh interpreter), and its names are
    the API's."""
    tree = ast.parse((REPO / "src" / "bamboo" / "__init__.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    imported = {a.name for n in top for a in n.names} | {n.module for n in top
                                                         if isinstance(n, ast.ImportFrom)}
    assert imported <= {"annotations", "__future__", "importlib", "logging", "Any",
                        "TYPE_CHECKING", "typing", "bamboo.config", "presets"}, imported
    from bamboo.api.job import Job
    from bamboo.control import RunFailed
    assert bamboo.Job is Job and bamboo.RunFailed is RunFailed
    assert {"Job", "train", "RunResult", "RunFailed"} <= set(dir(bamboo))
    with pytest.raises(AttributeError, match="has no attribute 'Jobs'"):
        bamboo.Jobs  # noqa: B018 (the attribute access is the test)
