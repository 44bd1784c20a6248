"""The prepared token directory that `--data DIR` names: header.json and one flat token file
per split (train.bin, val.bin: uint16 when the vocabulary fits, else uint32), read through
np.memmap so a run never loads it whole (docs/data.md). The format only, importable without
torch; `bamboo.data.tokens` writes such directories (`bamboo data prepare`).
"""
from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bamboo.util import strict_json

__all__ = ["FORMAT", "VERSION", "HEADER", "SPLITS", "MAX_VOCAB", "TokenHeader", "dtype_for",
           "read_header", "largest_token_id", "open_split", "write_header"]

FORMAT = "bamboo-tokens"
VERSION = 1
HEADER = "header.json"
SPLITS = ("train", "val")
MAX_VOCAB = 1 << 24


@dataclass(frozen=True, slots=True)
class TokenHeader:
    """header.json of a prepared directory, checked."""

    vocab_size: int
    dtype: str
    tokens: dict[str, int]
    """Tokens per split: {"train": n, "val": n}."""
    tokenizer: dict[str, Any]
    eot_id: int | None
    sources: list[dict[str, Any]]
    max_token_id: int | None = None
    """The largest token id in the splits (None: a header written before it was recorded;
    `largest_token_id` then scans the splits)."""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "tokenizer": self.tokenizer,
                "vocab_size": self.vocab_size, "dtype": self.dtype, "eot_id": self.eot_id,
                "tokens": self.tokens, "files": {s: f"{s}.bin" for s in SPLITS},
                "sources": self.sources, "max_token_id": self.max_token_id}


def dtype_for(vocab: int) -> str:
    return "uint16" if vocab <= 1 << 16 else "uint32"


def read_header(directory: str | Path) -> TokenHeader:
    """The checked header of a prepared directory; ValueError with one line otherwise."""
    path = Path(directory) / HEADER
    again = "prepare it again with `bamboo data prepare FILE... --out DIR`"
    if not path.is_file():
        raise ValueError(f"'{directory}' is a directory without {HEADER}, not a prepared "
                         f"token directory: write one with `bamboo data prepare FILE... --out "
                         f"DIR`, or give a UTF-8 text file")
    try:
        h = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} ({str(e).splitlines()[0]}): {again}") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} header: {again}")
    if h.get("version") != VERSION:
        raise ValueError(f"{path} has format version {h.get('version')!r}; this bamboo reads "
                         f"version {VERSION}: {again}")
    vocab, dtype, tokens = h.get("vocab_size"), h.get("dtype"), h.get("tokens")
    if not isinstance(vocab, int) or not 1 <= vocab <= MAX_VOCAB or dtype not in ("uint16", "uint32") or not isinstance(tokens, dict) \
            or (dtype == "uint16" and vocab > 1 << 16) \
            or not all(isinstance(tokens.get(s), int) and tokens[s] >= 0 for s in SPLITS):
        raise ValueError(f"{path} has a malformed vocab_size, dtype or tokens field: {again}")
    eot, largest = h.get("eot_id"), h.get("max_token_id")
    return TokenHeader(vocab_size=vocab, dtype=dtype, tokens={s: tokens[s] for s in SPLITS},
                       tokenizer=h.get("tokenizer") or {}, sources=h.get("sources") or [],
                       eot_id=eot if isinstance(eot, int) else None,
                       max_token_id=largest if isinstance(largest, int) else None)


def largest_token_id(directory: str | Path, header: TokenHeader) -> int:
    """The largest token id of the directory's splits: the header's record, else a scan
    (in chunks, so a large split is never read into memory at once)."""
    if header.max_token_id is not None:
        return header.max_token_id
    largest = 0
    for split in SPLITS:
        tokens = open_split(directory, header, split)
        for start in range(0, len(tokens), 1 << 24):
            largest = max(largest, int(tokens[start:start + (1 << 24)].max()))
    return largest


def open_split(directory: str | Path, header: TokenHeader, split: str) -> np.memmap:
    """Split `split`'s tokens as a read-only memory map (pages are read on access)."""
    path = Path(directory) / f"{split}.bin"
    n = header.tokens[split]
    size = path.stat().st_size if path.is_file() else -1
    expected = n * np.dtype(header.dtype).itemsize
    if size != expected:
        what = "is missing" if size < 0 else f"holds {size} bytes"
        raise ValueError(f"{path} {what}; its header says {n} {header.dtype} tokens "
                         f"({expected} bytes): prepare the directory again")
    if n == 0:
        raise ValueError(f"{path} holds no tokens: prepare the directory with more text")
    tokens = np.memmap(path, dtype=header.dtype, mode="r", shape=(n,))
    mapped = getattr(tokens, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_RANDOM"):
        # Windows are drawn at random offsets: read-ahead would only map pages never used.
        mapped.madvise(mmap.MADV_RANDOM)
    return tokens


def write_header(directory: str | Path, header: TokenHeader) -> None:
    (Path(directory) / HEADER).write_text(strict_json.dumps(header.to_json(), indent=2) + "\n",
                                          encoding="utf-8")
