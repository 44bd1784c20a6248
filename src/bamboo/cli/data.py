"""`bamboo data prepare FILE... --out DIR`: tokenize text files for `bamboo train --data DIR`
(`bamboo.data.tokens` does the work and defines the format).

    bamboo data prepare notes/*.txt --out data/notes                    # byte tokens
    bamboo data prepare corpus.txt --out data/c --tokenizer bpe:8192    # train a byte-level BPE
    bamboo data prepare corpus.txt --out data/c --tokenizer hf:tok/     # a local HF tokenizer
"""
from __future__ import annotations

import argparse
import sys

from bamboo.cli.parsing import EXIT_USAGE, UsageParser
from bamboo.data.tokens import VAL_FRACTION, prepare

__all__ = ["main", "data_parser"]


def data_parser() -> argparse.ArgumentParser:
    """The flags of `bamboo data` and its one action, `prepare`."""
    p = UsageParser(prog="bamboo data", description="Prepare tokenized datasets for "
                    "`bamboo train --data DIR`.")
    sub = p.add_subparsers(dest="action", metavar="prepare", parser_class=UsageParser)
    prep = sub.add_parser("prepare", help="tokenize text files into a prepared directory",
                          description="Tokenize UTF-8 text files into DIR: train.bin and val.bin "
                          "(the last --val-fraction of every file), header.json and the "
                          "tokenizer's files (docs/data.md).")
    prep.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files")
    prep.add_argument("--out", required=True, metavar="DIR",
                      help="the directory to write (must not exist, or be empty)")
    prep.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                      help="bytes (default: the 256 byte values) | bpe:VOCAB (train a byte-level "
                      "BPE of VOCAB tokens on the files) | hf:DIR (a local Hugging Face "
                      "tokenizer directory with tokenizer.json)")
    prep.add_argument("--val-fraction", type=float, default=VAL_FRACTION, metavar="F",
                      help=f"share of every file held out for evaluation (default {VAL_FRACTION})")
    prep.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    return p


def main(argv: list[str]) -> int:
    """`bamboo data prepare ...`; a user error is one line and exit status 2."""
    parser = data_parser()
    args = parser.parse_args(argv)
    if args.action is None:
        parser.error("nothing to do; use `bamboo data prepare FILE... --out DIR`")
    prog = "bamboo data prepare"
    say = (lambda s: None) if args.quiet else (lambda s: print(f"{prog}: {s}", file=sys.stderr))
    try:
        header = prepare(args.files, args.out, args.tokenizer, args.val_fraction, say)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    t = header.tokens
    say(f"wrote {args.out}: {t['train']} train and {t['val']} val tokens "
        f"({header.tokenizer['kind']}, vocab {header.vocab_size}, {header.dtype})")
    return 0
