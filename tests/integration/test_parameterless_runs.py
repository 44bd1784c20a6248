"""A plain `nn.Sequential` whose activations, dropout and reshape are layers of their own
(tests/support/tabular.py: seven layers, four without parameters), trained as it is: at
every stage count from one to seven, with a node killed in flight (at most stage counts one
that holds only layers without parameters), equal to its failure-free run and to the
single-process loop, its model.pt loading into the user's model; and through a checkpoint
restore onto fewer stages and a resume onto more, equal to the uninterrupted run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bamboo
from support.reference import train_reference
from support.runs import NEW_LAYOUT_REL, REL, assert_close, config, param_l2, run_in_process
from support.tabular import DATASET, MODEL, PARAMETERLESS, TRIPLE, build

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

COMMON = dict(model=MODEL, dataset=DATASET, micro_batches=2, micro_batch_size=4)

KILLS = {1: "1:0@2", 2: "0:0@2", 3: "0:1@2", 4: "0:1@2", 5: "0:2@2", 6: "0:4@2", 7: "0:5@2"}
"""The node killed at each stage count. One stage: one of two pipelines (no replica). Two:
stage 0, whose shadow is the last stage (it loads stage 0's data too). Four to seven: a
stage holding only ReLU, Dropout, GELU or Flatten (`support.tabular.PARAMETERLESS`)."""


def _model_pt_loads(run: Path, params: dict[str, torch.Tensor]) -> None:
    """model.pt holds the reference loop's parameters and loads into the user's model."""
    saved = torch.load(run / "model.pt", weights_only=True)
    assert saved.keys() == params.keys()
    for key, tensor in params.items():
        assert_close(float(saved[key].double().norm()), float(tensor.double().norm()), rel=REL)
    build().load_state_dict({k.removeprefix("layers."): v for k, v in saved.items()})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stages", range(1, 8))
def test_every_stage_count_killed_in_flight_ends_equal(stages: int, tmp_path: Path) -> None:
    nodes = max(stages, 2)
    cfg = config(COMMON, nodes=nodes, stages=stages, steps=4)
    clean = run_in_process(cfg, tmp_path / "clean")
    killed = run_in_process(config(COMMON, nodes=nodes, stages=stages, steps=4,
                                   kills=[KILLS[stages]]), tmp_path / "killed")
    assert clean["status"] == killed["status"] == "completed", killed.get("error")
    assert killed["preemptions"] == 1 and killed["checkpoint_restores"] == 0
    if stages > 1:  # a failover keeps the layout: the failure-free run's bits
        assert killed["failovers"] == 1
        assert (killed["losses"], killed["param_sha256"]) == \
            (clean["losses"], clean["param_sha256"])
    else:  # the other pipeline goes on alone: its sums are grouped otherwise
        assert_close(killed["losses"], clean["losses"], rel=NEW_LAYOUT_REL)
        assert_close(killed["param_l2"], clean["param_l2"], rel=NEW_LAYOUT_REL)
    if stages >= 4:
        parts = [e["parts"] for e in _events(tmp_path / "killed")
                 if e["event"] == "generation_ready"][0]
        stage = int(KILLS[stages].split(":")[1].split("@")[0])
        assert set(range(*parts[stage])) <= set(PARAMETERLESS), parts
    losses, params = train_reference(cfg)
    assert_close(clean["losses"], losses, rel=REL)
    assert_close(clean["param_l2"], param_l2(params), rel=REL)
    _model_pt_loads(tmp_path / "killed", params)


def _events(run: Path) -> list[dict]:
    import json
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_checkpoint_restore_onto_fewer_stages_and_a_resume_onto_more_end_equal(
        tmp_path: Path) -> None:
    """The default AdamW's state, layers without parameters among the layers moved: two
    adjacent nodes of four killed in one step (no copy of their stages left) restore the
    newest checkpoint onto the two that are left; a run of three steps on three stages,
    resumed on five, ends where the uninterrupted run does."""
    clean = run_in_process(config(COMMON, nodes=4, stages=4, steps=6), tmp_path / "clean")
    restored = run_in_process(config(COMMON, nodes=4, stages=4, steps=6, checkpoint_every=2,
                                     kills=["0:1@4", "0:2@4"]), tmp_path / "restored")
    first = run_in_process(config(COMMON, nodes=3, stages=3, steps=3), tmp_path / "first")
    assert clean["status"] == restored["status"] == first["status"] == "completed", \
        restored.get("error")
    # the first of the two is shadowed, the second takes its stage's every copy with it; the
    # checkpoint begun before step 4 is written in the background: restored from it when it
    # was published before the kills (nothing redone), else from step 2's (two steps redone)
    assert (restored["preemptions"], restored["failovers"], restored["checkpoint_restores"]) \
        == (2, 1, 1)
    assert restored["redone_steps"] in (0, 2), restored["redone_steps"]
    resumed = bamboo.train(bamboo.Job(**COMMON, nodes=5, stages=5, steps=6,
                                      resume=str(tmp_path / "first")), out=tmp_path / "resumed")
    assert resumed.resumed_from_step == 3
    for run in (restored["losses"], resumed.losses):
        assert_close(run, clean["losses"], rel=REL)
    for l2 in (restored["param_l2"], resumed.param_l2):
        assert_close(l2, clean["param_l2"], rel=REL)
    _, params = train_reference(config(COMMON, nodes=1, stages=1, steps=6))
    _model_pt_loads(tmp_path / "resumed", params)


OPTIMIZERS = {"amsgrad": "torch.optim:AdamW(lr=0.01, amsgrad=True)",
              "adafactor": "torch.optim:Adafactor(lr=0.01)",
              "triple": TRIPLE}
"""Three state tensors a parameter; factored row and column state; three tensors and two
Python numbers of a user's own optimizer (`support.tabular.Triple`)."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_optimizers_own_state_survives_a_kill_and_a_resume_onto_another_layout(
        name: str, tmp_path: Path) -> None:
    """Two adjacent nodes of one of two pipelines killed in flight: the first's shadow
    adopts its replica (which stepped the same optimizer), the second's stage comes whole
    from the other pipeline, and at the step's end the standby takes a stage with its
    state; and a run of two steps on two pipelines of three stages resumed onto two of two.
    Each ends with the uninterrupted run's bits (the same pipelines: every parameter sees
    the same sums in the same order at any stage count, so only a state carried exactly
    gives them)."""
    common = dict(COMMON, optimizer=OPTIMIZERS[name], steps=5)
    clean = run_in_process(config(common, nodes=7, stages=3), tmp_path / "clean")
    killed = run_in_process(config(common, nodes=7, stages=3, kills=["0:1@2", "0:2@2"]),
                            tmp_path / "killed")
    first = run_in_process(config(common, nodes=6, stages=3, steps=2), tmp_path / "first")
    assert clean["status"] == killed["status"] == first["status"] == "completed", \
        killed.get("error")
    resumed = bamboo.train(bamboo.Job(**common, nodes=4, stages=2, resume=str(tmp_path / "first")),
                           out=tmp_path / "resumed")
    assert (killed["failovers"], killed["peer_restores"], killed["preemptions"]) == (1, 1, 2)
    moved = [e for e in _events(tmp_path / "killed") if e["event"] == "reconfigured"]
    assert moved and moved[0]["transfers"] > 0, moved  # layer states sent to the standby
    loaded = sum(e["bytes"] for e in _events(tmp_path / "killed")
                 if e["event"] == "state_loaded" and e["gen"] == moved[0]["gen"])
    assert loaded > 0 and moved[0]["bytes"] == loaded, (moved, loaded)  # as the holders said
    assert resumed.resumed_from_step == 2
    for run in (killed, {"losses": resumed.losses, "param_sha256": resumed.param_sha256}):
        assert (run["losses"], run["param_sha256"]) == (clean["losses"], clean["param_sha256"])
    losses, params = train_reference(config(common, nodes=1, stages=1, micro_batches=4))
    assert_close(clean["losses"], losses, rel=REL)
    assert_close(clean["param_l2"], param_l2(params), rel=REL)
