"""Bamboo: pipeline-parallel training that survives spot-instance preemptions.

    import bamboo
    job = bamboo.Job(model="gpt2-mini", nodes=4, stages=2, steps=12, kill=["0:1@5"])
    result = bamboo.train(job, out="runs/mine")

The public names (`_LAZY`: `Job`, `train`, `RunResult`, `RunFailed`, `JobError`,
`load_result`, `same`, `Verdict`, `PipelineModel`, `TensorSpec`; docs/api.md) load on first
use, so `import bamboo`, and importing a torch-free part (`bamboo.config`, `bamboo.plan`),
never imports torch. Editors and type checkers read them from the `TYPE_CHECKING` imports
below, which name the same modules (a unit test keeps the two lists equal).

This root is also where the layers are wired: the configuration sizes a `MODULE:FUNCTION`
model by building it, which only the model package can do, so the root installs that
package's sizer (imported, with torch, when such a model is first sized), and the data
package's reader of a Dataset's first sample (whose shapes such a model is built for).

Bamboo logs through the `bamboo` logger and its children, one per module; the library adds
only a `NullHandler` here: the command line prints the records, and a script silences or
routes them (`bamboo.util.logs`; docs/api.md, "Output").
"""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from bamboo.config import presets as _presets

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


def _size_custom_model(name: str, vocab: int | None, inputs: str = "") -> Any:
    from bamboo.model.sizing import size_custom_model
    return size_custom_model(name, vocab, inputs)


def _dataset_inputs(dataset: str, collate: str | None) -> str:
    from bamboo.data.user import first_inputs
    return first_inputs(dataset, collate)


logging.getLogger(__name__).addHandler(logging.NullHandler())
_presets.set_custom_model_sizer(_size_custom_model)
_presets.set_dataset_inputs(_dataset_inputs)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bamboo' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
