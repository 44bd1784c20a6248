"""Memory by tensor accounting: what a node keeps alive, counted from the tensors themselves.

Not process RSS (the Python/torch runtime, allocator caches and fragmentation are left
out): the bytes of the tensors the engine holds. Two parts make a node's peak in a step:

- between steps, `StageState.memory()` of every stage held, the replica included:
  parameters, the gradient sum and the optimizer state (on the host for a replica whose
  optimizer is offloaded);
- within the step, `StepMemory`: every forward's saved tensors from that forward until its
  backward (eager FRC's until the step ends, on the host under `--frc-offload`), the
  stage outputs kept for a shadow, the received inputs; its running maximum is the peak.

`SavedTensors` are the pack/unpack hooks one forward runs under: they count what autograd
saves (each storage once; parameters and the stage's input leaf are held elsewhere and
not counted) and, for an offloaded forward, move it to host memory (pinned, with
non-blocking copies, where an accelerator is present; a plain copy on a CPU-only machine).
Counting keeps nothing alive: the hooks keep storage keys, never tensors, and what they
hand autograd holds no reference back to the graph (see `SavedTensors.pack`). A forward
that is not offloaded runs them only when its count is not known yet (`SavedCounts`: once
per stage and input signature, again every so often, always where the count varies).

What the process really holds (resident memory, the CUDA allocator's figures) is measured
apart, by `bamboo.node.procmem`.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bamboo.model.structure import leaves

__all__ = ["SavedTensors", "SavedCounts", "signature", "StepMemory", "storage_bytes",
           "to_host", "can_pin"]


def can_pin(t: torch.Tensor) -> bool:
    """Whether a host copy of `t` should be pinned: only for a tensor on a CUDA device
    (pinning needs an accelerator, and only pays off for copies to and from one)."""
    return t.device.type == "cuda" and torch.cuda.is_available()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: pinned and non-blocking from a CUDA device (ordered on its
    stream before any later use of `t`'s memory), a plain copy otherwise."""
    if can_pin(t):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
    return t.to("cpu", copy=True)


def storage_bytes(t: Any) -> int:
    """Bytes of the memory `t` keeps alive: its whole storage (a view keeps all of it);
    of a tuple or dict of tensors, each storage once (a received structure's tensors are
    views of one buffer)."""
    if not isinstance(t, torch.Tensor):
        storages = {_storage_key(x): x for x in leaves(t)}
        return sum(map(storage_bytes, storages.values()))
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    try:
        return str(t.device), t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return str(t.device), id(t)


class SavedTensors:
    """The saved-tensor hooks of one forward: counts what it saves, offloads it if asked.

    `device_bytes` counts each storage once (autograd often saves several views of one
    buffer, e.g. q, k and v of one projection); `host_bytes` the host copies made.
    """

    def __init__(self, offload: bool = False, held: Sequence[torch.Tensor] = ()) -> None:
        self.offload = offload
        self.device_bytes = 0
        self.host_bytes = 0
        self._seen: set[tuple[str, int]] = set()
        self._held = {_storage_key(t) for t in held if not t.is_floating_point()}
        """Storages of a structured input's tensors that take no gradient (a mask, ids):
        held by the step anyway, as the input leaf is, so neither counted nor offloaded."""

    def pack(self, t: torch.Tensor) -> tuple[torch.device | None, torch.Tensor, int]:
        """Called by autograd for every tensor a forward op saves for its backward."""
        if t.is_leaf and t.requires_grad:  # a parameter or the stage's input: held anyway
            return None, t, t._version
        if self._held and not t.is_floating_point() and _storage_key(t) in self._held:
            return None, t.detach(), t._version
        if self.offload:
            host = to_host(t)
            self.host_bytes += host.numel() * host.element_size()
            return t.device, host, -1
        key = _storage_key(t)
        if key not in self._seen:
            self._seen.add(key)
            self.device_bytes += storage_bytes(t)
        # Never `t` itself: for an op that saves its own output (softmax, exp, tanh) the
        # packed value would hold the output, whose grad_fn holds the packed value, a cycle
        # through autograd's C++ graph that Python's collector cannot see. It is freed only
        # by a backward, which a redundant forward never gets unless a failover adopts it:
        # every eager FRC graph would leak. A detached alias shares the storage and the
        # version counter and holds no grad_fn; autograd re-attaches the grad_fn to what
        # `unpack` returns.
        return None, t.detach(), t._version

    @staticmethod
    def unpack(packed: tuple[torch.device | None, torch.Tensor, int]) -> torch.Tensor:
        """Called in the backward: an offloaded tensor goes back to its device. Under hooks
        autograd skips its own check that a saved tensor was not changed in place since it
        was saved: the shared version counter makes it here."""
        device, t, version = packed
        if device is not None:
            return t.to(device, non_blocking=True)
        if t._version != version:
            raise RuntimeError("one of the variables needed for gradient computation has been "
                               f"modified by an inplace operation (version {t._version}, saved "
                               f"at {version})")
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def signature(x: Any) -> tuple:
    """What decides the bytes a stage's forward saves, besides the stage: the shape, dtype
    and `requires_grad` of each of its input's tensors."""
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in leaves(x))


