"""The Python API: `bamboo.Job`, `bamboo.train`, `bamboo.RunResult`, `bamboo.RunFailed`.

    bamboo.api.job    Job: the model and the command line's options, checked as the flags are
    bamboo.api.paths  how what the workers rebuild reaches them (derived import paths)
    bamboo.api.start  the checks before a run and the run itself (also `bamboo train`'s)
    bamboo.api.run    train(), RunResult, and same(): two runs equal under the contract's rule
    bamboo.api.trainer  Trainer: the user's own loop, one step per call

Names load on first use (the package imports torch only for a run), so `bamboo train`
checks its flags through `bamboo.api.job` before torch is imported.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what editors and type checkers see (the same modules as `_WHERE`)
    from bamboo.api.job import Job, JobError
    from bamboo.api.run import RunResult, Verdict, load_result, same, train
    from bamboo.api.trainer import Trainer
    from bamboo.control import RunFailed

__all__ = ["Job", "JobError", "train", "Trainer", "RunResult", "RunFailed", "load_result", "same",
           "Verdict"]

_WHERE = {"Job": "bamboo.api.job", "JobError": "bamboo.api.job", "train": "bamboo.api.run",
          "Trainer": "bamboo.api.trainer",
          "RunResult": "bamboo.api.run", "load_result": "bamboo.api.run",
          "same": "bamboo.api.run", "Verdict": "bamboo.api.run",
          "RunFailed": "bamboo.control"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'bamboo.api' has no attribute '{name}'")
