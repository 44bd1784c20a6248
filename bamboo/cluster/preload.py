"""Imported once by the fork server, so that every forked worker starts warm."""
from __future__ import annotations

import torch

import bamboo.cluster.worker  # noqa: F401  (the worker's whole import graph)

# Building an optimizer imports torch's compiler stack on first use; do it here once.
torch.optim.AdamW([torch.zeros(1, requires_grad=True)], foreach=False)
