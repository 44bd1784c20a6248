"""Job files (`bamboo train --config`): the schema, one-line errors, override precedence."""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from bamboo.config import SECTIONS, ConfigError, JobConfig, KillSpec, all_options
from bamboo.config.jobfile import example_config, field_paths, load_job_config


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _nested(dotted: str, value: object) -> dict:
    *sections, key = dotted.split(".")
    doc: dict = {key: value}
    for section in reversed(sections):
        doc = {section: doc}
    return doc


def _error(path: Path, overrides: dict | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_job_config(path, overrides or {})
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_example_loads_validates_and_documents_every_field(tmp_path: Path) -> None:
    text = example_config()
    cfg = load_job_config(_write(tmp_path, text), {})
    assert cfg == JobConfig()
    for name, dotted in field_paths().items():
        assert f"{dotted.rsplit('.', 1)[-1]}:" in text, name
    assert "# Worker processes to start" in text  # a field docstring from config.py
    assert "layout:" in text and "training:" in text


def test_every_field_is_a_declared_option_with_a_home() -> None:
    paths = field_paths()
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(JobConfig)]
    declared = {(f.section, f.name) for f in all_options()}
    for section, cls in SECTIONS.items():  # a field without option() would have no flag
        assert {(section, f.name) for f in dataclasses.fields(cls)} <= declared, section
    assert len(paths) == len(all_options())  # flat keys are unique
    assert paths["nodes"] == "layout.nodes" and paths["model"] == "model.name"
    assert paths["checkpoint_every"] == "checkpoints.every"
    assert all(p.count(".") == 1 for p in paths.values())


def test_nested_file_and_hyphenated_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, """
model: gpt2-mini
redundancy: lazy
layout: {nodes: 8, stages: 4, micro-batches: 2, micro_batch_size: 4}
training:
  steps: 7
  seed: 3
  lr: 1e-3            # YAML 1.1 reads this as a string; it is accepted as a number
runtime: {device: cpu}
cluster: {kills: ["1:2@3", "0:0@5"]}
checkpoints: {every: 3, keep_checkpoints: 4}
""")
    cfg = load_job_config(path, {})
    assert (cfg.model.name, cfg.redundancy.mode, cfg.layout.nodes, cfg.layout.stages, cfg.data_parallel) == (
        "gpt2-mini", "lazy", 8, 4, 2)
    assert (cfg.layout.micro_batches, cfg.layout.micro_batch_size, cfg.training.steps,
            cfg.training.seed, cfg.training.lr) == (2, 4, 7, 3, 1e-3)
    assert cfg.cluster.kills == [KillSpec(1, 2, 3), KillSpec(0, 0, 5)]
    assert (cfg.checkpoints.every, cfg.checkpoints.keep) == (3, 4)


def test_toml_file(tmp_path: Path) -> None:
    path = _write(tmp_path, 'model = "bert-tiny"\n[layout]\nnodes = 2\nstages = 2\n'
                            '[training]\nsteps = 3\n', "job.toml")
    cfg = load_job_config(path, {})
    assert (cfg.model.name, cfg.layout.nodes, cfg.layout.stages, cfg.training.steps) == ("bert-tiny", 2, 2, 3)
    bad = _write(tmp_path, "model = \n", "bad.toml")
    assert "bad.toml: TOML syntax error" in _error(bad)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "layout: {nodes: 8, stages: 4}\ntraining: {steps: 9, seed: 2}\n"
                            "cluster: {kills: ['0:1@2']}\n")
    cfg = load_job_config(path, {"steps": 3, "kills": [KillSpec(1, 0, 1)]})
    assert (cfg.layout.nodes, cfg.layout.stages, cfg.training.steps, cfg.training.seed) == (8, 4, 3, 2)
    assert cfg.cluster.kills == [KillSpec(1, 0, 1)]
    # a flag may also repair a file value that would not validate
    bad = _write(tmp_path, "layout: {stages: 9}\n", "bad.yaml")
    assert load_job_config(bad, {"stages": 2, "nodes": 2}).layout.stages == 2
    assert "layout.stages" in _error(bad, {"steps": 3})


