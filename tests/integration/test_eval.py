"""`--eval-every`: the held-out loss through the pipeline, equal to the single-process
model's in every layout and through kills, including one in the middle of the pass."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.config import JobConfig
from bamboo.engine.engine import EVAL_FAULT_INDEX
from bamboo.plan.faults import Fault
from support.procs import run_events
from support.reference import train_reference
from support.runs import assert_close, config, run_in_process

REL = 1e-6


def reference_evals(cfg: JobConfig) -> tuple[list[float], list[list[float]]]:
    evals: list[list[float]] = []
    losses, _ = train_reference(JobConfig.of(
        model=cfg.model.name, seed=cfg.training.seed, nodes=1, stages=1,
        steps=cfg.training.steps, micro_batches=cfg.global_micro_batches,
        micro_batch_size=cfg.layout.micro_batch_size, eval_every=cfg.evaluation.every,
        eval_batches=cfg.evaluation.batches, data=cfg.data.path).validate(), evals)
    return losses, evals


def assert_evals_equal(summary: dict, cfg: JobConfig) -> None:
    losses, evals = reference_evals(cfg)
    assert summary["status"] == "completed", summary["error"]
    assert [s for s, _ in summary["eval_losses"]] == [s for s, _ in evals]
    assert_close([x for _, x in summary["eval_losses"]], [x for _, x in evals], rel=REL)
    assert_close(summary["losses"], losses, rel=REL)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(nodes=2, stages=2, micro_batches=4),
                                    dict(nodes=4, stages=2, micro_batches=2),
                                    dict(nodes=3, stages=3, micro_batches=4)])
def test_eval_losses_equal_the_single_process_model(layout: dict, tmp_path: Path) -> None:
    cfg = config(dict(layout, steps=5, eval_every=2, eval_batches=3))
    summary = run_in_process(cfg, tmp_path / "run")
    assert_evals_equal(summary, cfg)
    assert [s for s, _ in summary["eval_losses"]] == [2, 4, 5]
    assert summary["eval_losses"][-1][1] < summary["eval_losses"][0][1]  # it learns
    events = run_events(tmp_path / "run")
    recorded = [e for e in events if e["event"] == "eval"]
    assert [[e["step"], e["loss"]] for e in recorded] == summary["eval_losses"]
    # One numbering: the eval at step K is of the parameters after K steps, between
    # step_done K-1 and step_done K (the step that starts from them).
    order = [(e["event"], e["step"]) for e in events if e["event"] in ("eval", "step_done")]
    assert order == [("step_done", 0), ("step_done", 1), ("eval", 2), ("step_done", 2),
                     ("step_done", 3), ("eval", 4), ("step_done", 4), ("eval", 5)]


@pytest.mark.procs
def test_no_eval_losses_without_the_flag(tmp_path: Path) -> None:
    cfg = config(dict(nodes=2, stages=2, steps=2))
    summary = run_in_process(cfg, tmp_path / "run")
    assert summary["status"] == "completed" and summary["eval_losses"] == []


KILLS_IN_EVAL = {
    # name: (flags, pipeline, stage, evaluation after this many steps)
    "the last stage, mid-pass": (dict(nodes=4, stages=4, micro_batches=2), 0, 3, 2),
    "stage 0, two pipelines": (dict(nodes=4, stages=2, micro_batches=2), 1, 0, 2),
    "the middle stage, tagged": (dict(nodes=3, stages=3, micro_batches=2, comm="tagged"), 0, 1, 2),
    "the last stage, in the final pass": (dict(nodes=3, stages=3, micro_batches=2), 0, 2, 4),
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", KILLS_IN_EVAL)
def test_a_kill_during_the_held_out_pass(name: str, tmp_path: Path) -> None:
    """SIGKILL after the victim's first val micro-batch: the survivors fail over and run
    the pass again under the new roles; the run ends equal to the failure-free one."""
    flags, pipeline, stage, at = KILLS_IN_EVAL[name]
    cfg = config(dict(flags, steps=4, eval_every=2, eval_batches=4))
    victim = pipeline * cfg.layout.stages + stage
    faults = {victim: [Fault("kill", at, EVAL_FAULT_INDEX)]}
    summary = run_in_process(cfg, tmp_path / "run", faults)
    assert_evals_equal(summary, cfg)
    assert summary["failovers"] == 1 and summary["checkpoint_restores"] == 0
    [lost] = [e for e in run_events(tmp_path / "run") if e["event"] == "node_lost"]
    assert lost["step"] == at and lost["handled_as"] == "failover"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The project's own docs, BPE-tokenized (a vocabulary of 320 trained on them)."""
    from bamboo.data.tokens import prepare
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path_factory.mktemp("data") / "docs"
    prepare([str(p) for p in sorted((repo / "docs").glob("*.md"))], out, "bpe:320")
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_prepared_data_with_eval_through_a_kill(model: str, prepared: Path,
                                                 tmp_path: Path) -> None:
    """The acceptance case: `bamboo data prepare` output, `--eval-every`, a SIGKILL in a
    step: losses, eval losses and parameters of the failure-free single process, on the
    data's vocabulary, with a falling eval loss."""
    cfg = config(dict(model=model, data=str(prepared), nodes=3, stages=3, micro_batches=2,
                      steps=6, eval_every=2, eval_batches=4, kills=["0:1@3"]))
    assert cfg.model_preset().vocab == 320
    summary = run_in_process(cfg, tmp_path / "run")
    assert_evals_equal(summary, cfg)
    assert summary["failovers"] == 1 and summary["checkpoint_restores"] == 0
    assert summary["eval_losses"][-1][1] < summary["eval_losses"][0][1]
    _, params = train_reference(JobConfig.of(
        model=model, data=str(prepared), nodes=1, stages=1, steps=cfg.training.steps,
        micro_batches=cfg.global_micro_batches, micro_batch_size=cfg.layout.micro_batch_size).validate())
    import torch
    trained = torch.load(tmp_path / "run" / "model.pt")
    assert trained.keys() == params.keys()
    for name, t in params.items():
        assert torch.allclose(trained[name], t, rtol=1e-5, atol=1e-6), name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_keeps_the_evaluations_before_its_checkpoint(tmp_path: Path) -> None:
    """Evaluations recorded before the checkpoint a run resumes from travel in its metadata;
    the resumed run adds the rest: the failure-free run's list, each step once."""
    from support.procs import run_bamboo
    out = tmp_path / "run"
    job = ["train", "--nodes", "2", "--stages", "2", "--eval-every", "1", "--eval-batches", "2",
           "--json", "--quiet"]
    first = run_bamboo([*job, "--steps", "4", "--checkpoint-every", "2"], out)
    assert first.code == 0, first.stderr
    second = run_bamboo([*job, "--steps", "7", "--resume", str(out)], None)
    assert second.code == 0, second.stderr
    summary = json.loads(second.stdout)
    assert summary["resumed_from_step"] == 4  # the finished run's final state
    cfg = config(dict(nodes=2, stages=2, steps=7, eval_every=1, eval_batches=2))
    assert [s for s, _ in summary["eval_losses"]] == [1, 2, 3, 4, 5, 6, 7]
    assert_evals_equal(summary, cfg)  # warm-up's lr does not depend on --steps
