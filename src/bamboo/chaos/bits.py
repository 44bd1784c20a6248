"""The contract's rule of which runs keep the failure-free run's parameter bits, as `bamboo
soak` judges by it: the rule itself lives in `bamboo.run.bits` (the Python API's
`bamboo.same` reads it too), re-exported here for the soak and the tests that import it."""
from __future__ import annotations

from bamboo.run.bits import COUNTERS, L2_REL, LOSS_REL, bits_must_match, differs, explain

__all__ = ["LOSS_REL", "L2_REL", "COUNTERS", "bits_must_match", "differs", "explain"]
