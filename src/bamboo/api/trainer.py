"""`bamboo.Trainer`: your own loop around a bamboo run, one global step per call.

    with bamboo.Trainer(job, out="runs/mine") as trainer:
        while trainer.steps_done < job.config.training.steps:
            step = trainer.train_step()           # every failover inside it
            if trainer.steps_done % 10 == 0:
                held_out = trainer.evaluate()
                plateau.step(held_out.loss)       # your rule, e.g. ReduceLROnPlateau's
                trainer.set_lr_scale(optimizer_scale)
            if step.loss < 0.1:
                break                              # stopping early is ending the loop
    result = trainer.result                        # as bamboo.train returns it

This process is the run's coordinator, as for `bamboo.train`; the workers start with the
Trainer and wait at every step boundary for what the next call asks (bamboo.plan.orders):
a step, a held-out pass, a checkpoint, the end. A kill, a drain or a restore that happens
during a call is handled inside it, and one that happens between calls at the next call;
either way the run ends with the losses and parameters of the same calls failure-free.
Between calls the run does nothing: the time your loop takes is not the run's.
"""
from __future__ import annotations

import atexit
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bamboo.api.job import Job, JobError, guard_worker_import
from bamboo.api.run import EventCallback, RunResult, _watched, load_result
from bamboo.plan.orders import Order, OrderKind
from bamboo.util.logs import by, fallback_output

__all__ = ["Trainer", "StepResult", "EvalResult"]

log = logging.getLogger(__name__)

_SAVE_GRACE_S = 20.0
"""On Ctrl-C between two calls, the longest the Trainer waits for a resume point."""


@dataclass(frozen=True)
class StepResult:
    """One global step, as `train_step()` ran it."""

    step: int
    """Its index: 0 for the run's first step (as events.jsonl and `kill=` count)."""
    loss: float
    """The mean loss over the step's global batch."""
    metrics: dict[str, float]
    """The job's `metrics=`, each the mean over the global batch (empty without)."""
    lr: float | None
    """The learning rate applied: the schedule's, times the scale in force."""
    grad_norm: float | None
    wall_s: float
    """Seconds the step took, from the call to its record."""
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """Every event the run wrote during the call (events.jsonl's records: `node_lost`,
    `role`, `reconfiguration`, `checkpoint`, `step_done`, ...)."""

    @property
    def preemptions(self) -> list[dict[str, Any]]:
        """The `node_lost` events of the call: what was lost and how it was handled."""
        return [e for e in self.events if e.get("event") == "node_lost"]


@dataclass(frozen=True)
class EvalResult:
    """The held-out pass on the parameters after `steps_done` steps."""

    steps_done: int
    loss: float
    metrics: dict[str, float]


