"""Models as users bring them, with nothing of bamboo's on them, and the Datasets that give
their shapes: float features with int labels (a tabular classifier), float images, and
token ids with their next tokens (a causal language model). Each Dataset is named by this
file's path, as a user's script would name it; `torch_models` and `built_pipeline_module`
make the model objects a test hands `bamboo.Job(model=...)`."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

_FILE = Path(__file__).resolve()
TABULAR = f"{_FILE}:Tabular(n=48)"
IMAGES = f"{_FILE}:Images(n=32)"
TOKENS = f"{_FILE}:Tokens(n=32)"
FEATURES, CLASSES, VOCAB, CONTEXT = 20, 2, 64, 8


def _generator(index: int, seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 100_003 + index)


class Tabular(Dataset):
    """`n` rows of FEATURES float features; the label is whether their sum is positive."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = torch.randn(FEATURES, generator=_generator(index))
        return x, int(x.sum() > 0)


class Images(Dataset):
    """`n` float images [3, 8, 8]; the label is the brightest channel."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = torch.rand(3, 8, 8, generator=_generator(index))
        return x, int(x.mean(dim=(1, 2)).argmax())


class Tokens(Dataset):
    """`n` samples of CONTEXT token ids below VOCAB and their next tokens (the labels)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, VOCAB, (CONTEXT + 1,), generator=_generator(index))
        return t[:-1], t[1:]


def tabular_model() -> nn.Sequential:
    """`nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))`'s kind, each layer
    with parameters."""
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Sequential(nn.ReLU(), nn.Linear(64, 32)),
                         nn.Linear(32, CLASSES))


def image_model() -> nn.Sequential:
    """Two conv layers on [3, 8, 8] images, then a classifier."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                         nn.Sequential(nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1)),
                         nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 3)))


def tied_head(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head: logits from the input embedding's weight (tied, as DeepSpeed's GPT
    examples tie it)."""
    return F.linear(x, embedding.weight)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@contextlib.contextmanager
def _one_rank_world() -> Iterator[None]:
    """torch.distributed as one stand-in rank (torch's fake process group) while a
    PipelineModule is built, as examples/deepspeed_pipeline.py builds one."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)
        yield
    finally:
        dist.destroy_process_group()


def built_pipeline_module(state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A DeepSpeed PipelineModule of one stage (a tied embedding and head, two blocks),
    built, then given `state` (weights loaded, as from a user's checkpoint)."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    d = 16
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, d),
              LayerSpec(nn.Linear, d, d), LayerSpec(nn.LayerNorm, d),
              TiedLayerSpec("embed", nn.Embedding, VOCAB, d, forward_fn=tied_head)]
    with _one_rank_world(), open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        module = PipelineModule(layers=layers, loss_fn=token_loss, num_stages=1)
    if state is not None:
        module.load_state_dict(state)
    return module
