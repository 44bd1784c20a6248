"""One stage a node holds: its layers, optimizer and gradient sum.

The same class serves a primary stage and a replica: a replica applies the same
reduced gradient with the same optimizer step, so it stays bit-identical to the
primary without shipping parameters or optimizer state.

The gradient sum is float64 under `--exact` (every layout gives the same bits) and
float32 otherwise; it is allocated on first use, so a replica, which is handed its
stage's reduced gradient and never sums one, holds none until it is adopted.

A replica's optimizer state may live in host memory (`offload_optimizer`, under
`--frc-offload`): its step then brings one parameter's state tensors to the device at a
time, runs the very step the primary runs (same kernels, same device: the same bits) and
puts them back. A replica that runs no forward (lazy redundancy) keeps its parameters there
too (`keep_on_host`: it takes no device memory), its step streamed the same way, and may
run that step on a thread of its own (`apply_later`, `replica_steps`), off the critical
path: every read of its state waits for it first (`settle`). `promote` (or
`to_device_optimizer`) moves the state to the device for good, when the replica is adopted
as a primary.

A stage may hold only layers without parameters (activations, dropout, reshapes, pooling):
it has no optimizer, its gradient sum is empty, and its layers' state is their layout's
header alone. A layer's state moves and is stored in the form `bamboo.engine.layer_state`
derives from the optimizer's own per-parameter state.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bamboo.config.presets import ModelPreset
from bamboo.engine import replica_steps
from bamboo.engine.layer_state import (
    LayerLayout,
    LayerState,
    group_options,
    layer_layout,
    read_state,
    snapshot,
    write_state,
)
from bamboo.engine.memory import to_host
from bamboo.engine.optim import make_optimizer, set_lr
from bamboo.engine.options import EngineOptions
from bamboo.engine.split_backward import Taping
from bamboo.model import build_layers, model_ties
from bamboo.model.ties import get_param
from bamboo.plan.schedule import defers_weight

__all__ = ["StageState", "StageOptimizer", "build_stage", "build_replica"]


@dataclass(frozen=True, slots=True)
class StageOptimizer:
    """How a stage's optimizer is made: its learning rate, weight decay and the optimizer
    (`spec`: `MODULE:NAME(...)`, `bamboo.engine.optim`; None: AdamW)."""

    lr: float
    weight_decay: float
    spec: str | None = None


def _offloadable(value: Any) -> bool:
    """A per-parameter state tensor `--frc-offload` keeps in host memory: any of one or more
    dimensions (a step count of no dimension stays where the optimizer keeps it)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class StageState:
    """Stage `stage` (layers `layer_indices`) on this node."""

    def __init__(self, *, preset: ModelPreset, stage: int, layer_indices: range, seed: int,
                 device: torch.device, optim: StageOptimizer,
                 accumulate_dtype: torch.dtype = torch.float32) -> None:
        self.stage, self.layer_indices, self.device = stage, layer_indices, device
        self.accumulate_dtype = accumulate_dtype
        self.module = nn.Sequential(*build_layers(preset, layer_indices, seed, device))
        self.module.train()
        self.params = list(self.module.parameters())
        self.optimizer: torch.optim.Optimizer | None = make_optimizer(
            self.module, lr=optim.lr, weight_decay=optim.weight_decay, spec=optim.spec
        ) if self.params else None
        """None when the stage's layers have no parameters (nothing to step)."""
        self._options = group_options(self.optimizer) if self.optimizer is not None else {}
        """Each parameter's group options as built: what its state's layout is probed with."""
        self._layouts: dict[int, LayerLayout] = {}
        self.numel = sum(p.numel() for p in self.params)
        self._grad_sum: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._served: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        """`--redundancy reroute`: the gradient sums of the micro-batches of other pipelines
        this node serves at this stage, one per pipeline (summed apart, so that `--exact`
        adds every pipeline's sum in pipeline order as a failure-free step does)."""
        self.optimizer_on_host = False
        """The optimizer's state tensors live in host memory (see `offload_optimizer`)."""
        self.on_host = False
        """The parameters live in host memory too (`keep_on_host`: a replica off the device)."""
        self._pending: Future | None = None
        """The optimizer step `apply_later` began and no read has waited for yet."""
        self.taping: Any = None
        """Under zb-h1, the forward hooks that tape its linear layers (`split_backward.Taping`)."""
        self.layer_spans: list[tuple[int, int, int]] = []
        """(layer index, start, end) of each layer's parameters in the flat gradient; a
        parameter tied to an earlier layer of this stage is in that layer's span."""
        self.layer_sizes: list[int] = []
        """Each layer's parameter count, tied parameters included (its `layer_state`)."""
        offset, seen, at = 0, set(), {}
        for layer_index, layer in zip(layer_indices, self.module):
            own = [p for p in layer.parameters() if id(p) not in seen]
            for p in own:
                seen.add(id(p))
                at[id(p)] = offset
                offset += p.numel()
            self.layer_spans.append((layer_index, offset - sum(p.numel() for p in own), offset))
            self.layer_sizes.append(sum(p.numel() for p in layer.parameters()))
        self.tied: dict[str, slice] = {}
        """Key -> where the tied parameter this stage holds lies in the flat gradient: the
        commit round adds these slices over the stages that hold the key."""
        self._norm_skips: dict[int, list[tuple[int, int]]] = {}
        """Layer -> the slices of its span that the gradient norm leaves out: a tied copy
        whose first use is on another stage (the norm counts it there)."""
        for tie in model_ties(preset):
            held = [(i, path) for i, path in tie.uses if i in layer_indices]
            if not held:
                continue
            layer, path = held[0]
            p = get_param(self.module[layer_indices.index(layer)], path)
            self.tied[tie.key] = slice(at[id(p)], at[id(p)] + p.numel())
            if tie.first[0] not in layer_indices:
                self._norm_skips.setdefault(layer, []).append((at[id(p)], at[id(p)] + p.numel()))

    @property
    def grad_sum(self) -> torch.Tensor:
        """The sum of this step's micro-batch gradients, flat in parameter order
        (`accumulate_dtype`; allocated, zeroed, on first use)."""
        self.sum_views()
        assert self._grad_sum is not None
        return self._grad_sum

    def sum_views(self) -> list[torch.Tensor]:
        """Views of the gradient sum shaped like the parameters, in order (allocating the
        sum, zeroed, the first time)."""
        if self._grad_sum is None:
            self._grad_sum = torch.zeros(self.numel, dtype=self.accumulate_dtype,
                                         device=self.device)
            self._views = self._split(self._grad_sum)
        return self._views

    def _split(self, flat: torch.Tensor,
               params: list[nn.Parameter] | None = None) -> list[torch.Tensor]:
        """Views of `flat` shaped like `params` (default: all of the stage's), in order."""
        views, offset = [], 0
        for p in self.params if params is None else params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def param_slices(self) -> list[tuple[nn.Parameter, int, int]]:
        """Each parameter with its [start, end) in the flat gradient sum, in order."""
        out, offset = [], 0
        for p in self.params:
            out.append((p, offset, offset + p.numel()))
            offset += p.numel()
        return out

    def served_sums(self) -> dict[int, torch.Tensor]:
        """Pipeline -> the gradient sum of its re-routed micro-batches this node ran."""
        return {d: flat for d, (flat, _) in sorted(self._served.items())}

    def accumulate(self, served_for: int | None = None) -> None:
        """Add this micro-batch's parameter gradients to the gradient sum (with `served_for`,
        to the sum of that pipeline's re-routed micro-batches)."""
        if served_for is None:
            views = self.sum_views()
        else:
            if served_for not in self._served:
                flat = torch.zeros(self.numel, dtype=self.accumulate_dtype, device=self.device)
                self._served[served_for] = (flat, self._split(flat))
            views = self._served[served_for][1]
        into, grads = [], []
        for view, p in zip(views, self.params):
            if p.grad is not None:
                into.append(view)
                grads.append(p.grad)
                p.grad = None
        if into:  # one fused add (one launch on CUDA): the bits of an add_ per parameter
            torch._foreach_add_(into, grads)

    def layer_sq_norms(self, reduced: torch.Tensor) -> list[tuple[int, float]]:
        """(layer index, sum of squares) of a reduced gradient of this stage, summed in
        float64 whatever the gradient's dtype."""
        if not self.layer_spans:
            return []
        sums = torch.stack([self._counted(reduced, i, a, b).to(torch.float64).square().sum()
                            for i, a, b in self.layer_spans])
        return list(zip((i for i, _, _ in self.layer_spans), sums.tolist()))  # one sync

    def _counted(self, reduced: torch.Tensor, layer: int, a: int, b: int) -> torch.Tensor:
        """Layer `layer`'s part of `reduced` that its norm counts: its span `[a, b)` less the
        tied copies counted on another stage (the same values, in the same order, as the
        span the layer has on a stage without that copy)."""
        skips = sorted(self._norm_skips.get(layer, ()))
        if not skips:
            return reduced[a:b]
        pieces, start = [], a
        for lo, hi in skips:
            pieces.append(reduced[start:lo])
            start = hi
        return torch.cat([*pieces, reduced[start:b]])

    def apply(self, grad32: torch.Tensor, coef: float, lr: float) -> None:
        """One optimizer step with the reduced gradient `grad32` (float32) scaled by `coef`."""
        if self.optimizer is None:  # layers without parameters: nothing to step
            return
        grad = grad32 * coef if coef != 1.0 else grad32
        set_lr(self.optimizer, lr)
        if self.optimizer_on_host:
            self._step_streamed(grad)
            return
        for view, p in zip(self._split(grad), self.params):
            p.grad = view
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def _step_streamed(self, grad: torch.Tensor) -> None:
        """The step with host-resident optimizer state, one parameter at a time: its state
        tensors go to the device, the optimizer steps that parameter alone (an elementwise
        optimizer skips parameters without a gradient, and its arithmetic for one parameter
        does not depend on which others step with it, loop or foreach
        (tests/test_devices.py), so the bits are the all-at-once step's) and the tensors go
        back to their host buffers."""
        assert self.optimizer is not None
        state = self.optimizer.state
        stream_params = self.on_host and self.device.type != "cpu"
        for view, p in zip(self._split(grad), self.params):
            host = {k: v for k, v in state[p].items() if _offloadable(v)} if p in state else None
            for k, v in (host or {}).items():
                state[p][k] = v.to(self.device, non_blocking=True)
            host_param = p.data
            if stream_params:
                p.data = host_param.to(self.device, non_blocking=True)
            p.grad = view
            try:
                self.optimizer.step()
            finally:
                p.grad = None
                if stream_params:
                    host_param.copy_(p.data, non_blocking=True)
                    p.data = host_param
            for k, on_device in list(state[p].items()):
                if not _offloadable(on_device):
                    continue
                if host is None or k not in host:
                    state[p][k] = on_device if on_device.device.type == "cpu" else to_host(on_device)
                else:
                    if host[k] is not on_device:
                        host[k].copy_(on_device, non_blocking=True)
                    state[p][k] = host[k]
        self._sync()

    def _sync(self) -> None:
        """Wait for non-blocking copies to host memory (before anyone reads it there)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- a replica in host memory, stepped off the critical path -----------------------------

    def keep_on_host(self) -> None:
        """Keep the parameters and the optimizer state in host memory from now on (pinned
        where an accelerator is present): this stage takes no device memory between its
        steps, which stream them through the device one parameter at a time. On a CPU
        device they are in host memory already and step as they are."""
        if self.device.type != "cpu":
            for p in self.params:
                p.data = to_host(p.data)
            self.offload_optimizer()
        self.on_host = True

    def apply_later(self, grad32: torch.Tensor, coef: float, lr: float) -> None:
        """`apply` on the replica-step thread, overlapping what the node does next; every
        read of this stage's state waits for it first (`settle`)."""
        if self._pending is not None and not self._pending.done() and replica_steps.yielding():
            replica_steps.behind()  # a whole step was not enough: the idle time went elsewhere
        self.settle()
        self._pending = replica_steps.submit(self.apply, grad32, coef, lr)

    def settle(self) -> None:
        """Wait for the step `apply_later` began (its error raised here), bounded."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        replica_steps.wait(pending, f"stage {self.stage}'s replica step")

    def promote(self) -> float:
        """Bring a replica's state to the device for good (it is adopted as a primary):
        the seconds it took, its pending step included."""
        start = time.perf_counter()
        self.settle()
        if self.on_host and self.device.type != "cpu":
            for p in self.params:
                p.data = p.data.to(self.device)
        self.on_host = False
        self.to_device_optimizer()
        self._sync()
        return time.perf_counter() - start

    # -- where the optimizer state lives -----------------------------------------------------

    def offload_optimizer(self) -> None:
        """Keep the optimizer's state tensors in host memory from now on (pinned where an
        accelerator is present); the step streams them through the device (see
        `_step_streamed`)."""
        if self.optimizer_on_host:
            return
        self.settle()
        for per in self._per_param_states():
            for k, v in per.items():
                if _offloadable(v) and v.device.type != "cpu":
                    per[k] = to_host(v)
        self._sync()
        self.optimizer_on_host = True

    def to_device_optimizer(self) -> None:
        """Bring host-resident optimizer state to the device for good (a replica adopted as
        a primary); a no-op for a stage whose optimizer state is on the device."""
        if not self.optimizer_on_host:
            return
        self.settle()
        for per in self._per_param_states():
            for k, v in per.items():
                if _offloadable(v):
                    per[k] = v.to(self.device)
        self.optimizer_on_host = False

    def _per_param_states(self) -> list[dict[str, Any]]:
        return [] if self.optimizer is None else list(self.optimizer.state.values())

    def memory(self) -> tuple[int, int]:
        """(device bytes, host bytes) this stage holds between steps by tensor accounting:
        parameters, the gradient sum (once allocated) and the optimizer's state tensors (on
        the host when offloaded, even where host and device are the same memory). Sizes
        only: it does not wait for a step under way (`apply_later`)."""
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = 0 if self._grad_sum is None else \
            self._grad_sum.numel() * self._grad_sum.element_size()
        grads += sum(flat.numel() * flat.element_size() for flat, _ in self._served.values())
        moments = sum(v.numel() * v.element_size() for per in self._per_param_states()
                      for v in list(per.values()) if _offloadable(v))
        if self.on_host:
            return grads, params + moments
        if self.optimizer_on_host:
            return params + grads, moments
        return params + grads + moments, 0

    def reset_grads(self) -> None:
        if self._grad_sum is not None:
            self._grad_sum.zero_()
        self._served.clear()
        for p in self.params:
            p.grad = None

    # -- state transfer (peer restore, reconfiguration, checkpoints) -------------------------

    def state_vector(self) -> torch.Tensor:
        """The whole stage's state packed (uint8, on the device): its layers' packed states
        in layer order (`state_size` bytes)."""
        self.settle()
        return torch.cat([self.packed_layer(i) for i in self.layer_indices])

    def state_size(self) -> int:
        """Bytes of `state_vector`: what a peer restoring this stage posts to receive."""
        return sum(self.layer_layout(i).nbytes for i in self.layer_indices)

    def load_state_vector(self, vector: torch.Tensor) -> None:
        offset = 0
        for i in self.layer_indices:
            size = self.layer_layout(i).nbytes
            self.load_layer_state(i, vector[offset:offset + size])
            offset += size

    def _layer_named(self, layer_index: int) -> list[tuple[str, nn.Parameter]]:
        position = self.layer_indices.index(layer_index)
        return list(self.module[position].named_parameters())

    def layer_layout(self, layer_index: int) -> LayerLayout:
        """The layout of one layer's state (`bamboo.engine.layer_state`), the same on every
        node that builds this layer with this optimizer."""
        if layer_index not in self._layouts:
            self.settle()
            self._layouts[layer_index] = layer_layout(self._layer_named(layer_index),
                                                      self.optimizer, self._options)
        return self._layouts[layer_index]

    def _live(self, layer_index: int) -> LayerState:
        self.settle()
        params = [p for _, p in self._layer_named(layer_index)]
        return read_state(self.layer_layout(layer_index), params, self.optimizer,
                          f"layer {layer_index}")

    def layer_state(self, layer_index: int) -> LayerState:
        """One layer's parameters and optimizer state as named CPU copies (the unit a
        checkpoint stores and a node keeps between generations: layers, not stages, since
        the partition may change)."""
        return snapshot(self._live(layer_index))

    def packed_layer(self, layer_index: int) -> torch.Tensor:
        """One layer's state packed into one uint8 buffer on the device (what a peer sends)."""
        return self.layer_layout(layer_index).pack(self._live(layer_index), self.device)

    def load_layer_state(self, layer_index: int,
                         state: Mapping[str, torch.Tensor] | torch.Tensor) -> None:
        """Set one layer's parameters and optimizer state from its named tensors (a
        checkpoint's, a `layer_state`) or its packed buffer (a peer's); ValueError (one
        line) when they are of another model or optimizer."""
        self.settle()
        layout, where = self.layer_layout(layer_index), f"layer {layer_index}"
        if isinstance(state, torch.Tensor):
            state = layout.unpack(state, where)
        else:
            layout.check(state, where)
        params = [p for _, p in self._layer_named(layer_index)]

        def place(t: torch.Tensor) -> torch.Tensor:
            if self.optimizer_on_host and t.dim() > 0:  # pinned where an accelerator is
                return to_host(t.to(self.device))
            return t.to(self.device, copy=True)
        write_state(layout, params, self.optimizer, state, place)
        self._sync()

    def digest(self) -> str:
        """sha256 of the parameters' float32 bytes (replica checks)."""
        import hashlib
        self.settle()
        sha = hashlib.sha256()
        for p in self.params:
            sha.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return sha.hexdigest()

    def parameters_by_layer(self) -> list[tuple[int, list[tuple[str, torch.Tensor]]]]:
        self.settle()
        return [(i, [(n, p.detach().to("cpu", torch.float32).clone())
                     for n, p in layer.named_parameters()])
                for i, layer in zip(self.layer_indices, self.module)]


def build_stage(preset: ModelPreset, o: EngineOptions, parts: Sequence[range],
                device: torch.device, stage: int) -> StageState:
    """A fresh `stage` of a node's engine: seeded parameters, gradient sums in float64
    under --exact; under zb-h1 its linear layers taped in every forward (`split_backward`)."""
    st = StageState(preset=preset, stage=stage, layer_indices=parts[stage], seed=o.seed,
                    device=device, optim=StageOptimizer(o.lr, o.weight_decay, o.optimizer),
                    accumulate_dtype=torch.float64 if o.exact else torch.float32)
    if defers_weight(o.schedule, stage):
        st.taping = Taping(st.module)
    return st


def build_replica(build: Callable[[int], StageState], stage: int | None, *,
                  runs_forward: bool) -> StageState | None:
    """A node's replica of `stage` (None: it keeps none): kept in host memory
    (`keep_on_host`) unless it runs forwards of its own (eager FRC runs them on the device)."""
    if stage is None:
        return None
    st = build(stage)
    if not runs_forward:
        st.keep_on_host()
    return st
