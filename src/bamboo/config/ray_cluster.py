"""A job's Ray options: run its nodes as actors on a Ray cluster (`--ray ADDRESS`).

The section is part of the job (a job file, `bamboo.Job(ray=...)` and `--resume auto` keep
it), read by `bamboo.launch.on_ray`; without `--ray` the nodes are local worker processes.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bamboo.config.options import ConfigError, option

if TYPE_CHECKING:
    from bamboo.config.sections import JobView

__all__ = ["RaySection", "parse_resources", "RAY_WAIT_S"]

RAY_WAIT_S = 120.0
"""How long a run on Ray waits for room for its first nodes before it stops."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")


def parse_resources(text: str) -> dict[str, float]:
    """`CPU=1,GPU=1,spot=1` as {name: amount}; ValueError saying what is wrong."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, amount = part.partition("=")
        name = name.strip()
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not sep or not _NAME.match(name) or value < 0 or value != value:
            raise ValueError(f"'{part}' is not NAME=AMOUNT (e.g. CPU=1,GPU=1)")
        if name in out:
            raise ValueError(f"names {name} twice")
        out[name] = value
    if not any(out.values()):
        raise ValueError("asks Ray for nothing: give at least one amount > 0 (e.g. CPU=1)")
    return out


def _address(value: str) -> str | None:
    if not value.strip():
        return "is empty: give the cluster's address (HOST:PORT) or auto"
    if value.startswith("ray://"):
        return (f"'{value}' is a Ray Client address: run the command on a node of the cluster "
                f"(e.g. through ray job submit) with --ray auto, or give the GCS address "
                f"HOST:6379")
    return None


def _resources(value: str) -> str | None:
    try:
        parse_resources(value)
    except ValueError as e:
        return str(e)
    return None


def _directory(value: str) -> str | None:
    return None if os.path.isdir(value) else f"'{value}' is not a directory"


def _wait(value: float) -> str | None:
    return None if value > 0 else f"must be > 0 seconds (got {value:g})"


@dataclass(kw_only=True, slots=True)
class RaySection:
    """Where on Ray the nodes run, and what each asks of it."""

    address: str | None = option(None, key="ray", metavar="ADDRESS", check=_address,
                                 help="""Run the nodes as actors on the Ray cluster at ADDRESS
        (HOST:PORT of its head; auto: RAY_ADDRESS or the head running on this machine). One
        actor per node, placed by Ray; a Ray node lost is a preemption, a drain a notice.""")
    resources: str | None = option(None, key="ray_resources", metavar="R=N,...",
                                   check=_resources, help="""What one node asks of Ray, e.g.
        CPU=4,GPU=1 or CPU=1,spot=1 (default: GPU=1 where the cluster has GPUs, else
        CPU=1).""")
    working_dir: str | None = option(None, key="ray_working_dir", metavar="DIR",
                                     check=_directory, help="""The directory Ray ships to
        every node for the job's code: its modules import there (default: none; objects sent
        by value travel with the job).""")
    wait_s: float = option(RAY_WAIT_S, key="ray_wait_s", metavar="S", check=_wait,
                           help=f"""How long to wait for Ray to place the first nodes (or to
        replace lost ones) before stopping, naming what is missing (default
        {RAY_WAIT_S:g}).""")

    @property
    def resource_ask(self) -> dict[str, float] | None:
        """`resources` parsed (None: the default, chosen from the cluster)."""
        return None if self.resources is None else parse_resources(self.resources)

    def check(self, job: JobView) -> None:
        if self.address is None:
            for key, value in (("ray_resources", self.resources),
                               ("ray_working_dir", self.working_dir)):
                if value is not None:
                    raise ConfigError(f"--{key.replace('_', '-')} applies to a run on Ray: "
                                      f"add --ray ADDRESS, or drop it", key, "ray")
            if self.wait_s != RAY_WAIT_S:
                raise ConfigError("--ray-wait-s applies to a run on Ray: add --ray ADDRESS, or "
                                  "drop it", "ray_wait_s", "ray")
