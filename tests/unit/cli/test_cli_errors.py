"""Bad input: one clear line on stderr, exit code != 0, nothing written to the run directory.
Its tests that start processes: tests/integration/test_cli_errors_runs.py."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from support.cli import FLAG_CASES, RunStarted, assert_one_line_error

BOOL_FLAGS = ("--frc-offload", "--exact", "--activation-checkpointing", "--no-report", "--check-replicas", "--json", "--quiet", "--debug")
"""Flags that take no value: giving one is the wrong value."""

TYPED_FLAGS = {"--nodes": "int", "--pipelines": "int", "--micro-batches": "int",
               "--global-batch-size": "int",
               "--micro-batch-size": "int", "--steps": "int", "--seed": "int", "--lr": "float",
               "--warmup-steps": "int", "--weight-decay": "float", "--grad-clip": "float",
               "--threads": "int", "--comm-timeout": "float", "--bucket-mb": "float", "--lease": "float",
               "--time-scale": "float", "--boot-s": "float", "--max-nodes": "int", "--notice-s": "float",
               "--checkpoint-every": "int", "--keep-checkpoints": "int", "--eval-every": "int",
               "--eval-batches": "int", "--ray-wait-s": "float"}
"""Flags argparse converts: a word instead of a number is its own one-line error."""


@pytest.mark.parametrize("flag", BOOL_FLAGS)
def test_a_value_given_to_a_switch_is_one_line(flag: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main(["train", f"{flag}=yes", "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    line = assert_one_line_error(capsys.readouterr().err, flag)
    assert "ignored explicit argument 'yes'" in line and "--help" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", TYPED_FLAGS)
def test_a_word_for_a_number_is_one_line(flag: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main(["train", flag, "many", "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    line = assert_one_line_error(capsys.readouterr().err, flag)
    assert f"invalid {TYPED_FLAGS[flag]} value: 'many'" in line
    assert not (tmp_path / "run").exists()


def test_every_flag_has_a_wrong_value_case() -> None:
    """A flag added to `bamboo train` without a wrong-value case above fails here."""
    import argparse

    from bamboo.cli.train import train_parser
    takes_value, switches, typed = set(), set(), {}
    for action in train_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = max(action.option_strings, key=len)
        (switches if action.nargs == 0 else takes_value).add(flag)
        if action.type in (int, float):
            typed[flag] = action.type.__name__
    assert takes_value - set(FLAG_CASES) == set(), "flags with no wrong-value case in FLAG_CASES"
    assert set(FLAG_CASES) - takes_value == set(), "FLAG_CASES names flags that do not exist"
    assert switches == set(BOOL_FLAGS), "switches missing from (or stale in) BOOL_FLAGS"
    assert typed == TYPED_FLAGS, "TYPED_FLAGS differs from the parser's int/float flags"


# -- faults a user meets: a lease, a place to write, a resumed run, an empty error -----------


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    paths = {name: tmp_path / name for name in (
        "missing", "dir", "small", "empty", "bad_yaml", "bad_trace", "remove_trace", "finished")}
    paths["bad_toml"] = tmp_path / "bad.toml"
    paths["bad_toml"].write_text("model = \n")
    paths["job"] = tmp_path / "job.yaml"
    paths["job"].write_text("layout: {nodez: 4}\n")
    paths["dir"].mkdir()
    paths["small"].write_text("hi\n")
    paths["empty"].write_text("")
    paths["bad_yaml"].write_text("model: gpt2-tiny\nlayout:\n nodes: 4\n  stages: 2\n")
    paths["bad_trace"].write_text("0,add,n1\n5,bogus,n2\n")
    paths["remove_trace"].write_text("0,remove,n1\n")
    paths["finished"].mkdir()
    (paths["finished"] / "summary.json").write_text('{"steps_completed": 3}')
    return paths


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _flag_cases() -> list:
    return [pytest.param(flag, case, id=f"{flag}-{i}")
            for flag, cases in FLAG_CASES.items() for i, case in enumerate(cases)]


@pytest.mark.parametrize("flag,case", _flag_cases())
def test_every_flag_with_a_wrong_value_gives_one_line(flag: str, case: tuple, tmp_path: Path,
                                                      files: dict[str, Path], no_start: None,
                                                      capsys: pytest.CaptureFixture) -> None:
    """Each refusal as `bamboo train` makes it (in this process: `main`'s exit code and
    stderr; tests/integration/test_cli_errors_runs.py runs the command itself)."""
    from bamboo.cli import main
    argv, expected, *names = case
    fill = {k: str(v) for k, v in files.items()}
    argv = [a.format(**fill) for a in argv]
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    if "--out" not in argv:
        argv += ["--out", str(out)]
    before = _snapshot(tmp_path)
    try:  # `python -m bamboo` exits with what main returns, or with argparse's SystemExit
        code = main(["train", *argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, err
    line = assert_one_line_error(err, names[0].format(**fill) if names else flag)
    assert expected.format(**fill) in line, line
    assert out == ""
    assert _snapshot(tmp_path) == before, "a wrong value changed files on disk"


def test_the_lease_must_outlast_a_heartbeat() -> None:
    from bamboo.config import HEARTBEAT_S, ConfigError, JobConfig
    from bamboo.node.worker import HEARTBEAT_S as WORKER_HEARTBEAT_S
    assert HEARTBEAT_S == WORKER_HEARTBEAT_S
    JobConfig.of(lease_s=HEARTBEAT_S + 0.01).validate()
    with pytest.raises(ConfigError, match="not longer than a worker's heartbeat interval"):
        JobConfig.of(lease_s=HEARTBEAT_S).validate()


def _checkpointed_run(root: Path, steps: int) -> Path:
    """A run directory holding a checkpoint at step 4 of a default job of `steps` steps, as
    the launcher writes it."""
    import torch

    from bamboo.config import JobConfig
    from bamboo.run.checkpoint import checkpoint_root, publish, step_dir, write_layers
    cfg = JobConfig.of(steps=steps)
    meta = {"unit": "layer", "model": cfg.model.name, "seed": cfg.training.seed, "steps": steps,
            "global_micro_batches": cfg.global_micro_batches,
            "micro_batch_size": cfg.layout.micro_batch_size, "losses": [5.0, 4.5, 4.0, 3.5]}
    write_layers(step_dir(checkpoint_root(root), 4),
                 {i: {"state": torch.zeros(3)} for i in range(8)})
    publish(checkpoint_root(root), 4, range(8), meta)
    return root


@pytest.mark.parametrize("steps,note", [
    (12, "bamboo train: note: resuming a run planned for 6 steps with --steps 12: the "
         "learning-rate schedule is stretched to 12 steps (pass --steps 6 to keep it)"),
    (5, "bamboo train: note: resuming a run planned for 6 steps with --steps 5: the "
        "learning-rate schedule is shortened to 5 steps (pass --steps 6 to keep it)"),
    (6, None)])
def test_resume_with_other_steps_says_the_schedule_changes(steps: int, note: str | None,
                                                           tmp_path: Path, no_start: None,
                                                           capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    run = _checkpointed_run(tmp_path / "run", steps=6)
    with pytest.raises(RunStarted):
        main(["train", "--resume", str(run), "--steps", str(steps), "--quiet"])
    assert capsys.readouterr().err.splitlines() == ([note] if note else [])


@pytest.mark.parametrize("error,line", [
    (MemoryError(), "bamboo: out of memory (MemoryError): reduce --micro-batch-size or the "
                    "model size, or spread it over more --stages (rerun with --debug for the "
                    "traceback)"),
    (KeyError(), "bamboo: internal error: KeyError (it carries no message) (rerun with --debug "
                 "for the traceback)"),
    (RuntimeError("first line\nsecond line"), "bamboo: internal error: RuntimeError: first "
                                              "line (rerun with --debug for the traceback)"),
    (OSError(errno.ENOSPC, "No space left on device", "runs/x/model.pt"),
     "bamboo: no space left on device (OSError: runs/x/model.pt): free some space or write "
     "elsewhere (rerun with --debug for the traceback)")])
def test_an_unexpected_error_is_one_line_that_names_it(error: Exception, line: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    from bamboo import cli
    from bamboo.cli import train

    def fail(argv: list[str]) -> int:
        raise error
    monkeypatch.setattr(train, "main", fail)
    assert cli.main(["train"]) == 1
    assert capsys.readouterr().err == line + "\n"
    with pytest.raises(type(error)):  # --debug shows the traceback instead
        cli.main(["train", "--debug"])


@pytest.mark.parametrize("flag,value,biggest", [
    ("--micro-batches", "100000000", "the step's schedule"),
    ("--micro-batch-size", "100000000", "activations in flight"),
])
def test_a_job_that_cannot_fit_is_refused_before_any_worker_starts(
        flag: str, value: str, biggest: str, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bamboo import cli
    from bamboo.model import fits
    from bamboo.node import forkserver

    def started() -> None:
        raise AssertionError("a job that cannot fit started a worker")
    monkeypatch.setattr(forkserver, "start", started)
    # a 24 GiB machine whatever runs the test: on one of 128 GiB the schedule of 10^8
    # micro-batches fits, and the job rightly starts
    monkeypatch.setattr(fits, "machine_memory_bytes", lambda: 24 * 2**30)
    code = cli.main(["train", "--nodes", "2", "--stages", "2", flag, value,
                     "--out", str(tmp_path / "run")])
    line = assert_one_line_error(capsys.readouterr().err, flag)
    assert code == 2 and f"({biggest}: " in line and "this machine has" in line, line
    assert f"(now {value})" in line and not (tmp_path / "run").exists()


def test_the_memory_bound_grows_with_what_it_counts() -> None:
    from bamboo.config import JobConfig
    from bamboo.model.fits import check_fits, node_memory_lower_bound
    base = dict(nodes=4, stages=4, steps=2)
    one = node_memory_lower_bound(JobConfig.of(**base).validate())
    wide = node_memory_lower_bound(JobConfig.of(**base, micro_batch_size=16).validate())
    off = node_memory_lower_bound(JobConfig.of(**base, redundancy="off").validate())
    assert wide.activation_bytes == 2 * one.activation_bytes > 0
    assert off.state_bytes < one.state_bytes  # no replica
    check_fits(JobConfig.of(**base).validate(), 4)  # the demo-sized job fits here


@pytest.mark.parametrize("extra", [[], ["--comm-timeout", "30"]])
def test_a_step_longer_than_the_run_waits_is_refused_before_any_worker_starts(
        extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--micro-batches 1000000` once sat at "0/2 ready" for minutes, then stopped with
    advice about --comm-timeout; it is refused at once, in one line."""
    from bamboo import cli
    from bamboo.node import forkserver

    def started() -> None:
        raise AssertionError("a job whose step cannot end in time started a worker")
    monkeypatch.setattr(forkserver, "start", started)
    code = cli.main(["train", "--nodes", "2", "--stages", "2", "--micro-batches", "1000000",
                     *extra, "--out", str(tmp_path / "run")])
    line = assert_one_line_error(capsys.readouterr().err, "--micro-batches")
    limit = 90 if not extra else 60
    assert code == 2 and "one step would take at least" in line, line
    assert f"longer than the {limit} s the run waits for a step" in line, line
    assert not (tmp_path / "run").exists()


def test_the_step_bound_is_below_what_a_step_really_takes() -> None:
    """The bound must never refuse a job that could run: it stays under a step measured
    here (the demo-sized job takes tens of milliseconds a step on one core)."""
    from bamboo.config import JobConfig
    from bamboo.model.fits import check_step_length, step_seconds_lower_bound
    cfg = JobConfig.of(nodes=2, stages=2, micro_batches=4, steps=2).validate()
    assert 0 < step_seconds_lower_bound(cfg, "cpu") < 0.005
    assert step_seconds_lower_bound(cfg, "cuda") < step_seconds_lower_bound(cfg, "cpu")
    check_step_length(JobConfig.of(nodes=2, stages=2, micro_batches=20000, steps=2).validate())
