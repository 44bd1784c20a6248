"""Deterministic, index-addressable training data.

Sample i of a run is a pure function of (seed, i). Step k's global batch is the
samples [k*G*B, (k+1)*G*B) cut into G micro-batches of B samples; global
micro-batch g of step k holds samples (k*G + g)*B ... + B-1. Any node can therefore
build any micro-batch (a shadow loads its failed peer's data), and any layout that
covers the same G micro-batches per step trains on the very same samples.

Sources: a learnable synthetic language (a sparse Markov chain drawn from the
seed), a directory written by `bamboo data prepare` (token windows read through a
memory map), any UTF-8 text file as byte tokens, and synthetic images for the CNN.
Each has a held-out split that `Task.eval_batch` draws from. They are `Samples` as a
user's Dataset is (`bamboo.data.user`): a `Task` over either is the engine's one data path.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bamboo.config.presets import CAUSAL_FAMILIES, ModelPreset
from bamboo.config.token_dir import SPLITS, open_split, read_header
from bamboo.data.sampling import DataPosition, dataset_indices, position_after, positions
from bamboo.data.tokens import text_split

__all__ = ["Batch", "DataSource", "SyntheticLanguage", "TextFile", "TokenFile", "SyntheticImages",
           "Samples", "PresetSamples", "Task", "Metric", "on_device", "make_task", "MASK_RATE"]

MASK_RATE = 0.15
_ALPHABET = 64
_SUCCESSORS = np.array([0.55, 0.25, 0.15, 0.05])


def _rng(seed: int, kind: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, sum(map(ord, kind)), index])


class DataSource:
    """Sequences of byte tokens addressed by sample index."""

    def sequences(self, indices: list[int], length: int, val: bool = False) -> np.ndarray:
        """Samples `indices` of the train split, or of the held-out split with `val`."""
        raise NotImplementedError


class SyntheticLanguage(DataSource):
    """A first-order Markov chain over 64 byte values, each with 4 likely successors.

    Its entropy is about 1.1 nats per token against ln(256) = 5.5 for a uniform
    guess, so a small model's loss falls visibly within tens of steps.
    """

    def __init__(self, seed: int) -> None:
        rng = _rng(seed, "chain", 0)
        self.alphabet = np.sort(rng.choice(np.arange(32, 127), size=_ALPHABET, replace=False))
        self.successors = np.stack([rng.choice(_ALPHABET, size=4, replace=False)
                                    for _ in range(_ALPHABET)])
        self.cumulative = np.cumsum(_SUCCESSORS)
        self.seed = seed

    def sequences(self, indices: list[int], length: int, val: bool = False) -> np.ndarray:
        kind = "val-sample" if val else "sample"  # held-out: samples of a stream of their own
        u = np.stack([_rng(self.seed, kind, i).random(length) for i in indices])
        state = np.minimum((u[:, 0] * _ALPHABET).astype(np.int64), _ALPHABET - 1)
        out = np.empty(u.shape, dtype=np.int64)
        out[:, 0] = state
        for t in range(1, length):
            choice = (u[:, t, None] > self.cumulative[None, :-1]).sum(axis=1)
            state = self.successors[state, choice]
            out[:, t] = state
        return self.alphabet[out]


def _windows(tokens: np.ndarray, seed: int, kind: str, indices: list[int],
             length: int) -> np.ndarray:
    """Windows of `length` tokens at offsets drawn from (seed, kind, sample index)."""
    last = len(tokens) - length
    starts = [int(_rng(seed, kind, i).integers(0, last + 1)) for i in indices]
    return np.stack([tokens[s:s + length] for s in starts]).astype(np.int64)


class TextFile(DataSource):
    """Windows of a text file's bytes, at offsets drawn from (seed, sample index).

    The file's last 5% of bytes (at least one window) is held out: val windows come from
    there, train windows from the rest."""

    def __init__(self, path: str | Path, seed: int, length: int) -> None:
        tokens = np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
        if len(tokens) < 2 * length:
            raise ValueError(f"data file {path} has {len(tokens)} bytes; it needs at least "
                             f"{2 * length} (the model's context + 1, to train on and held out)")
        cut = text_split(len(tokens), length)
        self.train, self.val = tokens[:cut], tokens[cut:]
        self.seed = seed

    def sequences(self, indices: list[int], length: int, val: bool = False) -> np.ndarray:
        if val:
            return _windows(self.val, self.seed, "val-offset", indices, length)
        return _windows(self.train, self.seed, "offset", indices, length)


class TokenFile(DataSource):
    """Windows of a prepared token directory (`bamboo data prepare`), read through np.memmap:
    only the pages a window touches are read, whatever the size of the files."""

    def __init__(self, directory: str | Path, seed: int, length: int) -> None:
        header = read_header(directory)
        self.vocab = header.vocab_size
        self.splits = {s: open_split(directory, header, s) for s in SPLITS}
        for split, tokens in self.splits.items():
            if len(tokens) < length:
                raise ValueError(f"the {split} split of {directory} has {len(tokens)} tokens; "
                                 f"the model needs at least {length} (its context + 1): "
                                 f"prepare more text")
        self.seed = seed

    def sequences(self, indices: list[int], length: int, val: bool = False) -> np.ndarray:
        # a plain ndarray view of the map: slicing an np.memmap costs a subclass hook per window
        tokens = self.splits["val" if val else "train"].view(np.ndarray)
        return _windows(tokens, self.seed, "val-offset" if val else "offset", indices, length)


class SyntheticImages:
    """Noisy copies of one smooth random prototype image per class."""

    def __init__(self, seed: int, classes: int, size: int) -> None:
        rng = _rng(seed, "prototypes", 0)
        coarse = rng.standard_normal((classes, 3, 4, 4))
        self.prototypes = coarse.repeat(size // 4, axis=2).repeat(size // 4, axis=3)
        self.seed, self.classes, self.size = seed, classes, size

    def images(self, indices: list[int], val: bool = False) -> tuple[np.ndarray, np.ndarray]:
        labels, images = [], []
        for i in indices:
            rng = _rng(self.seed, "val-image" if val else "image", i)
            label = int(rng.integers(self.classes))
            noise = rng.standard_normal((3, self.size, self.size))
            labels.append(label)
            images.append(self.prototypes[label] + 0.8 * noise)
        return np.stack(images).astype(np.float32), np.array(labels, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Batch:
    """One micro-batch: the model's inputs and the loss's targets (labels), each a tensor, or
    a tuple or dict of tensors (a user's Dataset)."""

    inputs: Any
    targets: Any


def on_device(x: Any, device: torch.device | str) -> Any:
    """`x` (a tensor, or a tuple, list or dict of them, nested) moved to `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: on_device(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(on_device(v, device) for v in x)
    return x


class Samples:
    """What a Task reads micro-batches of: samples addressed by index, a train and a
    held-out set. `size` None: an unbounded stream (bamboo's own sources), where sample
    position p is index p; else a dataset of `size` samples, shuffled by epoch
    (`bamboo.data.sampling`)."""

    size: int | None = None
    eval_size: int | None = None

    def batch(self, indices: list[int], val: bool) -> Batch:
        """The micro-batch of samples `indices` (of the held-out set with `val`)."""
        raise NotImplementedError


class PresetSamples(Samples):
    """Bamboo's own data for a preset's family: token sequences (next-token or masked-token
    targets) of a `DataSource`, or `SyntheticImages` for the CNN."""

    def __init__(self, preset: ModelPreset, seed: int, source: DataSource | None = None,
                 images: SyntheticImages | None = None) -> None:
        self.preset, self.seed, self.source, self.images = preset, seed, source, images

    def batch(self, indices: list[int], val: bool) -> Batch:
        family = self.preset.family
        if family == "cnn":
            assert self.images is not None
            x, y = self.images.images(indices, val)
            return Batch(torch.from_numpy(x), torch.from_numpy(y))
        assert self.source is not None
        if family in CAUSAL_FAMILIES:
            seq = torch.from_numpy(self.source.sequences(indices, self.preset.context + 1, val))
            return Batch(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
        return self._masked(indices, val)

    def _masked(self, indices: list[int], val: bool) -> Batch:
        assert self.source is not None
        seq = self.source.sequences(indices, self.preset.context, val)
        kind = "val-mask" if val else "mask"
        masks = np.stack([_rng(self.seed, kind, i).random(seq.shape[1]) < MASK_RATE
                          for i in indices])
        masks[:, 0] |= ~masks.any(axis=1)  # at least one target per sample
        inputs = np.where(masks, self.preset.vocab - 1, seq)
        targets = np.where(masks, seq, -100)
        return Batch(torch.from_numpy(inputs), torch.from_numpy(targets))


Metric = Callable[[Any, Any], torch.Tensor]
"""(outputs, labels) -> scalar tensor: a loss or a metric of a micro-batch."""


@dataclass(kw_only=True, slots=True)
class Task:
    """Turns (step, global micro-batch) into a Batch of its `samples`: the one data path of
    the engine, for bamboo's own sources and a user's Dataset alike. `loss` (None: the
    model's own) and `metrics` are what the last stage computes on it."""

    samples: Samples
    seed: int
    global_micro_batches: int
    micro_batch_size: int
    loss: Metric | None = None
    metrics: dict[str, Metric] = field(default_factory=dict)

    @property
    def source(self) -> DataSource | None:
        """Bamboo's token source, when the samples are bamboo's own."""
        return getattr(self.samples, "source", None)

    @property
    def images(self) -> SyntheticImages | None:
        return getattr(self.samples, "images", None)

    def sample_indices(self, step: int, micro_batch: int) -> list[int]:
        """The indices micro-batch `micro_batch` of `step` takes (a pure function of the
        seed, the step and the micro-batch: `bamboo.data.sampling`)."""
        where = positions(step, micro_batch, self.global_micro_batches, self.micro_batch_size)
        n = self.samples.size
        return list(where) if n is None else dataset_indices(self.seed, n, where)

    def batch(self, step: int, micro_batch: int) -> Batch:
        return self.samples.batch(self.sample_indices(step, micro_batch), val=False)

    def eval_batch(self, index: int) -> Batch:
        """Held-out micro-batch `index` (of `micro_batch_size` samples from the val split,
        in order), a pure function of (seed, index): every layout evaluates the very same
        samples."""
        first = index * self.micro_batch_size
        indices = list(range(first, first + self.micro_batch_size))
        n = self.samples.eval_size
        return self.samples.batch(indices if n is None else [i % n for i in indices], val=True)

    def position_after(self, steps: int) -> DataPosition | None:
        """Where the run stands in its dataset after `steps` steps (None: an unbounded
        stream)."""
        n = self.samples.size
        if n is None:
            return None
        return position_after(steps, self.global_micro_batches, self.micro_batch_size, n)


def make_task(p: ModelPreset, *, seed: int, global_micro_batches: int, micro_batch_size: int,
              data_file: str | None = None) -> Task:
    """The task for preset `p`: synthetic by default, token windows of a prepared directory
    or byte windows of a text file when `data_file` is one."""
    samples = PresetSamples(p, seed)
    if p.family == "cnn":
        samples.images = SyntheticImages(seed, p.classes, p.image_size)
    elif data_file is not None and Path(data_file).is_dir():
        source = TokenFile(data_file, seed, p.context + 1)
        # masked-LM families use id vocab-1 as [MASK], past the data's ids
        room = p.vocab - 1 if p.family not in CAUSAL_FAMILIES else p.vocab
        if source.vocab > room:
            raise ValueError(f"model {p.name} has {p.vocab} token ids but {data_file} holds "
                             f"{source.vocab}: build the model from JobConfig.model_preset()")
        samples.source = source
    elif data_file is not None:
        samples.source = TextFile(data_file, seed, p.context + 1)
    else:
        samples.source = SyntheticLanguage(seed)
    return Task(samples=samples, seed=seed, global_micro_batches=global_micro_batches,
                micro_batch_size=micro_batch_size)