def _wrong_value(tp: object) -> object:
    """A value of the wrong type for a field of type `tp`."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list:
        return "0:1@2"  # a string, not a list
    if str in args or tp is str:
        return 12
    return "twelve" if tp is not bool else 3


@pytest.mark.parametrize("key", [f.key for f in all_options()])
def test_every_field_with_a_wrong_value_names_it(tmp_path: Path, key: str) -> None:
    [option] = [f for f in all_options() if f.key == key]
    dotted = field_paths()[key]
    path = _write(tmp_path, yaml.safe_dump(_nested(dotted, _wrong_value(option.type))))
    message = _error(path)
    assert f"job.yaml: {dotted}: expected " in message, message


@pytest.mark.parametrize("dotted,value,expected", [
    ("model", "gpt5", "unknown model 'gpt5'; choose one of: bert-mini"),
    ("model", "gpt5", "(in {path}: model)"),
    ("model.name", "gpt5", "(in {path}: model.name)"),
    ("redundancy", "sometimes", "redundancy: 'sometimes' is not one of eager, lazy, off, reroute, auto"),
    ("redundancy.mode", "sometimes", "redundancy.mode: 'sometimes' is not one of eager"),
    ("runtime.device", "tpu", "runtime.device: 'tpu' is not one of auto, cpu, cuda"),
    ("layout.nodes", 0, "--nodes must be a positive integer (got 0) (in {path}: layout.nodes)"),
    ("layout.stages", 9, "--stages 9 is more than the 8 layers"),
    ("training.lr", -1, "--lr must be positive"),
    ("runtime.comm_timeout_s", 0, "(in {path}: runtime.comm_timeout_s)"),
    ("cluster.kills", ["0:1@x"], "cluster.kills[0]: --kill '0:1@x' is malformed"),
    ("cluster.kills", ["0:7@1"], "names no node"),
    ("cluster.kills", [3], "cluster.kills[0]: expected a \"D:S@K\" string, got an integer (3)"),
    ("checkpoints.every", -1, "--checkpoint-every must be an integer >= 0 (got -1) (in {path}: "
                              "checkpoints.every)"),
    ("redundancy.recovery", "checkpoint-restart", "(in {path}: redundancy.recovery)"),
    ("data", "/no/such/file.txt", "text file (in {path}: data)"),
    ("layout.nodes", True, "layout.nodes: expected an integer, got a boolean (True)"),
])
def test_bad_values_are_one_line_naming_the_field(tmp_path: Path, dotted: str, value: object,
                                                  expected: str) -> None:
    path = _write(tmp_path, yaml.safe_dump(_nested(dotted, value)))
    assert expected.format(path=path) in _error(path)


@pytest.mark.parametrize("text,expected", [
    ("nodes: 4\n", "unknown key 'nodes': it belongs at 'layout.nodes'"),
    ("layout: {nodez: 4}\n", "unknown key 'layout.nodez': did you mean 'nodes'? allowed: "),
    ("trainer: {steps: 4}\n", "unknown key 'trainer': did you mean 'training'?"),
    ("layout: 4\n", "'layout' must be a section (a mapping), got an integer (4)"),
    ("- 1\n- 2\n", "the top level must be a mapping"),
])
def test_unknown_keys_and_shapes(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _error(_write(tmp_path, text))


def test_empty_file_and_empty_section_are_the_defaults(tmp_path: Path) -> None:
    assert load_job_config(_write(tmp_path, ""), {}) == JobConfig()
    assert load_job_config(_write(tmp_path, "layout:\n"), {}) == JobConfig()


def test_missing_file_and_syntax_error(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.yaml")
    assert "--config file" in message and "nope.yaml' does not exist" in message
    assert "is a directory" in _error(tmp_path)
    path = _write(tmp_path, "model: gpt2-tiny\nlayout:\n  nodes: 4\n stages: 2\n")
    message = _error(path)
    assert message.startswith(f"{path}, line 4, column 2: YAML syntax error"), message


@pytest.mark.parametrize("text, line, key, first", [
    ("steps: 5\nnodes: 2\nsteps: 7\n", 3, "steps", 1),
    ("layout:\n  nodes: 2\n  stages: 2\n  nodes: 4\n", 4, "nodes", 2),
    ("layout: {nodes: 2, nodes: 4}\n", 1, "nodes", 1),
])
def test_a_key_given_twice_is_an_error(tmp_path: Path, text: str, line: int, key: str,
                                       first: int) -> None:
    """YAML's own loader keeps the last of two equal keys without a word."""
    path = _write(tmp_path, text)
    assert _error(path) == (f"{path}, line {line}: key '{key}' is given twice (first on line "
                            f"{first}): keep one of them")


