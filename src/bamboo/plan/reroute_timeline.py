"""The timeline model of one step of D pipelines while some slots' micro-batches are served by
their data-parallel peers (`--redundancy reroute`), and the rule that assigns them.

Torch-free; `bamboo timeline --pipelines D --lost d:s` prints it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bamboo.plan import schedule as S
from bamboo.plan.timeline import Costs, instruction_cost

__all__ = ["ReroutedStep", "reroute_assignment", "rerouted_step"]


@dataclass(frozen=True, kw_only=True)
class ReroutedStep:
    """One step of D pipelines with some slots' micro-batches served by their peers."""

    step_s: float
    phase_a_s: float
    busy_s: dict[tuple[int, int], float]
    """Live slot (pipeline, stage) -> seconds of compute in the step."""
    served_by: dict[tuple[int, int, int], tuple[int, int]]
    """(pipeline, stage, micro-batch) of a lost slot -> the slot that runs it."""


def reroute_assignment(stages: int, micro_batches: int, pipelines: int,
                       lost: Sequence[tuple[int, int]]) -> dict[tuple[int, int, int], tuple[int, int]]:
    """`--redundancy reroute`'s rule: micro-batch m of a lost slot (d, s) goes to the
    (m mod k)-th of the k live holders of stage s in the other pipelines, in pipeline
    order. Raises ValueError when a stage has no live holder left."""
    dead = set(lost)
    out: dict[tuple[int, int, int], tuple[int, int]] = {}
    for d, s in sorted(dead):
        peers = [(e, s) for e in range(pipelines) if (e, s) not in dead]
        if not peers:
            raise ValueError(f"stage {s} is lost in every pipeline: nothing to re-route to")
        for mb in range(micro_batches):
            out[(d, s, mb)] = peers[mb % len(peers)]
    return out


def rerouted_step(stages: int, micro_batches: int, pipelines: int,
                  lost: Sequence[tuple[int, int]], costs: Costs, *,
                  schedule: str = "1f1b") -> ReroutedStep:
    """The timeline model of one step while the slots in `lost` are re-routed (no lost
    slot: the failure-free step), one processor per node.

    Every pipeline runs its own lists; each instruction of a lost slot runs on the peer
    `reroute_assignment` gives its micro-batch. A node's list is its share of every
    pipeline's work ordered by (position in the global order, pipeline): a valid
    interleaving (all pipelines in lockstep), hence deadlock-free. Transfers take
    `costs.latency` between nodes, none within one; the step ends with the commit round
    and the slowest node's optimizer step."""
    order = S.global_order(stages, micro_batches, schedule)
    served = reroute_assignment(stages, micro_batches, pipelines, lost)
    lists: dict[tuple[int, int], list[tuple[int, S.Instruction]]] = {}
    for d in range(pipelines):
        for instr in order:
            slot = served.get((d, instr.stage, instr.mb), (d, instr.stage))
            lists.setdefault(slot, []).append((d, instr))
    for items in lists.values():
        items.sort(key=lambda x: (order[x[1]], x[0]))
    clock = dict.fromkeys(lists, 0.0)
    busy = dict.fromkeys(lists, 0.0)
    pc = dict.fromkeys(lists, 0)
    sends: dict[tuple[Any, ...], tuple[float, tuple[int, int]]] = {}
    while any(pc[n] < len(items) for n, items in lists.items()):
        progressed = False
        for n, items in lists.items():
            while pc[n] < len(items):
                d, instr = items[pc[n]]
                if isinstance(instr, (S.SendActivation, S.SendGrad)):
                    sends[(d, type(instr), instr.stage, instr.mb)] = (clock[n], n)
                else:
                    need = S.matching_send(instr)
                    if need is not None:
                        if (d, *need) not in sends:
                            break
                        at, sender = sends[(d, *need)]
                        clock[n] = max(clock[n], at + (0.0 if sender == n else costs.latency))
                    else:
                        cost = instruction_cost(costs, instr)
                        if cost is not None:
                            clock[n] += cost[1]
                            busy[n] += cost[1]
                pc[n] += 1
                progressed = True
        if not progressed:
            raise S.ScheduleError("deadlock in the rerouted timeline")
    phase_a = max(clock.values(), default=0.0)
    optim = max((costs.optim_cost(s) for _, s in lists), default=0.0)
    return ReroutedStep(step_s=phase_a + costs.commit + optim, phase_a_s=phase_a, busy_s=busy,
                        served_by=served)
