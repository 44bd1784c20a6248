"""Measured per-layer costs, for partitions by time instead of parameter counts.

By default stages are cut so that the largest stage holds the fewest parameters. That is a
poor proxy where parameters and compute part ways: a token embedding is a large table
whose forward is a lookup, while the LM head of the same size is the costliest matrix
product of the model (Llama-3.2-1B: 262M parameters each). `bamboo profile --layers-only`
times each layer alone (one micro-batch, forward and backward, median of the repeats after
a warm-up, one thread) and writes

    {"schema": "bamboo.layer-costs/1", "model": "llama-tiny", "micro_batch_size": 8,
     "layer_s": [0.0021, 0.0019, ...]}

and `bamboo train --layer-costs FILE` cuts the stages by those seconds (the same exact
partition, other weights). Reading and checking a file needs no torch.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bamboo.util import strict_json

__all__ = ["LayerCosts", "SCHEMA", "load_layer_costs", "save_layer_costs", "measure_layer_costs"]

SCHEMA = "bamboo.layer-costs/1"


@dataclass(frozen=True, slots=True)
class LayerCosts:
    model: str
    micro_batch_size: int
    layer_s: list[float]
    """Seconds of one micro-batch's forward and backward through each layer."""
    schema: str = SCHEMA


def load_layer_costs(path: str | Path) -> LayerCosts:
    """Read and check a layer-costs file; ValueError with one line otherwise."""
    where = str(path)
    hint = f"write one with: bamboo profile --layers-only --model MODEL --out {where}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"layer-costs file {where} does not exist; {hint}") from None
    except IsADirectoryError:
        raise ValueError(f"layer-costs file {where} is a directory; {hint}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read layer-costs file {where}: {e}".splitlines()[0]) from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{where} is not a layer-costs file (schema {SCHEMA}); {hint}")
    costs = data.get("layer_s")
    if not isinstance(costs, list) or not costs or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0
            for c in costs):
        raise ValueError(f"{where}: layer_s must be a non-empty list of positive seconds")
    model, size = data.get("model"), data.get("micro_batch_size")
    if not isinstance(model, str) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}: needs 'model' (a string) and 'micro_batch_size' (>= 1)")
    return LayerCosts(model=model, micro_batch_size=size, layer_s=[float(c) for c in costs])


def save_layer_costs(costs: LayerCosts, path: str | Path) -> None:
    Path(path).write_text(strict_json.dumps(asdict(costs), indent=2, sort_keys=True) + "\n",
                          encoding="utf-8")


def measure_layer_costs(model: str, micro_batch_size: int, repeats: int, seed: int = 0,
                        data: str | None = None) -> LayerCosts:
    """Time every layer of `model` alone (on the vocabulary of the prepared directory `data`
    when given); one layer is built at a time, so a model larger than memory as a whole can
    still be measured layer by layer."""
    import torch

    from bamboo.config import JobConfig
    from bamboo.data.datasets import make_task
    from bamboo.model import build_layer, loss_fn

    torch.set_num_threads(1)
    p = JobConfig.of(model=model, data=data).model_preset()
    batch = make_task(p, seed=seed, global_micro_batches=1, micro_batch_size=micro_batch_size,
                      data_file=data).batch(0, 0)
    criterion = loss_fn(p)
    x, seconds = batch.inputs, []
    for index in range(p.layers):
        layer = build_layer(p, index, seed)
        times = []
        for run in range(repeats + 1):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if index == p.layers - 1:
                out = criterion(out, batch.targets)
            out.backward(torch.ones_like(out) if out.dim() else None)
            if run:  # the first run warms up
                times.append(time.perf_counter() - start)
            layer.zero_grad(set_to_none=True)
        seconds.append(statistics.median(times))
        with torch.no_grad():
            x = layer(x.detach())
        del layer
    return LayerCosts(model=model, micro_batch_size=micro_batch_size, layer_s=seconds)
