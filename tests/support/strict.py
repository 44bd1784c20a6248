"""Strict JSON: what the project writes (summary.json, events.jsonl, `--json` output) must
parse with a parser that refuses NaN and Infinity, as JavaScript's `JSON.parse` and jq do."""
from __future__ import annotations

import json
from pathlib import Path


class NotStrictJson(AssertionError):
    """A file or output the project wrote is not strict JSON (NaN, Infinity, or no JSON)."""


def strict_loads(text: str, where: str):
    """`text` parsed by a strict JSON parser; NotStrictJson names `where` otherwise."""
    def refuse(constant: str):
        raise NotStrictJson(f"{where} is not strict JSON: it holds {constant}")
    try:
        return json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise NotStrictJson(f"{where} is not JSON: {e}") from None


def check_run_files_strict(root: Path) -> None:
    """Every summary.json and whole line of every events.jsonl under `root` parses as
    strict JSON (a last line without its newline is a write cut short by a kill)."""
    for path in root.rglob("summary.json"):
        strict_loads(path.read_text(encoding="utf-8"), str(path))
    for path in root.rglob("events.jsonl"):
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
        for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: after the last newline
            if line.strip():
                strict_loads(line, f"{path} line {number}")
