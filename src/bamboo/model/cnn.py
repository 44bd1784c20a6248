"""A small residual CNN for image classification, as a list of pipeline layers.

Layer 0 is the stem convolution, layers 1..n-2 are residual blocks (two 3x3
convolutions with GroupNorm; the middle one halves the resolution), and the last
layer pools and classifies. GroupNorm instead of BatchNorm: batch statistics would
make a sample's result depend on which micro-batch it shares, which breaks the
equality of results across layouts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.config.presets import ModelPreset

__all__ = ["ResidualBlock", "cnn_layer"]


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a (strided, projected) skip path."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(4, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(4, c_out)
        self.skip = (nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
                     if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.skip(x))


class Stem(nn.Module):
    """3x3 convolution from RGB to the base width."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(4, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class Classifier(nn.Module):
    """Global average pooling and a linear classifier."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def _block_widths(p: ModelPreset) -> list[tuple[int, int, int]]:
    """(in, out, stride) per residual block: the width doubles at the middle block."""
    n_blocks = p.layers - 2
    widths, c = [], p.channels
    for i in range(n_blocks):
        downsample = i == n_blocks // 2
        c_out = c * 2 if downsample else c
        widths.append((c, c_out, 2 if downsample else 1))
        c = c_out
    return widths


def cnn_layer(p: ModelPreset, index: int) -> nn.Module:
    """Layer `index` of preset `p` (parameters drawn from the current RNG)."""
    widths = _block_widths(p)
    if index == 0:
        return Stem(p.channels)
    if index == p.layers - 1:
        return Classifier(widths[-1][1], p.classes)
    return ResidualBlock(*widths[index - 1])
