"""A model with dropout in every layer (tests/support/dropout_model.py), killed in flight:
every path that runs a forward again (a shadow's eager FRC, a lazy shadow's redo, a
re-routed and restarted step, the activation-checkpointing recompute) draws the masks the
failure-free run drew, so the run ends with its losses and parameters (its bits where the
layout is kept), and with the single-process loop's, which seeds each layer the same way.
An hf: GPT-2 keeps transformers' dropout (0.1) and the same holds."""
from __future__ import annotations

from pathlib import Path

import pytest

from bamboo.chaos.bits import bits_must_match, differs
from bamboo.config.presets import preset
from bamboo.model.hf import hf_config
from support.dropout_model import NAME
from support.hf_models import GPT2
from support.reference import train_reference
from support.runs import NEW_LAYOUT_REL, REL, assert_close, config, param_l2, run_in_process

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

COMMON = dict(model=NAME, steps=6, micro_batches=2, micro_batch_size=2)

KILLED = {
    # name: (flags, what handles the loss)
    "eager FRC, the shadow adopts stage 1": (
        dict(nodes=4, stages=4, kills=["0:1@3"], eval_every=3, eval_batches=2), "failovers"),
    "lazy: the shadow redoes the forwards": (
        dict(nodes=4, stages=4, redundancy="lazy", kills=["0:2@3"]), "failovers"),
    "activation checkpointing": (
        dict(nodes=4, stages=4, activation_checkpointing=True, kills=["0:0@2"]), "failovers"),
    "zb-h1, the last stage lost": (
        dict(nodes=4, stages=4, schedule="zb-h1", kills=["0:3@4"]), "failovers"),
    "re-route: the step starts again on the peers": (
        dict(nodes=4, stages=2, redundancy="reroute", kills=["0:0@2"]), "reroutes"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", KILLED)
def test_a_dropout_model_killed_in_flight_ends_equal_to_its_failure_free_run(
        name: str, tmp_path: Path) -> None:
    flags, handled_as = KILLED[name]
    reroute = flags.get("redundancy") == "reroute"
    clean = run_in_process(config(COMMON, **{k: v for k, v in flags.items() if k != "kills"}),
                           tmp_path / "clean", check_replicas=not reroute)
    cfg = config(COMMON, **flags)
    killed = run_in_process(cfg, tmp_path / "killed", check_replicas=not reroute)
    assert clean["status"] == killed["status"] == "completed", killed.get("error")
    assert killed[handled_as] == 1 == killed["preemptions"]
    assert killed["checkpoint_restores"] == killed["redone_steps"] == 0
    assert differs(clean, killed) == ""
    if reroute:  # the re-routed stage sums its gradients in another order: not the bits
        assert not bits_must_match(killed)
    else:  # one pipeline: a new partition after the failover sums in the same order
        assert killed["param_sha256"] == clean["param_sha256"]
        assert killed["losses"] == clean["losses"]
        assert killed.get("eval_losses") == clean.get("eval_losses")
    evals: list[list[float]] = []
    losses, params = train_reference(cfg, evals if "eval_every" in flags else None)
    rel = NEW_LAYOUT_REL if reroute else REL
    assert_close(killed["losses"], losses, rel=rel)
    assert_close(killed["param_l2"], param_l2(params), rel=rel)
    if evals:
        assert [step for step, _ in killed["eval_losses"]] == [step for step, _ in evals]
        assert_close([v for _, v in killed["eval_losses"]], [v for _, v in evals], rel=rel)


@pytest.mark.timeout(300)
def test_an_hf_model_with_its_dropout_killed_in_flight_ends_equal(tmp_path: Path) -> None:
    assert hf_config(preset(GPT2).hf_config).resid_pdrop == 0.1  # dropout on
    flags = dict(model=GPT2, nodes=3, stages=3, steps=4, micro_batches=2, micro_batch_size=2)
    clean = run_in_process(config(flags), tmp_path / "clean")
    cfg = config(flags, kills=["0:1@2"])
    killed = run_in_process(cfg, tmp_path / "killed")
    assert killed["status"] == "completed" and killed["failovers"] == 1, killed.get("error")
    assert killed["param_sha256"] == clean["param_sha256"]
    assert killed["losses"] == clean["losses"]
    losses, params = train_reference(cfg)
    assert_close(killed["losses"], losses, rel=REL)
    assert_close(killed["param_l2"], param_l2(params), rel=REL)
