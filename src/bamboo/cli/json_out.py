"""Under `--json`, a command's stdout carries its one JSON document and nothing else.

The user's code that the calling process runs (a model factory built for the checks, a
dataset factory), a library's logger bound to `sys.stdout` (DeepSpeed's), and a C library
writing to descriptor 1 would otherwise print into the summary a script parses. While
`json_stdout(True)` lasts, descriptor 1 is the process's stderr, and the document is
written to the real stdout through the stream it yields. Processes started meanwhile
(the fork server, and through it the workers, which log to their own files:
`bamboo.node.output`) inherit the redirected descriptor.
"""
from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["json_stdout"]


@contextmanager
def json_stdout(enabled: bool) -> Iterator[TextIO]:
    """Where the JSON document goes: the real stdout; while the block runs (when
    `enabled`), everything else written to stdout goes to stderr."""
    if not enabled:
        yield sys.stdout
        return
    sys.stdout.flush()
    try:
        real = os.dup(1)
    except OSError:  # no stdout at all: nothing to keep clean
        yield sys.stdout
        return
    os.dup2(2, 1)
    try:
        yield _Unbuffered(real)  # type: ignore[misc]  # a file-like wrapper, not a TextIO subclass
    finally:
        sys.stdout.flush()
        os.dup2(real, 1)
        os.close(real)


class _Unbuffered(io.TextIOBase):
    """Text straight to a descriptor: nothing is held back to be written (or to fail) after
    the descriptor is closed; a reader that left raises BrokenPipeError at once, for
    `bamboo.cli.main` to end quietly."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        data = memoryview(text.encode())
        while data:
            data = data[os.write(self.fd, data):]
        return len(text)