@dataclass(slots=True)
class _Count:
    device_bytes: int
    uses: int = 0
    varies: bool = False


class SavedCounts:
    """The bytes a forward saves, counted once per (stage, input signature) and reused.

    Counting runs a Python hook on every tensor autograd saves, a cost a plain training loop
    does not pay; for a model whose forward saves the same tensors for the same input
    shapes (every preset, most models), one count says it for every later forward. A count
    is taken again every `recount_every`-th use; where it differs (a model whose saved
    tensors depend on the data, such as a mixture of experts' routing), that signature is
    counted on every forward from then on."""

    def __init__(self, recount_every: int = 64) -> None:
        self.recount_every = recount_every
        self._counts: dict[Hashable, _Count] = {}

    def known(self, key: Hashable) -> int | None:
        """The device bytes a forward of `key` saves, when this one need not be counted;
        None: count it (and give the count to `counted`)."""
        count = self._counts.get(key)
        if count is None or count.varies:
            return None
        count.uses += 1
        return None if count.uses % self.recount_every == 0 else count.device_bytes

    def counted(self, key: Hashable, device_bytes: int) -> None:
        count = self._counts.get(key)
        if count is None:
            self._counts[key] = _Count(device_bytes)
        elif count.device_bytes != device_bytes:
            count.varies, count.device_bytes = True, device_bytes


@dataclass(slots=True)
class StepMemory:
    """The bytes a node holds within one step on top of its stages' state, by owner.

    An owner is a key such as ("fwd", stage, mb); its bytes are held from `hold` until
    `release` (a backward) or the end of the step. `peak_device` and `peak_host` are the
    running maxima of the sums.
    """

    device: int = 0
    host: int = 0
    peak_device: int = 0
    peak_host: int = 0
    held: dict[Hashable, list[int]] = field(default_factory=dict)

    def hold(self, key: Hashable, device_bytes: int, host_bytes: int = 0) -> None:
        """Add bytes to `key`'s share (created if new) and update the peaks."""
        share = self.held.setdefault(key, [0, 0])
        share[0] += device_bytes
        share[1] += host_bytes
        self.device += device_bytes
        self.host += host_bytes
        self.peak_device = max(self.peak_device, self.device)
        self.peak_host = max(self.peak_host, self.host)

    def release(self, key: Hashable) -> bool:
        """Drop `key`'s share (its backward ran); False when it holds nothing."""
        share = self.held.pop(key, None)
        if share is None:
            return False
        self.device -= share[0]
        self.host -= share[1]
        return True

    def release_all(self) -> None:
        """Drop every share (the step starts again); the peaks stay."""
        self.held.clear()
        self.device = self.host = 0

    def node_peak(self, held: Sequence[Any], primaries: Sequence[Any]) -> tuple[int, int]:
        """(device, host) bytes the node peaked at in the step: every `held` stage's state
        (`StageState.memory()`: parameters, gradient sum, optimizer state, the replica's on
        the host when offloaded), one of the `primaries`' transient .grad (a backward's,
        until it is added to the sum), and this step's peak of saved activations, kept
        outputs and FRC."""
        states = [st.memory() for st in held]
        grads = max((sum(p.numel() * p.element_size() for p in st.params) for st in primaries),
                    default=0)
        return (sum(d for d, _ in states) + grads + self.peak_device,
                sum(h for _, h in states) + self.peak_host)

