"""In-process runs and their comparison with the failure-free run.

`run_in_process` runs the launcher in the test's own process (its fork server stays warm
across runs); `reference` is the plain single-process loop's result for a job's shape,
computed once per shape and process; `assert_equals_failure_free` (same layout, 1e-6) and
`assert_equal_and_accounted` (a new layout, 1e-4, every lost node counted once) compare a
run's summary with it."""
from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import torch

from bamboo.chaos.bits import COUNTERS
from bamboo.config import JobConfig, parse_kill
from bamboo.control import RunFailed, RunOptions, run_job
from bamboo.data.sizing import SIZING
from bamboo.launch.local import LocalWorkers
from bamboo.plan.faults import Fault
from bamboo.run.progress import ProgressDisplay
from bamboo.run.runlog import RunDir
from support.reference import train_reference

REL = 1e-6
"""The same layout as the failure-free run: the same sums in the same order."""

NEW_LAYOUT_REL = 1e-4
"""A restore onto a new layout sums data-parallel gradients in another grouping."""


def assert_close(a: list[float] | float, b: list[float] | float, rel: float) -> None:
    """Every value of `a` within `rel` relative of `b`, and no NaN anywhere."""
    a_list = a if isinstance(a, list) else [a]
    b_list = b if isinstance(b, list) else [b]
    assert len(a_list) == len(b_list), (a_list, b_list)
    for x, y in zip(a_list, b_list):
        assert x == x and y == y, "NaN"
        assert abs(x - y) <= rel * max(abs(x), abs(y)), (x, y, a_list, b_list)


def config(flags: dict | None = None, /, **more) -> JobConfig:
    """A validated job of `bamboo train`'s flags (as a dict, keywords, or both); `kills`
    are written as on the command line ("0:2@5")."""
    flags = {**(flags or {}), **more}
    kills = [parse_kill(k) for k in flags.pop("kills", [])]
    return JobConfig.of(kills=kills, **flags).validate(SIZING)


def run_in_process(cfg: JobConfig, out: Path, faults: dict[int, list[Fault]] | None = None,
                   check_replicas: bool = True) -> dict:
    """The launcher in this process: its fork server stays warm across runs. The summary,
    with `exit_code` added when the run failed."""
    try:
        cfg = cfg.replace(check_replicas=check_replicas)
        return run_job(cfg, RunDir(out), ProgressDisplay(cfg.training.steps, enabled=False),
                       LocalWorkers(), RunOptions(extra_faults=faults or {}))
    except RunFailed as e:
        return e.summary | {"exit_code": e.exit_code}


@cache
def reference(steps: int, global_micro_batches: int, micro_batch_size: int) -> tuple:
    """The failure-free run's losses and parameter L2 norm for a job of this shape (the
    default model and seed), from the plain single-process loop."""
    losses, params = train_reference(JobConfig.of(
        nodes=1, stages=1, steps=steps, micro_batches=global_micro_batches,
        micro_batch_size=micro_batch_size).validate(SIZING))
    return losses, param_l2(params)


def param_l2(params: dict[str, torch.Tensor]) -> float:
    """The L2 norm of every parameter together, as summary.json's `param_l2` takes it (each
    tensor's squares summed in float64, the tensors' sums added exactly): equal parameters
    give equal bits, in any order."""
    return math.sqrt(math.fsum(float(t.double().square().sum()) for t in params.values()))


def assert_equals_failure_free(summary: dict, cfg: JobConfig, rel: float = REL) -> None:
    """The run completed with the failure-free run's losses and parameters."""
    losses, l2 = reference(cfg.training.steps, cfg.global_micro_batches, cfg.layout.micro_batch_size)
    assert summary["status"] == "completed", summary.get("error")
    assert_close(summary["losses"], losses, rel=rel)
    assert_close(summary["param_l2"], l2, rel=rel)


def assert_equal_and_accounted(summary: dict, cfg: JobConfig, lost: int | None = None) -> None:
    """Equal to the failure-free run within NEW_LAYOUT_REL, every lost node counted under
    exactly one kind (and `lost` of them, when given)."""
    assert_equals_failure_free(summary, cfg, rel=NEW_LAYOUT_REL)
    assert sum(summary[k] for k in COUNTERS) == summary["preemptions"]
    if lost is not None:
        assert summary["preemptions"] == lost, summary
