"""A model whose code is as noisy as real model code and its libraries: importing it and
building it print to stdout and stderr, log through a logger bound to `sys.stdout` when the
module is imported (as DeepSpeed's logger is), and write to descriptor 1 directly (as a C
library does). Used as `--model tests/support/noisy_model.py:build` by
tests/integration/test_run_ends_runs.py: none of it may reach `--json` output, and what the
workers print is in their log files. Every line starts with `noisy-model:`."""
from __future__ import annotations

import logging
import os
import sys

import torch
from torch import nn

from bamboo.model.api import PipelineModel, TensorSpec

MARK = "noisy-model:"
CONTEXT, D = 16, 8

_log = logging.getLogger("noisy_model")
_handler = logging.StreamHandler(sys.stdout)  # the stream object of this moment, kept
_handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
_log.addHandler(_handler)
_log.setLevel(logging.INFO)
_log.propagate = False

print(f"{MARK} imported in pid {os.getpid()}")


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


def build(vocab_size: int = 256) -> PipelineModel:
    print(f"{MARK} build() on stdout in pid {os.getpid()}")
    print(f"{MARK} build() on stderr in pid {os.getpid()}", file=sys.stderr)
    _log.info(f"{MARK} a logger bound to sys.stdout in pid {os.getpid()}")
    os.write(1, f"{MARK} descriptor 1 in pid {os.getpid()}\n".encode())
    return PipelineModel(
        layers=[lambda: nn.Sequential(nn.Embedding(vocab_size, D), Mix()), Mix, Mix,
                lambda: nn.Sequential(Mix(), nn.Linear(D, vocab_size))],
        boundary=TensorSpec((CONTEXT, D)), context=CONTEXT, vocab_size=vocab_size)
