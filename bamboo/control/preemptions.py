"""Preemption sources: `--kill`, notices, and trace replay.

- `--kill D:S@K` is carried out inside the holder of (D, S) as step K begins (a fault
  in its spec); `--kill D:S@K+notice` is a notice sent from here as step K begins, with
  SIGKILL `--notice-s` seconds later. Each fires once, even when step K is redone.
- A notice (SIGTERM, a cloud's metadata, or one relayed by an agent) marks the node
  NOTICED: it drains at the next step boundary, and asks for a checkpoint there.
- `--trace` replays a preemption trace as capacity: at every moment the local cluster runs
  as many of the trace's live nodes as `--max-nodes` allows. An add starts a worker (a
  standby until the next boundary) when a slot is free; when a slot frees, a live trace
  node that has no worker takes it, the one alive longest first, `--boot-s` trace seconds
  later (a new instance boots); a remove preempts the worker that plays that node, and
  changes nothing for a trace node without one.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from bamboo.control.nodes import Node, NodeState, Supervisor
from bamboo.control.state import RunContext
from bamboo.plan.faults import Fault

__all__ = ["Preemptions"]


def kill_key(pipeline: int, stage: int, step: int) -> str:
    """The text form of a `--kill` (also its entry in `fired_kills`)."""
    return f"{pipeline}:{stage}@{step}"


class Preemptions:
    def __init__(self, ctx: RunContext, nodes: Supervisor, *, where: Callable[[Node], str],
                 extra_faults: dict[int, list[Fault]] | None = None) -> None:
        self.ctx, self.nodes, self.where = ctx, nodes, where
        cfg = ctx.cfg
        self.extra_faults = extra_faults or {}
        self.kill_faults = tuple(Fault("kill", k.step, pipeline=k.pipeline, stage=k.stage)
                                 for k in cfg.cluster.kills if not k.notice)
        self.fired: set[str] = set()
        """`--kill` specs carried out (each preempts once, even if its step is redone)."""
        self.replay: Any = None
        self.trace_t0: float | None = None
        self.trace_owner: dict[int, int] = {}
        """Trace node -> the node id that plays it."""
        self.trace_live: dict[int, float] = {}
        """Trace nodes alive in the trace now -> the trace second they were added."""
        self.booting: dict[int, float] = {}
        """Trace nodes given a freed slot -> the trace second their worker starts."""
        self.waiting_said: set[int] = set()

    # -- --kill -----------------------------------------------------------------------------

    def faults_for(self, node: int, first_gen: int) -> tuple[Fault, ...]:
        """The faults a worker starts with. One started later gets only the kills still
        ahead (a step redone after a restore must not preempt its new holder again)."""
        later = first_gen > 0
        return tuple(f for f in self.kill_faults
                     if kill_key(f.pipeline, f.stage, f.step) not in self.fired
                     and (not later or f.step >= self.ctx.committed)) + \
            tuple(self.extra_faults.get(node, []))

    def fired_kills(self) -> list[str]:
        return sorted(self.fired)

    def kill_fired(self, n: Node) -> None:
        """`n` was lost: the `--kill` aimed at its stage in this step is carried out."""
        ctx, roles = self.ctx, self.ctx.roles
        for k in ctx.cfg.cluster.kills:
            if k.step == ctx.committed and k.pipeline < roles.pipelines and \
                    k.stage < roles.stages and roles.holders[k.pipeline][k.stage] == n.rank:
                self.fired.add(kill_key(k.pipeline, k.stage, k.step))

    def step_begins(self, step: int) -> None:
        """`--kill D:S@K+notice`: notice the holder of (D, S) as step K begins; a `--kill`
        naming a stage no node holds by then (the layout changed) is reported."""
        ctx, roles = self.ctx, self.ctx.roles
        for k in ctx.cfg.cluster.kills:
            if k.step != step:
                continue
            if k.pipeline >= roles.pipelines or k.stage >= roles.stages:
                ctx.events.write("kill_unmatched", kill=str(k), step=step,
                                 layout=[roles.pipelines, roles.stages])
                ctx.say(f"warning: --kill {k} names no node in step {step}: the layout is "
                        f"now {roles.pipelines} x {roles.stages}")
                continue
            if k.notice and str(k) not in self.fired:
                self.fired.add(str(k))
                holder = self.nodes.by_name(ctx.plan.members[roles.holders[k.pipeline][k.stage]])
                self.preempt(holder, f"--kill {k}")

    # -- notices ----------------------------------------------------------------------------

    def on_notice(self, n: Node, source: str) -> bool:
        """True when this is news: a node that finished, left, was fenced or retired, or was
        noticed before, keeps its state (a late notice changes nothing)."""
        if n.exited or n.state not in (NodeState.STARTING, NodeState.READY):
            return False
        self.nodes.set_state(n, NodeState.NOTICED)
        self.ctx.events.write("notice", node=n.name, source=source, step=self.ctx.committed,
                              role=self.where(n))
        self.ctx.say(f"node {n.name} ({self.where(n)}) got a preemption notice ({source}); it "
                     f"drains at the next step boundary")
        return True

    def preempt(self, n: Node, why: str) -> None:
        """A cloud takes `n` away: SIGKILL now, or a notice (SIGTERM) and SIGKILL later."""
        if n.exited or n.state is NodeState.LOST:
            return
        notice = self.ctx.cfg.cluster.notice_s
        self.ctx.events.write("preempt", node=n.name, why=why, notice_s=notice)
        n.kill_sent = True
        if notice is None:
            n.process.kill()
            return
        n.kill_at = self.ctx.clock() + notice
        if hasattr(n.process, "terminate_notice"):  # an agent on another machine
            n.process.terminate_notice()
            return
        try:
            os.kill(n.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def tick(self, spawn: Callable[[int], Node]) -> None:
        """Due kills of noticed nodes, and the trace's due events."""
        now = self.ctx.clock()
        for n in self.nodes:
            if n.kill_at is not None and now >= n.kill_at:
                n.kill_at = None
                if not n.exited:
                    n.process.kill()
        if self.replay is None or self.trace_t0 is None:
            return
        trace_s = (now - self.trace_t0) * self.replay.time_scale
        added = set()
        for ev in self.replay.due(now - self.trace_t0):
            if ev.kind == "add":
                self.trace_live.setdefault(ev.node, ev.trace_s)
                added.add(ev.node)
                continue
            self.trace_live.pop(ev.node, None)
            self.booting.pop(ev.node, None)
            node = self.trace_owner.pop(ev.node, None)
            if node is not None:
                self.preempt(self.nodes[node], f"trace remove {ev.name}")
        for trace_node, node in list(self.trace_owner.items()):
            if self.nodes[node].exited:  # lost another way: the trace node is live still
                del self.trace_owner[trace_node]
        self._fill(trace_s, added, spawn)

    def _fill(self, trace_s: float, added: set[int], spawn: Callable[[int], Node]) -> None:
        """Free slots to live trace nodes without a worker, the longest alive first: one
        the trace adds now starts at once, one that waited after `--boot-s`."""
        cap, boot_s = self.ctx.cfg.node_cap, self.ctx.cfg.cluster.boot_s
        alive = sum(1 for n in self.nodes if n.is_alive and n.state in
                    (NodeState.STARTING, NodeState.READY, NodeState.DONE))
        free = cap - alive - len(self.booting)
        waiting = sorted((t, tn) for tn, t in self.trace_live.items()
                         if tn not in self.trace_owner and tn not in self.booting)
        for _, trace_node in waiting:
            if free <= 0:
                if trace_node not in self.waiting_said:
                    self.waiting_said.add(trace_node)
                    self.ctx.events.write("trace_waiting", trace_node=self.replay.name(trace_node),
                                          why=f"every slot taken (--max-nodes {cap})")
                continue
            free -= 1
            if trace_node in added or boot_s <= 0:
                self.trace_owner[trace_node] = spawn(trace_node).node
            else:
                self.booting[trace_node] = trace_s + boot_s
                self.ctx.events.write("trace_booting", trace_node=self.replay.name(trace_node),
                                      starts_at_trace_s=round(trace_s + boot_s, 1))
        for trace_node, due in list(self.booting.items()):
            if trace_s >= due:
                del self.booting[trace_node]
                self.trace_owner[trace_node] = spawn(trace_node).node

    def trace_finished(self) -> bool:
        """No node will ever be added again: the trace has no add to come, and no live
        trace node waits for a worker."""
        if self.replay is None:
            return True
        return self.replay.finished and not self.booting and all(
            tn in self.trace_owner for tn in self.trace_live)
