"""`--metric NAME=MODULE:FUNCTION(ARGS)`: a metric of the last stage, named as it is reported.

    --metric accuracy=mymetrics:accuracy
    --metric top5=mymetrics:top_k(k=5)

The name is what summary.json's `metrics`, the live line, TensorBoard, W&B and `/metrics`
show; the call is written as `--loss`'s (`bamboo.config.calls`). Parsed without importing
anything.
"""
from __future__ import annotations

import re
from typing import Any

from bamboo.config.calls import Call, parse_call

__all__ = ["parse_metric", "check_metrics", "RESERVED"]

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,39}$")

RESERVED = frozenset({"loss", "lr", "step"})
"""Names the reports already use for something else."""


def parse_metric(text: str) -> tuple[str, Call]:
    """(name, call) of `NAME=MODULE:FUNCTION(ARGS)`; ValueError (one line) otherwise."""
    name, sep, call = text.partition("=")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise ValueError(f"'{text}' is not NAME=MODULE:FUNCTION: write e.g. "
                         f"accuracy=mymetrics:accuracy (a name of letters, digits and _)")
    if name in RESERVED:
        raise ValueError(f"'{name}' is a name the reports use already ({', '.join(sorted(RESERVED))}): "
                         f"call the metric something else")
    return name, parse_call(call)


def check_metrics(value: Any) -> str | None:
    """An option's check (`bamboo.config.options`): None, or what is wrong."""
    if not isinstance(value, list):
        return f"must be a list of NAME=MODULE:FUNCTION (got {value!r})"
    names: set[str] = set()
    for text in value:
        if not isinstance(text, str):
            return f"must be NAME=MODULE:FUNCTION text (got {text!r})"
        try:
            name, _ = parse_metric(text)
        except ValueError as e:
            return str(e)
        if name in names:
            return f"names the metric '{name}' twice: give each metric its own name"
        names.add(name)
    return None
