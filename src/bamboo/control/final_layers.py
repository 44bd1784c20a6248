"""The trained model's last mile: a layer whose writer was lost after the last step.

After the last step each stage's first live holder writes its layers' final parameters
(`LayerParams`). A holder killed after the last commit but before that write would leave
the model incomplete, although other live nodes hold the same parameters: its replica
holder (lazy or eager redundancy keeps the replica stepped with the primary) or the
stage's holder in another pipeline. `FinalLayers.pending()` asks one of them, through
`protocol.final_request_key`, to write those layers from its copy, and keeps the run open
until it reports them. A loss that leaves some unwritten layer with no live copy at all is
not this part's: the failure handler abandons the finished generation
(`without_live_copy`), and the next one restores those layers from the newest checkpoint
and redoes the steps after it, as for a loss of every copy mid-run.
"""
from __future__ import annotations

import json
from typing import Any

from bamboo.config.modes import RedundancyMode
from bamboo.control.nodes import NodeState, Supervisor
from bamboo.control.state import RunContext
from bamboo.protocol.messages import final_request_key

__all__ = ["FinalLayers"]


class FinalLayers:
    def __init__(self, ctx: RunContext, nodes: Supervisor, results: Any) -> None:
        self.ctx, self.nodes, self.results = ctx, nodes, results
        self.asked: dict[int, int] = {}
        """Layer -> the node asked to write it from its copy."""

    def _copies(self, *, done_only: bool = True, running: bool = False) -> dict[int, list[int]]:
        """Layer -> the live nodes that hold a copy of it, primaries first: those done with
        the last step and waiting to shut down (`done_only`), else every live member.
        `running`: only those whose process still runs (one dead, its exit not yet handled,
        holds no copy: nodes killed together are each seen without the others' copies);
        else such a node still counts until its exit is handled (a copy asked to write that
        dies keeps the run waiting for the loss that follows, never ends it incomplete)."""
        roles, plan = self.ctx.roles, self.ctx.plan
        out: dict[int, list[int]] = {}
        for table in (roles.holders, roles.replicas if plan.redundancy is not RedundancyMode.OFF else []):
            for row in table:
                for s, rank in enumerate(row):
                    if rank is None:
                        continue
                    n = self.nodes.by_name(plan.members[rank])
                    if n.exited or n.is_gone or (running and not n.process.is_alive()) or \
                            (done_only and n.state is not NodeState.DONE):
                        continue
                    for layer in range(*plan.parts[s]):
                        out.setdefault(layer, [])
                        if n.node not in out[layer]:
                            out[layer].append(n.node)
        return out

    def without_live_copy(self) -> list[int]:
        """The layers whose final parameters no node reported and no live member holds."""
        copies = self._copies(done_only=False, running=True)
        missing = set(range(len(self.ctx.param_counts))) - self.results.final
        return sorted(layer for layer in missing if not copies.get(layer))

    def pending(self) -> bool:
        """Whether the run must wait for a layer's final parameters from another copy
        (asking for them when that is news)."""
        missing = set(range(len(self.ctx.param_counts))) - self.results.final
        if not missing:
            return False
        copies = self._copies()
        ask: dict[int, list[int]] = {}
        waiting = False
        for layer in sorted(missing):
            asked = self.asked.get(layer)
            if asked is not None and asked in copies.get(layer, []):
                waiting = True  # asked, alive, not reported yet
                continue
            holders = copies.get(layer, [])
            if not holders:
                continue  # no live copy: the run ends, the model incomplete
            self.asked[layer] = holders[0]
            ask.setdefault(holders[0], []).append(layer)
            waiting = True
        for node, layers in ask.items():
            n = self.nodes[node]
            mine = sorted(layer for layer, asked in self.asked.items() if asked == node
                          and layer in missing)
            self.ctx.store.set(final_request_key(n.name), json.dumps(mine))
            self.ctx.events.write("final_rewrite", node=n.name, layers=mine)
            self.ctx.say(f"the final parameters of layer(s) {', '.join(map(str, layers))} "
                         f"were not written by their lost holder; {n.name} writes them from "
                         f"its copy")
        return waiting
