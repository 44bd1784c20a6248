"""`bamboo coordinator`: the job of `bamboo train` whose nodes are agents (`bamboo agent`)
on other machines; this process holds the store and takes every decision."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from bamboo.cli.parsing import EXIT_USAGE
from bamboo.cli.train import run, train_parser
from bamboo.config import JobConfig
from bamboo.config.join import JoinConfig, join_options
from bamboo.config.options import add_flags

if TYPE_CHECKING:
    from bamboo.protocol.launch import Launcher

__all__ = ["main", "coordinator_parser", "CoordinatorCommand"]


def coordinator_parser(given_only: bool = False) -> argparse.ArgumentParser:
    """`bamboo coordinator`: the job's flags (as `bamboo train`) and where agents join
    (`bamboo.config.join`)."""
    p = train_parser(given_only)
    p.prog = "bamboo coordinator"
    p.description = ("Run a job whose nodes are agents (bamboo agent) on other machines; "
                     "this process holds the store and takes every decision.")
    add_flags(p, join_options(), given_only=given_only,
              titles={"join": "where agents join this coordinator"})
    return p


class CoordinatorCommand:
    """`bamboo coordinator`: the nodes are agents that join over the network
    (`train.JobCommand`; the run's launcher is `bamboo.launch.agents.Agents`)."""

    prog = "bamboo coordinator"
    nodes_here = False

    def __init__(self) -> None:
        self.join: JoinConfig | None = None

    def parser(self, given_only: bool = False) -> argparse.ArgumentParser:
        return coordinator_parser(given_only)

    def check(self, args: argparse.Namespace) -> None:
        names = {f.key for f in join_options()}
        self.join = JoinConfig(**{k: v for k, v in vars(args).items() if k in names}).validate()

    def launcher(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> Launcher | int:
        """Agents that join the listener (with the job's token) and, with --etcd, their
        leases (`bamboo.launch.agents.open_join`); EXIT_USAGE when it cannot start."""
        assert self.join is not None, "check() comes first"
        from bamboo.launch.agents import Agents, JoinError, open_join
        try:
            listener, membership, announce = open_join(self.join, run.path,
                                                       cfg.runtime.lease_s)
        except JoinError as e:
            print(f"{self.prog}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if announce is not None:
            print(announce, file=sys.stderr, flush=True)
        return Agents(listener, membership)


def main(argv: list[str]) -> int:
    return run(argv, CoordinatorCommand())
