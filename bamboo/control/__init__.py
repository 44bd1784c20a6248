"""The coordinator of a run: hosts the store, supervises the nodes, decides each step's fate
and plans every generation. `loop.Coordinator` is the top; the other modules are its parts
(see `loop`'s docstring for which part owns what)."""
from bamboo.control.loop import Coordinator, run_local
from bamboo.control.state import RunFailed

__all__ = ["Coordinator", "run_local", "RunFailed"]
