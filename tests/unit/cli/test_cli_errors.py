"""Bad input: one clear line on stderr, exit code != 0, nothing written to the run directory."""
from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from support.procs import REPO, mounted_tmpfs

CASES = {
    "too many stages": (["--stages", "9"], "--stages 9 is more than the 8 layers"),
    "nodes not a layout": (["--nodes", "3", "--stages", "2", "--pipelines", "2"], "needs 4 nodes"),
    "missing data file": (["--data", "/no/such/file.txt"], "does not exist"),
    "zero steps": (["--steps", "0"], "--steps must be a positive integer"),
    "unknown model": (["--model", "gpt5"], "unknown model 'gpt5'"),
    "not an integer": (["--steps", "ten"], "invalid int value"),
    "bad redundancy": (["--redundancy", "sometimes"], "--redundancy 'sometimes'"),
    "malformed kill": (["--kill", "2@x"], "--kill '2@x' is malformed"),
    "kill names no node": (["--kill", "0:7@1"], "names no node"),
    "kill past last step": (["--steps", "3", "--kill", "0:1@3"], "past the run's last step"),
    "unknown flag": (["--stagez", "2"], "unrecognized arguments"),
    "notice without --notice-s": (["--kill", "0:1@2+notice"], "needs --notice-s S"),
    "too few nodes": (["--nodes", "2", "--stages", "4"], "cannot hold one pipeline"),
}


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bamboo", "train", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


@pytest.mark.procs
@pytest.mark.parametrize("name", CASES)
def test_bad_input_gives_one_line_and_touches_nothing(name: str, tmp_path: Path) -> None:
    args, expected = CASES[name]
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = run([*args, "--out", str(out)])
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


@pytest.mark.procs
def test_a_finished_run_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "done"
    out.mkdir()
    (out / "summary.json").write_text('{"steps_completed": 3}')
    proc = run(["--steps", "1", "--out", str(out)])
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr
    assert (out / "summary.json").read_text() == '{"steps_completed": 3}'
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


@pytest.mark.procs
def test_unknown_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "bamboo", "trian"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("bamboo: error: unknown command 'trian'; choose one of: "
                                   "train, simulate, report, config, profile, coordinator, agent, "
                                   "lab, data, export, soak")


