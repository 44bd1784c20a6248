"""`bamboo config --example`: a commented job file for `bamboo train --config`."""
from __future__ import annotations

from bamboo.cli.parsing import UsageParser

__all__ = ["main", "config_parser"]


def config_parser() -> UsageParser:
    """The flags of `bamboo config`."""
    p = UsageParser(prog="bamboo config", description="Job files for `bamboo train --config`.")
    p.add_argument("--example", action="store_true", help="print a commented example job file")
    return p


def main(argv: list[str]) -> int:
    p = config_parser()
    args = p.parse_args(argv)
    if not args.example:
        p.error("nothing to do; use --example")
    from bamboo.config.jobfile import example_config
    print(example_config(), end="")
    return 0
