"""What a step-by-step run (`bamboo.Trainer`) asks of its nodes at a step boundary.

A run driven by the user's own loop does not run its steps by itself: at each boundary
(k steps done) every node waits for the coordinator's orders for that boundary, numbered
0, 1, 2, ... in the order the user's calls made them, and carries them out in that order:

    EVAL    the held-out pass on the parameters after k steps (`trainer.evaluate()`)
    SAVE    a checkpoint of the state after k steps (`trainer.save()`)
    STEP    run step k, its learning rate scaled by `lr_scale` (`trainer.train_step()`)
    FINISH  the run ends after k steps: write the trained model (`trainer.close()`)
    CATCH_UP  the roles changed while the nodes waited (a node was lost between steps):
            take them on now, as a failover between steps does (the coordinator's own)

STEP and FINISH close a boundary's list. EVAL and SAVE are carried out once: when one is
complete the coordinator marks it done, and a node that comes to the boundary again (a new
generation after a loss, a step redone from a checkpoint) skips it. An order, once written,
never changes, so a step redone after a restore runs with the learning rate it first had.
"""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass

__all__ = ["OrderKind", "Order", "scale_at"]


class OrderKind(enum.Enum):
    """What one order asks (see the module docstring)."""

    STEP = "step"
    EVAL = "eval"
    SAVE = "save"
    FINISH = "finish"
    CATCH_UP = "catch_up"

    @property
    def closes_boundary(self) -> bool:
        """The nodes leave the boundary after it: to the next step, or to the run's end."""
        return self in (OrderKind.STEP, OrderKind.FINISH)


@dataclass(frozen=True, slots=True)
class Order:
    """One order of a boundary; `lr_scale` multiplies a STEP's scheduled learning rate."""

    kind: OrderKind
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr_scale) and self.lr_scale >= 0):
            raise ValueError(f"lr_scale {self.lr_scale!r} is not a finite number >= 0")

    def encode(self) -> str:
        """The store's text form (JSON)."""
        body: dict[str, object] = {"kind": self.kind.value}
        if self.kind is OrderKind.STEP:
            body["lr_scale"] = self.lr_scale
        return json.dumps(body, sort_keys=True)

    @classmethod
    def decode(cls, text: str) -> Order:
        body = json.loads(text)
        return cls(OrderKind(body["kind"]), float(body.get("lr_scale", 1.0)))


def scale_at(changes: list[list[float]], step: int) -> float:
    """The learning-rate scale in force at `step`, from a run's changes `[[from step,
    scale], ...]` (in step order; 1.0 before the first)."""
    scale = 1.0
    for start, value in changes:
        if start <= step:
            scale = float(value)
    return scale
