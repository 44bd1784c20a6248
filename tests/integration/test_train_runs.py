"""End to end: real worker processes, gloo, the real command line.

The invariant every later feature keeps: any layout of the same global batch gives
the losses and parameters of a plain single-process loop. The layout and model runs go
through the launcher in this process (`run_in_process`: the same `run_job` the command
calls, its fork server kept warm between runs); the command line itself is checked by the
contract, text-file, divergence and interrupt tests below.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bamboo.config import JobConfig
from support.reference import train_reference
from support.runs import assert_close, config, run_in_process

pytestmark = pytest.mark.procs  # every test here starts worker processes

STEPS = 6
# Same global batch everywhere: D x M = 4 micro-batches of 8 samples.
LAYOUTS = {
    "1 node": dict(nodes=1, stages=1, micro_batches=4),
    "4 stages": dict(nodes=4, stages=4, micro_batches=4),
    "2 pipelines x 2 stages": dict(nodes=4, stages=2, pipelines=2, micro_batches=2),
    "2 pipelines x 4 stages": dict(nodes=8, stages=4, micro_batches=2),
    "4 pipelines x 1 stage": dict(nodes=4, stages=1, micro_batches=1),
}


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_reference(JobConfig.of(steps=STEPS, micro_batches=4).validate())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_equals_the_single_process_loop(tmp_path: Path, reference,
                                                    layout: str) -> None:
    summary = run_in_process(config(steps=STEPS, **LAYOUTS[layout]), tmp_path / "run")
    assert summary["status"] == "completed", summary["error"]
    ref_losses, ref_params = reference
    assert summary["steps_completed"] == STEPS
    assert_close(summary["losses"], ref_losses, rel=1e-6)
    l2 = float(torch.sqrt(sum(t.double().square().sum() for t in ref_params.values())))
    assert_close(summary["param_l2"], l2, rel=1e-6)
    params = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    for name, tensor in ref_params.items():
        torch.testing.assert_close(params[name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(240)
def test_exact_layouts_are_bit_identical(tmp_path: Path) -> None:
    """--exact: float64 sums in pipeline order, so one node, one pipeline of four stages and
    two or four pipelines give the same parameter bits and the same losses (at one stage
    each node computes the clipping norm from its own reduced gradient, with no exchange);
    the default (fp32 sums, one all-reduce) stays within 1e-6 of them."""
    summaries = [run_in_process(config(steps=3, exact=True, **LAYOUTS[name]), tmp_path / name)
                 for name in ("1 node", "4 stages", "2 pipelines x 2 stages",
                              "4 pipelines x 1 stage")]
    assert all(s["status"] == "completed" for s in summaries), [s["error"] for s in summaries]
    assert len({s["param_sha256"] for s in summaries}) == 1
    assert all(s["losses"] == summaries[0]["losses"] for s in summaries)
    assert all(s["config"]["exact"] for s in summaries)
    fp32 = run_in_process(config(steps=3, **LAYOUTS["2 pipelines x 2 stages"]), tmp_path / "fp32")
    assert fp32["status"] == "completed" and not fp32["config"]["exact"], fp32["error"]
    assert_close(fp32["losses"], summaries[0]["losses"], rel=1e-6)
    assert_close(fp32["param_l2"], summaries[0]["param_l2"], rel=1e-6)


@pytest.mark.timeout(180)
def test_summary_and_events_follow_the_contract(bamboo) -> None:
    result = bamboo(["--nodes", "5", "--stages", "4", "--steps", "3", "--json", "--quiet"])
    assert result.code == 0, result.stderr
    summary = result.summary
    for key, kind in [("steps_completed", int), ("samples", int), ("losses", list),
                      ("param_l2", float), ("param_sha256", str), ("preemptions", int),
                      ("failovers", int), ("drains", int), ("peer_restores", int),
                      ("checkpoint_restores", int), ("standby_losses", int),
                      ("reconfigurations", int), ("redone_steps", int), ("pause_s", list),
                      ("wall_s", float), ("throughput", float), ("config", dict)]:
        assert isinstance(summary[key], kind), key
    assert summary["samples"] == 3 * 4 * 8
    assert summary["config"] | {} == summary["config"]
    assert {k: summary["config"][k] for k in ("nodes", "stages", "pipelines", "micro_batches",
                                              "redundancy", "model", "seed")} == {
        "nodes": 5, "stages": 4, "pipelines": 1, "micro_batches": 4, "redundancy": "lazy",
        "model": "gpt2-tiny", "seed": 0}
    assert result.stdout.strip().startswith("{")  # --json: the summary on stdout
    events = result.events()
    ups = [e for e in events if e["event"] == "node_up"]
    assert [e["node"] for e in ups] == ["n0", "n1", "n2", "n3", "n4"]
    assert [e["stage"] for e in ups] == [0, 1, 2, 3, None]  # n4 is a standby
    assert all(isinstance(e["pid"], int) for e in ups)
    steps = [e for e in events if e["event"] == "step_done"]
    assert [e["step"] for e in steps] == [0, 1, 2]
    assert [e["loss"] for e in steps] == summary["losses"]
    for e in steps:
        assert [n["stages"] for n in e["nodes"]] == [[0], [1], [2], [3]]
        for node in e["nodes"]:
            assert node["compute_s"] > 0 and node["step_s"] >= node["compute_s"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model,stages", [("bert-tiny", 2), ("cnn-tiny", 3)])
def test_other_models_pipeline_equals_single_process(tmp_path: Path, model: str,
                                                    stages: int) -> None:
    job = dict(model=model, steps=3, micro_batches=3)
    one = run_in_process(config(job, nodes=1, stages=1), tmp_path / "one")
    many = run_in_process(config(job, nodes=stages, stages=stages), tmp_path / "many")
    assert one["status"] == many["status"] == "completed", (one["error"], many["error"])
    assert_close(many["losses"], one["losses"], rel=1e-6)
    assert_close(many["param_l2"], one["param_l2"], rel=1e-6)


@pytest.mark.timeout(180)
def test_trains_on_a_text_file(bamboo, tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    result = bamboo(["--data", str(text), "--nodes", "2", "--stages", "2", "--steps", "8",
                     "--json", "--quiet"])
    assert result.code == 0, result.stderr
    losses = result.summary["losses"]
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.timeout(240)
def test_the_demo_job_learns(tmp_path: Path) -> None:
    summary = run_in_process(config(steps=50), tmp_path / "run")
    assert summary["status"] == "completed", summary["error"]
    losses = summary["losses"]
    assert len(losses) == 50
    assert losses[-1] <= 0.7 * losses[0], losses


@pytest.mark.timeout(180)
def test_a_diverging_run_stops_naming_the_step(bamboo, tmp_path: Path) -> None:
    """--lr 1e6: the first non-finite loss or gradient norm stops the run with one line that
    names the step and suggests a lower --lr; the summary holds the finite steps before it,
    and no model is written (a good model.pt already there stays as it was)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "model.pt").write_bytes(b"a good model")
    result = bamboo(["--nodes", "2", "--stages", "2", "--steps", "8", "--lr", "1e6",
                     "--quiet", "--resume", "auto"])
    assert result.code != 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "diverged in step" in lines[0] and "lower --lr" in lines[0], \
        result.stderr
    assert "Traceback" not in result.stderr
    summary = result.summary
    step = int(lines[0].split("diverged in step ")[1].split(":")[0])
    assert summary["status"] == "failed" and summary["steps_completed"] == step < 8
    assert all(math.isfinite(x) for x in summary["losses"]) and len(summary["losses"]) == step
    assert (out / "model.pt").read_bytes() == b"a good model"
