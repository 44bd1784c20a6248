"""Where a worker's output goes (`bamboo.node.output`), its log records with it
(`bamboo.util.logs`): real descriptors, in a forked child. `--json`'s stdout under capfd:
tests/unit/node/test_output.py."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from bamboo.node.output import to_log
from bamboo.util import logs


def _real_streams() -> None:
    """`sys.stdout` and `sys.stderr` on descriptors 1 and 2, block-buffered, as in a process
    whose output is not a terminal (pytest's capture replaces them with its own files)."""
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)


def _in_child(body) -> int:
    """Run `body()` in a forked child (its descriptors are its own, its streams on them);
    its exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            _real_streams()
            body()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.procs  # a fork: cheap, but a process
def test_a_worker_log_takes_prints_loggers_and_descriptor_writes(tmp_path: Path,
                                                                  capfd: pytest.CaptureFixture) -> None:
    log = tmp_path / "run" / "logs" / "n3.log"

    def body() -> None:
        logger = logging.getLogger("test_output")
        logger.addHandler(logging.StreamHandler(sys.stdout))  # bound before the redirect
        logger.propagate = False
        assert to_log(str(log), "n3") is None
        print("a print")
        print("on stderr", file=sys.stderr)
        logger.warning("a logger's line")
        os.write(1, b"descriptor 1\n")
        os._exit(0)  # as a worker ends: no flush at exit (line buffering wrote each line)
    assert _in_child(body) == 0
    text = log.read_text()
    assert text.startswith("--- n3 (pid ") and " started " in text.splitlines()[0]
    assert text.splitlines()[1:] == ["a print", "on stderr", "a logger's line", "descriptor 1"]
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.procs  # a fork
def test_a_workers_bamboo_records_are_lines_of_its_log(tmp_path: Path,
                                                        capfd: pytest.CaptureFixture) -> None:
    """As `worker_main` starts: its output to the log, then the library's records (INFO and
    up) with it, each the line the command line would print, once (not again through a root
    handler that the user's code in the worker set up)."""
    log = tmp_path / "logs" / "n2.log"

    def body() -> None:
        assert to_log(str(log), "n2") is None
        logs.worker_output()
        logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
        logger = logging.getLogger("bamboo.node.worker")
        logger.warning("%s", "a warning", extra=logs.by("bamboo worker n2"))
        logger.info("a note")
        logger.debug("a detail")
        os._exit(0)
    assert _in_child(body) == 0
    assert log.read_text().splitlines()[1:] == ["bamboo worker n2: warning: a warning", "a note"]
    assert capfd.readouterr() == ("", "")


@pytest.mark.procs
def test_a_log_that_cannot_be_opened_sends_stdout_to_stderr(tmp_path: Path,
                                                            capfd: pytest.CaptureFixture) -> None:
    (tmp_path / "file").write_text("")

    def body() -> None:
        why = to_log(str(tmp_path / "file" / "n0.log"), "n0")  # its folder is a file
        assert why is not None and "cannot write its log" in why
        print("still said", flush=True)
    assert _in_child(body) == 0
    out, err = capfd.readouterr()
    assert out == "" and err == "still said\n"
