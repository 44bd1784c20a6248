"""What the engine is given and what it tells: its options from a job's configuration, the
list a node runs (`program.node_instructions`), and the instruction hook a fault plan is
(the points a fault names: an index of the step's program, the first forward, each val
micro-batch of the held-out pass)."""
from __future__ import annotations

import dataclasses

import pytest

from bamboo.config import JobConfig
from bamboo.engine.options import EngineOptions
from bamboo.plan import schedule as S
from bamboo.plan.faults import EVAL_FAULT_INDEX, Fault, FaultPlan, InjectedError
from bamboo.plan.layout import micro_batch_blocks
from bamboo.plan.program import (
    COMMIT_POINTS,
    MICRO_BATCHES_DONE,
    REDUCED,
    EvalMicroBatch,
    node_instructions,
)
from bamboo.plan.roles import RoleMap, plan_reroute


def test_the_options_come_from_the_config_in_one_place() -> None:
    cfg = JobConfig.of(nodes=4, stages=2, steps=7, lr=3e-3, seed=11, schedule="1f1b",
                       precision="bf16", exact=False, frc_at="slot", frc_offload=True,
                       check_replicas=True, activation_checkpointing=True).validate()
    o = EngineOptions.from_config(cfg)
    assert (o.lr, o.total_steps, o.seed, o.schedule) == (3e-3, 7, 11, "1f1b")
    assert EngineOptions.from_config(cfg.replace(schedule="zb-h1", activation_checkpointing=False)
                                     ).schedule == "zb-h1"
    assert (o.precision, o.exact, o.frc_at, o.frc_offload) == ("bf16", False, "slot", True)
    assert EngineOptions.from_config(cfg.replace(precision="fp32", exact=True)).exact
    assert o.check_replicas and o.activation_checkpointing
    assert (o.warmup_steps, o.weight_decay, o.grad_clip, o.comm) == (
        cfg.training.warmup_steps, cfg.training.weight_decay, cfg.training.grad_clip,
        cfg.runtime.comm)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.lr = 1.0  # type: ignore[misc]  # a frozen options object, changed on purpose


@pytest.mark.parametrize("schedule", sorted(S.SCHEDULES))
def test_a_node_runs_its_stages_schedule_with_the_frc_of_its_replica(schedule: str) -> None:
    roles = RoleMap.initial(stages=3, pipelines=2, redundancy=True)
    blocks = micro_batch_blocks(8, 2)
    for rank in roles.active_ranks():
        d = roles.pipeline_of(rank)
        frc = roles.replica_of(rank)
        mine = node_instructions(roles, rank, roles.stages_of(rank), blocks, schedule,
                                 frc_stage=frc)
        local = S.node_schedule(roles.stages_of(rank), 3, 4, frc_stage=frc, schedule=schedule)
        assert mine == [dataclasses.replace(i, mb=blocks[d][i.mb]) for i in local]


def test_a_peer_serving_a_rerouted_slot_runs_its_share_too() -> None:
    roles = plan_reroute(RoleMap.initial(stages=2, pipelines=2, redundancy=False), 1).roles
    blocks = micro_batch_blocks(4, 2)
    peer = node_instructions(roles, 3, roles.stages_of(3), blocks)
    assert {i.mb for i in peer} == set(blocks[0]) | set(blocks[1])  # pipeline 0's stage 1 too
    assert all(i.stage == 1 for i in peer)
    assert node_instructions(roles, 0, roles.stages_of(0), blocks) == [
        dataclasses.replace(i, mb=blocks[0][i.mb]) for i in S.node_schedule([0], 2, 2)]


def test_a_fault_fires_at_its_index_and_only_there() -> None:
    plan = FaultPlan([Fault("raise", 2, after=3)])
    plan.begin(2, lambda d, s: True)
    program = S.node_schedule([1], 2, 2)
    for index, instr in enumerate(program[:3]):
        plan.on_instruction(2, index, instr)
    plan.on_instruction(1, 3, program[3])  # another step
    with pytest.raises(InjectedError, match="step 2"):
        plan.on_instruction(2, 3, program[3])


def test_the_commit_round_points_follow_the_list() -> None:
    length = len(S.node_schedule([0], 2, 3))
    plan = FaultPlan([Fault("raise", 0, after=length + 1)])
    plan.begin(0, lambda d, s: True)
    plan.on_instruction(0, length, MICRO_BATCHES_DONE)
    assert COMMIT_POINTS.index(REDUCED) == 1
    with pytest.raises(InjectedError):
        plan.on_instruction(0, length + COMMIT_POINTS.index(REDUCED), REDUCED)


def test_by_default_a_fault_fires_after_the_steps_first_forward() -> None:
    plan = FaultPlan([Fault("raise", 5)])
    plan.begin(5, lambda d, s: True)
    plan.on_instruction(5, 0, S.RecvActivation(1, 0))
    plan.on_instruction(5, 1, S.RedundantForward(1, 0))  # FRC is no forward of the step
    with pytest.raises(InjectedError):
        plan.on_instruction(5, 2, S.Forward(1, 0))
    plan = FaultPlan([Fault("raise", 5)])
    plan.begin(5, lambda d, s: True)
    plan.on_instruction(4, 0, S.Forward(0, 0))  # the step before: begin() starts afresh
    plan.begin(5, lambda d, s: True)
    with pytest.raises(InjectedError):
        plan.on_instruction(5, 0, S.Forward(0, 0))


def test_an_eval_fault_fires_in_the_held_out_pass_only() -> None:
    plan = FaultPlan([Fault("raise", 2, EVAL_FAULT_INDEX)])
    plan.begin(2, lambda d, s: True)
    for index, instr in enumerate(S.node_schedule([0], 2, 2)):
        plan.on_instruction(2, index, instr)  # the step's instructions: not it
    with pytest.raises(InjectedError):
        plan.on_instruction(2, 0, EvalMicroBatch(0))
    step_fault = FaultPlan([Fault("raise", 2, after=0)])
    step_fault.begin(2, lambda d, s: True)
    step_fault.on_instruction(2, 0, EvalMicroBatch(0))  # index 0 of the pass is no step index


def test_a_stage_aimed_fault_is_decided_as_the_step_begins() -> None:
    held = {(0, 1)}
    plan = FaultPlan([Fault("raise", 3, pipeline=0, stage=1)])
    plan.begin(3, lambda d, s: (d, s) in held)
    held.clear()  # a role change later in the step does not re-aim it
    with pytest.raises(InjectedError):
        plan.on_instruction(3, 0, S.Forward(1, 0))
    other = FaultPlan([Fault("raise", 3, pipeline=0, stage=1)])
    other.begin(3, lambda d, s: False)
    other.on_instruction(3, 0, S.Forward(0, 0))  # not this node's
