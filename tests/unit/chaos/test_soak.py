"""`bamboo soak`: the user's job, failure-free and then with faults sent from outside.
Its tests that start processes: tests/integration/test_soak_runs.py."""
from __future__ import annotations

import json
import random

import pytest

from bamboo.chaos.bits import COUNTERS, bits_must_match, differs, explain
from bamboo.chaos.soak import Trial, draw, judge, rerun_command

KEPT = [{"from_step": 0, "pipelines": 2, "stages": 2, "rerouted": False}]
BASE = {"losses": [5.0, 4.5, 4.0], "param_l2": 10.0, "param_sha256": "abc",
        "reconfigurations": 0, "preemptions": 0, "layouts": KEPT, "config": {"exact": False},
        **{k: 0 for k in COUNTERS}}


def test_differs_says_what_differs() -> None:
    assert differs(BASE, BASE) == ""
    one_loss = dict(BASE, preemptions=1, failovers=1)
    assert differs(BASE, one_loss) == ""
    assert "the loss of step 1" in differs(BASE, dict(BASE, losses=[5.0, 4.6, 4.0]))
    assert "2 losses" in differs(BASE, dict(BASE, losses=[5.0, 4.5]))
    assert "param_l2" in differs(BASE, dict(BASE, param_l2=10.1))
    assert "param_sha256 differs" in differs(BASE, dict(BASE, param_sha256="abd"))
    assert "counters sum to 0" in differs(BASE, dict(BASE, preemptions=1))
    assert "is nan" in differs(BASE, dict(BASE, losses=[5.0, float("nan"), 4.0]))


def test_the_bits_rule_follows_the_contract() -> None:
    """Bits equal where every step kept D x P and no slot was re-routed, or under --exact;
    a re-route (another order of the fp32 sums) or a change of D or P leaves tolerance."""
    rerouted = KEPT + [{"from_step": 3, "pipelines": 2, "stages": 2, "rerouted": True}]
    smaller = KEPT + [{"from_step": 3, "pipelines": 1, "stages": 2, "rerouted": False}]
    back = smaller + [{"from_step": 5, "pipelines": 2, "stages": 2, "rerouted": False}]
    shadowed = dict(BASE, preemptions=2, failovers=1, drains=1, reconfigurations=1)
    assert bits_must_match(shadowed, BASE)  # a failover and a drain that keep the layout
    assert "param_sha256 differs" in differs(BASE, dict(shadowed, param_sha256="abd"))
    for layouts in (rerouted, smaller, back):
        got = dict(BASE, layouts=layouts, param_sha256="abd", preemptions=1, reroutes=1)
        assert not bits_must_match(got, BASE) and differs(BASE, got) == ""
        exact = dict(got, config={"exact": True})
        assert bits_must_match(exact, BASE) and "(--exact)" in differs(BASE, exact)
    assert not bits_must_match(dict(BASE, layouts=KEPT), dict(BASE, layouts=[
        {"from_step": 0, "pipelines": 1, "stages": 2, "rerouted": False}]))
    old = {k: v for k, v in BASE.items() if k != "layouts"}  # before the record
    assert bits_must_match(old) and not bits_must_match(dict(old, reroutes=1))


def test_an_equal_verdict_says_why() -> None:
    """The table explains each equal trial: how its losses were handled and which rule
    judged its bits."""
    shadowed = dict(BASE, preemptions=1, failovers=1, losses=[5.0, 4.5 * (1 + 2e-8), 4.0])
    assert explain(BASE, shadowed) == ("failovers 1; bits equal, as required (the layout was "
                                       "kept); losses within 2.0e-08 relative")
    rerouted = dict(BASE, preemptions=1, reroutes=1, param_sha256="abd", layouts=KEPT + [
        {"from_step": 3, "pipelines": 2, "stages": 2, "rerouted": True}])
    assert explain(BASE, rerouted).startswith("reroutes 1; bits differ, allowed: ")
    assert explain(BASE, dict(BASE, config={"exact": True})) == (
        "no loss; bits equal, as required (--exact); losses within 0.0e+00 relative")


