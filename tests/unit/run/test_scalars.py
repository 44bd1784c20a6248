"""`--tensorboard` and `--wandb`: the scalars a run writes equal what it recorded.
Its tests that start processes: tests/integration/test_scalars_runs.py."""
from __future__ import annotations

from pathlib import Path

from bamboo.cli import main
from bamboo.config import JobConfig
from bamboo.control.scalars import ScalarLog


class _Broken:
    name = "--tensorboard"

    def scalars(self, values: dict, step: int) -> None:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        raise AssertionError("a switched-off sink is not closed")


def test_a_failing_sink_is_switched_off_with_one_message() -> None:
    said: list[str] = []
    log = ScalarLog(JobConfig(), Path("."), said.append)
    log.sinks.append(_Broken())
    log.on_event({"event": "eval", "step": 2, "loss": 1.5})
    log.on_event({"event": "eval", "step": 4, "loss": 1.2})
    assert log.sinks == [] and len(said) == 1
    assert said[0].startswith("--tensorboard logging stopped: OSError")
    log.close()


def test_bad_logging_flags_are_one_line(tmp_path: Path, capsys) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    cases = [(["--tensorboard", str(afile)], "is not a directory"),
             (["--wandb", "no spaces"], "is not a project name"),
             (["--eval-every", "-1"], "--eval-every must be an integer >= 0"),
             (["--eval-batches", "0"], "--eval-batches must be an integer from 1 to 4096")]
    for flags, text in cases:
        code = main(["train", "--steps", "1", "--out", str(tmp_path / "run"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and text in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()
