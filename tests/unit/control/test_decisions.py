"""The coordinator's decisions without processes: votes, failure handling, generations.

Each scenario drives the real coordinator parts (`tests/coordinator_sim.py`) through a
dict store with scripted workers, so the table of named cases and the random event
sequences run in seconds. The integration tests (test_failover, test_reconfig) run the
same decisions with real processes and real signals.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bamboo.config import JobConfig
from bamboo.protocol.messages import MicroBatchesDone, RoundDone, decide_key, go_key
from coordinator_sim import SimCluster
from support.decisions import kill_stage, kill_stages, node_of, run

HANDLED = {"failover", "peer_restore", "checkpoint_restore", "drain"}


def cfg(**kw) -> JobConfig:
    base = dict(nodes=4, stages=4, steps=6, micro_batches=4)
    return JobConfig.of(**(base | kw)).validate()


def accounted(sim: SimCluster, killed: set[str]) -> None:
    """Every lost node has exactly one node_lost event, with a known handling."""
    lost = sim.lost_events()
    counts = Counter(e["node"] for e in lost)
    assert all(c == 1 for c in counts.values()), counts
    assert set(counts) >= killed, (counts, killed)
    for e in lost:
        assert e["handled_as"] in HANDLED | {"standby", "stopped"}, e


# -- the table of named cases ----------------------------------------------------------------

CASES = {
    # name: (config, script, expected handled_as counts)
    "stage 0 lost": (cfg(), {2: kill_stage(0, 0)}, {"failover": 1}),
    "stage 1 lost": (cfg(), {2: kill_stage(0, 1)}, {"failover": 1}),
    "stage 2 lost": (cfg(), {2: kill_stage(0, 2)}, {"failover": 1}),
    "last stage lost": (cfg(), {2: kill_stage(0, 3)}, {"failover": 1}),
    "adjacent, one pipeline": (cfg(), {3: kill_stages((0, 1), (0, 2))},
                               {"failover": 1, "checkpoint_restore": 1}),
    "adjacent, two pipelines": (cfg(nodes=8), {3: kill_stages((0, 1), (0, 2))},
                                {"failover": 1, "peer_restore": 1}),
    "two in one step, apart": (cfg(nodes=8), {2: kill_stages((0, 1), (1, 3))},
                               {"failover": 2}),
    "a shadow lost later": (cfg(nodes=8), {1: kill_stage(0, 2), 2: kill_stage(0, 1)},
                            {"failover": 1, "peer_restore": 1}),
    "whole pipeline lost": (cfg(nodes=8), {2: kill_stages((1, 0), (1, 1), (1, 2), (1, 3))},
                            None),
    "four of two pipelines with a checkpoint": (
        cfg(nodes=8, checkpoint_every=2),
        {3: kill_stages((0, 1), (0, 2), (1, 1), (1, 2))}, None),
    "redundancy off": (cfg(redundancy="off"), {2: kill_stage(0, 2)},
                       {"checkpoint_restore": 1}),
    "drain on notice": (cfg(nodes=5), {2: lambda sim: sim.notice(node_of(sim, 0, 1))},
                        {"drain": 1}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(CASES))
def test_named_case(tmp_path: Path, name: str) -> None:
    config, script, expected = CASES[name]
    sim = run(tmp_path, config, dict(script))
    assert sim.stopped is None, sim.stopped
    assert sim.ctx.committed == config.training.steps
    assert sim.core.finished()
    kinds = Counter(e["handled_as"] for e in sim.lost_events())
    if expected is not None:
        assert dict(kinds) == expected, sim.lost_events()
    accounted(sim, set())
    summary = sim.core.summary("completed", None)
    assert sum(summary[k] for k in ("failovers", "drains", "peer_restores",
                                    "checkpoint_restores", "standby_losses")) == \
        summary["preemptions"]


@pytest.mark.timeout(60)
def test_loss_while_generation_zero_forms_restarts_from_the_seed(tmp_path: Path) -> None:
    """A worker killed before anything trained: the run goes on from step 0 on seven."""
    sim = SimCluster(cfg(nodes=8), tmp_path / "run")
    sim.kill(5)  # before any GenerationReady
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert [e["handled_as"] for e in sim.lost_events()] == ["checkpoint_restore"]
    assert sim.core.restore.redone_steps == 0
    assert sim.ctx.plan.fresh_start


@pytest.mark.timeout(60)
def test_loss_during_a_reconfiguration_is_covered_by_the_next_plan(tmp_path: Path) -> None:
    sim = SimCluster(cfg(nodes=5), tmp_path / "run")
    sim.step()
    sim.notice(node_of(sim, 0, 2))
    sim.step()  # commits with +reconf: the generation ends at this boundary
    assert sim.ctx.reconf is not None
    sim.kill(node_of(sim, 0, 1))  # lost before the next plan
    sim.finish()
    assert sim.stopped is None, sim.stopped
    kinds = sorted(e["handled_as"] for e in sim.lost_events())
    assert kinds == ["drain", "peer_restore"] or kinds == ["checkpoint_restore", "drain"], kinds


@pytest.mark.timeout(60)
def test_restore_source_lost_mid_restore_replans(tmp_path: Path) -> None:
    """Pipeline 1's copy of stage 2 is being sent to pipeline 0 when its holder dies."""
    script = {3: kill_stages((0, 1), (0, 2))}
    before = {3: kill_stage(1, 2)}
    sim = run(tmp_path, cfg(nodes=8), script, before_round=before)
    assert sim.stopped is None, sim.stopped
    accounted(sim, set())
    assert sim.ctx.committed == 6