def test_a_rerun_command_carries_the_fault() -> None:
    train = ["--nodes", "4", "--stages", "2"]
    kill = Trial(index=2, faults=[{"kind": "burst", "node": "n0", "pipeline": 0, "stage": 0,
                                   "step": 3},
                                  {"kind": "burst", "node": "n1", "pipeline": 0, "stage": 1,
                                   "step": 3}])
    assert rerun_command(train, kill, ["kill", "burst"], 5) == \
        "bamboo train --nodes 4 --stages 2 --kill 0:0@3 --kill 0:1@3"
    notice = Trial(index=0, faults=[{"kind": "notice", "node": "n3", "pipeline": 1, "stage": 1,
                                     "step": 4}])
    assert rerun_command(train, notice, ["notice"], 5).endswith("--kill 1:1@4+notice")
    twice = Trial(index=7, faults=[dict(kill.faults[0], node=n) for n in ("n0", "n2")])
    assert rerun_command(train, twice, ["burst"], 5) == (  # one holder named twice
        "bamboo soak --nodes 4 --stages 2 --faults burst --seed 5 --trial 7")
    for faults in ([{"kind": "stop", "node": "n1", "pipeline": 0, "stage": 1, "step": 2}],
                   [{"kind": "kill", "node": "n4", "pipeline": None, "stage": None, "step": 2}],
                   [{"kind": "coordinator", "after_step": 2}]):
        assert rerun_command(train, Trial(index=7, faults=faults), ["kill", "stop"], 5) == \
            "bamboo soak --nodes 4 --stages 2 --faults kill,stop --seed 5 --trial 7"


@pytest.mark.parametrize("args,expected", [
    (["--faults", "kill,meteor"], "--faults 'kill,meteor': choose from kill, stop"),
    (["--trials", "0"], "--trials must be a positive integer"),
    (["--trial", "-1"], "--trial must be 0 or more"),
    (["--resume", "auto"], "--out, --resume and --json are the soak's own"),
])
def test_bad_soak_flags_are_one_line(args: list[str], expected: str,
                                     capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main(["soak", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


def test_draws_keep_every_seed_and_send_half_the_coordinator_kills_at_the_end() -> None:
    """A seed draws what it drew before the end moment existed (kind, step, delay); only a
    coordinator fault draws once more: whether it waits for the run's end."""
    for seed in range(20):
        rng = random.Random(seed * 100_003 + 3)
        old = (rng.choice(["kill", "stop"]), rng.randint(1, 6), rng.uniform(0.0, 0.5))
        d, _ = draw(seed, 3, ["kill", "stop"], 8)
        assert (d.kind, d.at_step, d.delay, d.at_end) == (*old, False)
    ends = [draw(seed, 0, ["coordinator"], 8)[0].at_end for seed in range(200)]
    assert 60 < sum(ends) < 140


def test_a_trial_is_judged_by_its_stdout() -> None:
    """A finished run's summary printed again (a coordinator killed after writing it, rerun
    with --resume auto) is equal; a stdout that is not the summary is wrong, saying so."""
    trial = Trial(index=0)
    judge(trial, BASE, 0, json.dumps(BASE), "bamboo train: the run in R already completed 3 "
          "steps; nothing to do")
    assert trial.outcome == "equal", trial.why
    for stdout in ("", "noisy-model: hello\n" + json.dumps(BASE)):
        judge(trial, BASE, 0, stdout, "")
        assert trial.outcome == "wrong"
        assert trial.why.startswith("exit code 0 but its stdout is not the summary ("), trial.why
    judge(trial, BASE, 1, "", "bamboo train: error: checkpoint of step 4 not saved: ...")
    assert trial.outcome == "clear_stop"
