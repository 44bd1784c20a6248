"""`bamboo.train`: run a `bamboo.Job` in this process, as `bamboo train` does, and its result.

    result = bamboo.train(job, out="runs/mine", on_event=print)
    result.losses, result.param_sha256, result.preemptions, result.run_dir
    params = result.state_dict()

This process is the run's coordinator (it holds the store and takes every decision), the
workers are processes it starts; `on_event` is called here with every event of the run's
events.jsonl as it is written. A run that stops before its last step raises
`bamboo.RunFailed`, its one-line reason as str() and its summary as `.summary`.
"""
from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bamboo.api.job import Job, JobError, guard_worker_import
from bamboo.config import ConfigError
from bamboo.run.runlog import EventLog, RunDir

__all__ = ["train", "RunResult", "load_result"]

EventCallback = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class RunResult:
    """A finished run: summary.json's fields as attributes, and where the run is."""

    run_dir: Path
    status: str
    steps_completed: int
    samples: int
    losses: list[float]
    """One mean loss per step, in step order."""
    eval_losses: list[list[float]]
    """`[steps done, held-out loss]` pairs (empty without `eval_every`)."""
    param_l2: float | None
    param_sha256: str | None
    """SHA-256 of every parameter's float32 bytes, in layer order."""
    preemptions: int
    failovers: int
    drains: int
    peer_restores: int
    checkpoint_restores: int
    standby_losses: int
    reroutes: int
    stopped: int
    reconfigurations: int
    redone_steps: int
    wall_s: float
    throughput: float
    """Samples a second over the run."""
    config: dict[str, Any]
    summary: dict[str, Any] = field(repr=False)
    """summary.json as a dict (every field, also those without an attribute)."""

    @classmethod
    def of(cls, summary: dict[str, Any], run_dir: Path) -> RunResult:
        named = {f.name for f in fields(cls)} - {"run_dir", "summary"}
        return cls(run_dir=Path(run_dir), summary=summary,
                   **{k: summary.get(k) for k in named})

    def __getattr__(self, name: str) -> Any:
        summary = self.__dict__.get("summary", {})
        if name in summary:
            return summary[name]
        raise AttributeError(f"RunResult has no field '{name}' (summary.json's keys: "
                             f"{', '.join(sorted(summary))})")

    @property
    def model_path(self) -> Path:
        """The trained parameters (a torch state dict, names like `layers.0.weight`)."""
        return self.run_dir / "model.pt"

    def state_dict(self) -> dict[str, Any]:
        """The final parameters, loaded from model.pt (CPU tensors)."""
        if not self.model_path.is_file():
            raise JobError(f"{self.model_path} does not exist: the run wrote no model")
        import torch
        return torch.load(self.model_path, map_location="cpu", weights_only=True)


def load_result(run_dir: str | Path) -> RunResult:
    """The RunResult of a finished run's directory (its summary.json)."""
    path = Path(run_dir)
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise JobError(f"{path}: no readable summary.json ({e})") from None
    return RunResult.of(summary, path)


def _watched(on_event: EventCallback | None,
             *own: Callable[[dict[str, Any]], None]) -> type[RunDir]:
    """A RunDir whose event log also hands every event to `own` listeners and to the user's
    `on_event` (a callback that raises is dropped with one warning: the run goes on)."""

    def listener(record: dict[str, Any]) -> None:
        if state["failed"] or on_event is None:
            return
        try:
            on_event(dict(record))
        except Exception as e:  # noqa: BLE001 - the user's callback must not end the run
            state["failed"] = True
            print(f"bamboo: warning: on_event raised {type(e).__name__}: {e}; it is called "
                  f"no more (the run goes on)".splitlines()[0], file=sys.stderr)

    state = {"failed": False}
    listeners = [*own, listener]

    class WatchedRunDir(RunDir):
        def events(self, t0: float) -> EventLog:
            log = super().events(t0)
            log.listeners.extend(listeners)
            return log

    return WatchedRunDir


def prepared(job: Job, out: str | Path | None, prog: str,
             run_dir: type[RunDir] = RunDir) -> Any:
    """`job`'s checks before a run here (its layout chosen, its fit, its run directory, the
    checkpoint it continues): the `bamboo.api.start.Start` to run, or None when
    `resume="auto"` finds its run already complete. JobError with one line."""
    from bamboo.api.start import prepare
    cfg = job.config
    try:
        if out is not None:
            cfg = cfg.replace(out=str(out)).validate()
        from bamboo.model.fits import check_fits, check_step_length
        from bamboo.model.layout_fit import resolve_stages
        cfg, chosen = resolve_stages(cfg, cfg.node_cap)  # --stages auto: P, D and M
        if chosen is not None:
            print(f"{prog}: {chosen}", file=sys.stderr)
        check_fits(cfg, cfg.node_cap)  # the local workers share this machine's memory
        check_step_length(cfg)
        return prepare(cfg, prog, run_dir)
    except ConfigError as e:
        raise JobError(f"{prog}: {e}", *e.options) from None


def train(job: Job, out: str | Path | None = None, *, on_event: EventCallback | None = None,
          quiet: bool = True, debug: bool = False) -> RunResult:
    """Run `job` to its end on local worker processes, in the run directory `out`
    (default: the job's `out`, else runs/<timestamp>; a directory that already holds a run
    is refused, never overwritten). `on_event(event)`: each event as the run writes it.
    `quiet=False` shows the progress line on stderr. `bamboo.RunFailed` when the run stops
    early; `bamboo.JobError` (one line) for a job that cannot start here."""
    guard_worker_import("bamboo.train")
    if not isinstance(job, Job):
        raise JobError(f"bamboo.train takes a bamboo.Job (got {type(job).__name__}): "
                       f"bamboo.train(bamboo.Job(model=..., nodes=4, ...), out=DIR)")
    if threading.current_thread() is not threading.main_thread():
        raise JobError("bamboo.train must be called from the main thread: the run stops "
                       "cleanly on Ctrl-C through the main thread's signal handlers")
    from bamboo.api.start import execute, warm_up
    start = prepared(job, out, "bamboo.train",
                     _watched(on_event) if on_event is not None else RunDir)
    cfg = job.config if out is None else job.config.replace(out=str(out))
    if start is None:  # `resume="auto"` and its run already completed
        return load_result(cfg.logging.out)
    warm_up(debug)
    from bamboo.control.sources import LocalWorkers
    from bamboo.run.progress import ProgressDisplay
    display = ProgressDisplay(start.cfg.training.steps, enabled=not quiet)
    summary = execute(start, LocalWorkers(), display, debug=debug)
    return RunResult.of(summary, start.run.path)
