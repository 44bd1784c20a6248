"""The facts (`ModelPreset`) of your own `MODULE:FUNCTION` model, found by building it.

`bamboo.config` sizes presets without torch, but a model of yours is only known once its
function runs; `size_custom_model` is the sizer handed to the configuration as an argument
(`bamboo.data.sizing.SIZING`), so the configuration can check a layout against your model
without importing this package itself.
"""
from __future__ import annotations

from bamboo.config.presets import ModelPreset
from bamboo.model.api import load_model

__all__ = ["size_custom_model"]


def size_custom_model(name: str, vocab: int | None = None, inputs: str = "") -> ModelPreset:
    """`name`'s model (`pkg.module:function` or `path/to/file.py:function`), built for
    `vocab` tokens (the function's default when None) and for `inputs` (what a Dataset's
    first sample hands layer 0, as text; "" without one), as a preset of family "custom"; its
    `vocab` is 0 when the model has no vocabulary (`vocab_size=None`: a classifier of a
    Dataset's inputs). Whether the data's tokens fit the vocabulary is the job's check
    (`JobConfig.validate`): a Dataset job needs none."""
    model = load_model(name, vocab, inputs)
    n, context, size = len(model.layers), model.context, model.vocab_size
    shapes = {getattr(spec, "shape", ()) for spec in model.boundaries[:-1]}  # () a structure
    shape = shapes.pop() if len(shapes) == 1 else ()
    d_model = shape[1] if len(shape) == 2 and shape[0] == context else 0  # [context, d] throughout
    vocab_text = f", vocab {size}" if size is not None else ""
    return ModelPreset(name=name, family="custom", layers=n, d_model=d_model, context=context,
                       vocab=size or 0, inputs=inputs, description=model.description or
                       f"your model {name}: {n} layers, context {context}{vocab_text}")
