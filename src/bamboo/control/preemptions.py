"""Preemption sources: `--kill`, notices, and trace replay.

- `--kill D:S@K` is carried out inside the holder of (D, S) as step K begins (a fault
  in its spec); `--kill D:S@K+notice` is a notice sent from here as step K begins, with
  SIGKILL `--notice-s` seconds later. Each fires once, even when step K is redone (the
  fired set is `kills.Kills`').
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

from typing import Any

from bamboo.control.kills import Kills
from bamboo.control.nodes import Node, NodeState, Supervisor
from bamboo.control.state import RunContext

__all__ = ["Preemptions"]


class Preemptions:
    def __init__(self, ctx: RunContext, nodes: Supervisor, kills: Kills) -> None:
        self.ctx, self.nodes, self.kills = ctx, nodes, kills
        self.replay: Any = None
        self.trace_t0: float | None = None
        self.trace_owner: dict[int, int] = {}
        """Trace node -> the node id that plays it."""
        self.trace_live: dict[int, float] = {}
        """Trace nodes alive in the trace now -> the trace second they were added."""
        self.booting: dict[int, float] = {}
        """Trace nodes given a freed slot -> the trace second their worker starts."""
        self.waiting_said: set[int] = set()

    def load_trace(self) -> None:
        """`--trace`: the replay of the job's trace (validated by the command line already)."""
        cfg = self.ctx.cfg.cluster
        if cfg.trace is None:
            return
        from bamboo.traces.replay import TraceReplay
        from bamboo.traces.trace import load_trace
        trace = load_trace(cfg.trace)
        replay = TraceReplay(trace, initial=self.ctx.cfg.layout.nodes,
                             time_scale=cfg.replay_time_scale)
        self.replay = replay
        self.trace_live.update(replay.initial_added)
        self.ctx.events.write("trace", file=cfg.trace, rows=len(trace.times),
                              preemptions=trace.preemptions, time_scale=cfg.replay_time_scale,
                              window_s=round(replay.window_s(), 2))

    def played_by(self, trace_node: int, node: int) -> None:
        """Node `node` now plays trace node `trace_node`."""
        self.trace_owner[trace_node] = node

    def generation_runs(self) -> bool:
        """A generation runs: the trace's clock starts with the first one (True then)."""
        if self.trace_t0 is not None:
            return False
        self.trace_t0 = self.ctx.clock()
        return True

    # -- --kill -----------------------------------------------------------------------------

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
            if k.notice and self.kills.fire(str(k)):
                holder = self.nodes.by_name(ctx.plan.members[roles.holders[k.pipeline][k.stage]])
                self.preempt(holder, f"--kill {k}")

    # -- notices ----------------------------------------------------------------------------

    def on_notice(self, n: Node, source: str, where: str) -> bool:
        """True when this is news: a node that finished, left, was fenced or retired, or was
        noticed before, keeps its state (a late notice changes nothing). `where`: its role."""
        if n.exited or n.state not in (NodeState.STARTING, NodeState.READY):
            return False
        self.nodes.set_state(n, NodeState.NOTICED)
        where_run = {"host": n.host, **n.labels} if n.host is not None else dict(n.labels)
        self.ctx.events.write("notice", node=n.name, source=source, step=self.ctx.committed,
                              role=where, **where_run)
        self.ctx.say(f"node {n.name} ({where}) got a preemption notice ({source}); it "
                     f"drains at the next step boundary")
        return True

    def preempt(self, n: Node, why: str) -> None:
        """A cloud takes `n` away: SIGKILL now, or a notice (SIGTERM) and SIGKILL later."""
        if n.exited or n.state is NodeState.LOST:
            return
        notice = self.ctx.cfg.cluster.notice_s
        self.ctx.events.write("preempt", node=n.name, why=why, notice_s=notice)
        if notice is None:
            self.nodes.kill(n)
            return
        self.nodes.kill(n, at=self.ctx.clock() + notice)
        n.process.terminate_notice()

    def tick(self) -> list[int]:
        """Due kills of noticed nodes, and the trace's due events: the trace nodes whose
        worker starts now (the caller starts them and says who plays each: `played_by`)."""
        now = self.ctx.clock()
        self.nodes.kill_due(now)
        if self.replay is None or self.trace_t0 is None:
            return []
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
        return self._fill(trace_s, added)

    def _fill(self, trace_s: float, added: set[int]) -> list[int]:
        """Free slots to live trace nodes without a worker, the longest alive first: one
        the trace adds now starts at once, one that waited after `--boot-s`. The trace
        nodes to start now."""
        cap, boot_s = self.ctx.cfg.node_cap, self.ctx.cfg.cluster.boot_s
        alive = sum(1 for n in self.nodes if n.is_alive and n.state in
                    (NodeState.STARTING, NodeState.READY, NodeState.DONE))
        free = cap - alive - len(self.booting)
        waiting = sorted((t, tn) for tn, t in self.trace_live.items()
                         if tn not in self.trace_owner and tn not in self.booting)
        start: list[int] = []
        for _, trace_node in waiting:
            if free <= 0:
                if trace_node not in self.waiting_said:
                    self.waiting_said.add(trace_node)
                    self.ctx.events.write("trace_waiting", trace_node=self.replay.name(trace_node),
                                          why=f"every slot taken (--max-nodes {cap})")
                continue
            free -= 1
            if trace_node in added or boot_s <= 0:
                start.append(trace_node)
            else:
                self.booting[trace_node] = trace_s + boot_s
                self.ctx.events.write("trace_booting", trace_node=self.replay.name(trace_node),
                                      starts_at_trace_s=round(trace_s + boot_s, 1))
        for trace_node, due in list(self.booting.items()):
            if trace_s >= due:
                del self.booting[trace_node]
                start.append(trace_node)
        return start

    def trace_finished(self) -> bool:
        """No node will ever be added again: the trace has no add to come, and no live
        trace node waits for a worker."""
        if self.replay is None:
            return True
        return self.replay.finished and not self.booting and all(
            tn in self.trace_owner for tn in self.trace_live)
