"""What a tuple or dict of tensors between layers costs against one tensor.

Two models with the same layers and the same arithmetic (gpt2-mini's width and context):
`build_one` hands on one float tensor (the hidden state) and makes its mask inside each
block; `build_dict` hands on `{"hidden": float, "mask": bool}`, the mask travelling between
stages (packed with the hidden state into one message; the hidden state's gradient goes
back as it is). A middle stage's micro-batch is timed as a node runs it (the received
message unpacked, the forward, the cast, the message packed for the next stage, the
backward with the received gradient, the input gradient packed), one thread,
interleaved, three ways: `today`, the code the engine ran before boundaries could be
structures; `one`, one tensor through `BoundarySpec`'s methods (no copy, no packing);
`dict`, the structure through `StructuredSpec`'s:

    .venv/bin/python benchmarks/structured_boundaries.py --reps 30

`--runs N` also trains both models with `bamboo train` (2 nodes, 2 stages), interleaved,
and compares their median step times (on a machine where other work runs, noisy). The
models are importable by path (`--model benchmarks/structured_boundaries.py:build_dict`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bamboo.model.api import PipelineModel, TensorSpec
from bamboo.model.pipeline import boundary_spec
from bamboo.model.structure import detach

CONTEXT, D, BLOCKS = 128, 128, 6


class Embed(nn.Module):
    def __init__(self, vocab: int, structured: bool) -> None:
        super().__init__()
        self.tokens, self.structured = nn.Embedding(vocab, D), structured

    def forward(self, idx: torch.Tensor) -> object:
        h = self.tokens(idx)
        return {"hidden": h, "mask": idx >= 0} if self.structured else h


class Block(nn.Module):
    """An MLP block on the positions the mask keeps (all of them, here)."""

    def __init__(self, structured: bool) -> None:
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.structured = structured

    def forward(self, x: object) -> object:
        if self.structured:
            h, mask = x["hidden"], x["mask"]  # type: ignore[index]  # a dict of tensors on this path
        else:
            h = x  # the same mask, made here
            mask = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        h = h + self.down(torch.relu(self.up(self.ln(h)))) * mask[..., None]
        return {"hidden": h, "mask": mask} if self.structured else h


class Head(nn.Module):
    def __init__(self, vocab: int, structured: bool) -> None:
        super().__init__()
        self.ln, self.out, self.structured = nn.LayerNorm(D), nn.Linear(D, vocab), structured

    def forward(self, x: object) -> torch.Tensor:
        return self.out(self.ln(x["hidden"] if self.structured else x))  # type: ignore[index]  # a dict of tensors on this path


def _build(vocab_size: int, structured: bool) -> PipelineModel:
    boundary: object = {"hidden": TensorSpec((CONTEXT, D)),
                        "mask": TensorSpec((CONTEXT,), torch.bool)} if structured \
        else TensorSpec((CONTEXT, D))
    layers = [lambda: Embed(vocab_size, structured)]
    layers += [lambda: Block(structured)] * BLOCKS
    layers += [lambda: Head(vocab_size, structured)]
    return PipelineModel(layers=layers, boundary=boundary, context=CONTEXT,  # type: ignore[arg-type]  # a structured boundary spec
                         vocab_size=vocab_size)


def build_one(vocab_size: int = 256) -> PipelineModel:
    return _build(vocab_size, structured=False)


def build_dict(vocab_size: int = 256) -> PipelineModel:
    return _build(vocab_size, structured=True)


def _median_step(name: str, out: Path, flags: list[str]) -> float:
    model = f"{Path(__file__).resolve()}:{name}"
    run = subprocess.run([sys.executable, "-m", "bamboo", "train", "--model", model, *flags,
                          "--out", str(out), "--json", "--quiet"],
                         capture_output=True, text=True, check=True)
    summary = json.loads(run.stdout)
    assert summary["status"] == "completed", summary.get("error")
    return float(summary["median_step_s"])


def _stage_timings(reps: int, batch: int) -> dict[str, list[float]]:
    """Seconds per middle-stage micro-batch (blocks 1..3), three ways, interleaved."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = [nn.Sequential(*[Block(s) for _ in range(3)]) for s in (False, True)]
    blocks[1].load_state_dict(blocks[0].state_dict())
    one = boundary_spec(TensorSpec((CONTEXT, D)), batch)
    both = boundary_spec({"hidden": TensorSpec((CONTEXT, D)),
                          "mask": TensorSpec((CONTEXT,), torch.bool)}, batch)
    h = torch.randn(batch, CONTEXT, D)
    wires = {"one": one.pack(h),
             "dict": both.pack({"hidden": h, "mask": torch.ones(batch, CONTEXT, dtype=torch.bool)})}
    grad = torch.randn(batch, CONTEXT, D)

    def today() -> None:  # the engine's code before structures
        x = wires["one"].detach().requires_grad_(True)
        out = blocks[0](x).to(torch.float32)
        sent = out.detach()  # noqa: F841 - sent as it is
        torch.autograd.backward(out, grad_tensors=grad)
        assert x.grad is not None

    def through(spec: object, module: nn.Module, wire: torch.Tensor) -> None:
        x = spec.as_input(spec.unpack(wire))  # type: ignore[attr-defined]  # the boundary spec of the structured path
        out = spec.cast(module(x))  # type: ignore[attr-defined]  # the boundary spec of the structured path
        spec.pack(detach(out))  # type: ignore[attr-defined]  # the boundary spec of the structured path
        outs, grads = spec.grad_pairs(out, spec.unpack_grad(spec.pack_grad(  # type: ignore[attr-defined]  # the boundary spec of the structured path
            grad if spec is one else (grad,))))
        torch.autograd.backward(outs, grad_tensors=grads)
        spec.pack_grad(spec.input_grads(x))  # type: ignore[attr-defined]  # the boundary spec of the structured path

    ways = {"today": today, "one": lambda: through(one, blocks[0], wires["one"]),
            "dict": lambda: through(both, blocks[1], wires["dict"])}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for fn in ways.values():
        fn()  # warm-up
    for _ in range(reps):
        for name, fn in ways.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _bookkeeping(reps: int, batch: int) -> dict[str, float]:
    """Median microseconds of a micro-batch's boundary handling alone (no forward, no
    backward: what the engine does around them), three ways. Robust to a busy machine,
    unlike the whole micro-batch, whose compute it is compared with."""
    one = boundary_spec(TensorSpec((CONTEXT, D)), batch)
    both = boundary_spec({"hidden": TensorSpec((CONTEXT, D)),
                          "mask": TensorSpec((CONTEXT,), torch.bool)}, batch)
    h = torch.randn(batch, CONTEXT, D, requires_grad=True) * 1.0
    value = {"hidden": h, "mask": torch.ones(batch, CONTEXT, dtype=torch.bool)}
    grad = torch.randn(batch, CONTEXT, D)
    wires = {"one": one.pack(h.detach()), "dict": both.pack(detach(value))}

    def today() -> None:
        x = wires["one"].detach().requires_grad_(True)
        h.to(torch.float32).detach()
        x.grad = grad  # what the backward leaves there
        assert x.grad is not None

    def through(spec: object, out: object, wire: torch.Tensor, g: object) -> None:
        x = spec.as_input(spec.unpack(wire))  # type: ignore[attr-defined]  # the boundary spec of the structured path
        spec.pack(detach(spec.cast(out)))  # type: ignore[attr-defined]  # the boundary spec of the structured path
        spec.grad_pairs(out, spec.unpack_grad(spec.pack_grad(g)))  # type: ignore[attr-defined]  # the boundary spec of the structured path
        for t in spec.grad_inputs(x):  # type: ignore[attr-defined]  # the boundary spec of the structured path
            t.grad = grad
        spec.pack_grad(spec.input_grads(x))  # type: ignore[attr-defined]  # the boundary spec of the structured path

    ways = {"today": today, "one": lambda: through(one, h, wires["one"], grad),
            "dict": lambda: through(both, value, wires["dict"], (grad,))}
    result = {}
    for name, fn in ways.items():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[name] = statistics.median(times) * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--runs", type=int, default=0, help="bamboo train runs of each model")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    times = _stage_timings(args.reps, args.micro_batch_size)
    base = statistics.median(times["today"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name}: median {med * 1e3:.2f} ms a micro-batch ({med / base:.4f} of today's)")
    compute = base * 1e6
    for name, us in _bookkeeping(100 * args.reps, args.micro_batch_size).items():
        print(f"{name}: boundary handling alone {us:.1f} us a micro-batch "
              f"({100 * us / compute:.3f}% of today's micro-batch)")
    if args.runs:
        _runs(args.runs, args.steps, args.micro_batch_size)


def _runs(reps: int, steps: int, batch: int) -> None:
    flags = ["--nodes", "2", "--stages", "2", "--micro-batches", "4", "--micro-batch-size",
             str(batch), "--steps", str(steps)]
    times: dict[str, list[float]] = {"build_one": [], "build_dict": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for name in times:
                times[name].append(_median_step(name, Path(tmp) / f"{name}{rep}", flags))
    for name, ts in times.items():
        print(f"bamboo train {name}: median step {statistics.median(ts) * 1e3:.1f} ms "
              f"{[round(t * 1e3, 1) for t in ts]}")


if __name__ == "__main__":
    main()
