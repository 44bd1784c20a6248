"""`bamboo coordinator`: the job of `bamboo train` whose nodes are agents (`bamboo agent`)
on other machines; this process holds the store and takes every decision."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bamboo.argparsing import EXIT_USAGE
from bamboo.cli.train import run, train_parser
from bamboo.config import JOIN_PORT, JOIN_TIMEOUT_S, ConfigError, JobConfig

__all__ = ["main", "coordinator_parser", "Agents", "COORDINATOR_FLAGS"]

COORDINATOR_FLAGS = ("--bind", "--advertise", "--store-port", "--token-file", "--etcd",
                     "--join-timeout")


def coordinator_parser() -> argparse.ArgumentParser:
    """`bamboo coordinator`: the job's flags (as `bamboo train`) and where agents join."""
    p = train_parser()
    p.prog = "bamboo coordinator"
    p.description = ("Run a job whose nodes are agents (bamboo agent) on other machines; "
                     "this process holds the store and takes every decision.")
    p.add_argument("--bind", default=f"127.0.0.1:{JOIN_PORT}", metavar="ADDR:PORT",
                   help=f"where agents join (default 127.0.0.1:{JOIN_PORT}; 0.0.0.0:PORT for "
                   f"other machines)")
    p.add_argument("--advertise", metavar="HOST",
                   help="the host name or address workers reach this machine's store at "
                   "(default: the --bind address, or with a wildcard bind the address each "
                   "agent joined on)")
    p.add_argument("--store-port", type=int, metavar="P",
                   help="the store's fixed port (default: the --bind port + 1)")
    p.add_argument("--token-file", metavar="PATH",
                   help="the job's join token: read from PATH if it exists (e.g. a mounted "
                   "secret), else generated and written there (mode 0600); default "
                   "RUN_DIR/join-token")
    p.add_argument("--etcd", metavar="URL",
                   help="keep membership in this etcd (v3, e.g. http://10.0.0.5:2379): "
                   "agents hold leases there, an expired lease is a lost node")
    p.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the job's --nodes agents before giving up with "
                   f"exit code 1 (default {JOIN_TIMEOUT_S:g})")
    return p


class Agents:
    """The nodes are agents that join over the network (`train.NodeSource`)."""

    prog = "bamboo coordinator"

    def __init__(self) -> None:
        self.bind: tuple[str, int] | None = None

    def parser(self) -> argparse.ArgumentParser:
        return coordinator_parser()

    def job_argv(self, argv: list[str]) -> list[str]:
        own = COORDINATOR_FLAGS
        return [a for i, a in enumerate(argv) if not a.startswith(own)
                and not (i > 0 and argv[i - 1] in own)]

    def check(self, args: argparse.Namespace, cfg: JobConfig | None) -> None:
        if cfg is not None:
            if cfg.trace is not None or cfg.recovery != "redundancy":
                raise ConfigError("--trace and --recovery checkpoint-restart need local "
                                  "workers: use bamboo train")
            return
        from bamboo.cluster.remote import parse_address
        try:
            self.bind = bind = parse_address(args.bind, "--bind")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if args.store_port is not None and not 0 < args.store_port < 65536:
            raise ConfigError(f"--store-port {args.store_port} is not a TCP port (1-65535)")
        if args.store_port is not None and args.store_port == bind[1]:
            raise ConfigError(f"--store-port {args.store_port} is the --bind port: the "
                              f"store needs a port of its own (default: bind port + 1)")
        if not args.join_timeout > 0:
            raise ConfigError(f"--join-timeout must be > 0 seconds (got {args.join_timeout:g})")
        if args.advertise is not None and not args.advertise.strip():
            raise ConfigError("--advertise is empty: give the host name or address the "
                              "agents reach this machine at")

    def start(self, args: argparse.Namespace, cfg: JobConfig, run: Any) -> tuple[Any, Any] | int:
        """The join listener (with the job's token) and, with --etcd, the membership."""
        prog, membership = self.prog, None
        from bamboo.cluster.remote import AgentListener, write_join_token
        run.path.mkdir(parents=True, exist_ok=True)
        token_file = Path(args.token_file) if args.token_file else run.path / "join-token"
        generated = not token_file.exists()
        if token_file.exists():
            token = token_file.read_text().strip()
            if len(token) < 16:
                print(f"{prog}: error: --token-file {token_file} holds a token of "
                      f"{len(token)} characters: use at least 16 (openssl rand -hex 32)",
                      file=sys.stderr)
                return EXIT_USAGE
        else:
            token = write_join_token(token_file)
        try:
            agents = AgentListener(self.bind, token, advertise=args.advertise,
                                   store_port=args.store_port, join_timeout_s=args.join_timeout)
        except OSError as e:
            print(f"{prog}: error: cannot listen on {args.bind} ({e.strerror or e}): choose "
                  f"another --bind", file=sys.stderr)
            return EXIT_USAGE
        if args.etcd:
            from bamboo.cluster.membership import EtcdMembership, MembershipError
            job = run.path.resolve().name
            try:
                membership = (EtcdMembership.host(args.etcd, token, job=job,
                                                  ttl_s=min(3.0, cfg.lease_s)), args.etcd, job)
            except MembershipError as e:
                agents.close()
                if generated:  # leave nothing behind for a job that never started
                    token_file.unlink(missing_ok=True)
                    if not any(run.path.iterdir()):
                        run.path.rmdir()
                print(f"{prog}: error: {e}", file=sys.stderr)
                return EXIT_USAGE
        if not args.token_file:
            print(f"join token: {token} (also in {token_file}, mode 0600)",
                  file=sys.stderr, flush=True)
        return agents, membership


def main(argv: list[str]) -> int:
    return run(argv, Agents())
