"""Which dataset indices a step's micro-batches take: a pure function of (seed, step).

Sample position p of a run is `(step * G + g) * B + i` (G global micro-batches of B
samples each, micro-batch g, its sample i). Over a dataset of n samples, position p lies
in epoch `e = p // n`, and takes index `permutation(seed, e)[p % n]`: each epoch is a
seeded shuffle of all n indices, so no index repeats within an epoch and every node, a
shadow's redo, a re-routed micro-batch, a restarted step and a resumed run take the very
same samples for the same (step, micro-batch), in whatever order they ask.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

__all__ = ["permutation", "positions", "dataset_indices", "DataPosition", "position_after"]

_KIND = 0x5A3D  # the permutations' own stream of the seed (the sources use others)


@functools.lru_cache(maxsize=4)
def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """Epoch `epoch`'s order of the indices 0..n-1 (read-only; a few epochs kept)."""
    order = np.random.default_rng([seed, _KIND, epoch]).permutation(n)
    order.setflags(write=False)
    return order


def positions(step: int, micro_batch: int, global_micro_batches: int,
              micro_batch_size: int) -> range:
    """The sample positions of global micro-batch `micro_batch` of `step`."""
    first = (step * global_micro_batches + micro_batch) * micro_batch_size
    return range(first, first + micro_batch_size)


def dataset_indices(seed: int, n: int, where: range | list[int]) -> list[int]:
    """The dataset indices of sample positions `where` over a dataset of `n` samples."""
    return [int(permutation(seed, p // n, n)[p % n]) for p in where]


@dataclass(frozen=True, slots=True)
class DataPosition:
    """Where a run stands in its dataset after some steps: checkpoints and summary.json
    record it, and a resume checks it against its own dataset."""

    epoch: int
    """The epoch the next sample is drawn from."""
    position: int
    """The next sample's place in that epoch's order (0..dataset_size-1)."""
    samples: int
    """Samples drawn so far (steps * G * B)."""
    dataset_size: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "samples": self.samples,
                "dataset_size": self.dataset_size}


def position_after(steps: int, global_micro_batches: int, micro_batch_size: int,
                   n: int) -> DataPosition:
    """The position after `steps` steps over a dataset of `n` samples."""
    p = steps * global_micro_batches * micro_batch_size
    return DataPosition(epoch=p // n, position=p % n, samples=p, dataset_size=n)
