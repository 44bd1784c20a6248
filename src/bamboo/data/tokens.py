"""Tokenized datasets: `prepare` (behind `bamboo data prepare`, `bamboo.cli.data`) and the
on-disk format `--data DIR` reads.

    bamboo data prepare notes/*.txt --out data/notes                    # byte tokens
    bamboo data prepare corpus.txt --out data/c --tokenizer bpe:8192    # train a byte-level BPE
    bamboo data prepare corpus.txt --out data/c --tokenizer hf:tok/     # a local HF tokenizer

A prepared directory holds one flat token file per split (train.bin, val.bin: uint16 when
the vocabulary fits, else uint32), read through np.memmap so a run never loads it whole,
and header.json describing them (docs/data.md). The last --val-fraction of every input
file is held out as val. Inputs are streamed in chunks, so a corpus larger than memory
can be prepared. Importable without torch.
"""
from __future__ import annotations

import codecs
import importlib.util
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bamboo.config.token_dir import (
    MAX_VOCAB,
    SPLITS,
    TokenHeader,
    dtype_for,
    write_header,
)

__all__ = ["VAL_FRACTION", "EOT", "text_split", "prepare"]

VAL_FRACTION = 0.05
"""Share of every input held out (prepared directories), or of a text file's bytes (--data FILE)."""
EOT = "<|endoftext|>"
CHUNK_BYTES = 1 << 22
"""Input read per chunk while streaming: memory stays bounded whatever the corpus size."""
PIECE_CHARS = 1 << 16
"""Characters given to a tokenizer at once (its per-call structures are ~100x the text)."""
MIN_SPLIT_TOKENS = 2
"""A split needs at least one input and one target; training checks the model's context."""
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
             "chat_template.jinja")
"""Files of a Hugging Face tokenizer directory copied next to the data (those present)."""


def text_split(size: int, length: int) -> int:
    """Where a raw text file of `size` bytes splits into train | val for windows of `length`:
    the last VAL_FRACTION of its bytes, and at least one window, is held out."""
    return size - max(math.ceil(size * VAL_FRACTION), length)


# -- tokenizers ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Tokenizer:
    kind: str
    spec: str
    vocab: int
    encode: Callable[[str], np.ndarray]
    eot_id: int | None
    save: Callable[[Path], list[str]]
    """Writes the tokenizer's files into the output directory; returns their names."""


def parse_tokenizer_spec(spec: str) -> tuple[str, Any]:
    """`bytes`, `bpe:VOCAB` or `hf:DIR`; ValueError with one line otherwise."""
    form = "write bytes, bpe:VOCAB (e.g. bpe:8192) or hf:DIR (a local tokenizer directory)"
    kind, sep, arg = spec.partition(":")
    if spec == "bytes":
        return "bytes", None
    if kind in ("bpe", "hf") and sep and importlib.util.find_spec("tokenizers") is None:
        raise ValueError(f"--tokenizer {spec} needs the tokenizers package: pip install "
                         f"tokenizers (or the hf extra: pip install 'bamboo-train[hf]')")
    if kind == "bpe" and sep:
        try:
            vocab = int(arg)
        except ValueError:
            raise ValueError(f"--tokenizer '{spec}': '{arg}' is not an integer; {form}") from None
        if not 257 <= vocab <= MAX_VOCAB:
            raise ValueError(f"--tokenizer '{spec}': VOCAB must be between 257 (256 bytes and "
                             f"an end-of-text token) and {MAX_VOCAB}")
        return "bpe", vocab
    if kind == "hf" and sep and arg:
        directory = Path(arg)
        if not directory.is_dir():
            raise ValueError(f"--tokenizer '{spec}': directory '{arg}' does not exist; {form}")
        if not (directory / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer '{spec}': '{arg}' has no tokenizer.json; save a fast "
                             f"tokenizer there (tokenizer.save_pretrained(DIR))")
        return "hf", directory
    raise ValueError(f"--tokenizer '{spec}' is not a tokenizer; {form}")


