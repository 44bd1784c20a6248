"""A per-instruction timeline model of one pipeline step, with and without redundancy.

It replays every node's instruction list (`schedule.node_schedule`, with the eager
FRC forwards where the engine runs them) as a discrete-event timeline:

- a compute instruction (Forward, Backward, RedundantForward; under ZB-H1 BackwardInput
  and BackwardWeight, which split a backward by `Costs.weight_share`) occupies its node
  for its cost;
- a send never blocks; a receive waits for its matching send plus `latency` (zero
  when both stages sit on the same node: the engine passes them in memory);
- after the last micro-batch instruction of every node comes the commit round (a
  barrier, then `commit` seconds) and the optimizer step (each node's own cost; with
  eager RC it also steps its replica, inline).
- lazy RC steps its replica as the engine does with a replica in host memory: on a
  thread of its own after the commit, overlapping what the node does next. The model
  lets that step fill the node's idle time (with one processor per node: its own
  bubbles; with shared cores: the cores' idle capacity of the micro-batch phase); only
  what does not fit lengthens the step ('P' intervals), and a replica's step, one
  thread, never ends sooner than its excess over that phase. That is the best case: where
  the idle time falls early in the step (the last stages wait for their first
  activation) the step fits; where it falls late (the first stage waits for its last
  gradient) the replica's step competes with the next step's first forwards.

Processors: by default every node has its own (the GPU case: one device per node).
With `cores=N`, N processors are shared by all nodes (processor sharing: k nodes
computing at once each run at min(1, N/k) of full speed), which is what several
worker processes on a small CPU machine see.

The model tells how much FRC work lands in bubbles: compare the eager timeline with
the `off` timeline on the same costs. A node's FRC work that fits in what would have
been idle time costs nothing; the rest lengthens the step, and
overhead = step_eager / step_off - 1.

Costs come from explicit numbers or from a run's events.jsonl (`bamboo.run.measured`). The
model of a step with re-routed slots is `reroute_timeline`, its text `timeline_text`.
Torch-free; `bamboo timeline --help` (the command is `bamboo.cli.timeline`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bamboo.plan import schedule as S

__all__ = [
    "MODES",
    "Costs",
    "Interval",
    "NodeTimeline",
    "Timeline",
    "Comparison",
    "compare",
    "node_lists",
    "simulate_step",
    "instruction_cost",
]

MODES = ("off", "lazy", "eager")
_EPS = 1e-12


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Seconds per micro-batch instruction, per stage; per step for commit and optimizer."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    frc: tuple[float, ...] | None = None
    """Cost of the eager FRC forward of stage r (run on r's predecessor); default forward[r]."""
    latency: float = 0.0
    """From a send to its receive being satisfied, between two nodes."""
    commit: float = 0.0
    """The commit round (gradient sums, replica gradient, global norm), after a barrier."""
    optim: tuple[float, ...] | None = None
    """Optimizer step of each primary stage; default zero."""
    replica_optim: tuple[float, ...] | None = None
    """Optimizer step of the replica of stage r (lazy and eager); default optim[r]."""
    weight_share: float = 0.5
    """ZB-H1: the part of a backward that is the weight gradient (the rest, the input
    gradient, is on the critical path). Stage 0 has no input gradient to send and runs its
    weight half right after its input half (ZB-H1 defers none there), so the model counts
    its whole backward as one piece, at the weight half's place."""

    @classmethod
    def uniform(cls, stages: int, f: float, b: float, **kw: object) -> Costs:
        return cls(forward=(f,) * stages, backward=(b,) * stages, **kw)  # type: ignore[arg-type]  # Costs' other fields, passed through by name

    def split_backward(self, stage: int) -> tuple[float, float]:
        """(input gradient, weight gradient) seconds of `stage` under ZB-H1."""
        b = self.backward[stage]
        if stage == 0:
            return 0.0, b
        return b * (1.0 - self.weight_share), b * self.weight_share

    def frc_cost(self, stage: int) -> float:
        return (self.frc or self.forward)[stage]

    def optim_cost(self, stage: int) -> float:
        return self.optim[stage] if self.optim else 0.0

    def replica_optim_cost(self, stage: int) -> float:
        return (self.replica_optim or self.optim or (0.0,) * len(self.forward))[stage]


@dataclass(frozen=True, slots=True)
class Interval:
    start: float
    end: float
    kind: str
    """'F' forward, 'B' backward (ZB-H1: its input gradient), 'W' weight gradient, 'R' eager
    FRC forward, 'C' commit, 'O' optimizer, 'P' what a lazy replica's step adds after it
    (the part that found no idle time)."""
    stage: int = -1
    mb: int = -1


@dataclass(kw_only=True)
class NodeTimeline:
    node: int
    stages: list[int]
    intervals: list[Interval] = field(default_factory=list)
    bubbles: list[tuple[float, float]] = field(default_factory=list)
    """Idle intervals in the micro-batch phase (before the commit barrier)."""

    def busy(self, kinds: str = "FBWR") -> float:
        return sum(i.end - i.start for i in self.intervals if i.kind in kinds)

    @property
    def frc_s(self) -> float:
        return self.busy("R")

    @property
    def idle_s(self) -> float:
        return sum(b - a for a, b in self.bubbles)


@dataclass(kw_only=True)
class Timeline:
    mode: str
    stages: int
    micro_batches: int
    cores: int | None
    phase_a_s: float
    step_s: float
    nodes: list[NodeTimeline]


def instruction_cost(costs: Costs, instr: S.Instruction) -> tuple[str, float] | None:
    if isinstance(instr, S.Forward):
        return "F", costs.forward[instr.stage]
    if isinstance(instr, S.Backward):
        return "B", costs.backward[instr.stage]
    if isinstance(instr, S.BackwardInput):
        return "B", costs.split_backward(instr.stage)[0]
    if isinstance(instr, S.BackwardWeight):
        return "W", costs.split_backward(instr.stage)[1]
    if isinstance(instr, S.RedundantForward):
        return "R", costs.frc_cost(instr.stage)
    return None


def node_lists(stages: int, micro_batches: int, mode: str,
               held: Sequence[Sequence[int]] | None = None,
               schedule: str = "1f1b") -> list[list[S.Instruction]]:
    """Every node's instruction list, as the engine builds it (eager: with FRC forwards)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
    held = [[s] for s in range(stages)] if held is None else [list(h) for h in held]
    order = S.global_order(stages, micro_batches, schedule)
    out = []
    for h in held:
        frc = (h[0] + 1) % stages if mode == "eager" and stages > 1 and len(h) == 1 else None
        out.append(S.node_schedule(sorted(h), stages, micro_batches, order=order, frc_stage=frc))
    return out


def simulate_step(stages: int, micro_batches: int, mode: str, costs: Costs, *,
                  cores: int | None = None, held: Sequence[Sequence[int]] | None = None,
                  frc_policy: str = "slot", schedule: str = "1f1b") -> Timeline:
    """The timeline of one step of one pipeline; `held[n]` = stages of node n (default one each).

    `frc_policy` (eager), as the engine's `--frc-at`: "slot" runs each FRC forward where
    `node_schedule` puts it (right after sending the replica's input); "waits" runs a
    pending FRC forward only when the node would otherwise block on a receive, and any
    left over after its last micro-batch instruction. The default is "slot": the closed
    forms the tests check are for it. `schedule` is the engine's `--schedule` (1f1b, zb-h1).
    """
    if frc_policy not in ("slot", "waits"):
        raise ValueError(f"frc_policy must be slot or waits (got {frc_policy!r})")
    if len(costs.forward) != stages or len(costs.backward) != stages:
        raise ValueError(f"costs must give one forward and one backward per stage ({stages})")
    if cores is not None and cores < 1:
        raise ValueError("cores must be at least 1")
    lists = [[s] for s in range(stages)] if held is None else [list(h) for h in held]
    replay = _Replay(stages, micro_batches, mode, costs, cores, lists, frc_policy, schedule)
    phase_a = replay.run()
    _mark_bubbles(replay.nodes, phase_a)
    work = 0.0  # the micro-batch phase's compute, read only for lazy on shared cores
    if mode == "lazy" and cores is not None:
        work = sum(c[1] for lst in node_lists(stages, micro_batches, mode, lists, schedule)
                   for i in lst if (c := instruction_cost(costs, i)) is not None)
    step_s = _commit_and_optimize(replay.nodes, mode, stages, costs, cores, phase_a, work)
    return Timeline(mode=mode, stages=stages, micro_batches=micro_batches, cores=cores,
                    phase_a_s=phase_a, step_s=step_s, nodes=replay.nodes)


_DONE, _BUSY, _BLOCKED = 0, 1, 2
"""What issuing one instruction did: done at once (a send, a satisfied receive), the node is
now computing, or the node waits."""


class _Replay:
    """The micro-batch phase of one step as a discrete-event loop over every node's list: its
    clocks (per node, and the processors they share), the sends so far and what each node is
    computing or waiting for."""

    def __init__(self, stages: int, micro_batches: int, mode: str, costs: Costs,
                 cores: int | None, held: list[list[int]], frc_policy: str,
                 schedule: str) -> None:
        greedy = frc_policy == "waits" and mode == "eager"
        self.costs, self.cores = costs, cores
        self.lists = node_lists(stages, micro_batches, "off" if greedy else mode, held, schedule)
        self.replica_of = {n: (h[0] + 1) % stages for n, h in enumerate(held)
                           if greedy and stages > 1 and len(h) == 1}
        self.queue: dict[int, list[S.Instruction]] = {
            n: [S.RedundantForward(0, mb) for mb in range(micro_batches)] if r == 0 else []
            for n, r in self.replica_of.items()}
        self.owner = {s: n for n, h in enumerate(held) for s in h}
        self.pc = [0] * len(self.lists)
        self.computing: dict[int, list[Any]] = {}  # node -> [instr, kind, remaining, start]
        self.wake: dict[int, float] = {}  # node -> time its pending receive is satisfied
        self.sends: dict[tuple[type, int, int], float] = {}
        self.nodes = [NodeTimeline(node=n, stages=sorted(h)) for n, h in enumerate(held)]
        self.t = 0.0

    def run(self) -> float:
        """Replay to the end of the micro-batch phase; its length (ScheduleError on a deadlock)."""
        while True:
            progressed = True
            while progressed:  # issue every zero-cost instruction possible at time t
                progressed = False
                for n in range(len(self.lists)):
                    progressed = self._issue(n) or progressed
            if not self.computing and not self.wake:
                if all(p == len(lst) for p, lst in zip(self.pc, self.lists)) \
                        and not any(self.queue.values()):
                    break
                stuck = {n: lst[self.pc[n]] for n, lst in enumerate(self.lists)
                         if self.pc[n] < len(lst)}
                raise S.ScheduleError(f"deadlock in the timeline: nodes waiting at {stuck}")
            self._advance()
        return max((i.end for nt in self.nodes for i in nt.intervals), default=0.0)

    def _issue(self, n: int) -> bool:
        """Issue what node `n` can at time t; whether anything was."""
        if n in self.computing:
            return False
        progressed = False
        if n in self.wake:
            if self.wake[n] > self.t + _EPS:
                return False
            del self.wake[n]
            self.pc[n] += 1  # the receive completes now
            progressed = True
        instructions = self.lists[n]
        while self.pc[n] < len(instructions):
            outcome = self._try(n, instructions[self.pc[n]])
            if outcome == _BLOCKED:
                break
            progressed = True
            if outcome == _BUSY:
                break
        if self.pc[n] == len(instructions) and n not in self.computing and self.queue.get(n):
            self._start_frc(n)  # left over after the last micro-batch instruction
            progressed = True
        return progressed

    def _try(self, n: int, instr: S.Instruction) -> int:
        """Issue `instr`, the next of node `n`: _DONE, _BUSY or _BLOCKED."""
        if isinstance(instr, (S.SendActivation, S.SendGrad)):
            self.sends[(type(instr), instr.stage, instr.mb)] = self.t
            if isinstance(instr, S.SendActivation) and n in self.replica_of \
                    and instr.stage + 1 == self.replica_of[n]:
                self.queue[n].append(S.RedundantForward(instr.stage + 1, instr.mb))
            self.pc[n] += 1
            return _DONE
        need = S.matching_send(instr)
        if need is None:
            kind, cost = instruction_cost(self.costs, instr)  # type: ignore[misc]  # a compute instruction here: its cost is a pair
            self.computing[n] = [instr, kind, cost, self.t]
            self.pc[n] += 1
            return _BUSY
        local = need in self.sends and self.owner.get(need[1]) == n
        ready = self.sends[need] + (0.0 if local else self.costs.latency) \
            if need in self.sends else None
        if (ready is None or ready > self.t + _EPS) and self.queue.get(n):
            self._start_frc(n)  # would block: fill the wait with FRC
            return _BUSY
        if ready is None:
            return _BLOCKED
        if ready > self.t + _EPS:
            self.wake[n] = ready
            return _BLOCKED
        self.pc[n] += 1
        return _DONE

    def _start_frc(self, n: int) -> None:
        frc = self.queue[n].pop(0)
        self.computing[n] = [frc, "R", self.costs.frc_cost(frc.stage), self.t]

    def _advance(self) -> None:
        """On to the next completion or wake-up; the nodes computing share the processors."""
        computing, cores = self.computing, self.cores
        rate = 1.0 if cores is None or not computing else min(1.0, cores / len(computing))
        dt = min([c[2] / rate for c in computing.values()]
                 + [w - self.t for w in self.wake.values()])
        dt = max(dt, 0.0)
        self.t += dt
        for n in list(computing):
            c = computing[n]
            c[2] -= rate * dt
            if c[2] <= _EPS * max(1.0, self.t):
                instr = c[0]
                self.nodes[n].intervals.append(Interval(c[3], self.t, c[1], instr.stage,
                                                        instr.mb))
                del computing[n]


def _mark_bubbles(nodes: list[NodeTimeline], phase_a: float) -> None:
    """Each node's idle intervals of the micro-batch phase."""
    for nt in nodes:
        cursor = 0.0
        for i in sorted(nt.intervals, key=lambda i: i.start):
            if i.start > cursor + _EPS:
                nt.bubbles.append((cursor, i.start))
            cursor = max(cursor, i.end)
        if phase_a > cursor + _EPS:
            nt.bubbles.append((cursor, phase_a))


def _commit_and_optimize(nodes: list[NodeTimeline], mode: str, stages: int, costs: Costs,
                         cores: int | None, phase_a: float, work: float) -> float:
    """The commit round after the barrier, then every node's optimizer step (with eager RC
    its replica's too; with lazy RC the part of the replica's step that found no idle time,
    see the module docstring); the step's end. `work`: the micro-batch phase's compute,
    every node's, in processor-seconds (read for lazy on shared cores)."""
    own, replica = [], []
    for nt in nodes:
        own.append(sum(costs.optim_cost(s) for s in nt.stages))
        keeps = mode != "off" and stages > 1 and len(nt.stages) == 1
        replica.append(costs.replica_optim_cost((nt.stages[0] + 1) % stages) if keeps else 0.0)
    optim = [o + r for o, r in zip(own, replica)] if mode == "eager" else own
    if mode != "lazy":
        replica = [0.0] * len(nodes)  # none, or stepped inline (eager) in `optim`
    if cores is None:  # each node's own end: its step, then what its replica's added
        ends = [(o, o + _lazy_rest([r], phase_a, r - nt.idle_s))
                for o, r, nt in zip(optim, replica, nodes)]
    else:  # processor sharing: the nodes' steps end together, then the replicas' rest
        own_end = max(max(optim, default=0.0), sum(optim) / cores) if optim else 0.0
        # each replica's step is one thread: it can take at most phase_a of the idle
        # capacity, and what is left runs on at most one processor a thread
        hidden = min(max(0.0, cores * phase_a - work), sum(min(r, phase_a) for r in replica))
        rest = _lazy_rest(replica, phase_a, sum(replica) - hidden, cores)
        ends = [(own_end, own_end + (rest if r > 0 else 0.0)) for r in replica]
    end_commit = phase_a + costs.commit
    for nt, o, (end_own, end) in zip(nodes, optim, ends):
        if costs.commit > 0:
            nt.intervals.append(Interval(phase_a, end_commit, "C"))
        if o > 0:
            nt.intervals.append(Interval(end_commit, end_commit + end_own, "O"))
        if end > end_own:
            nt.intervals.append(Interval(end_commit + end_own, end_commit + end, "P"))
    return end_commit + max((end for _, end in ends), default=0.0)


def _lazy_rest(replica: list[float], phase_a: float, left: float,
               processors: int | None = None) -> float:
    """Seconds lazy's replica steps (`replica`, one thread each) add after the nodes' own
    steps, `left` of their work having found no idle time: spread over the threads (at most
    `processors` of them at once), and never less than the longest one's excess over the
    micro-batch phase (a thread runs its step one processor at a time). 0 when no replica
    steps and for what rounding leaves."""
    threads = sum(1 for r in replica if r > 0)
    if threads == 0 or left <= _EPS:
        return 0.0
    rest = max(left / min(threads, processors or threads), max(replica) - phase_a)
    return rest if rest > _EPS else 0.0


@dataclass(kw_only=True)
class Comparison:
    timelines: dict[str, Timeline]
    policy: str = "slot"
    schedule: str = "1f1b"

    def overhead(self, mode: str) -> float:
        return self.timelines[mode].step_s / self.timelines["off"].step_s - 1.0

    def frc_hidden(self) -> list[tuple[int, float, float]]:
        """Per node: (node, FRC work, the part of it that fell into would-be idle time).

        FRC work lengthens a node's busy time by exactly its cost; whatever does not
        show up as a longer micro-batch phase was absorbed by bubbles.
        """
        off, eager = self.timelines["off"], self.timelines["eager"]
        extra = eager.phase_a_s - off.phase_a_s
        return [(nt.node, nt.frc_s, max(0.0, nt.frc_s - extra)) for nt in eager.nodes]


def compare(stages: int, micro_batches: int, costs: Costs, *, cores: int | None = None,
            modes: Sequence[str] = MODES, frc_policy: str = "slot",
            schedule: str = "1f1b") -> Comparison:
    """The timelines of `modes` (always including off) on the same costs."""
    modes = list(dict.fromkeys(["off", *modes]))
    return Comparison(timelines={m: simulate_step(stages, micro_batches, m, costs, cores=cores,
                                                  frc_policy=frc_policy, schedule=schedule)
                                 for m in modes}, policy=frc_policy, schedule=schedule)