@pytest.mark.timeout(60)
def test_a_stale_vote_is_answered_abort_and_redo(tmp_path: Path) -> None:
    sim = SimCluster(cfg(), tmp_path / "run")
    sim.step()
    old = sim.ctx.roles.epoch
    sim.kill(node_of(sim, 0, 2))  # epoch old + 1
    n0 = sim.workers[0].node
    sim.core.handle(n0, MicroBatchesDone(rank=0, step=1, epoch=old))
    sim.core.handle(n0, RoundDone(rank=0, step=1, epoch=old, ok=True, losses=[]))
    store = sim.store.data
    assert store[go_key(1, old)] == "abort" and store[decide_key(1, old)] == "redo"


@pytest.mark.timeout(60)
def test_every_node_lost_stops_with_one_true_line(tmp_path: Path) -> None:
    sim = SimCluster(cfg(nodes=2, stages=2), tmp_path / "run")
    sim.step()
    sim.kill(0)
    sim.kill(1)
    sim.settle()
    assert sim.stopped is not None and "no live node is left" in sim.stopped
    assert "--checkpoint-every" not in sim.stopped and "--pipelines" not in sim.stopped
    accounted(sim, {"n0", "n1"})
    assert {e["handled_as"] for e in sim.lost_events()} <= {"failover", "stopped"}
    assert_counters_sum(sim.failed)
    assert sim.failed["stopped"] == sum(e["handled_as"] == "stopped" for e in sim.lost_events())


COUNTERS = ("failovers", "drains", "peer_restores", "checkpoint_restores", "standby_losses",
            "stopped", "reroutes")


def assert_counters_sum(summary: dict) -> None:
    """Every lost node in exactly one counter (the contract's third-round additions)."""
    assert summary["preemptions"] == sum(summary[k] for k in COUNTERS), summary


@pytest.mark.timeout(60)
def test_all_four_of_two_pipelines_lost_in_one_step_are_all_counted(tmp_path: Path) -> None:
    sim = SimCluster(cfg(nodes=4, stages=2, steps=8, checkpoint_every=2), tmp_path / "run")
    for _ in range(5):
        sim.step()
    for node in range(4):
        sim.kill(node)
    sim.settle()
    assert sim.stopped is not None
    assert sim.failed["preemptions"] == 4
    assert_counters_sum(sim.failed)


@pytest.mark.timeout(60)
def test_redundancy_auto_records_a_choice_per_generation(tmp_path: Path) -> None:
    """Every generation's mode is the best of the expectations it records; a loss raises
    the observed rate, and the run still ends with every loss accounted."""
    sim = run(tmp_path, cfg(nodes=5, steps=12, redundancy="auto"),
              {3: kill_stage(0, 1), 7: kill_stage(0, 2)})
    assert sim.stopped is None, sim.stopped
    modes = sim.events.of("redundancy_mode")
    assert [e["gen"] for e in modes] == list(range(sim.ctx.plan.gen + 1))
    for e in modes:
        if not e["trial"]:  # a trial is the one exception (the sim's switches cost little)
            assert e["expected"][e["mode"]] == max(e["expected"].values()), e
    assert modes[-1]["rate_per_node_hour"] > modes[0]["rate_per_node_hour"]
    assert "eager" in modes[0]["estimated"]  # nothing measured before the first step
    accounted(sim, set())


# -- random event sequences ----------------------------------------------------------------

