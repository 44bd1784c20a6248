"""The coordinator of a local cluster: hosts the store, starts and watches the workers.

`bamboo train` runs this in its own process, so the store outlives every worker.
Workers come from a fork server that has already imported torch (a ready worker in
milliseconds instead of seconds of imports). The coordinator waits on every
worker's pipe and process sentinel at once, never longer than a fraction of a
second, and decides the run's fate: a worker that raised a Python exception stops
the run with that error shown; a worker killed by a signal is a lost node.
"""
from __future__ import annotations

import hashlib
import math
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from bamboo.cluster import forkserver
from bamboo.cluster.worker import SHUTDOWN_KEY, WorkerSpec, worker_main
from bamboo.config import JobConfig
from bamboo.faults import Fault
from bamboo.pipeline.layout import Layout
from bamboo.progress import ProgressDisplay
from bamboo.runlog import RunDir, write_atomic

__all__ = ["RunFailed", "LocalCluster", "run_local"]

_POLL_S = 0.2
_ROOT_CAUSE_GRACE_S = 2.0


class RunFailed(RuntimeError):
    """The run stopped before its last step; str() is the one line for the user."""

    def __init__(self, message: str, summary: dict[str, Any], exit_code: int = 1) -> None:
        super().__init__(message)
        self.summary, self.exit_code = summary, exit_code


@dataclass(slots=True)
class _Worker:
    rank: int
    name: str
    process: Any
    conn: Connection
    role: tuple[int | None, int | None]
    done: bool = False
    exited: bool = False


@dataclass(slots=True)
class _Progress:
    reports: dict[int, dict[int, dict]] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    step_records: list[dict] = field(default_factory=list)
    params: dict[int, list] = field(default_factory=dict)
    last_step_t: float = 0.0


