"""How a stage's forward runs on this node: its layers' seeded randomness, the
precision's autocast, activation checkpointing, the accounting of what autograd saves
(offloaded for eager FRC under `--frc-offload`), ZB-H1's tapes, and the CUDA stream eager
FRC runs on.

The engine's `Forward` and `RedundantForward` instructions call `StageForward.run`: a
node's own forward, eager FRC, a shadow's redo after a failover, a re-routed
micro-batch and a restarted step all run here, and every layer draws its random numbers
from generators seeded by (seed, step, global micro-batch id, layer index)
(`bamboo.model.run_layers`), so each of them draws the masks a failure-free run and the
single-process reference draw. The held-out pass (`evaluation`) runs `held_out`; ZB-H1's
weight gradients use `autocast`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bamboo.data.datasets import on_device
from bamboo.engine.memory import SavedCounts, SavedTensors, signature
from bamboo.engine.options import EngineOptions
from bamboo.engine.split_backward import Tape
from bamboo.engine.stage import StageState
from bamboo.engine.step import Forwarded
from bamboo.model import forward_seed, run_layers
from bamboo.model.structure import detach, float32, leaves

__all__ = ["StageForward", "metric_values"]


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each --precision that has one."""

class StageForward:
    """The forwards of one node: `P` stages, boundary `specs` by layer, each stage's layers
    `parts`, the `loss` of the last stage weighted by `weight` (1 / global micro-batches)."""

    def __init__(self, *, options: EngineOptions, device: torch.device, P: int,
                 parts: Sequence[range], specs: Sequence[Any],
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 weight: float, metrics: dict[str, Callable[[Any, Any], torch.Tensor]] | None = None
                 ) -> None:
        self.options, self.device, self.P, self.parts, self.specs = options, device, P, parts, specs
        self.loss, self.weight = loss, weight
        self.metrics = metrics or {}
        """The job's metrics (`--metric`), taken on the last stage's output under no_grad."""
        self._side_stream: Any = None
        """CUDA: the stream eager FRC runs on (`frc_stream`)."""
        self.saved_counts = SavedCounts()
        """What each stage's forward saves, by input signature (counted once, reused)."""
        self.loss_scale = 1.0
        """`--precision fp16`: the step's dynamic loss scale, by which the last stage's loss
        is multiplied before its backward (bamboo.plan.loss_scale); 1 otherwise."""

    def autocast(self) -> Any:
        """The context forwards run under: bf16 or fp16 autocast for --precision bf16 or fp16
        (parameters, gradients and optimizer state stay fp32), nothing for fp32."""
        dtype = _AUTOCAST.get(self.options.precision)
        if dtype is not None:
            return torch.autocast(device_type=self.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def _layers(self, st: StageState, x: torch.Tensor, step: int, mb: int) -> torch.Tensor:
        """`st`'s layers on `x`, each drawing from the generators seeded by (seed, `step`,
        `mb`, its layer index); with --activation-checkpointing each layer is a checkpoint
        (only its input is saved; its activations are recomputed in the backward, where
        the checkpoint restores the seeded generator state it ran under: the same masks)."""
        seed = self.options.seed
        call = _checkpointed if self.options.activation_checkpointing else None
        return run_layers(st.module, st.layer_indices, x, device=self.device, call=call,
                          seed_of=lambda layer: forward_seed(seed, step, mb, layer))

    def held_out(self, st: StageState, x: torch.Tensor, index: int) -> torch.Tensor:
        """`st`'s layers on val micro-batch `index` (the held-out pass): no gradients, under
        the precision's autocast, the layers in eval mode (no dropout; back in train mode
        after), any draw still made seeded by (seed, "eval", `index`, layer index)."""
        seed, module = self.options.seed, st.module
        module.eval()
        try:
            with torch.no_grad(), self.autocast():
                return run_layers(module, st.layer_indices, x, device=self.device,
                                  seed_of=lambda layer: forward_seed(seed, "eval", index, layer))
        finally:
            module.train()

    def run(self, st: StageState, mb: int, x: torch.Tensor, step: int,
            targets: Callable[[], torch.Tensor], frc: bool = False) -> Forwarded:
        """Forward of `stage` on `x` in `step`; the last stage's output is its weighted loss,
        with its value (against `targets()`).

        Runs under the precision's autocast; a stage's output leaves in its boundary
        spec's dtype (what the successor's receive buffers are), the loss is taken in fp32.
        Counts the bytes autograd keeps for the backward (parameters and the input leaf
        excluded: they are held anyway; counted once per input signature, `SavedCounts`):
        the activation memory of this forward, which the engine holds in the step's meter
        until the backward releases it; eager FRC's go to host memory under --frc-offload.
        Under zb-h1 the result carries the forward's tape (what the weight gradient needs).
        """
        stage = st.stage
        offload = frc and self.options.frc_offload
        key = None if offload else (stage, signature(x))
        known = None if key is None else self.saved_counts.known(key)
        saved = None if known is not None else \
            SavedTensors(offload=offload, held=() if isinstance(x, torch.Tensor) else leaves(x))
        # Under --frc-offload an FRC forward keeps nothing on the device for a tape: if a
        # failover adopts it, its backward runs whole in the input half.
        taped = st.taping is not None and not offload
        tape = Tape() if taped else None
        taping = st.taping.recording(tape) if tape is not None else contextlib.nullcontext()
        hooks = saved.hooks() if saved is not None else contextlib.nullcontext()
        metrics = None
        with hooks, taping:
            with self.autocast():
                out = self._layers(st, x, step, mb)
            if stage != self.P - 1:
                out = self.specs[self.parts[stage].stop - 1].cast(out)  # float tensors only
                loss = None
            else:
                labels = on_device(targets(), self.device)
                loss = self.loss(float32(out), labels)
                if self.metrics:
                    metrics = metric_values(self.metrics, out, labels)
        device_bytes, host_bytes = (known, 0) if saved is None else \
            (saved.device_bytes, saved.host_bytes)
        if key is not None and saved is not None:
            self.saved_counts.counted(key, device_bytes)
        value = None
        if loss is not None:
            out, value = loss * (self.weight * self.loss_scale), float(loss.detach())
        return Forwarded(out=out, loss=value, tape=tape,
                         metrics=metrics, device_bytes=device_bytes, host_bytes=host_bytes)

    def frc_stream(self) -> Any:
        """On CUDA, eager FRC runs on a stream of its own, after the work that produced its
        input, so it overlaps the pipeline's waits instead of queueing behind them (not yet
        run: no GPU here). Its results are used only by a failover, which waits for it."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def frc_results_complete(self) -> None:
        """Before a failover adopts eager FRC results: on CUDA, wait for their stream."""
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)


def metric_values(metrics: dict[str, Callable[[Any, Any], torch.Tensor]], out: Any,
                  labels: Any) -> dict[str, float]:
    """Each metric of the last stage's output `out` against `labels`, under no_grad (in fp32,
    as the loss)."""
    with torch.no_grad():
        outputs = float32(detach(out))
        return {name: float(fn(outputs, labels)) for name, fn in metrics.items()}


def _checkpointed(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer` on `x` as an activation checkpoint (the RNG state is kept for the recompute)."""
    return checkpoint(layer, x, use_reentrant=False, preserve_rng_state=True)