EVENTS = st.lists(st.tuples(st.integers(0, 7), st.sampled_from(
    ["kill", "kill2", "notice", "join", "kill_in_round", "kill_forming"])), max_size=6)


@pytest.mark.timeout(300)
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=EVENTS, nodes=st.sampled_from([4, 6, 8]),
       checkpoint_every=st.sampled_from([0, 2]))
def test_random_event_sequences_keep_the_invariants(tmp_path_factory, events, nodes,
                                                    checkpoint_every) -> None:
    """Any sequence of losses, notices, joins and losses during reconfigurations ends at
    the last step (or, with no node left, stops), with every lost node accounted once."""
    config = cfg(nodes=nodes, steps=8, checkpoint_every=checkpoint_every, max_nodes=12)
    sim = SimCluster(config, tmp_path_factory.mktemp("sim") / "run")
    by_step: dict[int, list[str]] = {}
    for step, kind in events:
        by_step.setdefault(step, []).append(kind)
    killed: set[str] = set()

    def live_members() -> list[int]:
        if sim.ctx.reconf is not None:
            return []
        return [node_of(sim, d, s) for d in range(sim.ctx.roles.pipelines)
                for s in range(sim.ctx.roles.stages)
                if not sim.core.gens.member(sim.ctx.roles.holders[d][s]).exited]

    def kill_one(i: int) -> None:
        live = live_members()
        if live:
            n = live[i % len(live)]
            killed.add(f"n{n}")
            sim.kill(n)

    seen: set[int] = set()
    for _ in range(100):
        k = sim.ctx.committed
        if sim.stopped is not None or k >= config.training.steps:
            break
        before = None
        if k not in seen:
            seen.add(k)
            for i, kind in enumerate(by_step.get(k, [])):
                if kind == "kill":
                    kill_one(i)
                elif kind == "kill2":
                    kill_one(i), kill_one(i + 1)
                elif kind == "notice" and live_members():
                    sim.notice(live_members()[i % len(live_members())])
                elif kind == "join":
                    sim.join()
                elif kind == "kill_in_round":
                    before = lambda i=i: kill_one(i)  # noqa: E731 (binds i now)
                elif kind == "kill_forming":
                    sim.kill(sim.join().node.node)  # a standby lost
        sim.step(before_round=before)
        sim.check_invariants()
    sim.finish()
    accounted(sim, killed)
    if sim.stopped is not None:
        assert "no live node is left" in sim.stopped, sim.stopped
    else:
        assert sim.ctx.committed == config.training.steps


def test_nothing_of_old_steps_stays_in_the_store_or_the_votes(tmp_path: Path) -> None:
    """A long run keeps a bounded store: when step k commits, the decision keys and the
    votes of steps <= k - FORGET_AFTER are gone (every survivor read them), through a loss."""
    from bamboo.control.steps import FORGET_AFTER
    steps = 12
    sim = run(tmp_path, cfg(steps=steps), {5: lambda s: s.kill(node_of(s, 0, 2))})
    assert sim.ctx.committed == steps
    keys = [k for k in sim.store.data if k.split("/")[0] in ("go", "decide", "eval")]
    old = [k for k in keys if int(k.split("/")[1]) <= steps - 1 - FORGET_AFTER]
    assert not old, old
    assert keys, "the newest steps' decisions must still be there"
    p = sim.core.steps
    for votes in (p.micro_batches_done, p.rounds, p.eval_votes):
        assert all(step > steps - 1 - FORGET_AFTER for step, _ in votes), votes
    assert all(k in sim.core.steps.written or k.startswith(("gen/", "epoch/"))
               for k in sim.store.data)


def test_a_lost_nodes_handles_are_closed(tmp_path: Path) -> None:
    from bamboo.control.nodes import EndedProcess
    sim = run(tmp_path, cfg(steps=6), {2: lambda s: s.kill(node_of(s, 0, 1))})
    lost = [n for n in sim.core.nodes if n.exited]
    assert lost and all(isinstance(n.process, EndedProcess) and n.conn.closed for n in lost)
    assert all(n.process.exitcode is not None for n in lost)
    accounted(sim, {n.name for n in lost})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("redundancy,nodes", [("lazy", 4), ("off", 8)])
