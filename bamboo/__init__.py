"""Bamboo: pipeline-parallel training that survives spot-instance preemptions.

    import bamboo
    job = bamboo.Job(model="gpt2-mini", nodes=4, stages=2, steps=12, kill=["0:1@5"])
    result = bamboo.train(job, out="runs/mine")

The API's names (`Job`, `train`, `RunResult`, `RunFailed`, `JobError`, `load_result`;
docs/api.md) load on first use, so importing a torch-free part (`bamboo.config`,
`bamboo.plan`) never imports torch.

This root is also where the layers are wired: the configuration sizes a `MODULE:FUNCTION`
model by building it, which only the model package can do, so the root installs that
package's sizer (imported, with torch, when such a model is first sized).
"""
from __future__ import annotations

import importlib
from typing import Any

from bamboo.config import presets as _presets

__version__ = "0.1.0"

__all__ = ["Job", "JobError", "train", "Trainer", "RunResult", "RunFailed", "load_result",
           "__version__"]

_API = frozenset(__all__) - {"__version__"}


def _size_custom_model(name: str, vocab: int | None) -> Any:
    from bamboo.model.sizing import size_custom_model
    return size_custom_model(name, vocab)


_presets.set_custom_model_sizer(_size_custom_model)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("bamboo.api"), name)
    raise AttributeError(f"module 'bamboo' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _API)
