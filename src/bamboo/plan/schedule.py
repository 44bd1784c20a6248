"""Pipeline schedules as data: per-stage lists of instructions for one step.

An instruction names the stage whose work it is, so a node can run a merged list
covering two stages (a shadow after failover). The engine is a dispatcher over
these lists; `simulate` replays the lists of all stages without any process, with
the engine's communication semantics (sends never block, a receive waits for its
matching send), to prove a schedule is complete and deadlock-free.

Two schedules: 1F1B (`one_f_one_b`, the default) and ZB-H1 (`zb_h1`, Zero Bubble
Pipeline Parallelism, ICLR'24), whose backward is split into the input gradient
(`BackwardInput`, on the critical path: the predecessor waits for it) and the weight
gradient (`BackwardWeight`, deferrable), so weight gradients fill what 1F1B leaves idle.

The gradient all-reduce and the optimizer step are not instructions: they are the
step's commit round (`bamboo.engine.commit`), which runs once after the list, under
the coordinator's go/commit votes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Instruction", "Forward", "Backward", "BackwardInput", "BackwardWeight", "SendActivation", "RecvActivation", "SendGrad",
    "RecvGrad", "RedundantForward", "one_f_one_b", "gpipe", "zb_h1", "SCHEDULES", "BACKWARDS",
    "simulate", "matching_send", "ScheduleError", "global_order", "node_schedule", "COMPUTE_KINDS",
    "merge_pipelines", "served_work", "defers_weight",
]


@dataclass(frozen=True, slots=True)
class Instruction:
    """Work of `stage` for one step; `mb` indexes the pipeline's own micro-batches."""

    stage: int
    mb: int


@dataclass(frozen=True, slots=True)
class Forward(Instruction):
    """Run the stage's forward on micro-batch `mb` (stage 0 loads its data first)."""


@dataclass(frozen=True, slots=True)
class Backward(Instruction):
    """Run the stage's backward on micro-batch `mb` and accumulate its gradients."""


@dataclass(frozen=True, slots=True)
class BackwardInput(Instruction):
    """ZB-H1: the gradient of the stage's input for `mb` (what the predecessor waits for),
    and of every parameter but the linear layers' weights; what those need (each layer's
    input and output gradient) is kept for `BackwardWeight`."""


@dataclass(frozen=True, slots=True)
class BackwardWeight(Instruction):
    """ZB-H1: the stage's parameter gradients for `mb`, from what its `BackwardInput` kept,
    added to the gradient sum."""


BACKWARDS = (Backward, BackwardInput, BackwardWeight)
"""The instructions of a backward pass."""


@dataclass(frozen=True, slots=True)
class SendActivation(Instruction):
    """Send the stage's output for `mb` to the holder of stage + 1."""


@dataclass(frozen=True, slots=True)
class RecvActivation(Instruction):
    """Receive the stage's input for `mb` from the holder of stage - 1."""


@dataclass(frozen=True, slots=True)
class SendGrad(Instruction):
    """Send the gradient of the stage's input for `mb` to the holder of stage - 1."""


@dataclass(frozen=True, slots=True)
class RecvGrad(Instruction):
    """Receive the gradient of the stage's output for `mb` from the holder of stage + 1."""


@dataclass(frozen=True, slots=True)
class RedundantForward(Instruction):
    """Eager FRC: run the replica of `stage` (the successor's) on micro-batch `mb`, locally."""


def _forward_group(stage: int, stages: int, mb: int) -> list[Instruction]:
    group: list[Instruction] = []
    if stage > 0:
        group.append(RecvActivation(stage, mb))
    group.append(Forward(stage, mb))
    if stage < stages - 1:
        group.append(SendActivation(stage, mb))
    return group


def _backward_group(stage: int, stages: int, mb: int, split: bool = False) -> list[Instruction]:
    group: list[Instruction] = []
    if stage < stages - 1:
        group.append(RecvGrad(stage, mb))
    group.append(BackwardInput(stage, mb) if split else Backward(stage, mb))
    if stage > 0:
        group.append(SendGrad(stage, mb))
    return group


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """Synchronous 1F1B (PipeDream-flush): warm-up forwards, steady F/B pairs, cool-down.

    Stage s keeps at most P - s micro-batches in flight, which bounds activation memory.
    """
    warmup = min(stages - stage - 1, micro_batches)
    out: list[Instruction] = []
    for mb in range(warmup):
        out += _forward_group(stage, stages, mb)
    for i in range(micro_batches - warmup):
        out += _forward_group(stage, stages, warmup + i)
        out += _backward_group(stage, stages, i)
    for mb in range(micro_batches - warmup, micro_batches):
        out += _backward_group(stage, stages, mb)
    return out