def test_a_writer_lost_after_the_last_commit_is_replaced_by_a_copy(
        tmp_path: Path, redundancy: str, nodes: int) -> None:
    sim = SimCluster(cfg(redundancy=redundancy, nodes=nodes, steps=3), tmp_path / "run")
    while sim.stopped is None and sim.ctx.committed < sim.cfg.training.steps:
        sim.step()
    sim.settle()
    victim = node_of(sim, 0, 1)
    sim.final_writes(lost_before_writing=victim)
    assert sim.stopped is None, sim.stopped
    assert sim.core.finished()
    [rewrite] = sim.events.of("final_rewrite")
    stage_1 = list(range(*sim.ctx.plan.parts[1]))
    assert rewrite["layers"] == stage_1 and rewrite["node"] != f"n{victim}"
    copy = sim.core.nodes.by_name(rewrite["node"]).rank
    roles = sim.ctx.roles
    assert copy == (roles.replicas[0][1] if redundancy == "lazy" else roles.holders[1][1])
    summary = sim.core.final_summary()
    assert summary["preemptions"] == summary["failovers"] == 1


@pytest.mark.timeout(60)
def test_a_loop_finished_early_takes_a_loss_after_its_last_step_as_one(tmp_path: Path) -> None:
    """A user's loop finishes after 2 of the job's 3 steps (its FINISH order ends the run
    there): a writer lost after that commit is a loss after the last step, whose layers a
    live copy writes, not a loss in a step that will never run."""
    from bamboo.plan.orders import Order, OrderKind
    sim = SimCluster(cfg(redundancy="lazy", nodes=4, steps=3), tmp_path / "run")
    while sim.stopped is None and sim.ctx.committed < 2:
        sim.step()
    sim.settle()
    sim.core.orders.give(Order(OrderKind.FINISH))
    victim = node_of(sim, 0, 1)
    sim.final_writes(lost_before_writing=victim)
    assert sim.stopped is None, sim.stopped
    assert sim.core.finished()
    [lost] = sim.lost_events()
    assert (lost["node"], lost["step"], lost["phase"], lost["handled_as"]) == \
        (f"n{victim}", 2, "after the last step", "failover")
    [rewrite] = sim.events.of("final_rewrite")
    assert rewrite["layers"] == list(range(*sim.ctx.plan.parts[1]))


@pytest.mark.timeout(60)
def test_a_copy_asked_to_write_that_dies_keeps_the_run_open_until_its_loss(
        tmp_path: Path) -> None:
    """The copy asked to write a lost writer's layers dies before its exit is handled: the
    run is not finished (it would end with the model incomplete); the exit, handled, is a
    loss after the last step that restores those layers, and the run completes."""
    sim = SimCluster(JobConfig.of(nodes=4, stages=2, pipelines=1, steps=3, micro_batches=4,
                                  redundancy="lazy").validate(), tmp_path / "run")
    while sim.stopped is None and sim.ctx.committed < sim.cfg.training.steps:
        sim.step()
    sim.settle()
    victim = node_of(sim, 0, 1)
    sim.final_writes(lost_before_writing=victim, serve=False)
    [rewrite] = sim.events.of("final_rewrite")
    copy = int(rewrite["node"][1:])
    sim.workers[copy].node.process.exitcode = -9  # dead, its exit not handled yet
    assert not sim.core.finished()
    sim.kill(copy)
    assert sim.stopped is None, sim.stopped
    sim.settle()
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert sim.core.final_summary()["status"] == "completed"
    accounted(sim, {f"n{victim}", f"n{copy}"})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint_every,restored_from", [(0, 0), (2, 3)])
def test_a_writer_lost_after_the_last_commit_with_no_live_copy_is_restored_and_redone(
        tmp_path: Path, checkpoint_every: int, restored_from: int) -> None:
    """The only holder of stage 1 (no redundancy, one pipeline) is lost after the last
    commit, before it writes its layers: the finished generation is abandoned, the next one
    (its survivors and a standby) restores from the newest checkpoint (here the last step's:
    nothing redone), or the initial state when there is none, redoes the steps after it and
    writes the whole model."""
    sim = SimCluster(cfg(redundancy="off", steps=3, nodes=5, checkpoint_every=checkpoint_every),
                     tmp_path / "run")
    while sim.stopped is None and sim.ctx.committed < sim.cfg.training.steps:
        sim.step()
    sim.settle()
    victim = node_of(sim, 0, 1)
    sim.final_writes(lost_before_writing=victim)
    assert sim.stopped is None, sim.stopped
    assert not sim.core.finished() and not sim.events.of("final_rewrite")
    assert sim.ctx.reconf is not None and sim.ctx.reconf.abandoned
    sim.settle()  # the survivors end the generation; the next one starts back
    assert sim.ctx.committed == restored_from and sim.core.gens.running()
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert sim.core.finished()
    [restore] = sim.events.of("checkpoint_restore")
    assert (restore["step"], restore["redone_steps"]) == (restored_from, 3 - restored_from)
    summary = sim.core.final_summary()
    assert summary["status"] == "completed"
    assert summary["preemptions"] == summary["checkpoint_restores"] == 1
    [lost] = sim.lost_events()
    assert (lost["node"], lost["phase"], lost["handled_as"]) == \
        (f"n{victim}", "after the last step", "checkpoint_restore")
    accounted(sim, {f"n{victim}"})


