"""`bamboo.train`: run a `bamboo.Job` in this process, as `bamboo train` does, and its result.

    result = bamboo.train(job, out="runs/mine", on_event=print)
    result.losses, result.param_sha256, result.preemptions, result.run_dir
    params = result.state_dict()            # your model's own names: "0.weight", ...
    bamboo.same(failure_free, result)       # equal under the contract's rule? .reason says why

This process is the run's coordinator (it holds the store and takes every decision), the
workers are processes it starts; `on_event` is called here with every event of the run's
events.jsonl as it is written. A run that stops before its last step raises
`bamboo.RunFailed`, its one-line reason as str() and its summary as `.summary`.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bamboo.api.job import Job, JobError, guard_worker_import
from bamboo.config import ConfigError, JobConfig
from bamboo.data.sizing import SIZING
from bamboo.run.interface import Interface
from bamboo.run.runlog import EventLog, RunDir
from bamboo.run.sameness import Verdict, compare
from bamboo.util.logs import by, fallback_output

__all__ = ["train", "run_config", "RunResult", "load_result", "same", "Verdict", "LAYER_PREFIX"]

log = logging.getLogger(__name__)

LAYER_PREFIX = "layers."
"""What model.pt's names begin with before the layer's index (`layers.0.weight`)."""

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
        """The trained parameters as the run wrote them: a torch state dict whose names carry
        the layer's index after `layers.` (`layers.0.weight`; what `bamboo export` reads)."""
        return self.run_dir / "model.pt"

    def state_dict(self) -> dict[str, Any]:
        """The final parameters (CPU tensors) under your model's own names: layer i's
        parameter `name` is `"i.name"`, as in an `nn.Sequential` of the model's layers, so
        `nn.Sequential(*layers).load_state_dict(result.state_dict())` takes them with
        `strict=True` (your `nn.Sequential` itself, or a list of modules wrapped in one)."""
        if not self.model_path.is_file():
            raise JobError(f"{self.model_path} does not exist: the run wrote no model")
        import torch
        saved = torch.load(self.model_path, map_location="cpu", weights_only=True)
        return {key.removeprefix(LAYER_PREFIX): tensor for key, tensor in saved.items()}

    def matches(self, other: RunResult | Mapping[str, Any] | str | Path) -> Verdict:
        """Whether this run ended the same as `other` under the contract's rule, and why
        (`bamboo.same(self, other)`)."""
        return same(self, other)


def same(a: RunResult | Mapping[str, Any] | str | Path,
         b: RunResult | Mapping[str, Any] | str | Path) -> Verdict:
    """Whether runs `a` and `b` ended the same under the contract's rule, the one `bamboo
    soak` judges by (`bamboo.run.sameness`): a `Verdict`, truthy when they did, whose
    `reason` says why in one line ("bit-equal: ...", "losses within 1e-5 and param_l2 within
    1e-6 (the layout changed: ...)", or what differs and by how much). Each run is a
    RunResult, a summary dict, or a finished run's directory; tolerances are relative to
    `a` (give the failure-free run first)."""
    return compare(_summary_of(a, "a"), _summary_of(b, "b"))


def _summary_of(run: RunResult | Mapping[str, Any] | str | Path, name: str) -> Mapping[str, Any]:
    if isinstance(run, RunResult):
        return run.summary
    if isinstance(run, Mapping):
        return run
    if isinstance(run, (str, Path)):
        return load_result(run).summary
    raise JobError(f"bamboo.same: {name}= takes a RunResult, a summary dict or a run "
                   f"directory (got {type(run).__name__})")


def load_result(run_dir: str | Path) -> RunResult:
    """The RunResult of a finished run's directory (its summary.json)."""
    path = Path(run_dir)
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError) as e:
        raise JobError(f"{path}: no readable summary.json ({e})") from None
    return RunResult.of(summary, path)


def _watched(on_event: EventCallback | None, *own: Callable[[dict[str, Any]], None],
             prog: str = "bamboo.train") -> type[RunDir]:
    """A RunDir whose event log also hands every event to `own` listeners and to the user's
    `on_event` (a callback that raises is dropped with one warning in the words of `prog`:
    the run goes on)."""

    def listener(record: dict[str, Any]) -> None:
        if state["failed"] or on_event is None:
            return
        try:
            on_event(dict(record))
        except Exception as e:  # noqa: BLE001 - the user's callback must not end the run
            state["failed"] = True
            said = f"on_event raised {type(e).__name__}: {e}; it is called no more (the run goes on)"
            log.warning("%s", said.splitlines()[0], extra=by(prog))

    state = {"failed": False}
    listeners = [*own, listener]

    class WatchedRunDir(RunDir):
        def events(self, t0: float) -> EventLog:
            log = super().events(t0)
            log.listeners.extend(listeners)
            return log

    return WatchedRunDir


def run_config(job: Job, out: str | Path | None, prog: str) -> JobConfig:
    """The job's configuration for its run in `out` (default: the job's own `out`): the
    run directory `resume="auto"` continues when there is a run in it, else starts.
    `prog` (`bamboo.train`, ...) names the call in the one-line JobError."""
    cfg = job.config if out is None else job.config.replace(out=str(out))
    if cfg.checkpoints.resume == "auto" and cfg.logging.out is None:
        raise JobError(f'{prog}: resume="auto" needs the run directory to continue (or to '
                       f'start): {prog}(job, out=DIR)', "resume", "out")
    if out is None:
        return cfg  # validated when the job was made
    try:
        return cfg.validate(SIZING)
    except ConfigError as e:
        raise JobError(f"{prog}: {e}", *e.options) from None


def prepared(cfg: JobConfig, prog: str, run_dir: type[RunDir] = RunDir,
             interface: Interface = Interface.TRAIN) -> Any:
    """The job's run here (`cfg`: `run_config`'s) through `bamboo.api.start.launch`: the
    `Start` to run, or None when `resume="auto"` finds its run already complete. JobError
    with one line."""
    from bamboo.api.start import launch
    try:
        return launch(cfg, prog, run_dir=run_dir, interface=interface)
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
    fallback_output()
    if not isinstance(job, Job):
        raise JobError(f"bamboo.train takes a bamboo.Job (got {type(job).__name__}): "
                       f"bamboo.train(bamboo.Job(model=..., nodes=4, ...), out=DIR)")
    if threading.current_thread() is not threading.main_thread():
        raise JobError("bamboo.train must be called from the main thread: the run stops "
                       "cleanly on Ctrl-C through the main thread's signal handlers")
    from bamboo.api.start import execute, warm_up
    cfg = run_config(job, out, "bamboo.train")
    start = prepared(cfg, "bamboo.train",
                     _watched(on_event) if on_event is not None else RunDir, Interface.TRAIN)
    if start is None:  # `resume="auto"` and its run already completed
        return load_result(cfg.logging.out)
    from bamboo.api.start import launcher_for
    from bamboo.protocol.launch import LaunchError
    try:
        launcher = launcher_for(start, "ray=")
    except LaunchError as e:
        raise JobError(f"bamboo.train: {e}", "ray") from None
    warm_up(debug)
    from bamboo.run.progress import ProgressDisplay
    display = ProgressDisplay(start.cfg.training.steps, enabled=not quiet,
                                  prog="bamboo.train")
    summary = execute(start, launcher, display, debug=debug, interface=Interface.TRAIN)
    return RunResult.of(summary, start.run.path)
