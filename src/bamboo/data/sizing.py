"""What sizes your own `MODULE:FUNCTION` model for the configuration: `SIZING`, the argument
`JobConfig.validate` and `JobConfig.model_preset` take (`bamboo.config.presets.CustomSizing`).

The configuration cannot build a model nor read a Dataset (it sits below both); this layer
can do both, so it hands them over. Importing this module imports neither torch nor the
modules that build: they load when a `MODULE:FUNCTION` model is first sized, so a command
checks a preset's job without torch.
"""
from __future__ import annotations

from bamboo.config.presets import CustomSizing, ModelPreset

__all__ = ["SIZING"]


def _size_model(name: str, vocab: int | None, inputs: str) -> ModelPreset:
    from bamboo.model.sizing import size_custom_model
    return size_custom_model(name, vocab, inputs)


def _dataset_inputs(dataset: str, collate: str | None) -> str:
    from bamboo.data.user import first_inputs
    return first_inputs(dataset, collate)


SIZING = CustomSizing(model=_size_model, dataset_inputs=_dataset_inputs)
"""Your own model built by `bamboo.model.sizing`, for the inputs of a Dataset's first
sample (`bamboo.data.user.first_inputs`)."""
