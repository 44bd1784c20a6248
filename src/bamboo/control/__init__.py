"""The coordinator of a run: hosts the store, supervises the nodes, decides each step's fate
and plans every generation. `loop.Coordinator` is the top; the other modules are its parts
(see `core`'s docstring for the parts, `state`'s for which part writes which field);
`run_job` runs one job to its end."""
from bamboo.control.loop import Coordinator, run_job
from bamboo.control.run_options import RunOptions
from bamboo.control.state import RunFailed

__all__ = ["Coordinator", "run_job", "RunFailed", "RunOptions"]
