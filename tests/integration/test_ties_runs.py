"""Tied weights through real runs (bamboo.model.ties): an embedding tied to the head on two
stages, whose copies the commit round keeps equal, killed as steps begin and inside the
commit round (the tie's root), and equal bit for bit to the failure-free run; on one stage (one shared parameter), in the single-process loop
and resumed from a two-stage checkpoint onto one stage, within float tolerance."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bamboo
from bamboo.config import JobConfig
from bamboo.data.sizing import SIZING
from bamboo.plan import schedule as S
from bamboo.plan.faults import Fault
from bamboo.plan.program import COMMIT_POINTS, REDUCED
from support.models import TIED, write_module
from support.procs import run_events
from support.reference import train_reference
from support.runs import NEW_LAYOUT_REL, assert_close, config, run_in_process

pytestmark = [pytest.mark.procs, pytest.mark.slow]


def _tied_copies_equal(run_dir: Path) -> bool:
    saved = torch.load(run_dir / "model.pt", weights_only=True)
    return torch.equal(saved["layers.0.weight"], saved["layers.3.weight"])


@pytest.mark.timeout(360)
def test_a_tied_embedding_and_head_survive_kills_equal_and_resume_onto_one_stage(
        tmp_path: Path) -> None:
    name = f"{write_module(tmp_path, 'tied_model_runs', TIED)}:build"
    common = dict(model=name, steps=4, micro_batches=2, micro_batch_size=4, seed=3)
    clean = run_in_process(config(common, nodes=4, stages=2), tmp_path / "clean")
    killed = run_in_process(config(common, nodes=4, stages=2, kills=["0:1@1", "1:0@2"]),
                            tmp_path / "killed")
    # the tie's root (stage 0's holder in pipeline 0) killed inside the commit round, after
    # the data-parallel and tied sums: the survivors run the round again, the shadow's copy
    # of the tied weight among them
    cfg = config(common, nodes=4, stages=2)
    frc = 1 if cfg.redundancy.mode == "eager" else None
    in_round = len(S.node_schedule([0], 2, cfg.layout.micro_batches, frc_stage=frc,
                                   schedule=cfg.layout.schedule)) + COMMIT_POINTS.index(REDUCED)
    root = run_in_process(cfg, tmp_path / "root", {0: [Fault("kill", 2, in_round)]})
    one = run_in_process(config(common, nodes=2, stages=1), tmp_path / "one")
    first = run_in_process(config(common, nodes=4, stages=2, steps=2, checkpoint_every=2),
                           tmp_path / "first")
    for run in (clean, killed, root, one, first):
        assert run["status"] == "completed", run.get("error")
    resumed = bamboo.train(bamboo.Job(**common, nodes=2, stages=1,
                                      resume=str(tmp_path / "first")), out=tmp_path / "resumed")
    assert killed["preemptions"] == 2
    assert (killed["losses"], killed["param_sha256"]) == (clean["losses"], clean["param_sha256"])
    assert root["preemptions"] == 1
    assert (root["losses"], root["param_sha256"]) == (clean["losses"], clean["param_sha256"])
    [lost] = [e for e in run_events(tmp_path / "root") if e["event"] == "node_lost"]
    assert (lost["node"], lost["step"], lost["phase"]) == ("n0", 2, "commit")
    for run in ("clean", "killed", "root", "one", "resumed"):
        assert _tied_copies_equal(tmp_path / run), run
    # One stage shares one parameter (autograd adds the two uses): the same within float
    # tolerance, as is the single-process loop.
    assert_close(one["losses"], clean["losses"], rel=1e-5)
    assert_close(one["param_l2"], clean["param_l2"], rel=1e-5)
    losses, params = train_reference(JobConfig.of(**{**common, "micro_batches": 4}).validate(SIZING))
    assert_close(clean["losses"], losses, rel=1e-5)
    saved = torch.load(tmp_path / "clean" / "model.pt", weights_only=True)
    assert saved.keys() == params.keys()
    for key, tensor in params.items():
        torch.testing.assert_close(saved[key], tensor, rtol=1e-5, atol=1e-6)
    assert resumed.resumed_from_step == 2
    assert_close(resumed.losses, clean["losses"], rel=NEW_LAYOUT_REL)
    assert_close(resumed.param_l2, clean["param_l2"], rel=NEW_LAYOUT_REL)
