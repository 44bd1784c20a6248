"""`bamboo export RUN_DIR --hf DIR`: write a finished run's model as a Hugging Face directory
(`bamboo.run.export` does the work).

    bamboo export runs/a --hf exported/a
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('exported/a')"
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bamboo.cli.parsing import EXIT_USAGE, UsageParser

__all__ = ["main", "export_parser"]


def export_parser() -> argparse.ArgumentParser:
    """The flags of `bamboo export`."""
    p = UsageParser(prog="bamboo export", description="Write a finished run's model as a "
                    "Hugging Face directory (config.json + model.safetensors) that "
                    "transformers.AutoModelForCausalLM.from_pretrained loads.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run directory of bamboo train "
                   "(it holds model.pt and summary.json)")
    p.add_argument("--hf", required=True, metavar="DIR",
                   help="the directory to write (new or empty)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def main(argv: list[str] | None = None) -> int:
    """`bamboo export`: 0 on success, 2 with one line on stderr for a user error."""
    args = export_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from bamboo.run.export import export
    try:
        line = export(Path(args.run_dir), Path(args.hf))
    except ValueError as e:
        if args.debug:
            raise
        print(f"bamboo export: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"bamboo export: {line}", file=sys.stderr)
    return 0