@pytest.mark.timeout(60)
def test_a_node_frozen_after_its_last_step_is_fenced_when_the_generation_is_abandoned(
        tmp_path: Path) -> None:
    """Stage 1's only holder is lost before writing its layers, so the finished generation
    is abandoned; stage 0's holder, done and waiting to shut down, is frozen (SIGSTOP) and
    never ends the generation. Its lease fences it within seconds (not the stall check's
    minute and a half), and the standbys restore and finish the run."""
    sim = SimCluster(cfg(redundancy="off", steps=3, nodes=5, lease_s=2.0), tmp_path / "run")
    while sim.stopped is None and sim.ctx.committed < sim.cfg.training.steps:
        sim.step()
    sim.settle()
    victim, frozen = node_of(sim, 0, 1), node_of(sim, 0, 0)
    sim.final_writes(lost_before_writing=victim)
    assert sim.ctx.reconf is not None and sim.ctx.reconf.abandoned
    sim.freeze(frozen)
    sim.settle()
    assert sim.stopped is None, sim.stopped
    [fenced] = sim.events.of("fenced")
    assert fenced["node"] == f"n{frozen}"
    assert fenced["silent_s"] <= 2.0 + 0.5 < sim.cfg.runtime.step_stall_s
    sim.finish()
    assert sim.stopped is None, sim.stopped
    summary = sim.core.final_summary()
    assert summary["status"] == "completed" and summary["preemptions"] == 2
    accounted(sim, {f"n{victim}", f"n{frozen}"})


@pytest.mark.timeout(60)
def test_every_copy_lost_together_after_the_last_step_is_one_restore_of_two_losses(
        tmp_path: Path) -> None:
    """Both nodes of a lazy pipeline (every copy of both stages) killed at the same moment
    after the last commit: neither dead process counts as the other's live copy, so no
    final write is asked of a dead node and both losses are restored after the last step."""
    sim = SimCluster(JobConfig.of(nodes=4, stages=2, pipelines=1, steps=3, micro_batches=4,
                                  redundancy="lazy", checkpoint_every=0).validate(),
                     tmp_path / "run")
    while sim.stopped is None and sim.ctx.committed < 3:
        sim.step()
    sim.settle()
    sim.kill(node_of(sim, 0, 0), node_of(sim, 0, 1))
    assert sim.ctx.reconf is not None and sim.ctx.reconf.abandoned
    assert not sim.events.of("final_rewrite")
    sim.settle()
    sim.finish()
    assert sim.stopped is None, sim.stopped
    summary = sim.core.final_summary()
    assert summary["preemptions"] == summary["checkpoint_restores"] == 2
    [restore] = sim.events.of("checkpoint_restore")
    assert (restore["step"], restore["redone_steps"]) == (0, 3)  # no checkpoint: from the seed
    lost = sim.lost_events()
    assert [(e["phase"], e["handled_as"]) for e in lost] == \
        [("after the last step", "checkpoint_restore")] * 2


def _last_evaluation(sim: SimCluster, skip: int | None = None) -> None:
    """Every active node but `skip` votes its part of the held-out pass after step 3."""
    from bamboo.protocol.messages import EvalDone
    roles = sim._roles()
    for r in roles.active_ranks():
        w = sim._worker(r)
        if w.node.node != skip and not w.node.exited:
            sim._send(w, EvalDone(rank=r, step=3, epoch=roles.epoch, losses=[(r, 1.0, 1.0)]))


