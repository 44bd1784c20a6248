"""`--kill` and `--crash`: the faults a worker starts with, and which kills were carried out.

`--kill D:S@K` is carried out inside the holder of (D, S) as step K begins (a fault in its
spec); `--kill D:S@K+notice` is a notice the coordinator sends as step K begins
(`preemptions.Preemptions.step_begins`). Each fires once, even when step K is redone: a
worker started later gets only the kills still ahead, and every plan names the kills
already fired (`GenerationPlan.fired_kills`), which a worker then drops.

This part is the one writer of the fired set; it needs no node, so the supervisor can ask
it for a new worker's faults before any other part exists.
"""
from __future__ import annotations

from bamboo.control.state import RunContext
from bamboo.plan.faults import Fault

__all__ = ["Kills", "kill_key"]


def kill_key(pipeline: int, stage: int, step: int) -> str:
    """The text form of a `--kill` (also its entry in `fired_kills`)."""
    return f"{pipeline}:{stage}@{step}"


class Kills:
    def __init__(self, ctx: RunContext, extra_faults: dict[int, list[Fault]] | None = None) -> None:
        self.ctx = ctx
        self.extra_faults = extra_faults or {}
        """Node id -> faults of its own (`--crash`)."""
        self.kill_faults = tuple(Fault("kill", k.step, pipeline=k.pipeline, stage=k.stage)
                                 for k in ctx.cfg.cluster.kills if not k.notice)
        self.fired: set[str] = set()
        """`--kill` specs carried out (each preempts once, even if its step is redone)."""

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

    def fire(self, kill: str) -> bool:
        """Mark `kill` carried out; False when it already was."""
        if kill in self.fired:
            return False
        self.fired.add(kill)
        return True

    def node_lost(self, rank: int) -> None:
        """The holder `rank` of the current roles was lost: the `--kill` aimed at its stage
        in this step is carried out."""
        ctx, roles = self.ctx, self.ctx.roles
        for k in ctx.cfg.cluster.kills:
            if k.step == ctx.committed and k.pipeline < roles.pipelines and \
                    k.stage < roles.stages and roles.holders[k.pipeline][k.stage] == rank:
                self.fired.add(kill_key(k.pipeline, k.stage, k.step))
