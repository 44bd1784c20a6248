"""Your own model: an ordered list of layers, what travels between them, and a loss.

A model is one Python file with a build function that returns a `PipelineModel` (or an
`nn.Sequential`, a layer list or DeepSpeed `LayerSpec`s: bamboo.model.forms converts them);
`bamboo train --model PACKAGE.MODULE:FUNCTION` (or `--model path/to/file.py:FUNCTION`)
trains it on next-token prediction like bamboo's own GPT-2 presets: every layer of the
pipeline gets a micro-batch of `[B, context]` int64 token ids (layer 0) or the previous
layer's output, and the last layer's output goes with the `[B, context]` int64 targets
into the loss. With a Dataset (`--dataset`, `bamboo.Job(dataset=...)`) layer 0 gets its
inputs instead, which the model declares (`inputs=`, below). A complete model::

    # mymodel.py
    import torch
    from torch import nn

    from bamboo.model.api import PipelineModel, TensorSpec


    class Embed(nn.Module):
        def __init__(self, vocab: int, context: int, d: int) -> None:
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(context, d)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


    class Mix(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(self.ln(x)))


    def build(vocab_size: int = 256) -> PipelineModel:
        context, d = 32, 64
        return PipelineModel(
            layers=[lambda: nn.Sequential(Embed(vocab_size, context, d), Mix(d)),
                    lambda: Mix(d),
                    lambda: nn.Sequential(Mix(d), nn.Linear(d, vocab_size))],
            boundary=TensorSpec((context, d)),
            context=context,
            vocab_size=vocab_size,
        )

    $ bamboo train --model mymodel:build --nodes 3 --stages 3

The rules:

- `layers` are zero-argument callables, one per pipeline layer, each returning a fresh
  `nn.Module`. A node calls only the factories of the layers it holds, each under the
  random stream bamboo seeds from (seed, layer index), so every node draws exactly the
  parameters a single process building the whole model would.
- Randomness in a forward (`nn.Dropout`, stochastic depth, noise) is welcome, drawn from
  torch's global generators (`torch.rand`, `torch.randn`, `torch.bernoulli`,
  `F.dropout`, what torch's modules use): around each layer's forward bamboo sets them to
  the state of (seed, step, global micro-batch id, layer index), so the node that runs it,
  an eager FRC, a shadow redoing it, a re-routed or restarted step and the
  activation-checkpointing recompute all draw the same masks, and a run with kills ends
  equal to its failure-free run. Layers run in train mode, and in eval mode (no dropout)
  for the held-out loss. A draw that bypasses torch's global generators is not seeded:
  Python's `random` and numpy's `np.random` in a factory or a forward are refused at the
  check below; a `torch.Generator` or a numpy `Generator` a layer keeps for itself cannot
  be seen, and a failover would draw other numbers from it: do not keep one.
- `boundary` is what one layer hands the next, per sample (no batch dimension): a
  `TensorSpec`, or a tuple or a dict of str to TensorSpecs when a layer returns a tuple
  or dict of tensors (the next layer gets it as its one argument), for every boundary,
  or a list of `len(layers) - 1` of them, one per boundary. Floating-point tensors get
  their gradients back; others (masks, ids) travel forward only; each boundary holds at
  least one floating tensor (bamboo.model.structure).
- `inputs` is what layer 0 receives per sample: `[context]` int64 token ids unless
  given; a `TensorSpec` of any dtype (`TensorSpec((3, 32, 32))` for float images), or a
  tuple or dict of them (`(ids, mask)`), as a Dataset's collate makes its inputs.
- The last layer's output is `output` per sample, `[context, vocab_size]` float32 logits
  unless given, and `loss(output, targets)` is the micro-batch's mean loss (by default
  next-token cross-entropy, targets of -100 ignored).
- A model with a vocabulary takes it as the build function's keyword `vocab_size` with a
  default: the training data's tokenizer may ask for another size, and bamboo calls it
  again. `vocab_size` is needed only for the default `output` and for bamboo's own byte
  tokens (256 or more); a classifier of a Dataset's images leaves it None, and its build
  function need not take it.
- Every process of a run imports the module: the coordinator, and each worker, which
  starts in the coordinator's working directory. A `PACKAGE.MODULE` is imported with that
  directory first on `sys.path` (as `python -m` does), so a module in the directory you run
  `bamboo` from is found; otherwise install it or put it on PYTHONPATH. Workers on other
  machines (`bamboo agent`) import it there the same way.

Before anything starts, bamboo builds every layer on the meta device (no memory) and runs a
batch of one sample of `inputs` through them (zeros; True for a bool mask), so a layer that
raises, a declared shape that does not hold or a draw from Python's or numpy's global
generator is one line on the command line, not a failure inside a worker or a run that
silently ends elsewhere than its failure-free run. The loss is tried there on `[1, context]`
token targets when the inputs are token ids (not declared) and the output is per token
(`[B, context, ...]`); a classifier's output (`[B, classes]`) and a model that declares its
`inputs` take a Dataset's labels, which the loss first meets in the job's check
(bamboo.data.user) and the run.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import pickle
import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from bamboo.config.presets import ModelPreset
from bamboo.model import forms
from bamboo.model.meta import shapes_only
from bamboo.model.pipeline import (
    Boundary,
    ModelError,
    PipelineModel,
    TensorSpec,
    describe_spec,
    next_token_loss,
    zeros_of,
)
from bamboo.model.spec_text import Unreadable, spec_of_text
from bamboo.model.structure import StructureError, Treedef, describe, flatten, float32
from bamboo.model.ties import TieError, check_shapes, get_param, uses_at

__all__ = ["PipelineModel", "TensorSpec", "ModelError", "next_token_loss", "load_model",
           "custom_layer", "import_object", "model_of"]


class _RunError(ModelError):
    """A factory, forward or loss that raised: on the meta device, maybe only there."""


# -- loading by import path ----------------------------------------------------------------

def split_name(name: str) -> tuple[str, str]:
    """`pkg.module:function` or `path/to/file.py:function` -> (target, function)."""
    target, _, function = name.rpartition(":")
    module = target.endswith(".py") or all(part.isidentifier() for part in target.split("."))
    if not target or not module or not function.isidentifier():
        raise ModelError(f"'{name}' is not MODULE:FUNCTION; write e.g. "
                         f"examples.custom_model:build or path/to/model.py:build")
    return target, function


def _import(target: str) -> object:
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise ModelError(f"file '{target}' does not exist")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
        module_name = f"_bamboo_model_{path.stem}_{digest}"
        if module_name in sys.modules:
            return sys.modules[module_name]
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))  # its sibling modules, as for a script
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)  # the console script's sys.path lacks it; `python -m` has it
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        # the module (or its package) itself is missing, not a module it imports
        if e.name is not None and (target + ".").startswith(e.name + "."):
            raise ModelError(f"no module '{target}' in {cwd} or on sys.path: run bamboo from the "
                             f"directory that holds it, or put it on PYTHONPATH") from None
        raise


def import_object(name: str) -> Callable[..., object]:
    """The callable a `MODULE:NAME` or `path/file.py:NAME` names, imported as `--model` is
    (a file under one module name, so a script the model came from is imported once)."""
    target, _, attribute = name.rpartition(":")
    obj = getattr(_import(target), attribute, None)
    if obj is None or not callable(obj):
        raise ModelError(f"'{target}' has no callable '{attribute}'")
    return obj


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@functools.cache
def load_model(name: str, vocab: int | None = None, inputs: str = "") -> PipelineModel:
    """The model of `name` (MODULE:FUNCTION), built for `vocab` tokens (the function's
    default when None or 0, a preset's vocabulary for a model without one) and for `inputs`
    (what a Dataset's first sample hands layer 0, as bamboo.model.spec_text writes it; ""
    without a Dataset), with its layers and shapes checked on the meta device. ValueError
    with one line when anything is wrong."""
    vocab = vocab or None
    try:
        model = _load(name, vocab, spec_of_text(inputs) if inputs else None)
        _check_shapes(model)
    except ModelError as e:
        raise ModelError(f"model '{name}': {e}") from None
    return model


def model_of(p: ModelPreset) -> PipelineModel:
    """The model of your own model's preset `p` (`load_model` of its name, vocabulary and
    inputs): what every process builds its layers from."""
    return load_model(p.name, p.vocab, p.inputs)


def _load(name: str, vocab: int | None, data_inputs: Boundary | Unreadable | None
          ) -> PipelineModel:
    target, function = split_name(name)
    try:
        module = _import(target)
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 (the user's module may raise anything on import)
        raise ModelError(f"importing '{target}' failed: {_one_line(e)}") from None
    build = getattr(module, function, None)
    if build is None:
        raise ModelError(f"'{target}' has no function '{function}'")
    if not callable(build):
        raise ModelError(f"'{function}' in '{target}' is {type(build).__name__}, not a function")
    takes_vocab = _takes_vocab(build, function, vocab)
    try:
        with forms.seeded_build():
            model = build(vocab_size=vocab) if vocab is not None and takes_vocab else build()
    except ModelError as e:
        raise ModelError(f"{function}(): {e}") from None
    except Exception as e:  # noqa: BLE001 (the user's build function may raise anything)
        raise ModelError(f"{function}() raised {_one_line(e)}") from None
    try:  # another form (nn.Sequential, a layer list, DeepSpeed's): converted
        model = forms.pipeline_model(model, vocab_size=vocab, build=build,
                                     data_inputs=data_inputs)
    except ModelError as e:  # an object sent by value is the model itself, not a factory's
        raise ModelError(str(e) if isinstance(build, forms.Given)
                         else f"{function}() returned {e}") from None
    if vocab is not None and model.vocab_size != vocab and not takes_vocab:
        raise ModelError(f"{function}() takes no vocab_size keyword, and its model's "
                         f"vocab_size={model.vocab_size} is not the {vocab} asked for; define "
                         f"it as def {function}(vocab_size: int = 256) -> PipelineModel")
    if vocab is not None and model.vocab_size != vocab:
        raise ModelError(f"{function}(vocab_size={vocab}) returned a model with vocab_size="
                         f"{model.vocab_size}: pass vocab_size on to the model")
    return model


def _takes_vocab(build: Callable, function: str, vocab: int | None) -> bool:
    """Whether `build` takes the keyword `vocab_size` (a model whose vocabulary the data's
    tokenizer sizes must); ModelError when it cannot be called as bamboo calls it (with
    `vocab_size=vocab` when it takes it, else with no argument)."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(vocab_size=1)
        takes = True
    except TypeError:
        takes = False
    if vocab is None or not takes:
        try:
            signature.bind()
        except TypeError:
            required = [n for n, q in signature.parameters.items()
                        if q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
            raise ModelError(f"{function}() has a parameter without a default "
                             f"({', '.join(required)}): bamboo calls it with none, so give "
                             f"each a default") from None
    return takes


def _check_shapes(model: PipelineModel) -> None:
    """Build every layer and run a batch of one sample of the model's inputs (zeros of
    `input_spec`) through them, on the meta device (no memory, no init); on CPU when some
    op has no meta kernel."""
    try:
        with shapes_only(), torch.no_grad():
            _trace(model)
    except _RunError:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            _trace(model)


def _unseeded_states() -> dict[str, bytes]:
    """The state of each global generator bamboo does not seed: Python's `random`, and
    numpy's `np.random` once numpy is imported."""
    states = {"Python's random module": pickle.dumps(random.getstate())}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy's np.random"] = pickle.dumps(numpy.random.get_state())
    return states


def _refuse_unseeded(before: dict[str, bytes], what: str) -> None:
    """ModelError when `what` (a layer's factory or forward) drew from a global generator
    bamboo does not seed (its state is not `before`)."""
    after = _unseeded_states()
    for name, state in before.items():
        if after.get(name) != state:
            raise ModelError(f"{what} draws from {name}, whose numbers a failover would not "
                             f"draw again: draw from torch's generator (torch.rand, "
                             f"nn.Dropout), which bamboo seeds by step, micro-batch and layer")


def _trace(model: PipelineModel) -> None:
    x: object = zeros_of(model.input_spec)
    firsts: dict[str, nn.Module] = {}
    for i, spec in enumerate(model.boundaries):
        before = _unseeded_states()
        layer = custom_layer(model, i)
        _refuse_unseeded(before, f"layer {i}'s factory")
        _check_ties(model, i, layer, firsts)
        try:
            x = layer(x)
        except Exception as e:  # noqa: BLE001 (the user's layer may raise anything)
            fed = (f"its input {_shapes(x)}" if i else f"its inputs, one sample of "
                   f"{describe_spec(model.input_spec)}{_declare(model)}")
            raise _RunError(f"layer {i} failed on {fed}: {_one_line(e)}") from None
        _refuse_unseeded(before, f"layer {i}'s forward")
        what = "output" if i == len(model.boundaries) - 1 else f"boundary {i}"
        _check_output(i, x, spec, what)
    if model.inputs is not None or not _per_token(x, model.context):
        return  # declared inputs, a sequence's prediction: the labels are a Dataset's
    targets = torch.zeros((1, model.context), dtype=torch.int64)
    try:
        loss = model.loss(float32(x), targets)
    except Exception as e:  # noqa: BLE001 (the user's loss may raise anything)
        raise _RunError(f"loss failed on the output {_shapes(x)} and targets "
                        f"{list(targets.shape)}: {_one_line(e)}") from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ModelError(f"loss returned {type(loss).__name__} "
                         f"{list(getattr(loss, 'shape', []))}, not a scalar tensor")


def _check_ties(model: PipelineModel, i: int, layer: nn.Module,
                firsts: dict[str, nn.Module]) -> None:
    """ModelError when a tie's use at layer `i` names no parameter of it, or one of another
    shape than the tie's first use (whose layer, in `firsts`, was built before)."""
    try:
        for tie, path in uses_at(model.ties, i):
            if tie.first[0] == i:
                get_param(layer, path)
                firsts[tie.key] = layer
            else:
                check_shapes(tie, firsts[tie.key], i, layer, path)
    except TieError as e:
        raise ModelError(str(e)) from None


def _declare(model: PipelineModel) -> str:
    """How to say what layer 0 takes, in a message about the default inputs."""
    return (" (token ids, the default: declare what layer 0 takes with "
            "PipelineModel(inputs=...))" if model.inputs is None else "")


def _per_token(output: object, context: int) -> bool:
    """Whether the last layer's output may take `[B, context]` token targets: a structure
    (as before), or one tensor of per-token predictions `[B, context, ...]`. One tensor of
    another shape (a classifier's `[B, classes]`) meets a Dataset's labels, which only the
    job has: its loss is first called in the run."""
    if not isinstance(output, torch.Tensor):
        return True
    return output.dim() >= 2 and output.shape[1] == context


def _shapes(x: object) -> str:
    """A value's shapes for a message: `of shape [1, 16]`, `(hidden [1, 16, 8], mask [1, 16])`."""
    if isinstance(x, torch.Tensor):
        return f"of shape {list(x.shape)}"
    try:
        items, treedef = flatten(x)
    except StructureError:
        return describe(x)
    return f"{treedef} of shapes {[list(t.shape) for t in items]}"


def _check_output(i: int, x: object, spec: object, what: str) -> None:
    """ModelError unless layer `i`'s output `x` has the structure, shapes and dtypes of its
    declared `spec` (`what`: "boundary i" or "output")."""
    try:
        items, treedef = flatten(x)
    except StructureError as e:
        raise ModelError(f"layer {i} returned {describe(x)} ({e} is not a tensor): a layer "
                         f"returns a tensor, or a tuple or a dict of str to tensors") from None
    specs, declared = flatten(spec, leaf=TensorSpec)
    if treedef != declared:
        raise ModelError(f"layer {i} returns {_structure_name(treedef)} but the model declares "
                         f"its {what} as {_structure_name(declared)}")
    for n, (t, s) in enumerate(zip(items, specs)):
        if tuple(t.shape) != (1, *s.shape) or t.dtype != s.dtype:
            at = "" if treedef.kind == "tensor" else f" (tensor {n} of {treedef})"
            raise ModelError(f"layer {i} outputs [B, {', '.join(map(str, t.shape[1:]))}] "
                             f"{t.dtype}{at} but the model declares its {what} as "
                             f"[B, {', '.join(map(str, s.shape))}] {s.dtype}")


def _structure_name(treedef: Treedef) -> str:
    return "one tensor" if treedef.kind == "tensor" else str(treedef)


def custom_layer(model: PipelineModel, index: int) -> nn.Module:
    """Layer `index` of `model`, from its factory (under whatever RNG state is current)."""
    try:
        layer = model.layers[index]()
    except Exception as e:  # noqa: BLE001 (the user's factory may raise anything)
        raise _RunError(f"layer {index}'s factory raised {_one_line(e)}") from None
    if not isinstance(layer, nn.Module):
        raise ModelError(f"layer {index}'s factory returned {type(layer).__name__}, not an "
                         f"nn.Module")
    return layer