def test_override_of_unknown_field_is_an_error(tmp_path: Path) -> None:
    assert "override 'nodez' is not an option" in _error(_write(tmp_path, ""), {"nodez": 1})
    assert "--steps: expected an integer" in _error(_write(tmp_path, ""), {"steps": "3"})


def test_an_error_about_two_options_names_both_places(tmp_path: Path) -> None:
    path = _write(tmp_path, "redundancy: {recovery: checkpoint-restart}\n"
                            "checkpoints: {every: 2}\n")
    message = _error(path)
    assert message.endswith(f"(in {path}: redundancy.recovery, checkpoints.every)"), message
    assert "(in " not in _error(path, {"recovery": "checkpoint-restart", "checkpoint_every": 2})


# -- every field of a job file with a wrong value, through `bamboo train --config` --------

MISSING = "/no/such/path"
FIELD_CASES: dict[str, list[tuple[object, str]]] = {
    "model": [("gpt5", "unknown model 'gpt5'; choose one of: bert-mini"),
              ("hf:/no/such/dir", "does not exist")],
    "nodes": [(0, "--nodes must be a positive integer (got 0)"), (2.5, "expected an integer")],
    "stages": [(9, "--stages 9 is more than the 8 layers"), ("all", "expected an integer or 'auto'")],
    "pipelines": [(0, "--pipelines must be a positive integer"), (2, "needs 8 nodes")],
    "micro_batches": [(0, "--micro-batches must be a positive integer")],
    "micro_batch_size": [(-1, "--micro-batch-size must be a positive integer")],
    "global_batch_size": [(0, "--global-batch-size must be a positive integer"),
                          (60, "not a multiple of 1 pipelines x 8 samples")],
    "memory_per_node": [("lots", "'lots' is not a size"), (64, "expected a string")],
    "host_memory_per_node": [("lots", "'lots' is not a size"), (64, "expected a string")],
    "steps": [(0, "--steps must be a positive integer"), ("ten", "expected an integer")],
    "seed": [(-1, "--seed must be >= 0")],
    "redundancy": [("sometimes", "'sometimes' is not one of eager, lazy, off, reroute, auto")],
    "frc_offload": [("sometimes", "expected true or false"), (1, "expected true or false")],
    "comm": [("loose", "'loose' is not one of strict, tagged")],
    "boot_s": [(-1, "--boot-s must be a number >= 0"), ("soon", "expected a number")],
    "pin_cpus": [("always", "'always' is not one of off, auto")],
    "frc_at": [("idle", "'idle' is not one of waits, slot")],
    "schedule": [("zb", "'zb' is not one of 1f1b, zb-h1")],
    "check_replicas": [("yes", "expected true or false")],
    "precision": [("fp8", "'fp8' is not one of fp32, bf16, fp16")],
    "exact": [("yes", "expected true or false")],
    "activation_checkpointing": [(2, "expected true or false")],
    "data": [(MISSING, "does not exist"), (12, "expected a string, got an integer (12)")],
    "layer_costs": [(MISSING, "does not exist")],
    "eval_every": [(-2, "--eval-every must be an integer >= 0"), ("often", "expected an integer")],
    "eval_batches": [(0, "--eval-batches must be an integer from 1 to 4096")],
    "tensorboard": [("{job}", "exists and is not a directory")],
    "wandb": [("my project", "is not a project name")],
    "lr": [(0, "--lr must be positive"), (float("nan"), "--lr must be positive")],
    "warmup_steps": [(-1, "--warmup-steps must be an integer >= 0")],
    "weight_decay": [(-0.5, "--weight-decay must be a number >= 0")],
    "grad_clip": [(float("inf"), "--grad-clip must be a number >= 0")],
    "optimizer": [("SGD", "--optimizer 'SGD' is not MODULE:NAME")],
    "lr_schedule": [("torch.optim:f(x=y)", "x= is not a literal")],
    "dataset": [("mydata", "--dataset 'mydata' is not MODULE:NAME")],
    "eval_dataset": [("mydata:held_out", "--eval-dataset goes with --dataset")],
    "collate": [("mydata:collate", "--collate goes with --dataset")],
    "loss": [("torch.nn:Loss(x)", "give every argument as key=value")],
    "metrics": [(["acc"], "'acc' is not NAME=MODULE:FUNCTION"),
                (["a=m:f", "a=m:g"], "names the metric 'a' twice")],
    "threads": [(0, "--threads must be a positive integer")],
    "comm_timeout_s": [(0, "--comm-timeout must be positive seconds")],
    "bucket_mb": [(-1, "--bucket-mb must be megabytes between 0")],
    "lease_s": [(11, "--lease must be in (0, 10]"), (0.25, "heartbeat interval (0.5 s)")],
    "device": [("tpu", "'tpu' is not one of auto, cpu, cuda")],
    "kills": [(["0:7@1"], "names no node"), (["0:1"], "is malformed"), ("0:1@2", "expected a list")],
    "trace": [(MISSING, "does not exist")],
    "time_scale": [(0, "--time-scale must be a positive number"), (float("nan"), "positive")],
    "max_nodes": [(2, "--max-nodes must be an integer >= --nodes 4 (got 2)")],
    "notice_s": [(0, "--notice-s must be in (0, 600]")],
    "checkpoint_every": [(-1, "--checkpoint-every must be an integer >= 0")],
    "recovery": [("sometimes", "'sometimes' is not one of redundancy, checkpoint-restart"),
                 ("checkpoint-restart", "needs --redundancy off")],
    "resume": [(MISSING, "does not exist"), ("{job}", "is not a directory")],
    "keep_checkpoints": [(0, "--keep-checkpoints must be an integer >= 1 (got 0)")],
    "checkpoint_dir": [("relative/ckpt", "--checkpoint-dir relative/ckpt must be an absolute "
                                         "path or a URL")],
    "ray": [("ray://head:10001", "is a Ray Client address"), (6379, "expected a string")],
    "ray_resources": [("GPU=one", "'GPU=one' is not NAME=AMOUNT"),
                      ("CPU=1", "--ray-resources applies to a run on Ray")],
    "ray_working_dir": [(MISSING, "is not a directory")],
    "ray_wait_s": [(0, "--ray-wait-s must be > 0 seconds"), ("soon", "expected a number")],
    "out": [("{job}", "exists and is not a directory"), ("{job}/run", "is a file, not a directory")],
}
"""Option key -> wrong values in a job file; every option of `field_paths()` has one."""


