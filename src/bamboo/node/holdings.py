"""What a worker holds between two generations: the state it can give a peer and the stages
it can take into its next engine as they are.

At a generation's end a worker keeps its engine's primary stages themselves (`kept`), and a
packed copy (`StageState.packed_layer`, on the CPU) of any other layer its engine held (a
replica, a stage adopted in a failover). When the next plan gives it the same stage, with
the same layers, from the step they are at, and sends it none of their layers, the new
engine takes the kept stage as it is: nothing is built, loaded or packed, and its first step
touches no new memory (the survivors of a loss at one stage, every survivor of a join). A
kept stage is packed only when a transfer sends one of its layers.

Once the new engine has loaded its state, the worker drops what it held here: the engine
holds it now, and gives it back at its end.

A standby at one stage builds the stage it will hold (every layer) while it waits
(`spare`): its join then loads the state into it, and the survivors, who wait for the
joiner to receive, do not wait for its build too.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from bamboo.engine.stage import StageState

__all__ = ["Holdings"]


class Holdings:
    """One worker's state between generations, at `step` (the first step not yet applied)."""

    def __init__(self) -> None:
        self.kept: dict[int, StageState] = {}
        """Stage -> the last engine's primary stage, as it left it."""
        self.packed: dict[int, torch.Tensor] = {}
        """Layer -> its packed state, for the layers of held stages that are not kept."""
        self.step = -1
        self.spare: StageState | None = None
        """A stage as built from the seed: built ahead, never loaded; no state."""

    def clear(self) -> None:
        """Drop the state held (a built-ahead `spare` holds none, and stays)."""
        self.kept, self.packed = {}, {}

    def built(self, stage: int, layers: range) -> StageState | None:
        """The `spare`, taken, if it is `stage` with these `layers` (to be loaded)."""
        st = self.spare
        if st is None or st.stage != stage or st.layer_indices != layers:
            return None
        self.spare = None
        return st

    def take(self, held: Iterable[StageState], primaries: Mapping[int, StageState],
             step: int) -> None:
        """An engine's end at `step`: of every stage it `held`, its `primaries` kept as they
        are (but those in host memory), the others packed."""
        self.kept = {s: st for s, st in primaries.items()
                     if not st.on_host and not st.optimizer_on_host}
        self.packed = {i: st.packed_layer(i).cpu() for st in held
                       if all(st is not k for k in self.kept.values())
                       for i in st.layer_indices}
        self.step = step

    def reusable(self, stages: Mapping[int, range], incoming: set[int]) -> dict[int, StageState]:
        """The kept stages among `stages` (stage -> its layers in the next generation, which
        starts at `step`) with the same layers, none of them `incoming` from a peer: their
        sums and gradients cleared, ready for a new engine."""
        reused = {}
        for s, layers in stages.items():
            st = self.kept.get(s)
            if st is not None and st.layer_indices == layers and not incoming & set(layers):
                st.settle()
                st.reset_grads()
                st.module.train()
                reused[s] = st
        return reused

    def sizes(self) -> dict[int, int]:
        """Each layer held, in order: the bytes of its packed state."""
        sizes = {i: v.nbytes for i, v in self.packed.items()}
        sizes.update({i: st.layer_layout(i).nbytes
                      for st in self.kept.values() for i in st.layer_indices})
        return dict(sorted(sizes.items()))

    def layer(self, index: int) -> torch.Tensor | None:
        """The packed state of layer `index` (None: not held)."""
        for st in self.kept.values():
            if index in st.layer_indices:
                return st.packed_layer(index)
        return self.packed.get(index)
