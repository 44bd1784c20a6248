"""The fixtures every tier shares (a `bamboo train` run, a real etcd, labs of network
namespaces), the strict-JSON check of every run directory, and the test tiers.

Helpers live in the `support` package (tests/support/), fixtures here. The folders are the
tiers: tests/unit starts no process, tests/integration does.

`make test` runs everything. `make test-fast` (`pytest --fast`) runs the tests that start no
process: unit, property and decision tests, tests/unit. A test that starts one (a
subprocess, a multiprocessing child, a fork) is in the `procs` tier, which is the folder
tests/integration: its every test is marked so at collection, and a test of tests/unit
marked `procs` or using the `bamboo` fixture stops the collection naming it. Under `--fast`
a test that starts a process fails at once, so the fast tier cannot silently start to spawn
workers.
`make test-smoke` (`pytest -m smoke`) runs one end-to-end test per capability."""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

from support.cli import RunStarted
from support.procs import Result, run_bamboo
from support.servers import etcd_server
from support.strict import check_run_files_strict


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


SMOKE = {
    # capability: its one end-to-end test (`make test-smoke`, marked `smoke` at collection)
    "a kill": "integration/test_failover.py::test_failover_ends_equal_to_failure_free"
              "[kill stage 2]",
    "a drain on a preemption notice": "integration/test_reconfig.py::test_drain_to_a_standby",
    "a join": "integration/test_reconfig.py::test_standbys_joining_grow_the_layout",
    "a restore from a checkpoint":
        "integration/test_reconfig.py::test_adjacent_kills_with_one_pipeline_restore_the_checkpoint",
    "a re-route": "integration/test_reroute.py::test_reroute_ends_equal_to_failure_free"
                  "[D=2, stage 0]",
    "a coordinator and its agents": "integration/test_remote.py::"
        "test_agents_join_with_the_token_and_train_to_the_failure_free_result",
    "etcd": "integration/test_remote.py::test_with_etcd_a_frozen_machine_is_fenced_by_its_lease",
    "a Ray cluster": "integration/test_ray.py::test_a_raylet_killed_with_its_processes_is_a_"
                     "preemption_and_one_that_joins_stands_by",
    "the demo's job and trace": "integration/test_reconfig.py::"
        "test_the_demo_job_survives_its_trace_and_writes_the_report",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    procs = pytest.mark.procs
    tests = Path(__file__).parent
    smoke = {f"{tests / nodeid.split('::')[0]}::{nodeid.split('::', 1)[1]}"
             for nodeid in SMOKE.values()}
    unit = tests / "unit"
    misplaced = []
    for item in items:
        if item.path.is_relative_to(unit):
            if item.get_closest_marker("procs") or "bamboo" in getattr(item, "fixturenames", ()):
                misplaced.append(item.nodeid)
        else:  # the folder is the tier: tests/integration starts processes
            item.add_marker(procs)
        if f"{item.path}::{item.name}" in smoke:
            item.add_marker(pytest.mark.smoke)
            smoke.discard(f"{item.path}::{item.name}")
    if misplaced:
        raise pytest.UsageError(f"tests of tests/unit that start processes belong in "
                                f"tests/integration: {misplaced}")
    collected = {str(item.path) for item in items}
    lost = [n for n in smoke if n.split("::")[0] in collected or not Path(n.split("::")[0]).exists()]
    if config.getoption("markexpr") == "smoke" and lost:
        raise pytest.UsageError(f"smoke tests not found (renamed?): {sorted(lost)}")
    if not config.getoption("--fast"):
        _longest_first(items)
        return
    kept = [i for i in items if i.get_closest_marker("procs") is None]
    config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("procs")])
    items[:] = kept


def _longest_first(items: list[pytest.Item]) -> None:
    """Modules with long runs first (a `slow` or `smoke` test), then those that start
    processes, then the rest, each module's tests together and in their order (its
    module-scoped fixtures stay shared). Two at a time (`make test`), a long run started last
    would leave one worker alone at the end; started first, the short tests fill around it."""
    rank: dict[Path, int] = {}
    for item in items:
        long = item.get_closest_marker("slow") or item.get_closest_marker("smoke")
        kind = 0 if long else 1 if item.get_closest_marker("procs") else 2
        rank[item.path] = min(rank.get(item.path, 2), kind)
    items.sort(key=lambda item: rank[item.path])


class StartsProcess(AssertionError):
    """A test of the fast tier started a process."""


@pytest.fixture(autouse=True)
def _no_process_in_the_fast_tier(request: pytest.FixtureRequest,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if not request.config.getoption("--fast"):
        return

    def refuse(*args, **kwargs):
        raise StartsProcess(f"{request.node.nodeid} starts a process: move it to "
                            f"tests/integration (it belongs to make test, not test-fast)")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(os, "fork", refuse)


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where `bamboo train` would start its fork server (and so its workers), RunStarted is
    raised instead: a test of what is checked before a run starts."""
    from bamboo.node import forkserver

    def start() -> None:
        raise RunStarted
    monkeypatch.setattr(forkserver, "start", start)


@pytest.fixture
def bamboo(tmp_path: Path):
    """`bamboo(args, name)` runs `bamboo train ARGS` with its own run directory."""
    def run(args: list[str], name: str = "run", timeout: float = 240, report: bool = False) -> Result:
        # The end-of-run report (matplotlib) is skipped unless a test is about it.
        extra = [] if report else ["--no-report"]
        return run_bamboo(["train", *args, *extra], tmp_path / name, timeout)
    return run


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory):
    """A real etcd on loopback for the whole session: each test uses its own job name, so
    tests do not see each other's nodes."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as url:
        yield url


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
