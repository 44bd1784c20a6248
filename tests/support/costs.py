"""A costs file (`bamboo profile`'s output, schema bamboo.costs/1) that is valid, for the
tests of `bamboo simulate --costs`."""
from __future__ import annotations

GOOD = {
    "schema": "bamboo.costs/1", "model": "gpt2-tiny", "stages": 4, "micro_batches": 8, "samples_per_step": 64,
    "forward_s": [0.01, 0.01, 0.01, 0.01], "backward_s": [0.02, 0.02, 0.02, 0.03], "rc_overhead": 0.2,
    "failover_pause_s": 0.4, "reconfiguration_s": 2.5,
}