class Trainer:
    """A bamboo run driven by your loop: `train_step()`, `evaluate()`, `set_lr_scale()`,
    `save()`, `close()` (also a context manager). `out` is the run directory, the one
    `resume="auto"` continues; `on_event`, `quiet` and `debug` as for `bamboo.train`."""

    def __init__(self, job: Job, out: str | Path | None = None, *,
                 on_event: EventCallback | None = None, quiet: bool = True,
                 debug: bool = False) -> None:
        guard_worker_import("bamboo.Trainer")
        fallback_output()
        if not isinstance(job, Job):
            raise JobError(f"bamboo.Trainer takes a bamboo.Job (got {type(job).__name__}): "
                           f"bamboo.Trainer(bamboo.Job(model=..., nodes=4, ...), out=DIR)")
        if threading.current_thread() is not threading.main_thread():
            raise JobError("bamboo.Trainer must be made in the main thread: its workers die "
                           "with the thread that started them")
        from bamboo.api.run import prepared, run_config
        from bamboo.run.interface import Interface
        self.job = job
        self.result: RunResult | None = None
        """The run's result once `close()` ended it (as `bamboo.train` returns it)."""
        self._events: list[dict[str, Any]] | None = None
        self._in_call = False
        cfg = run_config(job, out, "bamboo.Trainer")
        watched = _watched(on_event, self._listen, prog="bamboo.Trainer")
        start = prepared(cfg, "bamboo.Trainer", watched, Interface.TRAINER)
        if start is None:  # `resume="auto"` and its run already completed
            self.result = load_result(cfg.logging.out)
            self._coordinator: Any = None
            return
        self._open(start, quiet, debug)

    def _open(self, start: Any, quiet: bool, debug: bool) -> None:
        from bamboo.api.start import launcher_for, warm_up
        from bamboo.control.loop import Coordinator
        from bamboo.control.run_options import RunOptions
        from bamboo.protocol.launch import LaunchError
        from bamboo.run.interface import Interface
        from bamboo.run.progress import ProgressDisplay
        try:
            launcher = launcher_for(start, "ray=")
        except LaunchError as e:
            raise JobError(f"bamboo.Trainer: {e}", "ray") from None
        warm_up(debug)
        self.cfg = start.cfg
        self.run_dir: Path = start.run.path
        """The run directory: summary.json, events.jsonl, checkpoints/, model.pt."""
        display = ProgressDisplay(start.cfg.training.steps, enabled=not quiet,
                                  prog="bamboo.Trainer")
        self._coordinator = Coordinator(start.cfg, start.run, display, launcher, RunOptions(
            debug=debug, resume=start.resume, stepwise=True, interface=Interface.TRAINER))
        self._coordinator.open()
        self._core = self._coordinator.core
        self._start_step = self._core.committed
        atexit.register(self._at_exit)

    # -- what the run stands at -------------------------------------------------------------

    @property
    def steps_done(self) -> int:
        """Steps committed so far (a resumed run's included)."""
        if self._coordinator is None:
            return self.result.steps_completed if self.result is not None else 0
        return self._core.committed

    @property
    def losses(self) -> list[float]:
        """The loss of every step done, in step order (a resumed run's earlier ones too)."""
        if self._coordinator is None:
            return list(self.result.losses) if self.result is not None else []
        return list(self._core.ctx.losses)

    @property
    def eval_losses(self) -> list[tuple[int, float]]:
        """`(steps done, held-out loss)` of every evaluation so far (a resumed run's too)."""
        if self._coordinator is None:
            return [(int(s), loss) for s, loss in self.result.eval_losses] \
                if self.result is not None else []
        return [(int(s), loss) for s, loss in self._core.ctx.eval_losses]

    @property
    def lr_scale(self) -> float:
        """The factor on the scheduled learning rate of the next step."""
        if self._coordinator is None:
            from bamboo.plan.orders import scale_at
            return scale_at(self.result.lr_scales or [], self.steps_done) \
                if self.result is not None else 1.0
        return self._core.orders.lr_scale

    @property
    def closed(self) -> bool:
        return self.result is not None or getattr(self, "_failed", None) is not None

    # -- the calls --------------------------------------------------------------------------

    def train_step(self) -> StepResult:
        """Run the next global step to its commit, with every failover, re-route and
        restore it needs; its loss, metrics and what happened (`bamboo.RunFailed` if the run
        cannot go on)."""
        self._usable("train_step")
        k, steps = self.steps_done, self.cfg.training.steps
        if k >= steps:
            raise JobError(f"bamboo.Trainer.train_step: the job's {steps} steps are done (its "
                           f"learning-rate schedule ends there): make the Job with more steps=, "
                           f"or call trainer.close()")
        started = time.monotonic()
        events = self._call(Order(OrderKind.STEP, self.lr_scale), lambda: self._recorded(k))
        record = next(e for e in reversed(events)
                      if e.get("event") == "step_done" and e.get("step") == k)
        ctx = self._core.ctx
        return StepResult(step=k, loss=ctx.losses[k],
                          metrics=dict(ctx.metrics[k]) if k < len(ctx.metrics) else {},
                          lr=record.get("lr"), grad_norm=record.get("grad_norm"),
                          wall_s=time.monotonic() - started, events=events)

    def evaluate(self) -> EvalResult:
        """The held-out loss (and metrics) of the parameters as they are now: the job's
        `eval_dataset` (bamboo's own data: its held-out part), in order."""
        self._usable("evaluate")
        d = self.cfg.data
        if d.dataset is not None and d.eval_dataset is None:
            raise JobError("bamboo.Trainer.evaluate: the job has no held-out set: give "
                           "bamboo.Job(..., eval_dataset=...)")
        k = self.steps_done
        if k not in self._core.steps.evaluated:
            self._call(Order(OrderKind.EVAL),
                       lambda: k in self._core.steps.evaluated)
        ctx = self._core.ctx
        loss = next(loss for step, loss in ctx.eval_losses if step == k)
        metrics = next((m for step, m in ctx.eval_metrics if step == k), {})
        return EvalResult(steps_done=k, loss=loss, metrics=dict(metrics))

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the scheduled learning rate by `scale` from the next step on (your own
        rule: halve it on a plateau). Every node applies it; the run records it
        (summary.json's `lr_scales`, each checkpoint's), so a resume goes on with it."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
                not math.isfinite(scale) or scale < 0:
            raise JobError(f"bamboo.Trainer.set_lr_scale: the scale must be a finite number "
                           f">= 0 (got {scale!r})")
        self._usable("set_lr_scale")
        self._core.orders.set_scale(float(scale))

    def save(self) -> Path | str:
        """Write a checkpoint of the state after the steps done so far, now (a resume point:
        `resume="auto"` continues from it); its folder."""
        self._usable("save")
        k = self.steps_done
        checkpoints = self._core.checkpoints
        if checkpoints.last_step != k:
            failed = self._call(Order(OrderKind.SAVE),
                                lambda: checkpoints.last_step == k or self._save_failed(k))
            error = self._save_failed(k, failed)
            if error:
                raise JobError(f"bamboo.Trainer.save: the checkpoint after {k} steps was not "
                               f"written: {error}")
        return checkpoints.last

    def close(self) -> RunResult:
        """End the run after the steps done: a resume point when it stops before the job's
        last step, the trained model (model.pt) and summary.json written, every worker
        stopped; the result (also `trainer.result`). Closing twice returns it again."""
        if self.result is not None:
            return self.result
        self._usable("close")
        k = self.steps_done
        if self._saves_at_end(k):
            self.save()
        self._call(Order(OrderKind.FINISH), self._core.finished)
        try:
            summary = self._coordinator.finish()
        finally:
            self._shut()
        self.result = RunResult.of(summary, self.run_dir)
        return self.result

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 _tb: Any) -> None:
        if kind is None:
            self.close()
        elif not self.closed:
            self._abort(error)

    # -- inside ----------------------------------------------------------------------------

    def _usable(self, what: str) -> None:
        failed = getattr(self, "_failed", None)
        if failed is not None:
            raise JobError(f"bamboo.Trainer.{what}: the run stopped ({failed}): make a new "
                           f"Trainer (resume=\"auto\" in the Job continues it)")
        if self.result is not None:
            raise JobError(f"bamboo.Trainer.{what}: the run in {self.result.run_dir} is "
                           f"closed after {self.result.steps_completed} steps"
                           + ("" if what == "close" else ": make a new Trainer to go on"))

    def _listen(self, record: dict[str, Any]) -> None:
        if self._events is not None:
            self._events.append(record)

    def _call(self, order: Order, until: Callable[[], bool]) -> list[dict[str, Any]]:
        """Give `order` and drive the run until `until()`; the events written meanwhile.
        A run that cannot go on ends here (RunFailed, its summary written)."""
        from bamboo.control.state import Stop
        self._events, self._in_call = [], True
        try:
            self._core.give(order)
            self._coordinator.drive(until)
            return self._events
        except Stop as e:
            failure = self._coordinator.fail(e)
            self._failed = str(failure)
            self._shut()
            raise failure from None
        finally:
            self._events, self._in_call = None, False

    def _recorded(self, step: int) -> bool:
        records = self._core.results.records
        return bool(records) and records[-1]["step"] == step

    def _save_failed(self, step: int, events: list[dict[str, Any]] | None = None) -> str:
        """The error of a checkpoint of `step` that could not be published, if one failed."""
        for e in events if events is not None else (self._events or []):
            if e.get("event") == "checkpoint_failed" and e.get("step") == step:
                return str(e.get("error"))
        return ""

    def _saves_at_end(self, k: int) -> bool:
        """A run stopped before its last step leaves a resume point there."""
        interval = self._core.gens.interval
        return (k < self.cfg.training.steps and k > self._start_step and interval.enabled
                and self._core.checkpoints.last_step != k)

    def _abort(self, error: BaseException | None) -> None:
        """The loop raised (Ctrl-C among others): at a boundary, a resume point first
        (bounded, when checkpoints are on); then every worker stopped and the run's summary
        written with the reason and how to go on."""
        k = self.steps_done
        saved = ""
        if not self._in_call and self._saves_at_end(k):
            deadline = time.monotonic() + _SAVE_GRACE_S
            try:
                self._call(Order(OrderKind.SAVE),
                           lambda: self._core.checkpoints.last_step == k
                           or time.monotonic() > deadline)
            except BaseException:  # noqa: BLE001 - a second Ctrl-C: stop at once
                pass
        last = self._core.checkpoints.last if not self.closed else None
        if last is not None:
            saved = f"; the newest resume point is {last}"
        why = ("Ctrl-C" if isinstance(error, KeyboardInterrupt) else
               "the script's end before trainer.close()" if error is None else
               f"{type(error).__name__} in the loop")
        message = (f"stopped by {why} with {k} steps done{saved}: to continue, make the Trainer "
                   f"again with resume=\"auto\" in the Job and out={str(self.run_dir)!r}")
        if not self.closed:
            from bamboo.control.state import Stop
            self._failed = str(self._coordinator.fail(Stop(message, exit_code=130)))
            self._shut()
            log.warning("%s", message, extra=by("bamboo.Trainer"))

    def _shut(self) -> None:
        atexit.unregister(self._at_exit)
        self._coordinator.close()

    def _at_exit(self) -> None:
        """The script ended without closing the Trainer: its workers are stopped and the
        run says so (its checkpoints stay, to resume from)."""
        if not self.closed:
            self._abort(None)
