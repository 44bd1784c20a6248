"""A run's report: `report.txt` and PNG plots, rebuilt from summary.json and events.jsonl.

    write_report("runs/demo-20250101-120000")   # what `bamboo report RUN_DIR` runs (bamboo.cli.report)

Writes, into the run directory:

- `report.txt`: steps, first and last loss and the relative drop, throughput, wall time,
  every preemption and how it was handled, the pause each cost, reconfigurations, and
  the run's cost on spot against the same work on on-demand instances;
- `loss.png` (loss per step, a vertical line at each failure's step, coloured by how it
  was handled), `throughput.png` (samples/s of each step over time), `nodes.png` (live
  nodes over time), `cost.png` (cumulative $ on spot against on-demand, per step) and
  `pauses.png` (the wall time each failure cost) and `memory.png` (each worker's resident
  memory at the end of each step, over time).

It needs no torch and works on a finished, a failed and a cut-short run (one whose
launcher was killed: then summary.json may be missing and the figures come from the
events alone). Plots use matplotlib's Agg canvas directly, so no display is needed.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bamboo.run.runlog import EventLogError, read_events

__all__ = ["Prices", "Run", "ReportError", "load_run", "report_text", "write_report",
           "PLOT_SIZE_PX"]

PLOT_SIZE_PX = (800, 450)
"""Width and height of every PNG, in pixels."""
_DPI = 100

HANDLED_COLOURS: dict[str, str] = {
    "failover": "tab:orange",
    "peer_restore": "tab:purple",
    "drain": "tab:green",
    "checkpoint_restore": "tab:red",
    "standby": "tab:gray",
    "stopped": "black",
    "reroute": "tab:cyan",
}
_OTHER_COLOUR = "tab:brown"
_COUNTERS = (("failovers", "failover"), ("drains", "drain"), ("peer_restores", "peer restore"),
             ("checkpoint_restores", "checkpoint restore"), ("standby_losses", "standby"),
             ("reroutes", "reroute"))


def _write_atomic(path: Path, data: bytes) -> None:
    """Write through a temporary file and a rename (as bamboo.run.runlog does, whose import
    chain pulls in torch: this module stays torch-free so the command starts fast)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
        if not isinstance(value, list) or not all(_is_num(v) for v in value):
            raise ReportError(f"{path}: '{key}' must be a list of numbers")
    for key in ("steps_completed", "samples", "preemptions", "reconfigurations", "redone_steps",
                *(c for c, _ in _COUNTERS), "wall_s", "throughput"):
        if key in data and data[key] is not None and not _is_num(data[key]):
            raise ReportError(f"{path}: '{key}' must be a number, got {data[key]!r}")
    return data


def _is_num(value: Any) -> bool:
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
    if not _is_num(event.get("t")):
        raise ValueError("no numeric 't' (seconds since the run began)")
    if not isinstance(event.get("event"), str):
        raise ValueError("no 'event' name")
    kind = event["event"]
    if kind == "step_done" and not (isinstance(event.get("step"), int) and _is_num(event.get("loss"))):
        raise ValueError("step_done needs an integer 'step' and a numeric 'loss'")
    if kind in ("node_up", "node_lost") and not isinstance(event.get("node"), str):
        raise ValueError(f"{kind} needs a 'node' name")


# -- figures ------------------------------------------------------------------------------


def _failures(run: Run) -> list[Failure]:
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
        pause = float(pause) if _is_num(pause) else 0.0
        added = [c for c in later.get(e["node"], []) if _is_num(c.get("added_s"))]
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


def _pauses(run: Run, failures: list[Failure]) -> list[float]:
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
            if isinstance(k, int) and _is_num(x)]


def _losses(run: Run) -> list[float]:
    if isinstance(run.summary.get("losses"), list):
        return [float(x) for x in run.summary["losses"]]
    by_step = {e["step"]: float(e["loss"]) for e in run.of("step_done")}  # a redone step: last
    return [by_step[s] for s in sorted(by_step)]


def _samples_per_step(run: Run) -> float:
    cfg = run.config
    try:
        pipelines = cfg.get("pipelines") or cfg["nodes"] // cfg["stages"]
        return float(pipelines * cfg["micro_batches"] * cfg["micro_batch_size"])
    except (KeyError, TypeError, ZeroDivisionError):
        steps, samples = run.summary.get("steps_completed"), run.summary.get("samples")
        return float(samples) / steps if steps and samples else 0.0


def _end_time(run: Run) -> float:
    ends = run.of("run_done") + run.of("run_failed")
    if ends:
        return float(ends[-1]["t"])
    return float(run.events[-1]["t"]) if run.events else 0.0


# -- the text -----------------------------------------------------------------------------


