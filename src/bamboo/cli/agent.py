"""`bamboo agent --join ADDR:PORT`: one machine's workers for a coordinator elsewhere."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from bamboo.config import REJOIN_S
from bamboo.node.output import AGENT_LOG_DIR

__all__ = ["main", "agent_parser"]


def agent_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="bamboo agent", description="Run one machine's workers for a job "
                    "whose coordinator (bamboo coordinator) listens at ADDR:PORT.")
    p.add_argument("--join", required=True, metavar="ADDR:PORT", help="the coordinator's --bind")
    p.add_argument("--token", help="the job's join token (printed by the coordinator)")
    p.add_argument("--token-file", help="a file holding the join token")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="worker processes on this machine, one per GPU (worker k uses GPU k; "
                   "default 1)")
    p.add_argument("--rejoin-s", type=float, default=REJOIN_S, metavar="S",
                   help=f"when the coordinator goes away, keep trying to rejoin it for this "
                   f"many seconds before exiting (default {REJOIN_S:g})")
    p.add_argument("--notices", default="", help="preemption notice sources to watch besides "
                   "SIGTERM: a comma list of aws, gcp, azure")
    p.add_argument("--metadata-url", help="base URL of the notice source's metadata endpoint")
    p.add_argument("--http", metavar="ADDR:PORT", help="serve /healthz there (for probes)")
    p.add_argument("--log-dir", default=AGENT_LOG_DIR, metavar="DIR",
                   help=f"where each worker's stdout and stderr go, as n<id>.log (default "
                   f"{AGENT_LOG_DIR}, in the agent's working folder)")
    p.add_argument("--machine", metavar="NAME", help="this machine's name in the job's events "
                   "(default HOST-PID)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="stop with the process that started this agent (a Ray actor)")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = agent_parser().parse_args(argv)
    from bamboo.config.join import parse_address
    from bamboo.node.agent import AgentOptions, run_agent
    from bamboo.protocol.agent_wire import JoinError
    try:
        address = parse_address(args.join, "--join")
        if (args.token is None) == (args.token_file is None):
            raise ValueError("give the join token with exactly one of --token or --token-file")
        token = args.token
        if args.token_file is not None:
            try:
                token = Path(args.token_file).read_text().strip()
            except OSError as e:
                raise ValueError(f"--token-file {args.token_file}: {e.strerror or e}") from None
        if not 1 <= args.workers <= 256:
            raise ValueError(f"--workers must be between 1 and 256 (got {args.workers})")
        if args.rejoin_s < 0:
            raise ValueError(f"--rejoin-s must be >= 0 seconds (got {args.rejoin_s:g})")
        sources = [x for x in args.notices.split(",") if x]
        bad = [x for x in sources if x not in ("aws", "gcp", "azure", "sigterm")]
        if bad:
            raise ValueError(f"--notices: unknown source '{bad[0]}': choose from aws, gcp, azure")
        http = parse_address(args.http, "--http") if args.http else None
        say = (lambda text: None) if args.quiet else \
            (lambda text: print(f"bamboo agent: {text}", file=sys.stderr, flush=True))
        opts = AgentOptions(address=address, token=token, workers=args.workers,
                            rejoin_s=args.rejoin_s, notice_sources=sources,
                            metadata_url=args.metadata_url, log_dir=args.log_dir, say=say,
                            machine=args.machine,
                            parent_pid=os.getppid() if args.exit_with_parent else None)
        server = _agent_health(http, opts) if http else None
        try:
            return run_agent(opts)
        finally:
            if server is not None:
                server.close()
    except (ValueError, JoinError) as e:
        print(f"bamboo agent: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _agent_health(http: tuple[str, int], opts: Any) -> Any:
    """/healthz for an agent's probes: healthy while the process runs its loop."""
    from bamboo.control.http import HealthServer, RunMetrics
    try:
        return HealthServer(http[0], http[1], metrics=RunMetrics(),
                            health=lambda: (True, {"status": "agent", "join": "{}:{}".format(*opts.address),
                                                   "workers": opts.workers}))
    except OSError as e:
        raise ValueError(f"cannot serve --http {http[0]}:{http[1]} ({e.strerror or e})") from None
