"""The layer-costs file that `bamboo train --layer-costs FILE` reads: each layer's seconds
for one micro-batch, forward and backward, so that stages are cut by time instead of
parameter counts (`bamboo.engine.layer_costs` measures them; `bamboo profile --layers-only`
writes the file). Reading and checking one needs no torch.

    {"schema": "bamboo.layer-costs/1", "model": "llama-tiny", "micro_batch_size": 8,
     "layer_s": [0.0021, 0.0019, ...]}
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from bamboo.util import strict_json

__all__ = ["LayerCosts", "SCHEMA", "load_layer_costs", "save_layer_costs"]

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
