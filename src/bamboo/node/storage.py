"""What a node writes to storage: its parts of a checkpoint and its layers of the trained model.

Each stage's first live holder (lowest pipeline) writes that stage's layers: the state of
a checkpoint (`checkpoint_part`, after a commit marked `ckpt` or a step-by-step run's save)
and the final parameters after the run's last step (`final`). The writes run one after
another on the node's writer thread, from copies taken at once, so training does not wait
for storage; the coordinator hears of the layers once they are durable.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from bamboo.config import JobConfig
from bamboo.protocol.messages import SHUTDOWN_KEY, CheckpointPart, LayerParams, final_request_key
from bamboo.run.checkpoint import (
    CheckpointError,
    checkpoint_location,
    final_dir,
    step_dir,
    write_layers,
)
from bamboo.run.writers import stages_written_by
from bamboo.wire.link import CoordinatorLink

if TYPE_CHECKING:
    import torch.distributed as dist

    from bamboo.engine.engine import NodeEngine
    from bamboo.engine.stage import StageState

__all__ = ["StorageWrites", "one_line"]


def one_line(e: BaseException) -> str:
    """An exception as one line that always says something (`MemoryError()` has no text)."""
    text = str(e).splitlines()[0][:500] if str(e).strip() else ""
    if isinstance(e, MemoryError):
        return f"MemoryError: out of memory{': ' + text if text else ''}"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def first_holder_stages(engine: NodeEngine) -> list[StageState]:
    """The stages whose first live holder (lowest pipeline) this node is: the ones it writes
    to storage (a checkpoint, the final model); every stage has exactly one."""
    return [engine.stages[s] for s in stages_written_by(engine.roles, engine.rank, engine.stages)]


class StorageWrites:
    """One node's writes to the job's checkpoint storage, on its writer thread. (Not at a
    lower CPU priority: the thread holds the GIL in parts of a write, and training would
    wait on it.)"""

    def __init__(self, cfg: JobConfig, link: CoordinatorLink) -> None:
        self.cfg, self.link = cfg, link
        self._writer: ThreadPoolExecutor | None = None

    @property
    def writer(self) -> ThreadPoolExecutor:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._writer

    def checkpoint_part(self, engine: NodeEngine, step: int) -> None:
        """The layers of the stages this node first holds, as a part of step `step`'s
        checkpoint: copied now, written on the writer thread, reported (`CheckpointPart`)."""
        states = {i: st.layer_state(i)  # CPU copies: training goes on meanwhile
                  for st in first_holder_stages(engine) for i in st.layer_indices}
        if not states:
            return
        cfg, link = self.cfg, self.link
        size = sum(t.numel() * t.element_size() for v in states.values() for t in v.values())

        def write() -> None:
            start = time.perf_counter()
            try:
                written = write_layers(step_dir(checkpoint_location(cfg), step), states)
                error = None
            except Exception as e:  # noqa: BLE001 - a full disk: reported, the coordinator stops
                written, error = [], str(e) if isinstance(e, CheckpointError) else one_line(e)
            link.report(CheckpointPart, step=step, layers=written, error=error,
                        bytes=size if error is None else 0,
                        seconds=round(time.perf_counter() - start, 4))

        self.writer.submit(write)

    def final(self, engine: NodeEngine, end_step: int,
              layers: list[int] | None = None) -> tuple[list[int], str | None]:
        """After the run's last step (`end_step`): write the parameters (named, as model.pt
        holds them) of the layers this node first holds (or of `layers`, from any copy it
        holds) to `final-<end_step>/`, after every earlier write of this node; (layers
        written, error)."""
        states = first_holder_stages(engine) if layers is None else engine.held()
        params = {i: {f"param.{name}": t for name, t in named}
                  for st in states for i, named in st.parameters_by_layer()
                  if layers is None or i in layers}

        def write() -> tuple[list[int], str | None]:
            if not params:
                return [], None
            try:
                return write_layers(final_dir(checkpoint_location(self.cfg), end_step),
                                    params), None
            except Exception as e:  # noqa: BLE001 - the coordinator stops the run with it
                return [], str(e) if isinstance(e, CheckpointError) else one_line(e)

        return self.writer.submit(write).result()

    def serve_final_requests(self, engine: NodeEngine, end_step: int, store: dist.Store,
                             name: str) -> bool:
        """After the last step, until the run shuts down (True): when the coordinator asks
        (a layer's first holder was lost before it wrote the layer), write those layers'
        final parameters from this node's copy (its replica, or a data-parallel peer's
        stage). False: the coordinator abandoned the generation instead (every live copy of
        some layer was lost before its final parameters were written), and this node takes
        part in the generation that restores it."""
        key, served = final_request_key(name), None
        while not store.check([SHUTDOWN_KEY]):
            if engine.ctx.abandoned(engine.roles):
                return False
            if store.check([key]):
                text = store.get(key).decode()
                if text != served:
                    served = text
                    layers, error = self.final(engine, end_step, json.loads(text))
                    self.link.report(LayerParams, layers=layers, error=error)
            time.sleep(0.05)
        return True
