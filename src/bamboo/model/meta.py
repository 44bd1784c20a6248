"""Layers built for their shapes only: on the meta device, with torch's initialisers
switched off (what sizing, parameter counts and the start-up trace need)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["shapes_only"]

_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "zeros_",
                   "ones_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "constant_")


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Build modules on the meta device with initialisers switched off.

    Random initialisers on meta tensors route through torch's reference
    implementations and cost seconds; shapes need none of it.
    """
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)
