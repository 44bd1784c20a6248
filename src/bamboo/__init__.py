"""Bamboo: pipeline-parallel training that survives spot-instance preemptions.

    import bamboo
    job = bamboo.Job(model="gpt2-mini", nodes=4, stages=2, steps=12, kill=["0:1@5"])
    result = bamboo.train(job, out="runs/mine")

The public names (`_LAZY`: `Job`, `train`, `RunResult`, `RunFailed`, `JobError`,
`load_result`, `same`, `Verdict`, `PipelineModel`, `TensorSpec`; docs/api.md) load on first
use, so `import bamboo`, and importing a torch-free part (`bamboo.config`, `bamboo.plan`),
never imports torch. Editors and type checkers read them from the `TYPE_CHECKING` imports
below, which name the same modules (a unit test keeps the two lists equal).

Bamboo logs through the `bamboo` logger and its children, one per module; the library adds
only a `NullHandler` here: the command line prints the records, and a script silences or
routes them (`bamboo.util.logs`; docs/api.md, "Output").
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bamboo.api import (
        Job,
        JobError,
        RunFailed,
        RunResult,
        Trainer,
        Verdict,
        load_result,
        same,
        train,
    )
    from bamboo.model.api import PipelineModel, TensorSpec

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "Job": "bamboo.api", "JobError": "bamboo.api", "train": "bamboo.api",
    "RunResult": "bamboo.api", "RunFailed": "bamboo.api", "load_result": "bamboo.api",
    "same": "bamboo.api", "Verdict": "bamboo.api", "Trainer": "bamboo.api",
    "PipelineModel": "bamboo.model.api", "TensorSpec": "bamboo.model.api",
}
"""Each public name -> the module it is loaded from on first use (add a name here, to
`__all__` and to the `TYPE_CHECKING` imports above)."""

__all__ = ["Job", "JobError", "train", "Trainer", "RunResult", "RunFailed", "load_result",
           "same", "Verdict", "PipelineModel", "TensorSpec", "__version__"]
"""A literal list, as type checkers read it: `_LAZY`'s names (a unit test keeps them equal)."""


logging.getLogger(__name__).addHandler(logging.NullHandler())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bamboo' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
