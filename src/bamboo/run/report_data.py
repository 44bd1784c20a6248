"""What a report reads: a run's summary.json and events.jsonl as data (`load_run`), the
failures and pauses in them, and the constants every part of the report shares.

Torch-free, as the whole report is, so `bamboo report` starts fast. `bamboo.run.report`
writes the text, `report_cost` prices the run, `report_plots` draws it: all three read
this module, none of them each other's private names.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bamboo.run.runlog import EventLogError, read_events

__all__ = ["Prices", "Run", "Failure", "ReportError", "load_run", "failures_of", "pauses_of",
           "eval_losses", "losses_of", "samples_per_step", "end_time", "is_num",
           "PLOT_SIZE_PX", "DPI", "HANDLED_COLOURS", "OTHER_COLOUR", "COUNTERS", "write_atomic"]

PLOT_SIZE_PX = (800, 450)
"""Width and height of every PNG, in pixels."""
DPI = 100

HANDLED_COLOURS: dict[str, str] = {
    "failover": "tab:orange",
    "peer_restore": "tab:purple",
    "drain": "tab:green",
    "checkpoint_restore": "tab:red",
    "standby": "tab:gray",
    "stopped": "black",
    "reroute": "tab:cyan",
}
OTHER_COLOUR = "tab:brown"
COUNTERS = (("failovers", "failover"), ("drains", "drain"), ("peer_restores", "peer restore"),
             ("checkpoint_restores", "checkpoint restore"), ("standby_losses", "standby"),
             ("reroutes", "reroute"))


class ReportError(ValueError):
    """A run directory that cannot be reported on; str() is the one line to show."""


@dataclass(kw_only=True, slots=True)
class Prices:
    """$ per node-hour; defaults are AWS p3.2xlarge (1 V100) figures, as in the simulator."""

    spot: float = 0.91
    on_demand: float = 3.06


@dataclass(kw_only=True, slots=True)
class Failure:
    """One node_lost event."""

    t: float
    node: str
    step: int | None
    handled_as: str
    pause_s: float
    """Every second it cost: its step's extra time and its share of the reconfiguration
    that restored its layout (`loss_cost` events), as summary.json's `pause_s`."""
    phase: str | None = None
    shadow: str | None = None
    reconfiguration_s: float = 0.0
    """Of `pause_s`, its share of a reconfiguration's cost (a standby joining, layers moved)."""
    reconfigured_at: tuple[int, ...] = ()
    """The first steps of the generations that charged it a share."""


@dataclass(kw_only=True, slots=True)
class Run:
    """What a run directory says, checked: the summary (possibly empty) and the events."""

    path: Path
    summary: dict[str, Any]
    events: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    @property
    def config(self) -> dict[str, Any]:
        cfg = self.summary.get("config")
        if isinstance(cfg, dict):
            return cfg
        start = self.of("run_start")
        return start[0].get("config") or {} if start else {}

    @property
    def status(self) -> str:
        if not self.summary:
            return "incomplete (no summary.json: the run was stopped before it finished)"
        status = str(self.summary.get("status", "completed"))
        error = self.summary.get("error")
        return f"{status}: {error}" if error else status


# -- reading ------------------------------------------------------------------------------


