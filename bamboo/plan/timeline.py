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
  lazy or eager RC it also steps its replica).

Processors: by default every node has its own (the GPU case: one device per node).
With `cores=N`, N processors are shared by all nodes (processor sharing: k nodes
computing at once each run at min(1, N/k) of full speed), which is what several
worker processes on a small CPU machine see.

The model tells how much FRC work lands in bubbles: compare the eager timeline with
the `off` timeline on the same costs. A node's FRC work that fits in what would have
been idle time costs nothing; the rest lengthens the step, and
overhead = step_eager / step_off - 1.

Costs come from explicit numbers or from a run's events.jsonl (`measured.costs_from_events`).
Torch-free; `python -m bamboo.plan.timeline --help`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from bamboo.util import strict_json
from bamboo.plan import schedule as S

__all__ = [
    "MODES",
    "Costs",
    "Interval",
    "NodeTimeline",
    "Timeline",
    "ascii_timeline",
    "compare",
    "main",
    "render",
    "simulate_step",
    "ReroutedStep",
    "reroute_assignment",
    "rerouted_step",
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
        return cls(forward=(f,) * stages, backward=(b,) * stages, **kw)  # type: ignore[arg-type]

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
    FRC forward, 'C' commit, 'O' optimizer."""
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


def _cost(costs: Costs, instr: S.Instruction) -> tuple[str, float] | None:
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


def _matching_send(instr: S.Instruction) -> tuple[type, int, int] | None:
    if isinstance(instr, S.RecvActivation):
        return (S.SendActivation, instr.stage - 1, instr.mb)
    if isinstance(instr, S.RecvGrad):
        return (S.SendGrad, instr.stage + 1, instr.mb)
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

    One event loop over every node's instruction list; kept in one piece because its
    local state (clocks per node and per core, ready times of every transfer) is shared by
    every branch.

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
    held = [[s] for s in range(stages)] if held is None else [list(h) for h in held]
    greedy = frc_policy == "waits" and mode == "eager"
    lists = node_lists(stages, micro_batches, "off" if greedy else mode, held, schedule)
    n_nodes = len(lists)
    replica_of = {n: (h[0] + 1) % stages for n, h in enumerate(held)
                  if greedy and stages > 1 and len(h) == 1}
    queue: dict[int, list[S.Instruction]] = {
        n: [S.RedundantForward(0, mb) for mb in range(micro_batches)] if r == 0 else []
        for n, r in replica_of.items()}
    owner = {s: n for n, h in enumerate(held) for s in h}
    pc = [0] * n_nodes
    computing: dict[int, list] = {}  # node -> [instr, kind, remaining, start]
    wake: dict[int, float] = {}  # node -> time its pending receive is satisfied
    sends: dict[tuple[type, int, int], float] = {}
    nodes = [NodeTimeline(node=n, stages=sorted(h)) for n, h in enumerate(held)]
    t = 0.0
    while True:
        progressed = True
        while progressed:  # issue every zero-cost instruction possible at time t
            progressed = False
            for n in range(n_nodes):
                if n in computing:
                    continue
                if n in wake:
                    if wake[n] > t + _EPS:
                        continue
                    del wake[n]
                    pc[n] += 1  # the receive completes now
                    progressed = True
                while pc[n] < len(lists[n]):
                    instr = lists[n][pc[n]]
                    if isinstance(instr, (S.SendActivation, S.SendGrad)):
                        sends[(type(instr), instr.stage, instr.mb)] = t
                        if isinstance(instr, S.SendActivation) and n in replica_of \
                                and instr.stage + 1 == replica_of[n]:
                            queue[n].append(S.RedundantForward(instr.stage + 1, instr.mb))
                        pc[n] += 1
                        progressed = True
                        continue
                    need = _matching_send(instr)
                    if need is not None:
                        local = need in sends and owner.get(need[1]) == n
                        ready = sends[need] + (0.0 if local else costs.latency) \
                            if need in sends else None
                        if (ready is None or ready > t + _EPS) and queue.get(n):
                            frc = queue[n].pop(0)  # would block: fill the wait with FRC
                            computing[n] = [frc, "R", costs.frc_cost(frc.stage), t]
                            progressed = True
                            break
                        if ready is None:
                            break
                        if ready > t + _EPS:
                            wake[n] = ready
                            break
                        pc[n] += 1
                        progressed = True
                        continue
                    kind, cost = _cost(costs, instr)  # type: ignore[misc]
                    computing[n] = [instr, kind, cost, t]
                    pc[n] += 1
                    progressed = True
                    break
                if pc[n] == len(lists[n]) and n not in computing and queue.get(n):
                    frc = queue[n].pop(0)  # left over after the last micro-batch instruction
                    computing[n] = [frc, "R", costs.frc_cost(frc.stage), t]
                    progressed = True
        if not computing and not wake:
            if all(p == len(lst) for p, lst in zip(pc, lists)) and not any(queue.values()):
                break
            stuck = {n: lists[n][pc[n]] for n in range(n_nodes) if pc[n] < len(lists[n])}
            raise S.ScheduleError(f"deadlock in the timeline: nodes waiting at {stuck}")
        rate = 1.0 if cores is None or not computing else min(1.0, cores / len(computing))
        dt = min([c[2] / rate for c in computing.values()] + [w - t for w in wake.values()])
        dt = max(dt, 0.0)
        t += dt
        for n in list(computing):
            c = computing[n]
            c[2] -= rate * dt
            if c[2] <= _EPS * max(1.0, t):
                instr = c[0]
                nodes[n].intervals.append(Interval(c[3], t, c[1], instr.stage, instr.mb))
                del computing[n]
    phase_a = max((i.end for nt in nodes for i in nt.intervals), default=0.0)
    for nt in nodes:
        cursor = 0.0
        for i in sorted(nt.intervals, key=lambda i: i.start):
            if i.start > cursor + _EPS:
                nt.bubbles.append((cursor, i.start))
            cursor = max(cursor, i.end)
        if phase_a > cursor + _EPS:
            nt.bubbles.append((cursor, phase_a))
    # Commit round after the barrier, then every node's optimizer step(s).
    optim = []
    for nt in nodes:
        o = sum(costs.optim_cost(s) for s in nt.stages)
        if mode != "off" and stages > 1 and len(nt.stages) == 1:
            o += costs.replica_optim_cost((nt.stages[0] + 1) % stages)
        optim.append(o)
    end_commit = phase_a + costs.commit
    if cores is None:
        last = max(optim, default=0.0)
    else:
        last = max(max(optim, default=0.0), sum(optim) / cores)
    for nt, o in zip(nodes, optim):
        if costs.commit > 0:
            nt.intervals.append(Interval(phase_a, end_commit, "C"))
        if o > 0:
            nt.intervals.append(Interval(end_commit, end_commit + (o if cores is None else last), "O"))
    return Timeline(mode=mode, stages=stages, micro_batches=micro_batches, cores=cores,
                    phase_a_s=phase_a, step_s=end_commit + last, nodes=nodes)


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
    sends: dict[tuple, tuple[float, tuple[int, int]]] = {}
    while any(pc[n] < len(items) for n, items in lists.items()):
        progressed = False
        for n, items in lists.items():
            while pc[n] < len(items):
                d, instr = items[pc[n]]
                if isinstance(instr, (S.SendActivation, S.SendGrad)):
                    sends[(d, type(instr), instr.stage, instr.mb)] = (clock[n], n)
                else:
                    need = _matching_send(instr)
                    if need is not None:
                        if (d, *need) not in sends:
                            break
                        at, sender = sends[(d, *need)]
                        clock[n] = max(clock[n], at + (0.0 if sender == n else costs.latency))
                    else:
                        cost = _cost(costs, instr)
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


# -- output ---------------------------------------------------------------------------------


def ascii_timeline(tl: Timeline, width: int = 96, scale: float | None = None) -> list[str]:
    """One row per node: F forward, B backward, R eager FRC, C commit, O optimizer, . idle."""
    total = scale or tl.step_s or 1.0
    rows = []
    for nt in tl.nodes:
        cells = []
        for col in range(width):
            a, b = col * total / width, (col + 1) * total / width
            best, kind = 0.0, "." if a < tl.step_s else " "
            for i in nt.intervals:
                overlap = min(b, i.end) - max(a, i.start)
                if overlap > best:
                    best, kind = overlap, i.kind
            cells.append(kind if best >= 0.5 * (b - a) or kind in " ." else kind.lower())
        name = f"n{nt.node} s{'+'.join(map(str, nt.stages))}"
        rows.append(f"{name:<8}|{''.join(cells)}|")
    return rows


def render(cmp: Comparison, *, width: int = 96, show: bool = True) -> str:
    off = cmp.timelines["off"]
    where = "one processor per node" if off.cores is None else f"{off.cores} shared cores"
    where += f", FRC at {cmp.policy}, {cmp.schedule}"
    lines = [f"timeline model: P={off.stages} M={off.micro_batches}, {where}", "",
             f"{'mode':<6} {'step ms':>9} {'phase A ms':>11} {'overhead':>9}"]
    for mode, tl in cmp.timelines.items():
        lines.append(f"{mode:<6} {1e3 * tl.step_s:>9.2f} {1e3 * tl.phase_a_s:>11.2f} "
                     f"{100 * cmp.overhead(mode):>8.1f}%")
    lines += ["", (f"{'node':<6} {'mode':<6} {'busy ms':>8} {'idle ms':>8} {'bubbles':>8} "
                  f"{'FRC ms':>7} {'FRC in bubbles':>15}")]
    hidden = {n: (w, h) for n, w, h in cmp.frc_hidden()} if "eager" in cmp.timelines else {}
    for mode, tl in cmp.timelines.items():
        for nt in tl.nodes:
            extra = ""
            if mode == "eager" and nt.frc_s > 0:
                w, h = hidden[nt.node]
                extra = f"{1e3 * h:>7.2f} ({100 * h / w:.0f}%)"
            lines.append(f"n{nt.node:<5} {mode:<6} {1e3 * nt.busy():>8.2f} {1e3 * nt.idle_s:>8.2f} "
                         f"{len(nt.bubbles):>8} {1e3 * nt.frc_s:>7.2f} {extra:>15}")
    if show:
        scale = max(tl.step_s for tl in cmp.timelines.values())
        for mode, tl in cmp.timelines.items():
            lines += ["", (f"{mode}: {1e3 * tl.step_s:.2f} ms  (F forward, B backward, W weight "
                          f"gradient, R eager FRC, C commit, O optimizer, . idle; lower case: "
                          f"partly)")]
            lines += ascii_timeline(tl, width, scale)
    return "\n".join(lines)


def _floats(text: str, stages: int) -> tuple[float, ...]:
    values = [float(x) for x in text.split(",")]
    if len(values) == 1:
        values *= stages
    if len(values) != stages:
        raise SystemExit(f"error: expected 1 or {stages} comma-separated values, got {text!r}")
    return tuple(values)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bamboo.plan.timeline",
        description="Per-instruction timeline model of a 1F1B or ZB-H1 step with off/lazy/eager RC. "
                    "Costs from a run's events.jsonl or given in milliseconds.")
    ap.add_argument("--events", help="events.jsonl of a run (eager runs give the forward/"
                                     "backward split; else --backward-ratio)")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps to leave out (default 1)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--forward", default="10", help="ms per micro-batch, one or per stage")
    ap.add_argument("--backward", default="20", help="ms per micro-batch, one or per stage")
    ap.add_argument("--frc", help="ms of the FRC forward of each stage (default: --forward)")
    ap.add_argument("--backward-ratio", type=float, default=2.0)
    ap.add_argument("--latency", type=float, default=0.0, help="ms per transfer")
    ap.add_argument("--commit", type=float, default=0.0, help="ms")
    ap.add_argument("--optim", default="0", help="ms per stage")
    ap.add_argument("--cores", type=int, help="share N processors among all nodes")
    ap.add_argument("--frc-policy", choices=("slot", "waits"), default="slot",
                    help="as the engine's --frc-at: waits, FRC only when a node would block "
                         "on a receive; slot: FRC where node_schedule puts it")
    ap.add_argument("--schedule", choices=sorted(S.SCHEDULES), default="1f1b",
                    help="as the engine's --schedule")
    ap.add_argument("--weight-share", type=float, default=0.5,
                    help="zb-h1: the weight gradient's part of a backward (default 0.5)")
    ap.add_argument("--pipelines", type=int, default=1,
                    help="with --lost: data-parallel pipelines D")
    ap.add_argument("--lost", help="D:S[,D:S...]: the step while these slots are re-routed to "
                                   "their data-parallel peers (--redundancy reroute), against the "
                                   "step while stage S is shadowed by its predecessor")
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--no-ascii", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)
    if args.events:
        from bamboo.plan.measured import costs_from_events
        P, M, costs, notes = costs_from_events(args.events, skip=args.skip,
                                               backward_ratio=args.backward_ratio,
                                               latency=args.latency / 1e3)
        if not args.json:
            print(f"costs from {args.events}: {notes}")
    else:
        P, M = args.stages, args.micro_batches
        ms = lambda text: tuple(x / 1e3 for x in _floats(text, P))
        costs = Costs(forward=ms(args.forward), backward=ms(args.backward),
                      frc=ms(args.frc) if args.frc else None, latency=args.latency / 1e3,
                      commit=args.commit / 1e3, optim=ms(args.optim),
                      weight_share=args.weight_share)
    if not args.json:
        print("per-stage ms  forward " + " ".join(f"{1e3 * x:.2f}" for x in costs.forward)
              + "  backward " + " ".join(f"{1e3 * x:.2f}" for x in costs.backward)
              + f"  commit {1e3 * costs.commit:.2f}")
    if args.events:
        from dataclasses import replace
        costs = replace(costs, weight_share=args.weight_share)
    if args.lost:
        return _print_reroute(P, M, args.pipelines, args.lost, costs, args.schedule, args.json)
    cmp = compare(P, M, costs, cores=args.cores, frc_policy=args.frc_policy,
                  schedule=args.schedule)
    if args.json:
        print(strict_json.dumps(summary(cmp)))
    else:
        print(render(cmp, width=args.width, show=not args.no_ascii))
    return 0


def _print_reroute(P: int, M: int, D: int, text: str, costs: Costs, schedule: str,
                   as_json: bool) -> int:
    try:
        lost = [(int(a), int(b)) for a, b in (x.split(":") for x in text.split(","))]
        if any(not (0 <= d < D and 0 <= s < P) for d, s in lost):
            raise ValueError
    except ValueError:
        raise SystemExit(f"error: --lost {text!r}: write D:S[,D:S...] with D < {D}, S < {P}")
    clean = rerouted_step(P, M, D, [], costs, schedule=schedule).step_s
    try:
        rerouted = rerouted_step(P, M, D, lost, costs, schedule=schedule).step_s
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    shadowed = None
    if P > 1 and len({s for _, s in lost}) == 1 and len(lost) == 1:
        s = lost[0][1]
        pred = (s - 1) % P
        held = [[x] for x in range(P) if x not in (s, pred)] + [sorted({pred, s})]
        shadowed = simulate_step(P, M, "lazy", costs, held=held, schedule=schedule).step_s
    figures = {"failure_free_s": clean, "rerouted_s": rerouted, "shadowed_s": shadowed}
    if as_json:
        print(strict_json.dumps(figures))
    else:
        print(f"timeline model: P={P} D={D} M={M}, lost {text}, one processor per node, {schedule}")
        print(f"  failure-free step {1e3 * clean:.2f} ms")
        print(f"  re-routed to peers {1e3 * rerouted:.2f} ms ({rerouted / clean:.3f}x)")
        if shadowed is not None:
            print(f"  shadowed (lazy)    {1e3 * shadowed:.2f} ms ({shadowed / clean:.3f}x)")
    return 0


def summary(cmp: Comparison) -> dict:
    """The figures of a comparison as plain data."""
    out = {m: {"step_s": tl.step_s, "phase_a_s": tl.phase_a_s, "overhead": cmp.overhead(m),
               "idle_s": [nt.idle_s for nt in tl.nodes]} for m, tl in cmp.timelines.items()}
    if "eager" in cmp.timelines:
        out["frc_hidden"] = [{"node": n, "frc_s": w, "hidden_s": h} for n, w, h in cmp.frc_hidden()]
    return out


if __name__ == "__main__":
    sys.exit(main())
