"""A custom model (`--model module:function`) trained by the pipeline with processes: equal
to the single-process loop in every layout and through a kill."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from bamboo.config import JobConfig
from bamboo.data.sizing import SIZING
from support.models import EXAMPLE, TINY, write_module
from support.procs import run_events
from support.reference import train_reference
from support.runs import assert_close, config, run_in_process

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_module_on_pythonpath_trains_like_the_single_process_loop(
        bamboo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers import the module too: it lies outside the working directory, on PYTHONPATH."""
    modules = tmp_path / "modules"
    modules.mkdir()
    write_module(modules, "bamboo_tiny_model", TINY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(modules), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(modules))
    name = "bamboo_tiny_model:build"
    result = bamboo(["--model", name, "--nodes", "2", "--stages", "2", "--steps", "3",
                     "--micro-batches", "2", "--micro-batch-size", "4", "--json", "--quiet"])
    assert result.code == 0, result.stderr
    losses, params = train_reference(JobConfig.of(model=name, steps=3, micro_batches=2,
                                               micro_batch_size=4).validate(SIZING))
    assert result.summary["config"]["model"] == name
    assert_close(result.summary["losses"], losses, rel=1e-5)
    saved = torch.load(result.out / "model.pt", weights_only=True)
    assert saved.keys() == params.keys()
    for key, tensor in params.items():
        torch.testing.assert_close(saved[key], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_example_trains_the_same_in_every_layout_and_through_a_kill(tmp_path: Path) -> None:
    """One node, four stages, and four stages with the node of stage 1 killed in step 1:
    the same losses (the killed run's stage is finished by its shadow, in flight). Through
    the launcher in this process (its fork server warm); the command line with a model path
    is the test above."""
    common = dict(model=EXAMPLE, steps=3, micro_batches=2, micro_batch_size=2)
    one = run_in_process(config(common, nodes=1, stages=1), tmp_path / "one")
    four = run_in_process(config(common, nodes=4, stages=4), tmp_path / "four")
    k = run_in_process(config(common, nodes=4, stages=4, kills=["0:1@1"]), tmp_path / "killed")
    for run in (one, four, k):
        assert run["status"] == "completed", run["error"]
    assert one["steps_completed"] == 3
    assert_close(four["losses"], one["losses"], rel=1e-5)
    assert_close(four["param_l2"], one["param_l2"], rel=1e-5)
    assert (k["failovers"], k["checkpoint_restores"], k["redone_steps"]) == (1, 0, 0)
    assert_close(k["losses"], four["losses"], rel=1e-4)
    assert_close(k["param_l2"], four["param_l2"], rel=1e-4)
    [lost] = [e for e in run_events(tmp_path / "killed") if e["event"] == "node_lost"]
    assert (lost["node"], lost["step"], lost["handled_as"]) == ("n1", 1, "failover")
