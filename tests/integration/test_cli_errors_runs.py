"""The command line as a user meets it: every refusal is one line naming the flag and exits 2,
before any worker starts; nothing is written where it was refused."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bamboo.data.sizing import SIZING
from support.cli import assert_one_line_error
from support.procs import REPO, mounted_tmpfs

pytestmark = pytest.mark.procs  # every test here starts processes


def run(args: list[str]) -> subprocess.CompletedProcess:
    """`bamboo train ARGS` to completion, as a user types it."""
    return subprocess.run([sys.executable, "-m", "bamboo", "train", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


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


def test_a_finished_run_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "done"
    out.mkdir()
    (out / "summary.json").write_text('{"steps_completed": 3}')
    proc = run(["--steps", "1", "--out", str(out)])
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr
    assert (out / "summary.json").read_text() == '{"steps_completed": 3}'
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_unknown_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "bamboo", "trian"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("bamboo: error: unknown command 'trian'; choose one of: "
                                   "train, simulate, report, config, profile, coordinator, agent, "
                                   "lab, data, export, soak, timeline")


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


def test_the_example_job_file_is_valid(tmp_path: Path) -> None:
    example = subprocess.run([sys.executable, "-m", "bamboo", "config", "--example"],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
    assert example.returncode == 0
    job = tmp_path / "job.yaml"
    job.write_text(example.stdout)
    from bamboo.config.jobfile import load_job_config
    cfg = load_job_config(job, {}, SIZING)
    assert (cfg.model.name, cfg.layout.nodes, cfg.layout.stages) == ("gpt2-tiny", 4, 4)


def test_out_on_a_read_only_disk_is_one_line(tmp_path: Path, no_start: None,
                                             capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with mounted_tmpfs(tmp_path / "ro", "ro") as ro:
        assert main(["train", "--steps", "2", "--out", str(ro / "run")]) == 2
        line = assert_one_line_error(capsys.readouterr().err, "--out")
        assert line == (f"bamboo train: error: --out {ro}/run: cannot write {ro}/run (Read-only "
                        f"file system): choose a directory you can write to")
        assert list(ro.iterdir()) == []