def _every_copy_lost_after_the_last_step(tmp_path: Path, **kw) -> SimCluster:
    """One pipeline of two stages under lazy, four standbys: both nodes (every copy of
    both stages) lost after the last commit (and its held-out pass, when one is due); the
    next generation is planned."""
    sim = SimCluster(JobConfig.of(nodes=6, stages=2, pipelines=1, steps=3, micro_batches=4,
                                  redundancy="lazy", **kw).validate(), tmp_path / "run")
    while sim.stopped is None and sim.ctx.committed < 3:
        sim.step()
    sim.settle()
    if sim.cfg.evaluates_at(3):
        _last_evaluation(sim)
    sim.kill(0)
    sim.final_writes(lost_before_writing=1)
    assert sim.ctx.reconf is not None and sim.ctx.reconf.abandoned
    sim.end_generation()
    sim._guard(sim.core.tick, sim.clock())
    assert sim.ctx.reconf is None and sim.stopped is None
    return sim


@pytest.mark.timeout(60)
def test_a_member_lost_while_the_restored_last_step_forms_abandons_it(tmp_path: Path) -> None:
    """The generation restored at the last step (its checkpoint whole) loses a member
    before it runs: a loss while a generation forms (abandoned at once, not an 'after the
    last step' loss its survivors would wait on until the communication timeout)."""
    sim = _every_copy_lost_after_the_last_step(tmp_path, checkpoint_every=3)
    assert sim.ctx.plan.start_step == 3 and not sim.core.gens.running()
    epoch = sim.ctx.roles.epoch
    sim.kill(int(sim.ctx.plan.members[0][1:]))
    assert sim.ctx.roles.epoch > epoch and sim.ctx.roles.abandon
    assert sim.ctx.reconf is not None and sim.ctx.reconf.lost[0].phase == "reconfiguration"
    sim.settle()
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert sim.core.finished() and sim.core.final_summary()["status"] == "completed"


@pytest.mark.timeout(60)
def test_a_loss_during_the_redone_last_evaluation_is_covered_in_flight(tmp_path: Path) -> None:
    """After a restore the last step's held-out pass runs again (its first result, recorded,
    stands): a node lost in it is covered in flight (new roles for the pass under way), not
    taken for a loss after the run's evaluation, which would leave the pass's vote waiting
    on it."""
    sim = _every_copy_lost_after_the_last_step(tmp_path, eval_every=3, checkpoint_every=0)
    while sim.stopped is None and sim.ctx.committed < 3:
        sim.step()
    assert 3 in sim.core.steps.evaluated  # the first pass's result
    roles = sim._roles()
    victim = sim._worker(roles.holders[0][0]).node.node
    _last_evaluation(sim, skip=victim)
    sim.kill(victim)
    assert sim.stopped is None, sim.stopped
    assert sim.ctx.roles.epoch > roles.epoch  # the pass goes on under new roles
    assert all(e["phase"] != "after the last step" for e in sim.lost_events()
               if e["node"] == f"n{victim}")


def _trace(tmp_path: Path, rows: list[tuple[float, str, str]]) -> str:
    path = tmp_path / "trace.csv"
    path.write_text("".join(f"{s * 1000:.0f},{kind},{node}\n" for s, kind, node in rows))
    return str(path)


CAPACITY_TRACE = [(0, "add", "a"), (0, "add", "b"), (10, "add", "c"), (20, "remove", "a"),
                  (25, "add", "d"), (40, "remove", "b"), (300, "remove", "c")]
