"""ZB-H1 (`--schedule zb-h1`) with processes: runs equal to 1F1B's (bit-identical under
--exact), and kills of every stage survived, each ending equal to the failure-free run.
(The lists, the timeline model and the split gradients, without processes:
tests/unit/engine/test_zero_bubble.py.)
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bamboo.config import JobConfig, parse_kill
from support.procs import run_events
from support.runs import assert_equals_failure_free, run_in_process

# -- with processes ---------------------------------------------------------------------------


def _params(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


@pytest.mark.procs
@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_zb_h1_is_bit_identical_to_1f1b_under_exact(model: str, tmp_path: Path) -> None:
    runs = {}
    for schedule in ("1f1b", "zb-h1"):
        cfg = JobConfig.of(model=model, nodes=2, stages=2, micro_batches=4, micro_batch_size=2,
                           steps=3, redundancy="off", exact=True, schedule=schedule).validate()
        summary = run_in_process(cfg, tmp_path / schedule)
        assert summary["status"] == "completed", summary["error"]
        assert summary["config"]["schedule"] == schedule
        runs[schedule] = summary
    assert runs["zb-h1"]["losses"] == runs["1f1b"]["losses"]
    one, zb = _params(tmp_path / "1f1b"), _params(tmp_path / "zb-h1")
    assert one.keys() == zb.keys() and all(torch.equal(one[k], zb[k]) for k in one)


@pytest.mark.procs
@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", [
    dict(kills=["0:0@2"]), dict(kills=["0:1@2"]), dict(kills=["0:2@2"]), dict(kills=["0:3@2"]),
    dict(kills=["0:1@1"], redundancy="lazy"),
    dict(kills=["0:0@2", "0:2@2"], comm="tagged"),
    dict(kills=["0:2@2"], frc_offload=True),
], ids=["stage 0", "stage 1", "stage 2", "stage 3", "lazy", "two in one step, tagged",
        "FRC in host memory (adopted untaped)"])
def test_zb_h1_survives_kills_equal_to_the_failure_free_run(flags: dict, tmp_path: Path) -> None:
    flags = dict(flags)
    kills = [parse_kill(k) for k in flags.pop("kills")]
    cfg = JobConfig.of(steps=4, micro_batches=4, schedule="zb-h1", kills=kills,
                       **flags).validate()
    summary = run_in_process(cfg, tmp_path / "run")
    assert_equals_failure_free(summary, cfg)
    assert summary["failovers"] == len(kills) and summary["redone_steps"] == 0
    lost = [e for e in run_events(tmp_path / "run") if e["event"] == "node_lost"]
    assert len(lost) == len(kills)
    for e in lost:  # the shadow redid every input and weight gradient of the lost stage
        assert e["handled_as"] == "failover" and e["brc"] >= cfg.layout.micro_batches