def _bytes_tokenizer() -> _Tokenizer:
    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return _Tokenizer("bytes", "bytes", 256, encode, None, lambda out: [])


def _wrap(kind: str, spec: str, tok: Any, eot: str | None, save: Callable[[Path], list[str]]
          ) -> _Tokenizer:
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = dtype_for(vocab)

    def encode(text: str) -> np.ndarray:
        batch = tok.encode_batch(list(_pieces(text)), add_special_tokens=False)
        ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in batch] or
                             [np.zeros(0, dtype=np.int64)])
        if ids.size and int(ids.max()) >= vocab:  # an id beyond the tokenizer's own count
            raise ValueError(f"--tokenizer {spec} produced token id {int(ids.max())}, outside "
                             f"its vocabulary of {vocab}: the tokenizer files are inconsistent")
        return ids.astype(dtype)
    eot_id = tok.token_to_id(eot) if eot else None
    return _Tokenizer(kind, spec, vocab, encode, eot_id, save)


def _train_bpe(spec: str, vocab: int, texts: Iterator[str]) -> _Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((p for text in texts for p in _pieces(text)), trainer=trainer)

    def save(out: Path) -> list[str]:
        tok.save(str(out / "tokenizer.json"))
        return ["tokenizer.json"]
    return _wrap("bpe", spec, tok, EOT, save)


def _hf_tokenizer(spec: str, directory: Path) -> _Tokenizer:
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception type for a bad file)
        raise ValueError(f"--tokenizer {spec}: cannot load {directory / 'tokenizer.json'}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    eot = _hf_eos(directory)
    if eot is None or tok.token_to_id(eot) is None:
        eot = EOT if tok.token_to_id(EOT) is not None else None

    def save(out: Path) -> list[str]:
        names = [n for n in _HF_FILES if (directory / n).is_file()]
        for name in names:
            shutil.copyfile(directory / name, out / name)
        return names
    return _wrap("hf", spec, tok, eot, save)


def _hf_eos(directory: Path) -> str | None:
    """The eos token a tokenizer_config.json names, if any."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


# -- reading the inputs ----------------------------------------------------------------------


def _pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of about `size` characters that end at line breaks: a tokenizer's
    memory grows with the length of what it is given at once, far beyond the text itself."""
    i = 0
    while i < len(text):
        j = text.find("\n", i + size)
        j = len(text) if j < 0 else j + 1
        yield text[i:j]
        i = j


@dataclass(frozen=True, slots=True)
class _Source:
    path: Path
    size: int
    cut: int
    """Bytes [0, cut) are train, [cut, size) val (cut on a UTF-8 character boundary)."""


def _check_sources(files: list[str], fraction: float) -> list[_Source]:
    sources = []
    for name in files:
        path = Path(name)
        if path.is_dir():
            raise ValueError(f"input '{name}' is a directory: give text files (e.g. DIR/*.txt)")
        if not path.is_file():
            raise ValueError(f"input file '{name}' does not exist")
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"input file '{name}' is empty: leave it out")
        sources.append(_Source(path, size, _char_boundary(path, size - math.ceil(size * fraction))))
    return sources


def _char_boundary(path: Path, cut: int) -> int:
    """`cut` moved forward past UTF-8 continuation bytes, so no character is split."""
    with path.open("rb") as f:
        f.seek(cut)
        for byte in f.read(4):
            if byte & 0xC0 != 0x80:
                break
            cut += 1
    return cut


def _texts(source: _Source, split: str) -> Iterator[str]:
    """The text of `source`'s part for `split`, in chunks that end at a line break where
    the text has one (so a tokenizer rarely sees a word cut in two)."""
    start, end = (0, source.cut) if split == "train" else (source.cut, source.size)
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry = ""
    with source.path.open("rb") as f:
        f.seek(start)
        offset = start
        while offset < end:
            raw = f.read(min(CHUNK_BYTES, end - offset))
            if not raw:
                break
            try:
                text = decoder.decode(raw, final=offset + len(raw) >= end)
            except UnicodeDecodeError as e:
                raise ValueError(f"input file '{source.path}' is not UTF-8 text (invalid byte "
                                 f"near offset {offset + e.start}): convert it (iconv -t UTF-8) "
                                 f"or leave it out") from None
            if "\0" in text:
                raise ValueError(f"input file '{source.path}' looks binary (a NUL byte near "
                                 f"offset {offset + text.index(chr(0))}): give text files")
            offset += len(raw)
            text = carry + text
            cut = text.rfind("\n") + 1
            if offset >= end or cut == 0 and len(text) > 4 * CHUNK_BYTES:
                cut = len(text)
            carry = text[cut:]
            if cut:
                yield text[:cut]
    if carry:
        yield carry