def report_text(run: Run, prices: Prices | None = None) -> str:
    """The text of report.txt."""
    prices = prices or Prices()
    s, failures = run.summary, _failures(run)
    losses, pauses = _losses(run), _pauses(run, failures)
    steps = int(s.get("steps_completed", len(losses)))
    samples = s.get("samples", steps * _samples_per_step(run))
    wall = float(s["wall_s"]) if _is_num(s.get("wall_s")) else _end_time(run)
    throughput = float(s["throughput"]) if _is_num(s.get("throughput")) else (
        samples / wall if wall > 0 else 0.0)
    out = [f"Bamboo run report: {run.path}", f"status: {run.status}"]
    cfg = run.config
    if cfg:
        out.append("job: " + ", ".join(f"{k} {cfg[k]}" for k in (
            "model", "nodes", "stages", "pipelines", "micro_batches", "micro_batch_size",
            "redundancy", "seed") if cfg.get(k) is not None))
    out.append(f"steps: {steps} completed ({int(samples)} samples)")
    if losses:
        first, last = losses[0], losses[-1]
        drop = (first - last) / first if first else 0.0
        out.append(f"loss: {first:.4f} first -> {last:.4f} last ({100 * drop:.1f}% drop)")
    else:
        out.append("loss: no completed step")
    evals = eval_losses(run)
    if evals:
        (a, first), (b, last) = evals[0], evals[-1]
        out.append(f"eval loss (held-out): {first:.4f} after {a} steps -> {last:.4f} after "
                   f"{b} steps ({len(evals)} evaluations)")
    median = s.get("median_step_s")
    out.append(f"throughput: {throughput:.2f} samples/s; wall time {wall:.2f} s"
               + (f"; median step {median:.3f} s" if _is_num(median) else ""))
    out += _memory_lines(s)
    out += _failure_lines(run, failures, pauses)
    out += _mode_lines(run)
    out.append(f"reconfigurations: {int(s.get('reconfigurations', 0))}; "
               f"redone steps: {int(s.get('redone_steps', 0))}")
    from bamboo.run.report_cost import cost, cost_lines
    out += cost_lines(cost(run, failures, prices), prices)
    out += [f"warning: {w}" for w in run.warnings]
    return "\n".join(out) + "\n"


def _memory_lines(s: dict[str, Any]) -> list[str]:
    """Peak resident memory per node, and how fast it grew over the run's second half."""
    names, peaks = s.get("memory_nodes"), s.get("rss_per_node_bytes")
    if not isinstance(names, list) or not isinstance(peaks, list) or not any(peaks):
        return []
    growth = s.get("rss_growth_per_step_bytes") or [None] * len(names)
    cells = []
    for name, peak, g in zip(names, peaks, growth):
        rate = f", {g / 2**20:+.2f} MiB/step" if _is_num(g) else ""
        cells.append(f"{name} {peak / 2**20:.0f} MiB{rate}")
    return ["resident memory (peak, growth over the second half): " + "; ".join(cells)]


def _mode_lines(run: Run) -> list[str]:
    """`--redundancy auto`: the mode of every generation, with the figures it was chosen on."""
    out = []
    for e in run.of("redundancy_mode"):
        expected = e.get("expected") if isinstance(e.get("expected"), dict) else {}
        figures = ", ".join(f"{m} {v:.1f}" for m, v in expected.items() if _is_num(v))
        rate = e.get("rate_per_node_hour")
        out.append(f"  t={float(e.get('t', 0)):.2f} s  generation {e.get('gen')} from step "
                   f"{e.get('step')}: {e.get('mode')}"
                   + (f" at {rate:.3f} preemptions/node-hour" if _is_num(rate) else "")
                   + (f" (expected samples/s: {figures})" if figures else ""))
    return ["redundancy over time:"] + out if out else []


def _failure_lines(run: Run, failures: list[Failure], pauses: list[float]) -> list[str]:
    s = run.summary
    count = int(s.get("preemptions", len(failures)))
    if "preemptions" in s:
        kinds = ", ".join(f"{label} {int(s.get(key, 0))}" for key, label in _COUNTERS)
    else:
        by: dict[str, int] = {}
        for f in failures:
            by[f.handled_as] = by.get(f.handled_as, 0) + 1
        kinds = ", ".join(f"{k} {v}" for k, v in by.items()) or "none"
    out = [f"preemptions: {count} ({kinds})"]
    for f in failures:
        where = f"step {f.step}" + (f" ({f.phase})" if f.phase else "")
        shadow = f", shadow {f.shadow}" if f.shadow else ""
        steps = " and ".join(map(str, f.reconfigured_at))
        reconf = (f" ({f.reconfiguration_s:.2f} s of it the reconfiguration"
                  f"{'s' if len(f.reconfigured_at) > 1 else ''} before step"
                  f"{'s' if len(f.reconfigured_at) > 1 else ''} {steps})"
                  if f.reconfiguration_s > 0 and f.reconfigured_at else "")
        out.append(f"  t={f.t:.2f} s  {f.node} lost in {where}: {f.handled_as}{shadow}, "
                   f"pause {f.pause_s:.2f} s{reconf}")
    if pauses:
        out.append(f"pause per failure: {', '.join(f'{p:.2f}' for p in pauses)} s (total "
                   f"{sum(pauses):.2f} s, mean {sum(pauses) / len(pauses):.2f} s)")
    else:
        out.append("pause per failure: none")
    return out


def write_report(run_dir: str | Path, prices: Prices | None = None) -> list[Path]:
    """Write report.txt and the five PNGs into `run_dir`; their paths, report.txt first."""
    prices = prices or Prices()
    run = load_run(run_dir)
    failures = _failures(run)
    path = run.path
    try:
        text_path = path / "report.txt"
        _write_atomic(text_path, report_text(run, prices).encode("utf-8"))
        from bamboo.run.report_plots import write_plots
        return [text_path, *write_plots(run, failures, prices, path)]
    except PermissionError as e:
        raise ReportError(f"cannot write the report into '{path}': {e.strerror}") from None
