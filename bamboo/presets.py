"""Model presets as plain data, importable without torch.

The command line validates a layout (stages <= layers) before it pays for importing
torch, so the facts it needs about each preset live here, apart from the modules.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelPreset", "PRESETS", "preset"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelPreset:
    """What a preset is, in numbers."""

    name: str
    family: str
    """`gpt2`, `bert` or `cnn`: which builder and which task it uses."""
    layers: int
    """Number of pipeline layers: the units a partition may cut between."""
    d_model: int = 0
    heads: int = 0
    context: int = 0
    vocab: int = 256
    image_size: int = 0
    channels: int = 0
    classes: int = 0
    description: str = ""


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(name="gpt2-tiny", family="gpt2", layers=8, d_model=64, heads=4, context=64,
                    description="GPT-2 architecture, 8 blocks, d=64, 4 heads, context 64, byte vocab"),
        ModelPreset(name="gpt2-mini", family="gpt2", layers=12, d_model=128, heads=4, context=128,
                    description="GPT-2 architecture, 12 blocks, d=128, 4 heads, context 128"),
        ModelPreset(name="gpt2-small", family="gpt2", layers=12, d_model=768, heads=12,
                    context=1024, vocab=50257,
                    description="GPT-2 small sizes: 12 blocks, d=768 (163M parameters with the untied head)"),
        ModelPreset(name="gpt2-medium", family="gpt2", layers=24, d_model=1024, heads=16,
                    context=1024, vocab=50257,
                    description="GPT-2 medium sizes: 24 blocks, d=1024 (406M parameters with the untied head)"),
        ModelPreset(name="bert-tiny", family="bert", layers=4, d_model=64, heads=4, context=64,
                    vocab=257,
                    description="BERT-style post-LN encoder, 4 blocks, d=64, masked-LM objective"),
        ModelPreset(name="bert-mini", family="bert", layers=8, d_model=128, heads=4, context=128,
                    vocab=257,
                    description="BERT-style post-LN encoder, 8 blocks, d=128, masked-LM objective"),
        ModelPreset(name="cnn-tiny", family="cnn", layers=6, channels=16, image_size=32,
                    classes=10,
                    description="Residual CNN, stem + 4 residual blocks + classifier, 32x32 images"),
    )
}


def preset(name: str) -> ModelPreset:
    """The preset called `name`; ValueError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model '{name}'; choose one of: {known}") from None