# -- prepare ---------------------------------------------------------------------------------


def prepare(files: list[str], out: str | Path, tokenizer: str = "bytes",
            val_fraction: float = VAL_FRACTION, say: Callable[[str], None] = lambda s: None
            ) -> TokenHeader:
    """Tokenize `files` into the prepared directory `out` (which must not exist, or be empty).

    Everything is written into a temporary directory next to `out` and renamed at the end,
    so an error leaves nothing behind and an existing directory is never touched."""
    if not files:
        raise ValueError("no input files: give one or more UTF-8 text files")
    if not (0 < val_fraction < 1):  # also nan
        raise ValueError(f"--val-fraction must be between 0 and 1, e.g. 0.05 (got {val_fraction})")
    kind, arg = parse_tokenizer_spec(tokenizer)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        what = "is not empty" if target.is_dir() else "exists and is not a directory"
        raise ValueError(f"--out {target} {what}: choose a new directory (nothing is overwritten)")
    sources = _check_sources(files, val_fraction)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial",
                                    dir=target.parent))
    except OSError as e:
        raise ValueError(f"cannot write beside --out {target}: {e.strerror or e}") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 is for the temporary name only
        if kind == "bytes":
            tok = _bytes_tokenizer()
        elif kind == "bpe":
            say(f"training a byte-level BPE of {arg} tokens on {len(sources)} file(s)")
            tok = _train_bpe(tokenizer, arg, (t for s in sources for t in _texts(s, "train")))
        else:
            tok = _hf_tokenizer(tokenizer, arg)
        header = _write_splits(tmp, sources, tok)
        for split in SPLITS:
            if header.tokens[split] < MIN_SPLIT_TOKENS:
                raise ValueError(f"the {split} split has {header.tokens[split]} token(s): give "
                                 f"more text" + (" or a larger --val-fraction" if split == "val"
                                                 else " or a smaller --val-fraction"))
        write_header(tmp, header)
        os.rename(tmp, target)  # replaces an empty directory; atomic on one file system
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return header


def _write_splits(tmp: Path, sources: list[_Source], tok: _Tokenizer) -> TokenHeader:
    dtype = dtype_for(tok.vocab)
    counts = {s: 0 for s in SPLITS}
    per_source: list[dict[str, Any]] = [{"path": str(s.path.resolve()), "bytes": s.size}
                                        for s in sources]
    eot = None if tok.eot_id is None else np.array([tok.eot_id], dtype=dtype)
    largest = -1 if tok.eot_id is None or len(sources) < 2 else tok.eot_id
    for split in SPLITS:
        with (tmp / f"{split}.bin").open("wb") as f:
            for i, source in enumerate(sources):
                if i and eot is not None:  # files are separated by end-of-text
                    f.write(eot.tobytes())
                    counts[split] += 1
                n = 0
                for text in _texts(source, split):
                    ids = tok.encode(text).astype(dtype, copy=False)
                    if len(ids):
                        largest = max(largest, int(ids.max()))
                    f.write(ids.tobytes())
                    n += len(ids)
                per_source[i][f"{split}_tokens"] = n
                counts[split] += n
    files = tok.save(tmp)
    return TokenHeader(vocab_size=tok.vocab, dtype=dtype, tokens=counts, eot_id=tok.eot_id,
                       tokenizer={"kind": tok.kind, "spec": tok.spec, "files": files},
                       sources=per_source, max_token_id=largest if largest >= 0 else None)