"""c and d come while both slots are taken; each takes the slot a removal frees."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("boot_s", [0.0, 15.0])
def test_the_trace_is_capacity_a_freed_slot_goes_to_a_waiting_trace_node(
        tmp_path: Path, boot_s: float) -> None:
    config = cfg(nodes=2, stages=2, steps=12, max_nodes=2, time_scale=40.0, boot_s=boot_s,
                 trace=_trace(tmp_path, CAPACITY_TRACE))  # a step (0.25 s) is 10 trace s
    sim = SimCluster(config, tmp_path / "run")
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert sim.core.finished()
    played = [e["trace_node"] for e in sim.events.of("node_up")]
    assert played == ["a", "b", "c", "d"]
    assert [e["trace_node"] for e in sim.events.of("trace_waiting")] == ["c", "d"]
    booting = sim.events.of("trace_booting")
    if boot_s:
        assert [(e["trace_node"], e["starts_at_trace_s"] - boot_s) for e in booting][0][0] == "c"
        assert all(e["starts_at_trace_s"] >= 20 + boot_s for e in booting)
    else:
        assert not booting
    summary = sim.core.final_summary()
    assert summary["preemptions"] == 2 and summary["preemptions"] == sum(
        summary[k] for k in COUNTERS)


@pytest.mark.timeout(60)
def test_a_remove_of_a_trace_node_without_a_worker_changes_nothing(tmp_path: Path) -> None:
    rows = [(0, "add", "a"), (0, "add", "b"), (10, "add", "c"), (30, "remove", "c")]
    config = cfg(nodes=2, stages=2, steps=8, max_nodes=2, time_scale=40.0,
                 trace=_trace(tmp_path, rows))
    sim = SimCluster(config, tmp_path / "run")
    sim.finish()
    assert sim.stopped is None, sim.stopped
    assert [e["trace_node"] for e in sim.events.of("node_up")] == ["a", "b"]
    assert not sim.events.of("preempt") and sim.core.final_summary()["preemptions"] == 0


@pytest.mark.timeout(60)
def test_a_failed_state_transfer_is_said_in_the_projects_words(tmp_path: Path) -> None:
    from bamboo.protocol.messages import GenerationEnd
    sim = SimCluster(cfg(nodes=2, stages=2, steps=6), tmp_path / "run")
    sim.step()
    raw = ("state transfer of generation 0 failed: transfer with rank 1 failed: [/__w/pytorch/"
           "pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
           "[127.0.0.1]:6838: Connection reset by peer")
    w = sim.workers[0]
    sim.core.handle(w.node, GenerationEnd(rank=0, gen=sim.ctx.plan.gen, layers=[],
                                          step=sim.ctx.committed, failed=raw))
    shown = "\n".join(sim.core.display.lines)
    assert "the state transfer between n0 and n1 broke off" in shown, shown
    assert "pair.cc" not in shown and "gloo" not in shown
    [event] = sim.events.of("transfer_failed")
    assert event["error"] == raw and event["node"] == "n0"


@pytest.mark.timeout(60)
def test_redundancy_auto_tries_a_mode_whose_advantage_passes_its_uncertainty(tmp_path: Path) -> None:
    """One pipeline, no checkpoint: a loss under `off` sends the run back to its start, so
    the observed rate makes protection worth more than lazy's estimated extra step. Lazy,
    never run, is then tried (a generation of its own until two of its steps are timed),
    and the choice after the trial is made on its measured step."""
    sim = run(tmp_path, cfg(nodes=3, stages=2, steps=100, redundancy="auto", checkpoint_every=0),
              {10: kill_stage(0, 1)})
    assert sim.stopped is None, sim.stopped
    modes = sim.events.of("redundancy_mode")
    trials = [e for e in modes if e["trial"]]
    assert [e["mode"] for e in trials] == ["lazy"]
    trial = trials[0]
    assert "lazy" in trial["estimated"] and "lazy" not in trial["measured_step_s"]
    # On its estimate lazy is not the best: only its uncertainty makes it worth a trial.
    assert trial["expected"]["lazy"] < max(trial["expected"].values())
    for e in modes:
        if not e["trial"]:
            assert e["expected"][e["mode"]] == max(e["expected"].values()), e
    assert modes[-1] is trial  # once measured, lazy stays: no switch back
    final = sim.core.auto.costs()
    assert {"lazy", "off"} <= set(final.step_s)
    assert sim.core.auto.choose(-1) == "lazy"  # measured now, and protection pays
    assert sim.ctx.committed == 100


@pytest.mark.timeout(60)
def test_redundancy_auto_tries_nothing_on_a_quiet_cluster(tmp_path: Path) -> None:
    """No loss: at the prior rate no protected mode, even as fast as off, would pay for two
    mode switches, so a long run stays in the mode it measured first."""
    sim = run(tmp_path, cfg(nodes=4, stages=2, steps=100, redundancy="auto"), {})
    assert sim.stopped is None, sim.stopped
    modes = sim.events.of("redundancy_mode")
    assert [(e["mode"], e["trial"]) for e in modes] == [("off", False)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("own_processor, tried", [(False, []), (True, ["lazy"])])
def test_redundancy_auto_weighs_a_trial_against_the_work_it_would_add(
        tmp_path: Path, own_processor: bool, tried: list[str]) -> None:
    """The run of the trial above, with each node's timers reported: the replica's
    optimizer step (stage s + 1's optim_s) is work lazy would add. Where the workers share
    processors, a wait cannot hide it: lazy is at least 40% slower than off here, and no
    trial can pay. Where each worker has a processor of its own and waits longer than
    that work, lazy may be as fast as off, and it is tried as before."""
    work = dict(compute_s=0.15, wait_s=0.2, optim_s=0.1)
    sim = run(tmp_path, cfg(nodes=3, stages=2, steps=100, redundancy="auto", checkpoint_every=0),
              {10: kill_stage(0, 1)}, work=work, own_processor=own_processor)
    assert sim.stopped is None, sim.stopped
    modes = sim.events.of("redundancy_mode")
    assert [e["mode"] for e in modes if e["trial"]] == tried
    floors = modes[-1]["work_floor_s"]
    if own_processor:
        assert floors == {"eager": 0.0, "lazy": 0.0}
    else:
        assert floors == pytest.approx({"eager": 0.1 + 0.05, "lazy": 0.1})
        assert modes[-1]["step_s"]["lazy"] >= modes[-1]["step_s"]["off"] + 0.1 - 1e-9


@pytest.mark.timeout(60)
def test_redundancy_auto_measures_reroute_with_off(tmp_path: Path) -> None:
    """A failure-free re-routing step runs off's instructions: measuring one measures the
    other, so reroute is never run as a trial."""
    sim = run(tmp_path, cfg(nodes=4, stages=2, steps=30, redundancy="auto"), {})
    assert sim.stopped is None, sim.stopped
    costs = sim.core.auto.costs()
    assert costs.measured("reroute") and costs.step_s["reroute"] == costs.step_s["off"]
    assert not any(e["trial"] for e in sim.events.of("redundancy_mode"))


@pytest.mark.timeout(60)
def test_redundancy_auto_at_one_stage_protects_by_re_routing(tmp_path: Path) -> None:
    """At one stage no mode keeps a replica, so every mode's step is off's; a mode that
    re-routes a loss in flight is worth more than off's restore, so auto never picks off
    with peers to re-route to, and the loss is re-routed, not restored."""
    sim = run(tmp_path, cfg(nodes=4, stages=1, steps=10, redundancy="auto"), {4: kill_stage(1, 0)})
    assert sim.stopped is None, sim.stopped
    modes = sim.events.of("redundancy_mode")
    first = modes[0]
    assert first["mode"] != "off" and not first["trial"]
    assert first["expected"]["lazy"] == first["expected"]["reroute"] > first["expected"]["off"]
    assert len(set(first["step_s"].values())) == 1  # no mode estimated above off at P == 1
    assert [e["handled_as"] for e in sim.lost_events()] == ["reroute"]
    assert all(e["mode"] != "off" for e in modes[1:])


@pytest.mark.timeout(60)
def test_redundancy_auto_leaves_reroute_when_one_pipeline_is_left(tmp_path: Path) -> None:
    """A generation re-routing at D=2 loses a node, and no standby comes: the next
    generation has one pipeline, where reroute is not a mode; the choice is made among
    the others (once, this raised a KeyError on the current mode)."""
    sim = SimCluster(cfg(nodes=4, stages=2, steps=12, redundancy="auto"), tmp_path / "run")
    for _ in range(3):
        sim.step()
    sim.core.auto.current = "reroute"  # as chosen at D=2
    sim.kill(node_of(sim, 0, 1))
    while sim.stopped is None and sim.ctx.committed < 12:
        sim.step()
        sim.check_invariants()
    assert sim.stopped is None, sim.stopped
    last = sim.events.of("redundancy_mode")[-1]
    assert sim.ctx.plan.pipelines == 1 and "reroute" not in last["expected"]
    assert last["mode"] in ("eager", "lazy", "off")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loss,norm", [(float("nan"), 1.0), (2.0, float("inf"))])
def test_a_non_finite_step_stops_before_its_commit(tmp_path: Path, loss: float,
                                                  norm: float) -> None:
    """A diverging run stops at the first non-finite loss or gradient norm, naming the step;
    that step is never committed and the summary holds only the finite steps before it."""
    sim = SimCluster(cfg(nodes=2, stages=2), tmp_path / "run")
    sim.step()
    epoch = sim.ctx.roles.epoch
    workers = [sim.workers[0], sim.workers[1]]
    for r, w in enumerate(workers):
        sim._send(w, MicroBatchesDone(rank=r, step=1, epoch=epoch))
    for r, w in enumerate(workers):
        sim._send(w, RoundDone(rank=r, step=1, epoch=epoch, ok=True, losses=[(r, loss, 0.5)],
                               grad_norm=norm))
    assert sim.stopped is not None and "training diverged in step 1" in sim.stopped
    assert "lower --lr" in sim.stopped and len(sim.stopped.splitlines()) == 1
    assert decide_key(1, epoch) not in sim.store.data
    assert sim.failed["status"] == "failed" and sim.failed["steps_completed"] == 1
    assert len(sim.failed["losses"]) == 1