def load_run(run_dir: str | Path) -> Run:
    """Read and check a run directory; ReportError with one line if it is not one."""
    path = Path(run_dir)
    if not path.exists():
        raise ReportError(f"run directory '{path}' does not exist: give a directory written "
                          f"by bamboo train --out")
    if not path.is_dir():
        raise ReportError(f"'{path}' is not a directory: give a run directory")
    summary_path, events_path = path / "summary.json", path / "events.jsonl"
    if not summary_path.exists() and not events_path.exists():
        raise ReportError(f"'{path}' holds no run (no summary.json or events.jsonl): give a "
                          f"directory written by bamboo train --out")
    warnings: list[str] = []
    events = _read_events(events_path, warnings) if events_path.exists() else []
    summary = _read_summary(summary_path) if summary_path.exists() else {}
    if not events_path.exists():
        warnings.append("no events.jsonl: plots over time are empty")
    return Run(path=path, summary=summary, events=events, warnings=warnings)


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ReportError(f"{path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} must hold a JSON object, not {type(data).__name__}")
    for key in ("losses", "pause_s"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(is_num(v) for v in value):
            raise ReportError(f"{path}: '{key}' must be a list of numbers")
    for key in ("steps_completed", "samples", "preemptions", "reconfigurations", "redone_steps",
                *(c for c, _ in COUNTERS), "wall_s", "throughput"):
        if key in data and data[key] is not None and not is_num(data[key]):
            raise ReportError(f"{path}: '{key}' must be a number, got {data[key]!r}")
    return data


def is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_events(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    def cut_short(number: int) -> None:
        warnings.append(f"events.jsonl line {number} is cut short (the run was stopped "
                        f"while writing it) and was ignored")

    try:
        events = read_events(path, check=_check_event, on_cut_short=cut_short)
    except EventLogError as e:
        raise ReportError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"{path} cannot be read: {e}") from None
    events.sort(key=lambda e: e["t"])  # stable: same-time events keep their order
    return events


def _check_event(event: dict[str, Any]) -> None:
    """ValueError unless `event` has what the report reads."""
    if not is_num(event.get("t")):
        raise ValueError("no numeric 't' (seconds since the run began)")
    if not isinstance(event.get("event"), str):
        raise ValueError("no 'event' name")
    kind = event["event"]
    if kind == "step_done" and not (isinstance(event.get("step"), int) and is_num(event.get("loss"))):
        raise ValueError("step_done needs an integer 'step' and a numeric 'loss'")
    if kind in ("node_up", "node_lost") and not isinstance(event.get("node"), str):
        raise ValueError(f"{kind} needs a 'node' name")


# -- figures ------------------------------------------------------------------------------


def failures_of(run: Run) -> list[Failure]:
    """One Failure per node_lost event. Its pause: summary.json's `pause_s` entry when that
    list has one per event (the final figures), else the event's, with what later
    `loss_cost` events added (a reconfiguration that loss caused)."""
    lost = run.of("node_lost")
    listed = run.summary.get("pause_s")
    aligned = isinstance(listed, list) and len(listed) == len(lost)
    later: dict[str, list[dict[str, Any]]] = {}
    for e in run.of("loss_cost"):
        later.setdefault(str(e.get("node")), []).append(e)
    out = []
    for i, e in enumerate(lost):
        pause = e.get("pause_s")
        pause = float(pause) if is_num(pause) else 0.0
        added = [c for c in later.get(e["node"], []) if is_num(c.get("added_s"))]
        reconf = sum(float(c["added_s"]) for c in added)
        pause = float(listed[i]) if aligned else pause + reconf
        at = tuple(c["at_step"] for c in added if isinstance(c.get("at_step"), int))
        step = e.get("step")
        out.append(Failure(t=float(e["t"]), node=e["node"], step=step if isinstance(step, int) else None,
                           handled_as=str(e.get("handled_as", "unknown")), pause_s=pause,
                           phase=e.get("phase"), shadow=e.get("shadow"),
                           reconfiguration_s=reconf,
                           reconfigured_at=at))
    return out


def pauses_of(run: Run, failures: list[Failure]) -> list[float]:
    """Per failure (one per node_lost event, in their order), every second it cost."""
    listed = run.summary.get("pause_s")
    if not failures and isinstance(listed, list):  # a summary without its events
        return [float(p) for p in listed]
    return [f.pause_s for f in failures]


def eval_losses(run: Run) -> list[tuple[int, float]]:
    """(steps done, held-out loss) of every evaluation: summary.json's, else the events'."""
    rows = run.summary.get("eval_losses")
    if not isinstance(rows, list):
        rows = [[e.get("step"), e.get("loss")] for e in run.of("eval")]
    return [(int(k), float(x)) for k, x in (r for r in rows if isinstance(r, list) and len(r) == 2)
            if isinstance(k, int) and is_num(x)]


def losses_of(run: Run) -> list[float]:
    if isinstance(run.summary.get("losses"), list):
        return [float(x) for x in run.summary["losses"]]
    by_step = {e["step"]: float(e["loss"]) for e in run.of("step_done")}  # a redone step: last
    return [by_step[s] for s in sorted(by_step)]


def samples_per_step(run: Run) -> float:
    cfg = run.config
    try:
        pipelines = cfg.get("pipelines") or cfg["nodes"] // cfg["stages"]
        return float(pipelines * cfg["micro_batches"] * cfg["micro_batch_size"])
    except (KeyError, TypeError, ZeroDivisionError):
        steps, samples = run.summary.get("steps_completed"), run.summary.get("samples")
        return float(samples) / steps if steps and samples else 0.0


def end_time(run: Run) -> float:
    ends = run.of("run_done") + run.of("run_failed")
    if ends:
        return float(ends[-1]["t"])
    return float(run.events[-1]["t"]) if run.events else 0.0


def write_atomic(path: Path, data: bytes) -> None:
    """Write through a temporary file and a rename (as bamboo.run.runlog does, whose import
    chain pulls in torch: this module stays torch-free so the command starts fast)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
