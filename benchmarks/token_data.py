"""Prepared token directories against raw text: batch speed and the reader's memory.

    .venv/bin/python benchmarks/token_data.py [--big-gb 1.0] [--batches 200]

(a) micro-batches per second of `Task.batch` for gpt2-mini (context 128, 8 samples) from a
prepared directory (`--data DIR`: TokenFile, np.memmap) and from the same text as a file
(`--data FILE`: TextFile, byte windows of the file read into memory); (b) the peak resident
memory of a fresh process that opens a prepared directory and draws --batches micro-batches,
with a ~10 MB token file and with a --big-gb token file: the memory map reads only the pages
the windows touch, so the peak does not grow with the file. The big directory is written
token by token in the prepared format (a header and raw uint16 tokens) into a temporary
directory and deleted afterwards.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from bamboo.config.token_dir import TokenHeader, dtype_for, write_header  # noqa: E402 (after sys.path is set)

_PEAK = """
def status_kb(key="VmHWM"):  # VmHWM: this process's own peak (ru_maxrss includes the parent's)
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])
def peak_kb():
    return status_kb()
"""
_RSS_PROBE = _PEAK + """
import sys
from bamboo.config import JobConfig
from bamboo.data.datasets import make_task
before = peak_kb()
p = JobConfig.of(model="gpt2-mini", data=sys.argv[1]).model_preset()
task = make_task(p, seed=0, global_micro_batches=4, micro_batch_size=8,
                 data_file=sys.argv[1])
for i in range(int(sys.argv[2])):
    task.batch(i // 4, i % 4)
print(before, peak_kb(), status_kb("RssAnon"), status_kb("RssFile"))
"""
_PREPARE = _PEAK + """
import sys, time
from bamboo.cli.data import main
t0 = time.perf_counter()
assert main(sys.argv[1:]) == 0
print(time.perf_counter() - t0, peak_kb())
"""


def _text(path: Path, megabytes: float, seed: int = 0) -> None:
    """`megabytes` of words drawn with the frequencies of the repository's docs/*.md."""
    docs = " ".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))
    words = np.array(re.findall(r"\w+|[^\w\s]", docs))
    rng = np.random.default_rng(seed)
    with path.open("w", encoding="utf-8") as f:
        written = 0
        while written < megabytes * 1e6:
            chunk = " ".join(rng.choice(words, size=50_000)).replace(" . ", ".\n")
            f.write(chunk + "\n")
            written += len(chunk) + 1


def _big_dir(directory: Path, gigabytes: float) -> int:
    """A prepared directory whose train.bin holds `gigabytes` of random uint16 tokens."""
    directory.mkdir()
    vocab, n, block = 50257, int(gigabytes * 1e9) // 2, 1 << 25
    rng = np.random.default_rng(0)
    with (directory / "train.bin").open("wb") as f:
        for start in range(0, n, block):
            f.write(rng.integers(0, vocab, size=min(block, n - start), dtype=np.uint16).tobytes())
    rng.integers(0, vocab, size=100_000, dtype=np.uint16).tofile(directory / "val.bin")
    write_header(directory, TokenHeader(vocab_size=vocab, dtype=dtype_for(vocab),
                                        tokens={"train": n, "val": 100_000},
                                        tokenizer={"kind": "synthetic", "spec": "", "files": []},
                                        eot_id=None, sources=[]))
    return n * 2


def _batches_per_s(data: str, seconds: float = 1.5) -> float:
    from bamboo.config import JobConfig
    from bamboo.data.datasets import make_task
    p = JobConfig.of(model="gpt2-mini", data=data).model_preset()
    task = make_task(p, seed=0, global_micro_batches=4, micro_batch_size=8,
                     data_file=data)
    task.batch(0, 0)
    best = 0.0
    for _ in range(3):  # best of three: the machine is shared
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            task.batch(n // 4, n % 4)
            n += 1
        best = max(best, n / (time.perf_counter() - t0))
    return best


def _child(script: str, *args: str) -> list[float]:
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    return [float(x) for x in out]


def _drop_cache(path: Path) -> None:
    """Evict `path` from the page cache, as for a dataset prepared long before the run."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_through(path: Path) -> None:
    """Bring all of `path` into the page cache, as right after it was written."""
    with path.open("rb") as f:
        while f.read(1 << 24):
            pass


def _memory_mb(data: Path, batches: int, cold: bool) -> list[float]:
    """Peak RSS after imports, peak RSS after opening the data and drawing the batches,
    and the anonymous and file-backed parts of the RSS at the end, in MB."""
    if cold:
        _drop_cache(data / "train.bin")
    else:
        _read_through(data / "train.bin")
    return [kb / 1024 for kb in _child(_RSS_PROBE, str(data), str(batches))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big-gb", type=float, default=1.0)
    ap.add_argument("--batches", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        text = root / "corpus.txt"
        _text(text, 10)
        print(f"prepare {text.stat().st_size / 1e6:.1f} MB of text (a fresh process each)")
        print(f"{'tokenizer':<34} {'seconds':>8} {'peak RSS MB':>12}")
        for spec in ("bytes", "bpe:4096"):
            seconds, peak = _child(_PREPARE, "prepare", str(text), "--out",
                                   str(root / spec.split(":")[0]), "--tokenizer", spec, "--quiet")
            print(f"{spec + (' (training included)' if ':' in spec else ''):<34} "
                  f"{seconds:>8.1f} {peak / 1024:>12.0f}")
        print()
        print("(a) Task.batch, gpt2-mini (context 128, 8 samples per micro-batch)")
        print(f"{'source':<34} {'micro-batches/s':>16}")
        for name, data in (("--data FILE (TextFile, bytes)", str(text)),
                           ("--data DIR (TokenFile, bytes)", str(root / "bytes")),
                           ("--data DIR (TokenFile, bpe:4096)", str(root / "bpe"))):
            print(f"{name:<34} {_batches_per_s(data):>16.0f}")
        small = (root / "bytes" / "train.bin").stat().st_size
        big_bytes = _big_dir(root / "big", args.big_gb)
        print(f"\n(b) memory of a fresh process drawing {args.batches} micro-batches (MB)")
        print(f"{'train.bin':>10} {'page cache':>10} {'peak: imports':>13} {'peak: +batches':>14} "
              f"{'growth':>7} {'anon at end':>11} {'file at end':>11}")
        for size, data in ((small, root / "bytes"), (big_bytes, root / "big")):
            for cold in (True, False):
                before, after, anon, file = _memory_mb(data, args.batches, cold)
                print(f"{size / 1e6:>7.0f} MB {'cold' if cold else 'warm':>10} {before:>13.0f} "
                      f"{after:>14.0f} {after - before:>7.1f} {anon:>11.0f} {file:>11.0f}")
        (root / "big" / "train.bin").unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