def zb_h1(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """ZB-H1: 1F1B's forwards and input gradients, with stage s deferring its weight
    gradients by s micro-batches (the last ones fill the cool-down's waits).

    With forward, input gradient and weight gradient of equal cost the step takes
    3M + P - 1 units against 1F1B's 3(M + P - 1): a third of the bubble. Every stage keeps
    at most P micro-batches in flight (forward done, weight gradient not yet), 1F1B's
    peak (its stage 0's), so activation memory does not grow.
    """
    warmup = min(stages - stage - 1, micro_batches)
    deferred: list[int] = []
    out: list[Instruction] = []

    def backward(mb: int) -> None:
        out.extend(_backward_group(stage, stages, mb, split=True))
        deferred.append(mb)
        if len(deferred) > stage:
            out.append(BackwardWeight(stage, deferred.pop(0)))

    for mb in range(warmup):
        out += _forward_group(stage, stages, mb)
    for i in range(micro_batches - warmup):
        out += _forward_group(stage, stages, warmup + i)
        backward(i)
    for mb in range(micro_batches - warmup, micro_batches):
        backward(mb)
    out += [BackwardWeight(stage, mb) for mb in deferred]
    return out


def defers_weight(schedule: str, stage: int) -> bool:
    """Whether `stage`'s weight gradients wait behind other work under `schedule`. Under
    ZB-H1 stage s defers them by s micro-batches, so stage 0 runs each right after its
    input gradient: splitting its backward would buy nothing and cost a second pass."""
    return schedule == "zb-h1" and stage > 0


SCHEDULES = {"1f1b": one_f_one_b, "zb-h1": zb_h1}
"""`--schedule`: name -> the per-stage list builder."""


def gpipe(stage: int, stages: int, micro_batches: int) -> list[Instruction]:
    """All forwards, then all backwards (GPipe); kept for comparison and tests."""
    out: list[Instruction] = []
    for mb in range(micro_batches):
        out += _forward_group(stage, stages, mb)
    for mb in reversed(range(micro_batches)):
        out += _backward_group(stage, stages, mb)
    return out


class ScheduleError(RuntimeError):
    """A set of schedules that deadlocks or leaves work undone."""


def matching_send(instr: Instruction) -> tuple[type, int, int] | None:
    """The send a receive waits for, as `simulate`'s `sent` holds it: (kind, sending stage,
    micro-batch); None for an instruction that waits for no message."""
    if isinstance(instr, RecvActivation):
        return (SendActivation, instr.stage - 1, instr.mb)
    if isinstance(instr, RecvGrad):
        return (SendGrad, instr.stage + 1, instr.mb)
    return None


def simulate(schedules: Sequence[Sequence[Instruction]], *,
             sent: set[tuple[type, int, int]] | None = None,
             done_forward: set[tuple[int, int]] | None = None,
             done_input: set[tuple[int, int]] | None = None) -> list[tuple[int, Instruction]]:
    """Run every node's list to completion; the global order executed, as (node, instr).

    Sends complete immediately; a receive waits until its matching send was issued;
    forward/backward order is checked per stage (a backward or input gradient needs its
    forward, a weight gradient its input gradient, and, off the last stage, the received
    gradient). `sent`, `done_forward` and `done_input` give the state of a step already
    under way. Raises ScheduleError on deadlock.
    """
    sent = set() if sent is None else set(sent)
    done_forward = set() if done_forward is None else set(done_forward)
    done_input = set() if done_input is None else set(done_input)
    schedules = [[i for i in sched if not isinstance(i, RedundantForward)] for sched in schedules]
    positions = [0] * len(schedules)
    order: list[tuple[int, Instruction]] = []
    while True:
        progressed = False
        for node, schedule in enumerate(schedules):
            while positions[node] < len(schedule):
                instr = schedule[positions[node]]
                need = matching_send(instr)
                if need is not None and need not in sent:
                    break
                slot = (instr.stage, instr.mb)
                if isinstance(instr, (Backward, BackwardInput)) and slot not in done_forward:
                    raise ScheduleError(f"node {node}: backward of stage {instr.stage} mb "
                                        f"{instr.mb} before its forward")
                if isinstance(instr, BackwardWeight) and slot not in done_input:
                    raise ScheduleError(f"node {node}: weight gradient of stage {instr.stage} "
                                        f"mb {instr.mb} before its input gradient")
                if isinstance(instr, Forward):
                    done_forward.add(slot)
                if isinstance(instr, BackwardInput):
                    done_input.add(slot)
                if isinstance(instr, (SendActivation, SendGrad)):
                    sent.add((type(instr), instr.stage, instr.mb))
                order.append((node, instr))
                positions[node] += 1
                progressed = True
        if all(p == len(s) for p, s in zip(positions, schedules)):
            return order
        if not progressed:
            stuck = {n: schedules[n][p] for n, p in enumerate(positions) if p < len(schedules[n])}
            raise ScheduleError(f"deadlock: nodes waiting at {stuck}")


COMPUTE_KINDS = (Forward, Backward, BackwardInput, BackwardWeight, SendActivation,
                 RecvActivation, SendGrad, RecvGrad)


def global_order(stages: int, micro_batches: int,
                 schedule: str = "1f1b") -> dict[Instruction, int]:
    """A position for every per-micro-batch instruction of every stage in one step.

    The order is one complete execution of all stages' lists of `schedule` (1f1b, zb-h1). Any node's list is
    the subsequence of this order for the stages it holds, so lists built this way
    (for nodes holding one stage, two after a failover, or more) are always
    deadlock-free together: executing all remaining work in this order is a valid
    interleaving, and with non-blocking sends one valid interleaving proves that none
    of them can deadlock.
    """
    build = SCHEDULES[schedule]
    lists = [[i for i in build(s, stages, micro_batches) if isinstance(i, COMPUTE_KINDS)]
             for s in range(stages)]
    return {instr: pos for pos, (_, instr) in enumerate(simulate(lists))}


def node_schedule(held: Sequence[int], stages: int, micro_batches: int, *,
                  order: dict[Instruction, int] | None = None,
                  frc_stage: int | None = None, schedule: str = "1f1b") -> list[Instruction]:
    """The per-micro-batch work of a node holding stages `held`, in global order (`order`,
    or that of `schedule`).

    Transfers between two stages the node holds stay in the list: the engine passes
    them in memory. With `frc_stage` (eager FRC), the replica's forward of each
    micro-batch is placed where the node would otherwise wait: right after it sent the
    replica's input, or, for a replica of stage 0 (its input is data), right before
    the node's wait for that micro-batch's activation.
    """
    order = order if order is not None else global_order(stages, micro_batches, schedule)
    chosen = set(held)
    out: list[Instruction] = []
    for instr in sorted((i for i in order if i.stage in chosen), key=order.__getitem__):
        if frc_stage == 0 and isinstance(instr, RecvActivation) and instr.stage == stages - 1:
            out.append(RedundantForward(0, instr.mb))
        out.append(instr)
        if (frc_stage is not None and frc_stage != 0 and isinstance(instr, SendActivation)
                and instr.stage == frc_stage - 1):
            out.append(RedundantForward(frc_stage, instr.mb))
    if frc_stage == 0 and stages == 1:
        out = [RedundantForward(0, mb) for mb in range(micro_batches)] + out
    return out


def served_work(reroutes: Sequence[Any], rank: int, blocks: Sequence[Sequence[int]],
                order_of: Callable[[int], dict[Instruction, int]]
                ) -> list[tuple[int, list[Instruction]]]:
    """(pipeline, instructions with local micro-batch ids) of each re-routed slot
    (`roles.Reroute`) that `rank` serves: that stage's work for the micro-batches the slot
    gives it, in the pipeline's global order."""
    out = []
    for r in reroutes:
        mine = {i for i in range(len(blocks[r.pipeline])) if r.peer_for(i) == rank}
        if not mine:
            continue
        order = order_of(len(blocks[r.pipeline]))
        out.append((r.pipeline, [i for i in sorted(order, key=order.__getitem__)
                                 if i.stage == r.stage and i.mb in mine]))
    return out


def merge_pipelines(lists: Sequence[tuple[int, Sequence[Instruction]]],
                    blocks: Sequence[Sequence[int]],
                    order_of: Callable[[int], dict[Instruction, int]]) -> list[Instruction]:
    """One node's work in several pipelines (its own, and re-routed slots it serves) as one
    list, micro-batches renamed to their global ids (`blocks[d][local]`).

    Every pipeline's instructions are ranked by their position in the global order of the
    largest pipeline (`order_of(max M_d)`: a pipeline of fewer micro-batches runs its
    subsequence, still a complete valid execution of its own), ties broken by pipeline.
    Every node ranks alike, so every node's list is a subsequence of one total order of
    all pipelines' work: the argument of `global_order` makes the lists deadlock-free
    together. And since one order ranks them all, the messages two nodes exchange at one
    boundary for two pipelines come in micro-batch order, then pipeline order, on both
    sides (per-pipeline orders of different lengths would drift apart, and strict rules
    match by order). An FRC forward keeps its place after the instruction it followed.
    """
    keyed: list[tuple[tuple[int, int, int], Instruction]] = []
    order = order_of(max(len(b) for b in blocks))
    for d, instrs in lists:
        last, k = -1, 0
        for instr in instrs:
            if instr in order:
                last, k = order[instr], 0
            else:
                k += 1
            keyed.append(((last, d, k), dataclasses.replace(instr, mb=blocks[d][instr.mb])))
    keyed.sort(key=lambda item: item[0])
    return [instr for _, instr in keyed]
