"""`bamboo coordinator`'s own options: where agents join, the store, the token, etcd.

Declared like a job's sections (flags derive from `option()`), but not part of the job: a
job file describes what is trained, these describe where this coordinator listens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bamboo.config.options import ConfigError, check_section, option, option_fields

__all__ = ["JoinConfig", "JOIN_PORT", "JOIN_TIMEOUT_S", "join_options", "parse_address"]

JOIN_PORT = 29400
"""The coordinator's default join port; its store listens on the next port, /metrics is
commonly the one after (docs/deploy.md lists them)."""
JOIN_TIMEOUT_S = 600.0
"""How long a coordinator waits for its first --nodes agents."""


def parse_address(text: str, flag: str) -> tuple[str, int]:
    """`ADDRESS:PORT` (`--bind`, `--join`, `--http`) as (host, port); ValueError naming `flag`
    otherwise. An IPv6 address may be bracketed: `[::1]:29400`."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{flag} '{text}' is not ADDRESS:PORT (e.g. 127.0.0.1:29400)")
    return host.strip("[]"), int(port)


def _port(value: Any) -> str | None:
    return None if 0 < value < 65536 else f"{value} is not a TCP port (1-65535)"


def _positive_s(value: Any) -> str | None:
    return None if value > 0 else f"must be > 0 seconds (got {value:g})"


def _not_blank(value: str) -> str | None:
    return None if value.strip() else \
        "is empty: give the host name or address the agents reach this machine at"


@dataclass(kw_only=True, slots=True)
class JoinConfig:
    """Where agents join this coordinator, and what they are told."""

    bind: str = option(f"127.0.0.1:{JOIN_PORT}", metavar="ADDR:PORT", help=f"""Where agents
        join; 0.0.0.0:PORT for other machines (default 127.0.0.1:{JOIN_PORT}).""")
    advertise: str | None = option(None, metavar="HOST", check=_not_blank, help="""The host name
        or address workers reach this machine's store at (default: the --bind address, or with
        a wildcard bind the address each agent joined on).""")
    store_port: int | None = option(None, metavar="P", check=_port, help="""The store's fixed
        port (default: the --bind port + 1).""")
    token_file: str | None = option(None, metavar="PATH", help="""The job's join token: read
        from PATH if it exists (e.g. a mounted secret), else generated and written there (mode
        0600); default RUN_DIR/join-token.""")
    etcd: str | None = option(None, metavar="URL", help="""Keep membership in this etcd (v3,
        e.g. http://10.0.0.5:2379): agents hold leases there, an expired lease is a lost
        node.""")
    join_timeout_s: float = option(JOIN_TIMEOUT_S, flag="--join-timeout", metavar="S",
                                   check=_positive_s, help="""Seconds to wait for the job's
        --nodes agents before giving up with exit code 1.""")

    def address(self) -> tuple[str, int]:
        """--bind as (host, port), checked (ConfigError, one line)."""
        try:
            return parse_address(self.bind, "--bind")
        except ValueError as e:
            raise ConfigError(str(e), "bind") from None

    def validate(self) -> JoinConfig:
        check_section(self, join_options())
        bind = self.address()
        if self.store_port is not None and self.store_port == bind[1]:
            raise ConfigError(f"--store-port {self.store_port} is the --bind port: the store "
                              f"needs a port of its own (default: bind port + 1)", "store_port")
        return self


def join_options() -> list[Any]:
    return list(option_fields("join", JoinConfig))
