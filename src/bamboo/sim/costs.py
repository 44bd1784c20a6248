"""The costs file: per-stage step costs measured by ``bamboo profile``, read by ``bamboo simulate``.

This module is shared by the profiler (which writes the file) and the simulator
(which reads it), so it must stay free of torch. The schema (version 1) is a JSON
object; docs/simulator.md documents every field::

    {
      "schema": "bamboo.costs/1",
      "model": "gpt2-tiny",            # free text
      "stages": 4,                     # P, pipeline stages the times were measured with
      "micro_batches": 8,              # G, micro-batches in one global step
      "samples_per_step": 64,          # samples in one global step (G x micro-batch size)
      "forward_s": [0.010, ...],       # per stage: seconds of one micro-batch's forward
      "backward_s": [0.020, ...],      # per stage: seconds of one micro-batch's backward
      "rc_overhead": 0.12,             # fraction of step time eager FRC adds
      "failover_pause_s": 0.4,         # extra wall time one failover costs
      "reconfiguration_s": 2.5,        # wall time of one reconfiguration (re-plan + move state)
      "allreduce_s": 0.005,            # optional: gradient all-reduce per step (default 0)
      "optimizer_s": 0.002,            # optional: optimizer step (default 0)
      "restart_s": 12.0,               # optional: restart from a checkpoint (default: preset's)
      "checkpoint_save_s": 1.5,        # optional: write one durable checkpoint (default: preset's)
      "max_pipelines": 4               # optional: largest D to consider (default 4)
    }
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bamboo.util import strict_json

__all__ = ["SCHEMA", "CostsError", "StepCosts", "load_costs", "save_costs", "costs_from_dict"]

SCHEMA = "bamboo.costs/1"


class CostsError(ValueError):
    """A costs file that does not follow the schema; the message names the field."""


@dataclass(kw_only=True, slots=True)
class StepCosts:
    """Measured costs of one training step of one model (schema ``bamboo.costs/1``)."""

    model: str
    """Name of the model that was profiled."""
    stages: int
    """P: number of pipeline stages the per-stage times refer to."""
    micro_batches: int
    """G: micro-batches in one global step, split across the D pipelines."""
    samples_per_step: int
    """Samples in one global step."""
    forward_s: list[float]
    """Per stage: seconds for the forward of one micro-batch."""
    backward_s: list[float]
    """Per stage: seconds for the backward of one micro-batch."""
    rc_overhead: float
    """Fraction of the step time that eager forward redundant computation adds."""
    failover_pause_s: float
    """Extra wall time one failover (shadow takes over in flight) costs."""
    reconfiguration_s: float
    """Wall time of one reconfiguration (new layout, state moved between live nodes)."""
    allreduce_s: float = 0.0
    """Seconds of the gradient all-reduce per step."""
    optimizer_s: float = 0.0
    """Seconds of the optimizer step."""
    restart_s: float | None = None
    """Seconds to restart every worker from a durable checkpoint (None: model preset's)."""
    checkpoint_save_s: float | None = None
    """Seconds to write one durable checkpoint (None: model preset's)."""
    max_pipelines: int = 4
    """Largest number of data-parallel pipelines D to consider."""
    schema: str = field(default=SCHEMA)

    def step_time(self, pipelines: int) -> float:
        """Seconds per global step with ``pipelines`` pipelines, without RC (1F1B timeline model)."""
        if pipelines < 1:
            raise ValueError("pipelines must be at least 1")
        per_pipeline = math.ceil(self.micro_batches / pipelines)
        slot = max(f + b for f, b in zip(self.forward_s, self.backward_s))
        return (per_pipeline + self.stages - 1) * slot + self.allreduce_s + self.optimizer_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(d: dict[str, Any], key: str, where: str, *, lo: float = 0.0, integer: bool = False,
         optional: bool = False, default: Any = None) -> Any:
    if key not in d or d[key] is None:
        if optional:
            return default
        raise CostsError(f"{where}: missing field {key!r} (see docs/simulator.md for the schema)")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CostsError(f"{where}: field {key!r} must be a number, got {v!r}")
    if integer and (not float(v).is_integer()):
        raise CostsError(f"{where}: field {key!r} must be an integer, got {v!r}")
    if not math.isfinite(v) or v < lo:
        raise CostsError(f"{where}: field {key!r} must be a finite number >= {lo:g}, got {v!r}")
    return int(v) if integer else float(v)


def costs_from_dict(d: Any, where: str = "costs") -> StepCosts:
    """Validate a parsed costs object and build :class:`StepCosts`."""
    if not isinstance(d, dict):
        raise CostsError(f"{where}: expected a JSON object with the fields of schema {SCHEMA}")
    schema = d.get("schema", SCHEMA)
    if schema != SCHEMA:
        raise CostsError(f"{where}: schema {schema!r} is not supported (expected {SCHEMA!r})")
    known = set(StepCosts.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise CostsError(f"{where}: unknown field(s) {', '.join(unknown)} (see docs/simulator.md)")
    stages = _num(d, "stages", where, lo=1, integer=True)
    lists = {}
    for key in ("forward_s", "backward_s"):
        v = d.get(key)
        if not isinstance(v, list) or len(v) != stages:
            raise CostsError(f"{where}: field {key!r} must be a list of {stages} numbers (one per stage)")
        for x in v:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise CostsError(f"{where}: field {key!r} holds {x!r}; every entry must be seconds >= 0")
        lists[key] = [float(x) for x in v]
    if max(f + b for f, b in zip(lists["forward_s"], lists["backward_s"])) <= 0:
        raise CostsError(f"{where}: forward_s and backward_s are all zero; a step must take time")
    model = d.get("model", "")
    if not isinstance(model, str):
        raise CostsError(f"{where}: field 'model' must be a string")
    return StepCosts(
        model=model,
        stages=stages,
        micro_batches=_num(d, "micro_batches", where, lo=1, integer=True),
        samples_per_step=_num(d, "samples_per_step", where, lo=1, integer=True),
        forward_s=lists["forward_s"],
        backward_s=lists["backward_s"],
        rc_overhead=_num(d, "rc_overhead", where),
        failover_pause_s=_num(d, "failover_pause_s", where),
        reconfiguration_s=_num(d, "reconfiguration_s", where),
        allreduce_s=_num(d, "allreduce_s", where, optional=True, default=0.0),
        optimizer_s=_num(d, "optimizer_s", where, optional=True, default=0.0),
        restart_s=_num(d, "restart_s", where, optional=True),
        checkpoint_save_s=_num(d, "checkpoint_save_s", where, optional=True),
        max_pipelines=_num(d, "max_pipelines", where, lo=1, integer=True, optional=True, default=4),
    )


def load_costs(path: str | Path) -> StepCosts:
    """Read and validate a costs file; raises :class:`CostsError` with one clear line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CostsError(f"{p}: no such costs file (write one with 'bamboo profile --out {p}')") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CostsError(f"{p}: cannot read costs file ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CostsError(f"{p}:{exc.lineno}: costs file is not valid JSON ({exc.msg})") from None
    return costs_from_dict(data, str(p))


def save_costs(costs: StepCosts, path: str | Path) -> None:
    """Write a costs file (sorted keys, so equal costs give equal files)."""
    Path(path).write_text(strict_json.dumps(costs.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
