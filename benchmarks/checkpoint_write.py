"""What a checkpoint's layer costs to write, by how its state is stored: named tensors (the
checkpoint format: each parameter and each of its optimizer entries a tensor of its own, so
a checkpoint reads back by name) against the same values packed into one vector (one
tensor a layer, as the format before named layer state stored them).

A GPT-2 block of width `d` (12 parameters, AdamW: 4 entries each, 48 tensors), `--layers`
of them written by `bamboo.run.checkpoint.write_layers` (DCP, fsync, digests, atomic
rename), alternated over `--reps`; the median seconds of each and their ratio.

    .venv/bin/python benchmarks/checkpoint_write.py --width 64 --width 768
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bamboo.run.checkpoint import write_layers


def block_state(d: int) -> dict[str, torch.Tensor]:
    """A GPT-2 block's parameters with AdamW's entries, as named layer state."""
    shapes = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,),
              (d, 4 * d), (d,)]
    state: dict[str, torch.Tensor] = {}
    for j, shape in enumerate(shapes):
        for entry in ("param", "exp_avg", "exp_avg_sq"):
            state[f"{j}.{entry}"] = torch.randn(shape)
        state[f"{j}.step"] = torch.tensor(3.0)
    return state


def timed(root: Path, layers: dict[int, dict[str, torch.Tensor]]) -> float:
    start = time.perf_counter()
    write_layers(root, layers)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, action="append")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| width | MB a layer | named: s for the layers | packed: s | named / packed |")
    print("| --- | --- | --- | --- | --- |")
    for d in args.width or [64, 768]:
        named = block_state(d)
        packed = {"state": torch.cat([t.reshape(-1) for t in named.values()])}
        mb = packed["state"].numel() * 4 / 1e6
        times: dict[str, list[float]] = {"named": [], "packed": []}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.reps):
                for form, state in (("named", named), ("packed", packed)):
                    times[form].append(timed(Path(tmp) / f"{form}-{r}",
                                             dict.fromkeys(range(args.layers), state)))
        n, p = statistics.median(times["named"]), statistics.median(times["packed"])
        print(f"| {d} | {mb:.2f} | {n:.3f} | {p:.3f} | {n / p:.2f}x |")


if __name__ == "__main__":
    main()
