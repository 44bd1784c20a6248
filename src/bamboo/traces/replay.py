"""Replaying a preemption trace on the local cluster: which trace events are due.

Pure bookkeeping, no processes: the coordinator asks `due(trace_seconds)` and executes
what comes back (start a worker, preempt one). Rules (the contract's):

- trace time 0 is the start of the first step, and `time_scale` trace seconds pass per
  wall second;
- the first `initial` distinct nodes the trace adds are the initial workers: their adds
  are already satisfied;
- the trace is capacity (`coordinator.preemptions`): a later add asks for a worker, and
  gets one when a slot under `--max-nodes` is free, else when one frees (after
  `--boot-s`); a remove of a trace node that has a worker preempts it, and of one without a
  worker changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from bamboo.traces.trace import ADD, Trace

__all__ = ["TraceEvent", "TraceReplay"]


@dataclass(frozen=True, slots=True)
class TraceEvent:
    trace_s: float
    kind: str
    """`add` or `remove`."""
    node: int
    """Dense trace node id (Trace.nodes)."""
    name: str
    """The trace's name for it."""


class TraceReplay:
    def __init__(self, trace: Trace, *, initial: int, time_scale: float) -> None:
        self.trace, self.time_scale = trace, time_scale
        self.initial: list[int] = []
        self.initial_added: dict[int, float] = {}
        """The initial trace nodes -> the trace second the trace added them."""
        satisfied: set[int] = set()
        for i, (kind, node) in enumerate(zip(trace.kinds, trace.nodes)):
            if len(self.initial) == initial:
                break
            if kind == ADD and node not in self.initial:
                self.initial.append(node)
                self.initial_added[node] = trace.times[i]
                satisfied.add(i)
        self._rows = [i for i in range(len(trace.times)) if i not in satisfied]
        self._next = 0

    def name(self, node: int) -> str:
        names = self.trace.node_names
        return names[node] if node < len(names) else f"node{node}"

    def due(self, wall_s: float) -> list[TraceEvent]:
        """Events whose trace time has come `wall_s` wall seconds after the first step began."""
        now = wall_s * self.time_scale
        out = []
        while self._next < len(self._rows):
            i = self._rows[self._next]
            if self.trace.times[i] > now:
                break
            node = self.trace.nodes[i]
            out.append(TraceEvent(self.trace.times[i], "add" if self.trace.kinds[i] == ADD
                                  else "remove", node, self.name(node)))
            self._next += 1
        return out

    @property
    def finished(self) -> bool:
        return self._next >= len(self._rows)

    def window_s(self) -> float:
        """Wall seconds the whole trace takes at this time scale."""
        return self.trace.duration / self.time_scale
