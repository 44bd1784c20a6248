"""Driving the coordinator's real parts without processes (`coordinator_sim.SimCluster`):
run a job to its end with scripted losses, and name the node that holds a stage."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bamboo.config import JobConfig
from coordinator_sim import SimCluster

__all__ = ["run", "node_of", "kill_stage", "kill_stages"]


def run(tmp_path: Path, config: JobConfig, script: dict[int, Callable[[SimCluster], None]],
        *, before_round: dict[int, Callable[[SimCluster], None]] | None = None,
        **sim_kw: Any) -> SimCluster:
    """Run to the end; `script[k]` acts as step k begins, `before_round[k]` between the
    votes of step k; `sim_kw` goes to `SimCluster`."""
    sim = SimCluster(config, tmp_path / "run", **sim_kw)
    done: set[int] = set()
    for _ in range(200):
        if sim.stopped is not None or sim.ctx.committed >= config.training.steps:
            break
        k = sim.ctx.committed
        if k in script and k not in done:
            done.add(k)
            script[k](sim)
        act = (before_round or {}).pop(k, None)
        sim.step(before_round=(lambda act=act: act(sim)) if act else None)
        sim.check_invariants()
    sim.finish()
    return sim


def node_of(sim: SimCluster, pipeline: int, stage: int) -> int:
    return sim.core.gens.member(sim.ctx.roles.holders[pipeline][stage]).node


def kill_stage(pipeline: int, stage: int) -> Callable[[SimCluster], None]:
    return lambda sim: sim.kill(node_of(sim, pipeline, stage))


def kill_stages(*targets: tuple[int, int]) -> Callable[[SimCluster], None]:
    def act(sim: SimCluster) -> None:
        nodes = [node_of(sim, d, s) for d, s in targets]
        for n in nodes:
            sim.kill(n)
    return act
