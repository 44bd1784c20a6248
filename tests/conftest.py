"""Shared helpers: run the real `bamboo` command in a subprocess and read its results; the
two test tiers.

`make test` runs everything. `make test-fast` (`pytest --fast`) runs the tests that start no
process: unit, property and decision tests. A test that starts one (a subprocess, a
multiprocessing child, a fork) is in the `procs` tier: every test that uses the `bamboo`
fixture is marked so at collection, others by `@pytest.mark.procs` or a module's
`pytestmark`. Under `--fast` an unmarked test that starts a process fails at once, naming
the marker it lacks, so the fast tier cannot silently start to spawn workers."""
from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bamboo.run.runlog import read_events

REPO = Path(__file__).resolve().parent.parent
BAMBOO = [sys.executable, "-m", "bamboo"]

# the shared helpers (`reference`, `coordinator_sim`) and tests whose helpers other tests
# import are importable by name from every tier's folder
for _folder in [Path(__file__).parent, Path(__file__).parent / "integration",
                *sorted((Path(__file__).parent / "unit").iterdir())]:
    if _folder.is_dir() and str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict:
        path = self.out / "summary.json"
        return strict_loads(path.read_text(), str(path))

    def events(self) -> list[dict]:
        return run_events(self.out)


def run_events(out: Path) -> list[dict]:
    """The events of the run directory `out`: whole lines only (its coordinator may be
    writing the last one right now); [] before the file exists."""
    path = out / "events.jsonl"
    return read_events(path) if path.exists() else []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and so was the one after it (a
    coordinator's store takes its --bind port + 1 by default)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            try:
                with socket.socket() as t:
                    t.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free TCP ports in a row on 127.0.0.1")


def run_bamboo(args: list[str], out: Path | None, timeout: float = 240) -> Result:
    """Run `bamboo ARGS [--out OUT]` to completion (killed after `timeout`); a `--json`
    output on stdout must be strict JSON."""
    cmd = BAMBOO + args + (["--out", str(out)] if out is not None else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if "--json" in args and proc.returncode == 0:
        strict_loads(proc.stdout, f"`bamboo {' '.join(args)}` stdout")
    return Result(proc.returncode, proc.stdout, proc.stderr, out or Path("/nonexistent"))


class NotStrictJson(AssertionError):
    """A file or output the project wrote is not strict JSON (NaN, Infinity, or no JSON)."""


def strict_loads(text: str, where: str):
    """`text` parsed by a strict JSON parser (one that refuses NaN and Infinity, as
    JavaScript's `JSON.parse` and jq do); NotStrictJson names `where` otherwise."""
    def refuse(constant: str):
        raise NotStrictJson(f"{where} is not strict JSON: it holds {constant}")
    try:
        return json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise NotStrictJson(f"{where} is not JSON: {e}") from None


def check_run_files_strict(root: Path) -> None:
    """Every summary.json and whole line of every events.jsonl under `root` parses as
    strict JSON (a last line without its newline is a write cut short by a kill)."""
    for path in root.rglob("summary.json"):
        strict_loads(path.read_text(encoding="utf-8"), str(path))
    for path in root.rglob("events.jsonl"):
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
        for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: after the last newline
            if line.strip():
                strict_loads(line, f"{path} line {number}")


@pytest.fixture(autouse=True)
def _run_files_are_strict_json(request: pytest.FixtureRequest):
    """Every test that used a tmp_path ends with every summary.json and events.jsonl in it
    strict JSON: the check runs at teardown, over whatever the test's runs wrote (except in
    a test marked `malformed_run_files`, whose broken files are a reader's input)."""
    # Asked for here, before the test, so that tmp_path is torn down after this check.
    checked = "tmp_path" in request.fixturenames and \
        request.node.get_closest_marker("malformed_run_files") is None
    root = request.getfixturevalue("tmp_path") if checked else None
    yield
    if root is not None:
        check_run_files_strict(root)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="only the tests that start no process (make test-fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    procs = pytest.mark.procs
    for item in items:
        if "bamboo" in getattr(item, "fixturenames", ()) or item.get_closest_marker("slow"):
            item.add_marker(procs)
    if not config.getoption("--fast"):
        return
    kept = [i for i in items if i.get_closest_marker("procs") is None]
    config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("procs")])
    items[:] = kept


class StartsProcess(AssertionError):
    """A test of the fast tier started a process."""


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_tier(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if not request.config.getoption("--fast"):
        return

    def refuse(*args, **kwargs):
        raise StartsProcess(f"{request.node.nodeid} starts a process: mark it "
                            f"@pytest.mark.procs (it belongs to make test, not test-fast)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


@pytest.fixture
def bamboo(tmp_path: Path):
    """`bamboo(args, name)` runs `bamboo train ARGS` with its own run directory."""
    def run(args: list[str], name: str = "run", timeout: float = 240, report: bool = False) -> Result:
        # The end-of-run report (matplotlib) is skipped unless a test is about it.
        extra = [] if report else ["--no-report"]
        return run_bamboo(["train", *args, *extra], tmp_path / name, timeout)
    return run


def assert_close(a: list[float] | float, b: list[float] | float, rel: float) -> None:
    """Every value of `a` within `rel` relative of `b`, and no NaN anywhere."""
    a_list = a if isinstance(a, list) else [a]
    b_list = b if isinstance(b, list) else [b]
    assert len(a_list) == len(b_list), (a_list, b_list)
    for x, y in zip(a_list, b_list):
        assert x == x and y == y, "NaN"
        assert abs(x - y) <= rel * max(abs(x), abs(y)), (x, y, a_list, b_list)


@contextlib.contextmanager
def mounted_tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real tmpfs at `path` (e.g. options "size=64k" for a disk that fills up, "ro" for a
    read-only one), unmounted on exit; the test is skipped where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)


# -- a lab of real hosts (network namespaces): tests/lab/ ----------------------------------


def assert_no_lab_namespaces(prefix: str | None = None) -> None:
    """No network namespace of this process's labs (or of `prefix`) is left on the machine."""
    from bamboo.chaos.lab import lab_prefix, leftover_namespaces
    left = leftover_namespaces(prefix or lab_prefix())
    assert not left, f"lab namespaces left behind: {left} (remove with `ip netns del NAME`)"


@pytest.fixture(scope="session")
def lab_session_check():
    """Not autouse: `lab_factory` requests it, so only sessions that built labs check, at
    their end, that every namespace those labs made is gone."""
    yield
    from bamboo.chaos.lab import unsupported_reason
    if unsupported_reason() is None:
        assert_no_lab_namespaces()


@pytest.fixture
def lab_factory(lab_session_check):
    """`make(hosts) -> Lab`: a lab of `hosts` network-namespace hosts ("coord", "a1", ...),
    every one closed (and checked gone) at teardown. Skipped only where labs cannot be
    built at all: not root, or no `ip` command."""
    from bamboo.chaos.lab import Lab, LabError, leftover_namespaces, unsupported_reason
    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(f"a lab of network namespaces cannot be built here: {reason}")
    labs: list[Lab] = []

    def make(hosts: int) -> Lab:
        lab = Lab(hosts)
        labs.append(lab)
        return lab

    yield make
    errors = []
    for lab in labs:
        try:
            lab.close()
        except LabError as e:
            errors.append(str(e))
        errors += [f"{n} left behind" for n in leftover_namespaces(lab.prefix)]
    assert not errors, errors