def _field_cases() -> list:
    return [pytest.param(name, value, expected, id=f"{name}-{i}")
            for name, cases in FIELD_CASES.items() for i, (value, expected) in enumerate(cases)]


@pytest.mark.parametrize("name,value,expected", _field_cases())
def test_every_field_with_a_wrong_value_is_one_line_naming_file_and_key(
        name: str, value: object, expected: str, tmp_path: Path,
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from bamboo import cli
    from bamboo.node import forkserver

    def started() -> None:
        raise AssertionError(f"a wrong {name} passed validation")
    monkeypatch.setattr(forkserver, "start", started)  # a wrong value must never start a run
    path = tmp_path / "job.yaml"
    if isinstance(value, str):
        value = value.format(job=path)
    dotted = field_paths()[name]
    path.write_text(yaml.safe_dump(_nested(dotted, value)))
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    argv = ["train", "--config", str(path)] + ([] if name == "out" else ["--out", str(out)])
    before = sorted((p, p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*"))
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("bamboo train: error: "), line
    assert str(path) in line and dotted in line, f"file or key '{dotted}' not named: {line}"
    assert expected in line, line
    assert sorted((p, p.read_bytes() if p.is_file() else None)
                  for p in tmp_path.rglob("*")) == before


def test_every_field_has_a_wrong_value_case() -> None:
    """A JobConfig field added without a wrong-value case in FIELD_CASES fails here."""
    assert set(field_paths()) - set(FIELD_CASES) == set(), "fields with no wrong-value case"
    assert set(FIELD_CASES) - set(field_paths()) == set(), "FIELD_CASES names unknown fields"
