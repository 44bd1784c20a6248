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
partition, other weights). The file's format, read without torch: `bamboo.config.layer_costs`.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from bamboo.config.layer_costs import LayerCosts
from bamboo.data.sizing import SIZING

__all__ = ["measure_layer_costs", "first_batch"]


def first_batch(model: str, micro_batch_size: int, seed: int = 0, data: str | None = None,
                dataset: str | None = None, loss: str | None = None) -> tuple[Any, Callable]:
    """The first micro-batch of `model`'s job and the loss that takes its output: from the
    `dataset` (MODULE:CALL, as `bamboo train --dataset`) with `loss` when given, else from
    bamboo's data (the prepared directory `data`, or the synthetic language)."""
    from bamboo.config import JobConfig
    from bamboo.data.user import job_task
    from bamboo.model import loss_fn

    job = JobConfig.of(model=model, data=data, dataset=dataset, loss=loss, seed=seed,
                       micro_batches=1, micro_batch_size=micro_batch_size)
    p = job.model_preset(SIZING)
    task = job_task(job, p)
    return task.batch(0, 0), task.loss or loss_fn(p)

def measure_layer_costs(model: str, micro_batch_size: int, repeats: int, seed: int = 0,
                        data: str | None = None, dataset: str | None = None,
                        loss: str | None = None) -> LayerCosts:
    """Time every layer of `model` alone (on the vocabulary of the prepared directory `data`
    when given; on a `dataset`'s samples, with its `loss`, for a model that takes other
    inputs); one layer is built at a time, so a model larger than memory as a whole can
    still be measured layer by layer."""
    import torch

    from bamboo.config import JobConfig
    from bamboo.model import build_layer
    from bamboo.model.structure import detach, float32, leaves, map_floats

    torch.set_num_threads(1)
    p = JobConfig.of(model=model, data=data, dataset=dataset).model_preset(SIZING)
    batch, criterion = first_batch(model, micro_batch_size, seed, data, dataset, loss)
    x, seconds = batch.inputs, []
    for index in range(p.layers):
        layer = build_layer(p, index, seed)
        times = []
        for run in range(repeats + 1):
            inp = map_floats(lambda t: t.requires_grad_(), detach(x))  # a tuple or dict too
            start = time.perf_counter()
            out = layer(inp)
            if index == p.layers - 1:
                out = criterion(float32(out), batch.targets)
            outs = [t for t in leaves(out) if t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) if t.dim() else None for t in outs])
            if run:  # the first run warms up
                times.append(time.perf_counter() - start)
            layer.zero_grad(set_to_none=True)
        seconds.append(statistics.median(times))
        with torch.no_grad():
            x = detach(layer(detach(x)))
        del layer
    return LayerCosts(model=model, micro_batch_size=micro_batch_size, layer_s=seconds)
