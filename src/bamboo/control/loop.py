"""The coordinator's process: one run, from the run directory and the store to the summary.

`bamboo train` runs this in its own process, so the store outlives every worker. It owns
what a process has (signals, the run directory and its event log, the TCPStore, --http,
TensorBoard/W&B) and drives the decisions' core (`core.CoordinatorCore`) with the nodes'
messages: it waits on every node's pipe and process at once, never longer than a fraction
of a second, hands each message to `core.handle`, each ended process to
`core.node_exited`, and calls `core.tick` in between.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from bamboo.config import JobConfig
from bamboo.control.core import CoordinatorCore
from bamboo.control.nodes import Node
from bamboo.control.run_options import RunOptions
from bamboo.control.state import RunFailed, Stop
from bamboo.control.user_stop import UserStop
from bamboo.protocol.launch import Launcher
from bamboo.protocol.messages import SHUTDOWN_KEY, WorkerMessage
from bamboo.run.progress import ProgressDisplay
from bamboo.run.runlog import RunDir, RunDirError, write_atomic
from bamboo.wire.store import serve_store

__all__ = ["Coordinator", "run_job", "RunFailed"]

_POLL_S = 0.1


class Coordinator:
    """One training run, its nodes from `launcher`: local worker processes, or agents."""

    def __init__(self, cfg: JobConfig, run: RunDir, display: ProgressDisplay,
                 launcher: Launcher, options: RunOptions | None = None) -> None:
        options = options or RunOptions()
        # The workers write checkpoints and the final layers under the run directory (unless
        # --checkpoint-dir says elsewhere): they get its absolute path with the job.
        cfg = cfg.replace(out=str(run.path.resolve()))
        self.cfg, self.rundir, self.display, self.debug = cfg, run, display, options.debug
        self.http = options.http
        """`--http`: (host, port) to serve /healthz and /metrics on (bamboo.control.http)."""
        self.resume = options.resume
        self.user_stop = UserStop(options.interface)
        self.core = CoordinatorCore(cfg, run.path, display, launcher, options)
        self.health: Any = None
        """The --http feed (bamboo.control.health), while the run lasts."""
        self.scalars: Any = None
        """--tensorboard / --wandb logging (`scalars.ScalarLog`), fed from the event log."""
        self.final_status: str | None = None
        """"completed" or "failed" once the run has ended so (not when interrupted)."""
        self.closed = False

    # -- the run, top to bottom -------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """The whole run under this process's signal handlers (Ctrl-C stops it cleanly):
        its summary, or RunFailed."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.open()
            self.drive(self.core.finished)
            return self.finish()
        except Stop as e:
            raise self._failed(str(e), e.exit_code) from None
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.close()

    def open(self) -> None:
        """The run directory, its event log, the store, and the first nodes and plan; what
        was opened is closed again if a later part fails (RunFailed for a Stop)."""
        # First: a bad --http leaves no run directory behind (HttpServeError, one line).
        if self.http is not None:
            from bamboo.control.health import HealthFeed  # prometheus_client
            self.health = HealthFeed(self.http, self.cfg)
        try:
            self.rundir.create(resume=self.resume is not None)
        except BaseException:
            self._close_health()
            raise
        self.events = self.rundir.events(time.monotonic())
        try:
            self._start_scalars()
            self.events.write("run_start", config=self.cfg.to_dict(),
                              resumed_from=str(self.resume.path) if self.resume else None)
            if self.health is not None:
                host, port = self.health.address
                self.events.write("http", address=f"{host}:{port}")
            self._start_store()
            self.core.start(self.store, self.events, time.monotonic, store_host=self.store_host)
            if self.health is not None:
                self.health.attach(self.core)
        except Stop as e:
            try:
                raise self._failed(str(e), e.exit_code) from None
            finally:
                self.close()
        except BaseException:
            self.close()
            raise

    def drive(self, until: Callable[[], bool]) -> None:
        """Read the nodes and let the core decide until `until()` holds (Stop when the run
        cannot go on; the caller turns it into RunFailed with `fail`)."""
        core = self.core
        while not until():
            self.user_stop.check(core, time.monotonic())
            self._wait_and_read()
            core.tick(time.monotonic())
            if self.health is not None:
                self.health.update()

    def finish(self) -> dict[str, Any]:
        """The finished run's end: every worker told to exit, model.pt and summary.json
        written; the summary (RunFailed when they cannot be)."""
        if self.health is not None:
            self.health.update(finished=True)
        self.store.set(SHUTDOWN_KEY, "1")
        return self._finish()

    def fail(self, stop: Stop) -> RunFailed:
        """The run ended by `stop`: its summary written, the RunFailed to raise."""
        return self._failed(str(stop), stop.exit_code)

    def close(self) -> None:
        """Stop every node still running and close what the run opened (idempotent)."""
        if hasattr(self.core, "nodes"):
            self.core.nodes.stop_all()
        if not self.closed:
            self.closed = True
            self.core.supply.close(self.final_status)
        self.display.close()
        if self.scalars is not None:
            self.scalars.close()
            self.scalars = None
        self._close_health()
        if hasattr(self, "events"):
            self.events.close()

    def _close_health(self) -> None:
        if self.health is not None:
            self.health.close()
            self.health = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """The user's signal: only recorded (the first also tells the node supply)."""
        if self.core.supply.interrupted is None:
            self.core.supply.interrupted = signum
        self.user_stop.signal(signum)

    def _start_store(self) -> None:
        """The store where the launcher says: for local workers on loopback and any free
        port; for agents on the fixed --store-port (`bamboo.launch.agents.Agents`)."""
        timeout = timedelta(seconds=self.cfg.runtime.comm_timeout_s)
        address = self.core.supply.store_address()
        bind_host, port, self.store_host = address.bind_host, address.port, address.advertised
        try:
            self.store = serve_store(bind_host, port, timeout)
        except (RuntimeError, OSError) as e:
            if not port:
                raise
            raise Stop(f"cannot serve the store on port {port} "
                       f"({str(e).splitlines()[0][:120]}): choose another --store-port",
                       exit_code=2) from None
        if not port:
            return
        self.events.write("store", port=self.store.port,
                          advertised=self.store_host or "the address each agent joined on")

    def _start_scalars(self) -> None:
        """--tensorboard / --wandb: scalars from every event from now on."""
        cfg = self.cfg
        if cfg.logging.tensorboard is None and cfg.logging.wandb is None:
            return
        from bamboo.control.scalars import ScalarLog
        try:
            self.scalars = ScalarLog(cfg, self.rundir.path, self.display.message,
                                     live_nodes=lambda: self.core.nodes.alive_count()
                                     if hasattr(self.core, "nodes") else None)
        except Exception as e:  # noqa: BLE001 (a logging library's own errors: stop with one line)
            which = "--wandb" if cfg.logging.wandb is not None else "--tensorboard"
            raise Stop(f"cannot start {which} logging: {type(e).__name__}: {e}".splitlines()[0],
                       exit_code=2) from None
        self.events.listeners.append(self.scalars.on_event)

    def _finish(self) -> dict[str, Any]:
        summary = self.core.final_summary()
        try:
            model = self.core.results.model_bytes()
            if model is not None:
                write_atomic(self.rundir.path / "model.pt", model)
        except RunDirError as e:  # the failed run's summary is still written (or said not)
            raise self._failed(str(e), 1) from None
        try:
            self.rundir.write_json("summary.json", summary)
        except RunDirError as e:
            raise self._failed(str(e), 1, write_summary=False) from None
        self.events.write("run_done", steps=summary["steps_completed"], wall_s=summary["wall_s"])
        self.final_status = "completed"
        return summary

    def _failed(self, message: str, exit_code: int, write_summary: bool = True) -> RunFailed:
        if self.core.supply.interrupted is None:
            self.final_status = "failed"
        summary = self.core.fail(message) if hasattr(self.core, "ctx") else {
            "status": "failed", "error": message, "steps_completed": 0, "losses": []}
        if write_summary:
            try:
                self.rundir.write_json("summary.json", summary)
            except RunDirError as e:
                message = f"{message}; and {e}"
        return RunFailed(message, summary, exit_code)

    # -- reading the nodes ------------------------------------------------------------------

    def _wait_and_read(self) -> None:
        nodes = [n for n in self.core.nodes if not n.exited]
        live = {n.conn: n for n in nodes}
        sentinels = {n.process.sentinel: n for n in nodes}
        ready = wait(list(live) + list(sentinels), timeout=_POLL_S)
        for obj in ready:
            if obj in live:
                self._drain(live[obj])
        for obj in ready:
            if obj in sentinels:
                n = sentinels[obj]
                self._drain(n)
                self.core.node_exited(n)

    def _drain(self, n: Node) -> None:
        """Hand every message waiting on `n`'s pipe to the core."""
        try:
            while n.conn.poll():
                msg: WorkerMessage = n.conn.recv()
                self.core.handle(n, msg)
        except (EOFError, OSError):
            pass


def run_job(cfg: JobConfig, run: RunDir, display: ProgressDisplay, launcher: Launcher,
            options: RunOptions | None = None) -> dict[str, Any]:
    """Run the job `cfg` to its end, its nodes from `launcher` (`bamboo.launch`: local worker
    processes, agents that join, Ray actors) and driven as `options` say: the summary, or
    RunFailed (HttpServeError when `options.http`, --http's address, cannot be served)."""
    return Coordinator(cfg, run, display, launcher, options).run()
