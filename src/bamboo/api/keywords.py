"""`given_only`: a typed signature for editors and `help()` whose call hands on only what the
caller gave.

`bamboo.Job(...)`'s signature lists every option with its type and its default
(`bamboo.api.job_options`, generated from the declaration), but an option left out must stay
unset, not be given its default: the job's configuration fills it in, and some options
follow others only where they were not given (`global_batch_size` sets `micro_batches`).
A name the signature lacks is refused by the job's own check, which names the nearest known
one (and accepts the other names an option answers to, such as `kills` for `kill`). So the
decorated `__init__`'s body never runs: the call goes to the method named `build`, with the
positional arguments and the keywords exactly as the caller wrote them.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

__all__ = ["given_only"]

F = TypeVar("F", bound=Callable[..., None])


def given_only(build: str) -> Callable[[F], F]:
    """Make an `__init__` whose signature is the one shown and whose call is
    `self.<build>(*args, **kwargs)` with what the caller gave (see the module's docstring)."""

    def decorate(init: F) -> F:
        params = list(inspect.signature(init).parameters.values())[1:]  # after self
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]

        @functools.wraps(init)
        def call(self: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) > len(positional):
                raise TypeError(f"{type(self).__name__}() takes at most {len(positional)} "
                                f"arguments by position ({', '.join(positional)}), {len(args)} were given: "
                                f"give the options by keyword (nodes=4, steps=10, ...)")
            getattr(self, build)(*args, **kwargs)
        return cast(F, call)
    return decorate
