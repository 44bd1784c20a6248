"""Models as ordered lists of layers that a partition may cut anywhere between.

Every layer is built from its own RNG stream, keyed by (seed, layer index), so a
node that builds only its stage's layers gets exactly the parameters a single
process building the whole model would get. Every layer's forward draws its random
numbers (dropout masks, stochastic depth, noise) from torch's generators set to the
state of (seed, step, global micro-batch id, layer index) (`run_layers`), so whichever
node runs it, as often as a failover makes it run, it draws what a single process draws.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bamboo.config.presets import ModelPreset
from bamboo.model.api import custom_layer, model_of
from bamboo.model.bert import bert_layer
from bamboo.model.cnn import _block_widths, cnn_layer
from bamboo.model.gpt2 import gpt2_layer
from bamboo.model.hf import hf_layer, load_transformers
from bamboo.model.llama import llama_layer
from bamboo.model.meta import shapes_only
from bamboo.model.pipeline import boundary_spec
from bamboo.model.structure import BoundarySpec, StructuredSpec
from bamboo.model.ties import Tie, initial_copy, share_within, uses_at

__all__ = [
    "build_layer", "build_layers", "model_ties", "layer_param_counts", "boundary_shapes",
    "loss_fn",
    "derive_seed", "forward_seed", "seeded_randomness", "run_layers",
]


def _custom_layer(p: ModelPreset, index: int) -> nn.Module:
    """Your own model's layer (bamboo.model.api), built for the preset's vocabulary."""
    return custom_layer(model_of(p), index)


_BUILDERS: dict[str, Callable[[ModelPreset, int], nn.Module]] = {
    "custom": _custom_layer,
    "gpt2": gpt2_layer, "bert": bert_layer, "cnn": cnn_layer, "llama": llama_layer,
}


def _builder(p: ModelPreset) -> Callable[[ModelPreset, int], nn.Module]:
    """transformers' modules for hf: presets, bamboo's own otherwise (same family, same task)."""
    return hf_layer if p.hf_config else _BUILDERS[p.family]


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that is a pure function of `parts` (stable across processes)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def forward_seed(seed: int, step: int | str, mb: int, layer: int) -> int:
    """The seed of the random draws of layer `layer`'s forward on global micro-batch `mb`
    of `step` (a step number, or "eval" for the held-out pass, whose `mb` is the val
    micro-batch's index)."""
    return derive_seed("forward", seed, step, mb, layer)


def _generators(device: torch.device) -> list[torch.Generator] | None:
    """The global generators a forward on `device` draws from: the CPU's, and the CUDA
    device's where it runs on one; None for another accelerator (all are seeded then)."""
    if device.type == "cpu":
        return [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return [torch.default_generator, torch.cuda.default_generators[index]]
    return None


@contextlib.contextmanager
def seeded_randomness(device: torch.device | str) -> Iterator[Callable[[int], None]]:
    """For one forward: yields `reseed(seed)`, which sets torch's global generators (the
    CPU's and `device`'s) to the state `torch.manual_seed(seed)` gives them; on exit they
    are back where they were, so nothing outside the forward sees a draw or a seed.

    Seeding a generator itself costs about a microsecond; `torch.manual_seed`, which
    visits every device type, about a hundred (docs/results.md, "Seeded randomness")."""
    device = torch.device(device)
    generators = _generators(device)
    forked = [device] if device.type == "cuda" else []

    def reseed(seed: int) -> None:
        if generators is None:
            torch.manual_seed(seed)
            return
        for generator in generators:
            generator.manual_seed(seed)

    with torch.random.fork_rng(devices=forked, device_type="cuda" if device.type == "cpu"
                               else device.type):
        yield reseed


def run_layers(layers: Sequence[nn.Module], indices: Sequence[int], x: torch.Tensor, *,
               seed_of: Callable[[int], int], device: torch.device | str,
               call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """`x` through `layers` (the model's layers `indices`), each forward drawing from the
    generators seeded by `seed_of(its index)` (see `forward_seed`); `call(layer, x)` runs
    one (default: `layer(x)`; torch's activation checkpointing keeps the seeded state for
    its recompute). Every path that runs a forward goes through here, and so does the
    single-process reference: the same masks wherever a layer runs."""
    with seeded_randomness(device) as reseed:
        for index, layer in zip(indices, layers, strict=True):
            reseed(seed_of(index))
            x = layer(x) if call is None else call(layer, x)
    return x


def _seeded_layer(p: ModelPreset, index: int, seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed("layer", seed, index))
        return _builder(p)(p, index)


def model_ties(p: ModelPreset) -> tuple[Tie, ...]:
    """The tied weights of preset `p` (a model of your own may declare them)."""
    return model_of(p).ties if p.family == "custom" else ()


def build_layer(p: ModelPreset, index: int, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Layer `index` of preset `p`, initialised from the stream (seed, index); a tied
    parameter whose tie's first use is another layer starts as that layer's stream builds
    it (bamboo.model.ties)."""
    return build_layers(p, [index], seed, device)[0]


def build_layers(p: ModelPreset, indices: Iterable[int], seed: int,
                 device: str | torch.device = "cpu") -> list[nn.Module]:
    """The layers `indices` of preset `p` (each as `build_layer` builds it), the uses of a
    tie among them sharing one parameter."""
    indices = list(indices)
    layers = [_seeded_layer(p, i, seed) for i in indices]
    ties = model_ties(p)
    firsts: dict[int, nn.Module] = dict(zip(indices, layers))
    for index, layer in zip(indices, layers):
        for tie, path in uses_at(ties, index):
            first = tie.first[0]
            if first != index:
                if first not in firsts:  # its stream, built once, for the copies here
                    firsts[first] = _seeded_layer(p, first, seed)
                initial_copy(tie, firsts[first], index, layer, path)
    layers = [layer.to(device) for layer in layers]
    share_within(layers, indices, ties)
    return layers


def _meta_layer(p: ModelPreset, index: int) -> nn.Module:
    if p.hf_config:
        load_transformers()  # before the init functions are stubbed: it keeps references
        with shapes_only():
            return hf_layer(p, index, init=False)
    if p.family == "custom":
        model_of(p)  # outside: a build function may make modules by value
        try:
            with shapes_only():
                return _custom_layer(p, index)
        except Exception:  # noqa: BLE001 (a constructor that needs real tensors: count them on the CPU)
            with torch.random.fork_rng(devices=[]):
                return _custom_layer(p, index)
    with shapes_only():
        return _BUILDERS[p.family](p, index)


def layer_param_counts(p: ModelPreset) -> list[int]:
    """Parameter count of every layer, computed on the meta device (no memory)."""
    return [sum(t.numel() for t in _meta_layer(p, i).parameters()) for i in range(p.layers)]


def boundary_shapes(p: ModelPreset, micro_batch_size: int
                    ) -> list[BoundarySpec | StructuredSpec]:
    """Output spec of every layer for a micro-batch of `micro_batch_size` samples (a
    tuple or dict of tensors: a `StructuredSpec`, whose shape and dtype are its message's).

    Worked out from the preset (a forward pass on the meta device costs seconds);
    a test checks it against real forward passes.
    """
    b = micro_batch_size
    if p.family == "custom":
        return [boundary_spec(spec, b) for spec in model_of(p).boundaries]
    if p.family == "cnn":
        shapes, size = [(b, p.channels, p.image_size, p.image_size)], p.image_size
        for _, c_out, stride in _block_widths(p):
            size = (size + 1) // stride if stride > 1 else size
            shapes.append((b, c_out, size, size))
        shapes.append((b, p.classes))
    else:
        shapes = [(b, p.context, p.d_model)] * (p.layers - 1) + [(b, p.context, p.vocab)]
    return [BoundarySpec(shape, torch.float32) for shape in shapes]


def loss_fn(p: ModelPreset) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean loss of a micro-batch: next-token, masked-token or class cross-entropy."""
    if p.family == "cnn":
        return F.cross_entropy
    if p.family == "custom":
        return model_of(p).loss

    def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)
    return token_loss
