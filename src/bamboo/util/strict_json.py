"""The one JSON writer for every file and `--json` output the project writes.

Strict JSON only: a parser such as JavaScript's `JSON.parse` or jq reads it unchanged. A
float that is not finite (a diverged loss, a time that was never measured) is written as
`null`, the value every reader of `summary.json`, `events.jsonl` and `--json` output must
take to mean "unknown"; `allow_nan=False` then guards against anything that slipped
through (an object whose own encoding yields one)."""
from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite_or_none"]


def finite_or_none(obj: Any) -> Any:
    """`obj` with every non-finite float, at any depth of dicts, lists and tuples, made None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` of `obj` as strict JSON: non-finite floats become null (see above)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)
