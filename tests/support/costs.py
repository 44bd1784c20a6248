"""A costs file (`bamboo profile`'s output, schema bamboo.costs/1) that is valid, for the
tests of `bamboo simulate --costs`; a layer-costs file (`bamboo profile --layers-only`) for
those of `bamboo train --layer-costs`."""
from __future__ import annotations

import json
from pathlib import Path

from bamboo.config.layer_costs import SCHEMA

GOOD = {
    "schema": "bamboo.costs/1", "model": "gpt2-tiny", "stages": 4, "micro_batches": 8, "samples_per_step": 64,
    "forward_s": [0.01, 0.01, 0.01, 0.01], "backward_s": [0.02, 0.02, 0.02, 0.03], "rc_overhead": 0.2,
    "failover_pause_s": 0.4, "reconfiguration_s": 2.5,
}


def write_layer_costs(path: Path, **fields: object) -> Path:
    """A layer-costs file of gpt2-tiny (8 layers of 1 s each), `fields` replacing its own."""
    path.write_text(json.dumps({"schema": SCHEMA, "model": "gpt2-tiny", "micro_batch_size": 8,
                                "layer_s": [1.0] * 8, **fields}))
    return path