class LocalCluster:
    """One training run on local worker processes."""

    def __init__(self, cfg: JobConfig, run: RunDir, display: ProgressDisplay,
                 extra_faults: dict[int, list[Fault]] | None = None, debug: bool = False) -> None:
        self.cfg, self.rundir, self.display, self.debug = cfg, run, display, debug
        self._peer_lost_message = ""
        self.layout = Layout(nodes=cfg.nodes, pipelines=cfg.data_parallel, stages=cfg.stages,
                             global_micro_batches=cfg.global_micro_batches)
        self.faults = self._plan_faults(extra_faults or {})
        self.workers: dict[int, _Worker] = {}
        self.state = _Progress()
        self.interrupted: int | None = None

    def _plan_faults(self, extra: dict[int, list[Fault]]) -> dict[int, list[Fault]]:
        plan = {rank: list(faults) for rank, faults in extra.items()}
        for k in self.cfg.kills:
            plan.setdefault(self.layout.rank(k.pipeline, k.stage), []).append(Fault("kill", k.step))
        return plan

    # -- lifecycle --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        self.rundir.create()
        self.events = self.rundir.events(self.t0)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.events.write("run_start", config=self.cfg.to_dict())
            self._start_store()
            self._start_workers()
            self._supervise()
            return self._finish()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._stop_all()
            self.display.close()
            self.events.close()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.interrupted = signum

    def _start_store(self) -> None:
        timeout = timedelta(seconds=self.cfg.comm_timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timeout)

    def _start_workers(self) -> None:
        ctx = forkserver.context()
        for rank in range(self.cfg.nodes):
            reader, writer = ctx.Pipe(duplex=False)
            spec = WorkerSpec(rank=rank, world_size=self.cfg.nodes, store_host="127.0.0.1",
                              store_port=self.store.port, config=self.cfg,
                              faults=tuple(self.faults.get(rank, [])))
            process = ctx.Process(target=worker_main, args=(spec, writer), name=f"bamboo-n{rank}")
            process.start()
            writer.close()
            role = self.layout.role(rank)
            w = _Worker(rank, self.layout.node_name(rank), process, reader, (role.pipeline, role.stage))
            self.workers[rank] = w
            self.events.write("node_up", node=w.name, pid=process.pid, pipeline=role.pipeline,
                              stage=role.stage)
        self.display.message(f"started {self.cfg.nodes} workers: {self.cfg.data_parallel} "
                             f"pipeline(s) x {self.cfg.stages} stage(s), model {self.cfg.model}")
        self.state.last_step_t = time.monotonic()

    def _stop_all(self) -> None:
        for w in self.workers.values():
            if w.process.is_alive():
                w.process.kill()
        for w in self.workers.values():
            w.process.join(timeout=5)

    # -- supervision ------------------------------------------------------------------------

    def _supervise(self) -> None:
        stall_s = self.cfg.comm_timeout_s + 30.0
        last_news = time.monotonic()
        peer_lost_at: float | None = None
        while not all(w.done for w in self.workers.values()):
            if self.interrupted is not None:
                self._fail(f"interrupted by {signal.Signals(self.interrupted).name}; "
                           f"all workers stopped", exit_code=128 + self.interrupted)
            live = {w.conn: w for w in self.workers.values() if not w.exited}
            sentinels = {w.process.sentinel: w for w in self.workers.values() if not w.exited}
            ready = wait(list(live) + list(sentinels), timeout=_POLL_S)
            for obj in ready:
                if obj in live:
                    last_news = time.monotonic()
                    peer_lost = self._drain(live[obj])
                    if peer_lost and peer_lost_at is None:
                        peer_lost_at = time.monotonic()
            for obj in ready:
                if obj in sentinels:
                    self._on_exit(sentinels[obj])
            if peer_lost_at is not None and time.monotonic() - peer_lost_at > _ROOT_CAUSE_GRACE_S:
                self._fail(self._peer_lost_message)
            if time.monotonic() - last_news > stall_s:
                self._fail(f"no worker reported progress for {stall_s:.0f} s; stopped the run "
                           f"(raise --comm-timeout if steps are that slow)")

    def _drain(self, w: _Worker) -> bool:
        """Handle every message waiting on `w`'s pipe; True when it reported a lost peer."""
        peer_lost = False
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                peer_lost |= self._handle(w, msg)
        except (EOFError, OSError):
            pass
        return peer_lost

    def _handle(self, w: _Worker, msg: dict) -> bool:
        kind = msg["kind"]
        if kind == "step":
            self._on_step_report(msg)
        elif kind == "params":
            for layer_index, tensors in msg["layers"]:
                self.state.params[layer_index] = tensors
        elif kind == "done":
            w.done = True
            if all(x.done for x in self.workers.values() if x.role[1] is not None):
                self.store.set(SHUTDOWN_KEY, "1")
        elif kind == "error":
            self.events.write("worker_error", node=w.name, step=msg["step"], error=msg["error"],
                              peer_lost=msg["peer_lost"], traceback=msg["traceback"])
            if not msg["peer_lost"]:
                self._fail(self._software_error(w, msg))
            self._peer_lost_message = self._peer_lost_message or (
                f"node {w.name} lost a peer in step {msg['step']} ({msg['error']}) "
                f"and no other cause was reported")
            return True
        return False

    def _software_error(self, w: _Worker, msg: dict) -> str:
        where = self._where(w)
        if self.debug:
            print(msg["traceback"], file=sys.stderr, flush=True)
        return f"worker {w.name} ({where}) failed in step {msg['step']}: {msg['error']}"

    def _where(self, w: _Worker) -> str:
        pipeline, stage = w.role
        return "standby" if stage is None else f"pipeline {pipeline}, stage {stage}"

    def _on_exit(self, w: _Worker) -> None:
        w.exited = True
        self._drain(w)
        code = w.process.exitcode
        if w.done and code == 0:
            return
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            step = len(self.state.losses)
            self.events.write("node_lost", node=w.name, step=step, signal=name,
                              handled_as="stopped")
            self._fail(f"node {w.name} ({self._where(w)}) was lost in step {step} ({name}); "
                       f"this run has no failover, so it stops here",
                       exit_code=3)
        if not w.done:
            self._fail(f"worker {w.name} ({self._where(w)}) exited with code {code} "
                       f"before finishing (see events.jsonl)")

    def _on_step_report(self, msg: dict) -> None:
        step = msg["step"]
        reports = self.state.reports.setdefault(step, {})
        reports[msg["rank"]] = msg
        active = self.layout.pipelines * self.layout.stages
        # Steps finish in order: every node runs them in order and reports after each.
        while len(self.state.reports.get(len(self.state.losses), {})) == active:
            self._step_done(len(self.state.losses))

    def _step_done(self, step: int) -> None:
        reports = self.state.reports.pop(step)
        mb_losses = sorted(x for r in reports.values() for x in r["losses"])
        loss = math.fsum(l * w for _, l, w in mb_losses)
        now = time.monotonic()
        elapsed = now - self.state.last_step_t
        self.state.last_step_t = now
        samples = self.cfg.global_micro_batches * self.cfg.micro_batch_size
        per_stage = self._stage_breakdown(reports)
        self.state.losses.append(loss)
        record = {"step": step, "loss": loss, "wall_s": elapsed,
                  "grad_norm": next(iter(reports.values()))["grad_norm"],
                  "lr": next(iter(reports.values()))["lr"], "stages": per_stage}
        self.state.step_records.append(record)
        self.events.write("step_done", **record)
        self.display.step(step, loss, samples / max(elapsed, 1e-9),
                          [1000 * s["step_s"] for s in per_stage])

    def _stage_breakdown(self, reports: dict[int, dict]) -> list[dict]:
        """Per stage, the slowest pipeline's timers (that pipeline sets the pace)."""
        out = []
        for stage in range(self.layout.stages):
            rows = [r for r in reports.values() if r["stage"] == stage]
            slowest = max(rows, key=lambda r: r["step_s"])
            out.append({k: round(slowest[k], 6) for k in
                        ("step_s", "compute_s", "wait_s", "reduce_s", "optim_s")}
                       | {"bytes_sent": slowest["bytes_sent"]})
        return out

    def _fail(self, message: str, exit_code: int = 1) -> None:
        self._stop_all()
        self.events.write("run_failed", error=message)
        summary = self._summary(status="failed", error=message)
        self.rundir.write_json("summary.json", summary)
        raise RunFailed(message, summary, exit_code)

    # -- results ----------------------------------------------------------------------------

    def _finish(self) -> dict[str, Any]:
        summary = self._summary(status="completed", error=None)
        self._save_model()
        self.rundir.write_json("summary.json", summary)
        self.events.write("run_done", steps=summary["steps_completed"], wall_s=summary["wall_s"])
        return summary

    def _ordered_params(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for layer_index in sorted(self.state.params):
            out += [(f"layers.{layer_index}.{n}", t) for n, t in self.state.params[layer_index]]
        return out

    def _save_model(self) -> None:
        params = self._ordered_params()
        if not params:
            return
        import io
        buffer = io.BytesIO()
        torch.save(dict(params), buffer)
        write_atomic(self.rundir.path / "model.pt", buffer.getvalue())

    def _summary(self, *, status: str, error: str | None) -> dict[str, Any]:
        params = self._ordered_params()
        l2 = math.sqrt(math.fsum(float(t.double().square().sum()) for _, t in params))
        sha = hashlib.sha256()
        for _, t in params:
            sha.update(t.contiguous().numpy().tobytes())
        steps = len(self.state.losses)
        samples = steps * self.cfg.global_micro_batches * self.cfg.micro_batch_size
        wall = time.monotonic() - self.t0
        step_walls = [r["wall_s"] for r in self.state.step_records[1:]]
        return {
            "status": status, "error": error,
            "steps_completed": steps, "samples": samples, "losses": self.state.losses,
            "param_l2": l2 if params else None,
            "param_sha256": sha.hexdigest() if params else None,
            "preemptions": 0, "failovers": 0, "drains": 0, "peer_restores": 0,
            "checkpoint_restores": 0, "standby_losses": 0, "reconfigurations": 0,
            "redone_steps": 0, "pause_s": [],
            "wall_s": wall, "throughput": samples / wall if wall > 0 else 0.0,
            "median_step_s": statistics.median(step_walls) if step_walls else None,
            "config": self.cfg.summary_fields(),
        }


def run_local(cfg: JobConfig, run: RunDir, display: ProgressDisplay,
              extra_faults: dict[int, list[Fault]] | None = None,
              debug: bool = False) -> dict[str, Any]:
    """Train `cfg` on a local cluster; the summary, or RunFailed."""
    return LocalCluster(cfg, run, display, extra_faults, debug).run()