@pytest.mark.procs
def test_config_file_errors_name_the_field_and_flags_override_the_file(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("layout:\n  nodes: 0\n")
    proc = run(["--config", str(job), "--out", str(tmp_path / "a")])
    assert proc.returncode == 2 and "layout.nodes" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    job.write_text("training:\n  steps: 3\n")
    proc = run(["--config", str(job), "--steps", "0", "--out", str(tmp_path / "b")])
    assert proc.returncode == 2 and "--steps must be a positive integer (got 0)" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.procs
def test_the_example_job_file_is_valid(tmp_path: Path) -> None:
    example = subprocess.run([sys.executable, "-m", "bamboo", "config", "--example"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
    assert example.returncode == 0
    job = tmp_path / "job.yaml"
    job.write_text(example.stdout)
    from bamboo.config.jobfile import load_job_config
    cfg = load_job_config(job, {})
    assert (cfg.model.name, cfg.layout.nodes, cfg.layout.stages) == ("gpt2-tiny", 4, 4)


# -- every flag of `bamboo train` with a wrong value ---------------------------------------
#
# Each case: (argv, text the one line must hold). "{name}" is a path from `files` below.
# The line must also name the flag, unless the case says `names=` what it names instead.

FLAG_CASES: dict[str, list[tuple]] = {
    "--config": [(["--config", "{missing}"], "--config file '{missing}' does not exist"),
                 (["--config", "{dir}"], "is a directory"),
                 (["--config", "{bad_yaml}"], "line 4, column 9: YAML syntax error",
                  "{bad_yaml}"),
                 (["--config", "{bad_toml}"], "TOML syntax error", "{bad_toml}"),
                 (["--config", "{job}"], "unknown key 'layout.nodez': did you mean 'nodes'?",
                  "{job}")],
    "--model": [(["--model", "gpt5"], "unknown model 'gpt5'"),
                (["--model", "hf:/no/such/model"], "does not exist")],
    "--nodes": [(["--nodes", "0"], "--nodes must be a positive integer (got 0)")],
    "--stages": [(["--stages", "9"], "is more than the 8 layers")],
    "--pipelines": [(["--pipelines", "0"], "must be a positive integer"),
                    (["--pipelines", "2"], "needs 8 nodes but --nodes is 4")],
    "--micro-batches": [(["--micro-batches", "0"], "must be a positive integer")],
    "--micro-batch-size": [(["--micro-batch-size", "-1"], "must be a positive integer")],
    "--steps": [(["--steps", "0"], "must be a positive integer")],
    "--seed": [(["--seed", "-1"], "must be >= 0")],
    "--redundancy": [(["--redundancy", "foo"], "'foo' is not one of eager, lazy, off, reroute, auto"),
                     (["--redundancy", "reroute", "--nodes", "2", "--stages", "2"],
                      "--redundancy reroute needs at least 2 pipelines (got 1)")],
    "--data": [(["--data", "{missing}"], "does not exist"),
               (["--data", "{dir}"], "is a directory"),
               (["--data", "{small}"], "has 3 bytes; gpt2-tiny needs at least 65"),
               (["--data", "{small}", "--model", "cnn-tiny", "--stages", "2"],
                "is for token models")],
    "--layer-costs": [(["--layer-costs", "{missing}"], "does not exist"),
                      (["--layer-costs", "{small}"], "cannot read layer-costs file")],
    "--eval-every": [(["--eval-every", "-1"], "--eval-every must be an integer >= 0")],
    "--eval-batches": [(["--eval-batches", "5000"], "must be an integer from 1 to 4096")],
    "--tensorboard": [(["--tensorboard", "{small}"], "exists and is not a directory")],
    "--wandb": [(["--wandb", "team/project"], "is not a project name")],
    "--lr": [(["--lr", "0"], "must be positive"), (["--lr", "inf"], "must be positive"),
             (["--lr", "nan"], "must be positive")],
    "--warmup-steps": [(["--warmup-steps", "-1"], "must be an integer >= 0")],
    "--weight-decay": [(["--weight-decay", "-0.1"], ">= 0"), (["--weight-decay", "nan"], ">= 0")],
    "--grad-clip": [(["--grad-clip", "-1"], "0 disables"), (["--grad-clip", "nan"], "0 disables")],
    "--threads": [(["--threads", "0"], "must be a positive integer")],
    "--comm-timeout": [(["--comm-timeout", "-1"], "must be positive seconds"),
                       (["--comm-timeout", "inf"], "at most 86400")],
    "--lease": [(["--lease", "0"], "must be in (0, 10]"), (["--lease", "11"], "(got 11.0)"),
                (["--lease", "nan"], "must be in (0, 10]"),
                (["--lease", "0.5"], "--lease 0.5 s is not longer than a worker's heartbeat "
                 "interval (0.5 s): live nodes would be fenced between two heartbeats; use "
                 "--lease 2 or more"),
                (["--lease", "0.1"], "is not longer than a worker's heartbeat interval")],
    "--device": [(["--device", "tpu"], "'tpu' is not one of auto, cpu, cuda")],
    "--boot-s": [(["--boot-s", "-5"], "--boot-s must be a number >= 0 (got -5.0)")],
    "--pin-cpus": [(["--pin-cpus", "always"], "--pin-cpus 'always' is not one of off, auto")],
    "--frc-at": [(["--frc-at", "idle"], "--frc-at 'idle' is not one of waits, slot")],
    "--schedule": [(["--schedule", "zb"], "--schedule 'zb' is not one of 1f1b, zb-h1"),
                   (["--schedule", "zb-h1", "--activation-checkpointing"],
                    "--activation-checkpointing works with --schedule 1f1b only")],
    "--kill": [(["--kill", "0:1"], "is malformed: write PIPELINE:STAGE@STEP"),
               (["--kill", "0:7@1"], "names no node: pipelines are 0..0 and stages 0..3"),
               (["--kill", "1:0@1"], "names no node"),
               (["--kill", "0:1@50"], "past the run's last step 49"),
               (["--kill", "0:1@2+notice"], "needs --notice-s S")],
    "--crash": [(["--crash", "x"], "--crash 'x' is malformed: write PIPELINE:STAGE@STEP"),
                (["--crash", "0:1@2+notice"], "is malformed"),
                (["--crash", "0:9@1"], "names no node: pipelines are 0..0 and stages 0..3"),
                (["--crash", "0:1@50"], "past the run's last step 49")],
    "--trace": [(["--trace", "{missing}"], "does not exist"),
                (["--trace", "{dir}"], "is a directory"),
                (["--trace", "{bad_trace}"], "{bad_trace}:2: event 'bogus' is neither"),
                (["--trace", "{empty}"], "trace is empty"),
                (["--trace", "{remove_trace}"], "is removed at 0 ms but is not live")],
    "--time-scale": [(["--time-scale", "0"], "must be a positive number"),
                     (["--time-scale", "nan"], "must be a positive number"),
                     (["--time-scale", "inf"], "must be a positive number"),
                     (["--time-scale", "5"], "--time-scale 5 has no trace to scale: add --trace")],
    "--max-nodes": [(["--max-nodes", "2"], "must be an integer >= --nodes 4 (got 2)")],
    "--notice-s": [(["--notice-s", "0"], "must be in (0, 600]"),
                   (["--notice-s", "nan"], "must be in (0, 600]"),
                   (["--notice-s", "601"], "must be in (0, 600]")],
    "--checkpoint-every": [(["--checkpoint-every", "-1"], "must be an integer >= 0")],
    "--recovery": [(["--recovery", "sometimes"], "is not one of redundancy, checkpoint-restart"),
                   (["--recovery", "checkpoint-restart"], "needs --redundancy off")],
    "--resume": [(["--resume", "{missing}"], "does not exist"),
                 (["--resume", "{small}"], "is not a directory"),
                 (["--resume", "{dir}"], "no checkpoint in")],
    "--comm": [(["--comm", "loose"], "--comm 'loose' is not one of strict, tagged"),
               (["--comm", "tagged", "--device", "cuda"], "--comm tagged needs gloo")],
    "--precision": [(["--precision", "fp16"], "'fp16' is not one of fp32, bf16"),
                    (["--precision", "bf16", "--exact"], "--exact needs --precision fp32")],
    "--keep-checkpoints": [(["--keep-checkpoints", "0"], "must be an integer >= 1 (got 0)")],
    "--http": [(["--http", "nonsense"], "--http 'nonsense' is not ADDRESS:PORT"),
               (["--http", "127.0.0.1:99999"], "is not ADDRESS:PORT")],
    "--checkpoint-dir": [(["--checkpoint-dir", "relative/ckpt"],
                          "--checkpoint-dir relative/ckpt must be an absolute path or a URL")],
    "--out": [(["--out", "{small}"], "exists and is not a directory"),
              (["--out", "{small}/run"], "is a file, not a directory"),
              (["--out", "{finished}"], "already holds a run (summary.json)"),
              (["--out", "/proc/bamboo-run"], "--out /proc/bamboo-run: cannot write "
               "/proc/bamboo-run (No such file or directory): choose a directory you can write")],
}
"""Flag -> wrong values; every value-taking flag of `bamboo train` has at least one."""

BOOL_FLAGS = ("--frc-offload", "--exact", "--activation-checkpointing", "--no-report", "--check-replicas", "--json", "--quiet", "--debug")
"""Flags that take no value: giving one is the wrong value."""

TYPED_FLAGS = {"--nodes": "int", "--stages": "int", "--pipelines": "int", "--micro-batches": "int",
               "--micro-batch-size": "int", "--steps": "int", "--seed": "int", "--lr": "float",
               "--warmup-steps": "int", "--weight-decay": "float", "--grad-clip": "float",
               "--threads": "int", "--comm-timeout": "float", "--lease": "float",
               "--time-scale": "float", "--boot-s": "float", "--max-nodes": "int", "--notice-s": "float",
               "--checkpoint-every": "int", "--keep-checkpoints": "int", "--eval-every": "int",
               "--eval-batches": "int"}
"""Flags argparse converts: a word instead of a number is its own one-line error."""


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


def _assert_one_line_error(stderr: str, flag: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("bamboo train: error: "), stderr
    assert flag in lines[0], f"{flag} is not named: {lines[0]}"
    return lines[0]


@pytest.mark.procs
@pytest.mark.parametrize("flag,case", _flag_cases())
def test_every_flag_with_a_wrong_value_gives_one_line(flag: str, case: tuple, tmp_path: Path,
                                                      files: dict[str, Path]) -> None:
    argv, expected, *names = case
    fill = {k: str(v) for k, v in files.items()}
    argv = [a.format(**fill) for a in argv]
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    if "--out" not in argv:
        argv += ["--out", str(out)]
    before = _snapshot(tmp_path)
    proc = run(argv)
    assert proc.returncode == 2, proc.stderr
    line = _assert_one_line_error(proc.stderr, names[0].format(**fill) if names else flag)
    assert expected.format(**fill) in line, line
    assert proc.stdout == ""
    assert _snapshot(tmp_path) == before, "a wrong value changed files on disk"


@pytest.mark.parametrize("flag", BOOL_FLAGS)
def test_a_value_given_to_a_switch_is_one_line(flag: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main(["train", f"{flag}=yes", "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    line = _assert_one_line_error(capsys.readouterr().err, flag)
    assert "ignored explicit argument 'yes'" in line and "--help" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", TYPED_FLAGS)
def test_a_word_for_a_number_is_one_line(flag: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main(["train", flag, "many", "--out", str(tmp_path / "run")])
    assert info.value.code == 2
    line = _assert_one_line_error(capsys.readouterr().err, flag)
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


class _Started(BaseException):
    """Raised where a run would start: everything before it (all checks) has passed."""


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from bamboo.node import forkserver

    def start() -> None:
        raise _Started
    monkeypatch.setattr(forkserver, "start", start)


def test_the_lease_must_outlast_a_heartbeat() -> None:
    from bamboo.node.worker import HEARTBEAT_S as WORKER_HEARTBEAT_S
    from bamboo.config import HEARTBEAT_S, ConfigError, JobConfig
    assert HEARTBEAT_S == WORKER_HEARTBEAT_S
    JobConfig.of(lease_s=HEARTBEAT_S + 0.01).validate()
    with pytest.raises(ConfigError, match="not longer than a worker's heartbeat interval"):
        JobConfig.of(lease_s=HEARTBEAT_S).validate()


@pytest.mark.procs
def test_out_on_a_read_only_disk_is_one_line(tmp_path: Path, no_start: None,
                                             capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with mounted_tmpfs(tmp_path / "ro", "ro") as ro:
        assert main(["train", "--steps", "2", "--out", str(ro / "run")]) == 2
        line = _assert_one_line_error(capsys.readouterr().err, "--out")
        assert line == (f"bamboo train: error: --out {ro}/run: cannot write {ro}/run (Read-only "
                        f"file system): choose a directory you can write to")
        assert list(ro.iterdir()) == []


def _checkpointed_run(root: Path, steps: int) -> Path:
    """A run directory holding a checkpoint at step 4 of a default job of `steps` steps, as
    the launcher writes it."""
    import torch

    from bamboo.run.checkpoint import checkpoint_root, publish, step_dir, write_layers
    from bamboo.config import JobConfig
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
    with pytest.raises(_Started):
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
    from bamboo.node import forkserver

    def started() -> None:
        raise AssertionError("a job that cannot fit started a worker")
    monkeypatch.setattr(forkserver, "start", started)
    code = cli.main(["train", "--nodes", "2", "--stages", "2", flag, value,
                     "--out", str(tmp_path / "run")])
    line = _assert_one_line_error(capsys.readouterr().err, flag)
    assert code == 2 and f"({biggest}: " in line and "this machine has" in line, line
    assert f"(now {value})" in line and not (tmp_path / "run").exists()


def test_the_memory_bound_grows_with_what_it_counts() -> None:
    from bamboo.config import JobConfig
    from bamboo.plan.fits import check_fits, node_memory_lower_bound
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
    line = _assert_one_line_error(capsys.readouterr().err, "--micro-batches")
    limit = 90 if not extra else 60
    assert code == 2 and "one step would take at least" in line, line
    assert f"longer than the {limit} s the run waits for a step" in line, line
    assert not (tmp_path / "run").exists()


def test_the_step_bound_is_below_what_a_step_really_takes() -> None:
    """The bound must never refuse a job that could run: it stays under a step measured
    here (the demo-sized job takes tens of milliseconds a step on one core)."""
    from bamboo.config import JobConfig
    from bamboo.plan.fits import check_step_length, step_seconds_lower_bound
    cfg = JobConfig.of(nodes=2, stages=2, micro_batches=4, steps=2).validate()
    assert 0 < step_seconds_lower_bound(cfg, "cpu") < 0.005
    assert step_seconds_lower_bound(cfg, "cuda") < step_seconds_lower_bound(cfg, "cpu")
    check_step_length(JobConfig.of(nodes=2, stages=2, micro_batches=20000, steps=2).validate())
