"""The shell commands of the user's pages (README.md, docs/*.md): every `bamboo`,
`python -m bamboo` and `make` command of a shell code block, with its page and line, as the
pages' checks and the README's quick-start run read them."""
from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support.procs import REPO

SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
"""Fenced blocks of these languages, and indented blocks, may hold commands."""

NOT_COMMANDS: dict[str, str] = {
    "bamboo train (coordinator)": "docs/architecture.md's process diagram, not a command",
}
"""Lines that start like a command and are not one: a substring of the line -> why."""


@dataclass(frozen=True)
class Command:
    """One shell command of a page: where it is and its words (the program first)."""

    page: str
    line: int
    text: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


# -- extracting the commands ------------------------------------------------------------------


def code_blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines) of every shell code block: fenced with a shell language or
    none, or indented by 4 spaces after a blank line (outside fences)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```\s*(\w*)", lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip().startswith("```")), len(lines))
            if fence.group(1).lower() in SHELL_LANGS:
                yield i + 2, lines[i + 1:end]
            i = end + 1
            continue
        if lines[i].startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            start = i
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                i += 1
            yield start + 1, [line[4:] for line in lines[start:i]]
            continue
        i += 1


def logical_lines(first: int, lines: list[str]) -> Iterator[tuple[int, str]]:
    """The block's lines with backslash continuations joined, each with its line number."""
    buffer, at = "", first
    for number, line in enumerate(lines, start=first):
        if not buffer:
            at = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        yield at, buffer + stripped
        buffer = ""
    if buffer:
        yield at, buffer


def split_commands(line: str) -> Iterator[list[str]]:
    """The simple commands of a shell line: comments dropped, redirections (> FILE, 2>&1)
    removed, split at ; && || |."""
    line = re.sub(r"(^|\s)\d?>>?&\d+", " ", line.lstrip("$ "))
    line = re.sub(r"(^|\s)\d?(>>?|<)\s*[^\s;&|]+", " ", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    for token in lexer:
        if token in (";", "&&", "||", "|", "&"):
            if words:
                yield words
            words = []
        else:
            words.append(token)
    if words:
        yield words


def program(words: list[str]) -> list[str] | None:
    """The command from its program on ("bamboo ...", "make ..."), without `sudo`, `timeout
    N`, variable assignments and the `.venv/bin/` prefix; None when it is not one of ours."""
    while words and (words[0] in ("sudo", "env", "exec") or re.fullmatch(r"\w+=.*", words[0])):
        words = words[1:]
    if words[:1] == ["timeout"]:
        words = words[2:]
    if not words:
        return None
    name = words[0].removeprefix("./").removeprefix(".venv/bin/")
    if name == "bamboo":
        return ["bamboo", *words[1:]]
    if re.fullmatch(r"python3?", name) and words[1:3] == ["-m", "bamboo"]:
        return ["bamboo", *words[3:]]
    if re.fullmatch(r"python3?", name) and words[1:2] == ["-m"] and words[2].startswith("bamboo."):
        return ["python -m", *words[2:]]
    if name == "make":
        return ["make", *words[1:]]
    return None


def page_commands(page: Path) -> list[Command]:
    """Every `bamboo` and `make` command of a page's shell code blocks."""
    found = []
    rel = page.relative_to(REPO).as_posix()
    for first, lines in code_blocks(page.read_text(encoding="utf-8")):
        for number, line in logical_lines(first, lines):
            if any(marker in line for marker in NOT_COMMANDS):
                continue
            if not re.match(r"^\s*(\$ )?(sudo |timeout \d+ |\w+=\S+ )*(\./)?"
                            r"(\.venv/bin/)?(bamboo|python3? -m bamboo|make)\b", line):
                continue
            for words in split_commands(line):
                command = program(words)
                if command is not None:
                    found.append(Command(rel, number, line.strip(), tuple(command)))
    return found
