"""`bamboo report RUN_DIR`: rewrite a run's report.txt and PNG plots (`bamboo.run.report`).

    bamboo report runs/demo-20250101-120000      # rewrites report.txt and the plots
"""
from __future__ import annotations

import argparse
import sys

from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from bamboo.run.report import Prices, ReportError, write_report

__all__ = ["main", "report_parser"]


def report_parser() -> argparse.ArgumentParser:
    """The flags of `bamboo report`."""
    d = Prices()
    p = UsageParser(prog="bamboo report", description="Rewrite a run's report.txt and PNG "
                    "plots from its summary.json and events.jsonl.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a directory written by bamboo train --out")
    p.add_argument("--spot-price", type=float, default=d.spot,
                   help=f"$ per node-hour on spot (default {d.spot})")
    p.add_argument("--on-demand-price", type=float, default=d.on_demand,
                   help=f"$ per node-hour on demand (default {d.on_demand})")
    p.add_argument("--quiet", action="store_true", help="do not print the report on stdout")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    """`bamboo report RUN_DIR`: 0 on success, 2 (one line on stderr) for a bad run directory."""
    args = report_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if not (args.spot_price >= 0 and args.on_demand_price >= 0):
            raise ReportError("--spot-price and --on-demand-price must be >= 0 $ per node-hour")
        paths = write_report(args.run_dir, Prices(spot=args.spot_price,
                                                  on_demand=args.on_demand_price))
    except ReportError as e:
        if args.debug:
            raise
        print(f"bamboo report: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if not args.quiet:
        sys.stdout.write(paths[0].read_text(encoding="utf-8"))
    print(f"wrote {', '.join(p.name for p in paths)} in {paths[0].parent}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
