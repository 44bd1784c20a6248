"""What a person watching the run sees of the coordinator: the layout panel (which node
holds which stage, shadows, standbys), a `role` event for every change of who holds what,
and a line every 2 s while something keeps the job from training."""
from __future__ import annotations

import time
from typing import Any

from bamboo.control.generations import Generations
from bamboo.control.nodes import Supervisor
from bamboo.control.state import RunContext

__all__ = ["RunView"]


class RunView:
    def __init__(self, ctx: RunContext, nodes: Supervisor, generations: Generations,
                 display: Any) -> None:
        self.ctx, self.nodes, self.gens, self.display = ctx, nodes, generations, display
        self.roles_seen: dict[int, tuple] = {}
        self._waiting_since: float | None = None
        self._last_wait_note = 0.0

    def layout_changed(self) -> None:
        self.display.layout(self.gens.rows(), [n.name for n in self.nodes.standbys()])
        self._write_roles()

    def _write_roles(self) -> None:
        """A `role` event for every live node whose role changed (which process holds which
        stage, for anyone watching the run from outside)."""
        roles, plan = self.ctx.roles, self.ctx.plan
        for n in self.nodes:
            if n.exited or n.is_gone:
                continue
            active = n.rank is not None and n.rank < plan.active
            d = roles.pipeline_of(n.rank) if active else None
            stages = roles.stages_of(n.rank) if active else []
            role = (d, tuple(stages))
            if self.roles_seen.get(n.node) != role:
                d0, s0 = self.gens.initial_role(n.node)
                # a node on a machine of its launcher's (agents, Ray) had no role in its node_up
                if n.node in self.roles_seen or n.machine is not None or \
                        role != (d0, (s0,) if s0 is not None else ()):
                    self.ctx.events.write("role", node=n.name, pid=n.process.pid, pipeline=d,
                                          stage=stages[0] if stages else None, stages=stages)
                self.roles_seen[n.node] = role

    def note_waits(self) -> None:
        """Anything that keeps the job from training for more than 2 s says so, every 2 s."""
        now, r = time.monotonic(), self.ctx.reconf
        waiting = None
        if r is not None:
            waiting = (f"reconfiguring: {len(r.ending)} node(s) still ending the generation"
                       if r.ending else "reconfiguring: waiting for nodes")
        elif not self.gens.running():
            active = self.gens.active_members()
            waiting = (f"generation {self.ctx.plan.gen}: {len(self.gens.ready & active)}/"
                       f"{len(active)} node(s) ready")
        if waiting is None:
            self._waiting_since = None
            return
        if self._waiting_since is None:
            self._waiting_since = self._last_wait_note = now
        elif now - self._last_wait_note >= 2.0:
            self._last_wait_note = now
            self.ctx.say(f"{waiting} ({now - self._waiting_since:.0f} s)")
