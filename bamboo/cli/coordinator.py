"""`bamboo coordinator`: the job of `bamboo train` whose nodes are agents (`bamboo agent`)
on other machines; this process holds the store and takes every decision."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bamboo.cli.parsing import EXIT_USAGE
from bamboo.cli.train import NodesStarted, run, train_parser
from bamboo.config import ConfigError, JobConfig
from bamboo.config.join import JoinConfig, join_options
from bamboo.config.options import add_flags

__all__ = ["main", "coordinator_parser", "Agents"]


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


class Agents:
    """The nodes are agents that join over the network (`train.NodeSource`)."""

    prog = "bamboo coordinator"

    def __init__(self) -> None:
        self.join: JoinConfig | None = None

    def parser(self, given_only: bool = False) -> argparse.ArgumentParser:
        return coordinator_parser(given_only)

    def check(self, args: argparse.Namespace, cfg: JobConfig | None) -> None:
        if cfg is not None:
            if cfg.cluster.trace is not None or cfg.redundancy.recovery != "redundancy":
                raise ConfigError("--trace and --recovery checkpoint-restart need local "
                                  "workers: use bamboo train")
            from bamboo.plan.fits import check_step_length
            check_step_length(cfg, nodes_here=False)
            return
        names = {f.key for f in join_options()}
        self.join = JoinConfig(**{k: v for k, v in vars(args).items() if k in names}).validate()

    def start(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> NodesStarted | int:
        """The join listener (with the job's token) and, with --etcd, the membership."""
        prog, membership, join = self.prog, None, self.join
        assert join is not None, "check() comes first"
        import secrets

        from bamboo.fleet.remote import AgentListener, write_join_token
        run.path.mkdir(parents=True, exist_ok=True)
        token_file = Path(join.token_file) if join.token_file else run.path / "join-token"
        generated = not token_file.exists()
        if token_file.exists():
            token = token_file.read_text().strip()
            if len(token) < 16:
                print(f"{prog}: error: --token-file {token_file} holds a token of "
                      f"{len(token)} characters: use at least 16 (openssl rand -hex 32)",
                      file=sys.stderr)
                return EXIT_USAGE
        else:
            token = secrets.token_hex(16)
        try:
            agents = AgentListener(join.address(), token, advertise=join.advertise,
                                   store_port=join.store_port,
                                   join_timeout_s=join.join_timeout_s)
        except OSError as e:
            print(f"{prog}: error: cannot listen on {join.bind} ({e.strerror or e}): choose "
                  f"another --bind", file=sys.stderr)
            return EXIT_USAGE
        if generated:  # only now: whoever waits for the file may connect at once
            write_join_token(token_file, token)
        if join.etcd:
            from bamboo.fleet.membership import EtcdMembership, MembershipError
            job = run.path.resolve().name
            try:
                membership = EtcdMembership.host(join.etcd, token, job=job,
                                                 ttl_s=min(3.0, cfg.runtime.lease_s))
            except MembershipError as e:
                agents.close()
                if generated:  # leave nothing behind for a job that never started
                    token_file.unlink(missing_ok=True)
                    if not any(run.path.iterdir()):
                        run.path.rmdir()
                print(f"{prog}: error: {e}", file=sys.stderr)
                return EXIT_USAGE
        if not join.token_file:
            print(f"join token: {token} (also in {token_file}, mode 0600)",
                  file=sys.stderr, flush=True)
        return NodesStarted(agents, membership)


def main(argv: list[str]) -> int:
    return run(argv, Agents())
