"""The coordinator of a local cluster: hosts the store, starts, watches and fences workers,
and decides each step's fate.

`bamboo train` runs this in its own process, so the store outlives every worker.
Workers come from a fork server that has already imported torch. The coordinator
waits on every worker's pipe and process at once, never longer than a fraction of a
second, and:

- notices a lost node within that fraction of a second (its process is gone) or when
  its heartbeat lease runs out (a frozen machine: it is fenced with SIGKILL first);
- publishes the new role map (`epoch/<e>`), which every survivor applies to the step
  under way; a loss no copy can cover stops the run with one line;
- says "go" to a step's commit round when every live node has finished its
  micro-batches, and "commit" when every live node's round succeeded (else "redo");
- stops the run with the worker's error when a worker raises (a software error is
  never failed over: a deterministic bug would only cascade through the shadows).
"""
from __future__ import annotations

import hashlib
import io
import math
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.sharedctypes import RawArray
from typing import Any

import torch
import torch.distributed as dist

from bamboo.cluster import forkserver
from bamboo.cluster.worker import SHUTDOWN_KEY, WorkerSpec, worker_main
from bamboo.config import JobConfig
from bamboo.faults import Fault
from bamboo.pipeline.engine import PHASES
from bamboo.pipeline.layout import Layout
from bamboo.progress import ProgressDisplay
from bamboo.redundancy.roles import RoleMap, Unrecoverable, plan_failover
from bamboo.runlog import RunDir, write_atomic

__all__ = ["RunFailed", "LocalCluster", "run_local"]

_POLL_S = 0.1
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
    done: bool = False
    exited: bool = False
    lost: bool = False
    fenced: bool = False


@dataclass(slots=True)
class _Failure:
    node: str
    rank: int
    step: int
    phase: str
    handled_as: str
    shadow: str | None
    t: float
    signal: str
    pause_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _PendingStep:
    step: int
    loss: float
    wall_s: float
    expected: set[int]
    reports: dict[int, dict] = field(default_factory=dict)


class LocalCluster:
    """One training run on local worker processes."""

    def __init__(self, cfg: JobConfig, run: RunDir, display: ProgressDisplay,
                 extra_faults: dict[int, list[Fault]] | None = None, debug: bool = False,
                 check_replicas: bool = False) -> None:
        self.cfg, self.rundir, self.display, self.debug = cfg, run, display, debug
        self.check_replicas = check_replicas
        self.layout = Layout(nodes=cfg.nodes, pipelines=cfg.data_parallel, stages=cfg.stages,
                             global_micro_batches=cfg.global_micro_batches)
        self.rc = cfg.redundancy != "off" and cfg.stages > 1
        self.roles = RoleMap.initial(stages=cfg.stages, pipelines=cfg.data_parallel,
                                     redundancy=self.rc)
        self.faults = self._plan_faults(extra_faults or {})
        self.workers: dict[int, _Worker] = {}
        self.interrupted: int | None = None
        self._peer_lost_message = ""
        self.committed = 0
        self.phase_a: dict[tuple[int, int], set[int]] = {}
        self.rounds: dict[tuple[int, int], dict[int, dict]] = {}
        self.written: set[str] = set()
        self.round_failed_at: float | None = None
        self.pending: dict[int, _PendingStep] = {}
        self.losses: list[float] = []
        self.step_records: list[dict] = []
        self.failures: list[_Failure] = []
        self.params: dict[int, list] = {}
        self.standby_losses = 0

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
        n = self.cfg.nodes
        self.beats = RawArray("d", [time.monotonic() + 30.0] * n)  # grace for start-up
        self.progress = RawArray("i", [0] * (2 * n))
        for rank in range(n):
            reader, writer = ctx.Pipe(duplex=False)
            spec = WorkerSpec(rank=rank, world_size=n, store_host="127.0.0.1",
                              store_port=self.store.port, config=self.cfg,
                              faults=tuple(self.faults.get(rank, [])),
                              check_replicas=self.check_replicas)
            process = ctx.Process(target=worker_main, args=(spec, writer, self.beats, self.progress),
                                  name=f"bamboo-n{rank}")
            process.start()
            writer.close()
            role = self.layout.role(rank)
            w = _Worker(rank, self.layout.node_name(rank), process, reader)
            self.workers[rank] = w
            self.events.write("node_up", node=w.name, pid=process.pid, pipeline=role.pipeline,
                              stage=role.stage)
        self.display.message(f"started {n} workers: {self.cfg.data_parallel} pipeline(s) x "
                             f"{self.cfg.stages} stage(s), model {self.cfg.model}, redundancy "
                             f"{self.cfg.redundancy if self.rc else 'off'}")
        self.last_commit_t = time.monotonic()

    def _stop_all(self) -> None:
        for w in self.workers.values():
            if w.process.is_alive():
                w.process.kill()
        for w in self.workers.values():
            w.process.join(timeout=5)

    # -- supervision ------------------------------------------------------------------------

    def _supervise(self) -> None:
        stall_s = self.cfg.comm_timeout_s + 30.0
        self.last_news = time.monotonic()
        peer_lost_at: float | None = None
        while not all(w.done or w.lost for w in self.workers.values()):
            if self.interrupted is not None:
                self._fail(f"interrupted by {signal.Signals(self.interrupted).name}; "
                           f"all workers stopped", exit_code=128 + self.interrupted)
            live = {w.conn: w for w in self.workers.values() if not w.exited}
            sentinels = {w.process.sentinel: w for w in self.workers.values() if not w.exited}
            ready = wait(list(live) + list(sentinels), timeout=_POLL_S)
            for obj in ready:
                if obj in live:
                    self.last_news = time.monotonic()
                    if self._drain(live[obj]) and peer_lost_at is None:
                        peer_lost_at = time.monotonic()
            for obj in ready:
                if obj in sentinels:
                    self._on_exit(sentinels[obj])
            self._check_leases()
            now = time.monotonic()
            if peer_lost_at is not None and now - peer_lost_at > _ROOT_CAUSE_GRACE_S:
                self._fail(self._peer_lost_message)
            if self.round_failed_at is not None and now - self.round_failed_at > self.cfg.lease_s + 5:
                self._fail("a node reported a failed commit round but no node was lost; "
                           "stopped the run (see events.jsonl)")
            if now - self.last_news > stall_s:
                self._fail(f"no worker reported progress for {stall_s:.0f} s; stopped the run "
                           f"(raise --comm-timeout if steps are that slow)")

    def _check_leases(self) -> None:
        now = time.monotonic()
        for w in self.workers.values():
            if w.exited or w.done or w.fenced:
                continue
            silent = now - self.beats[w.rank]
            if silent > self.cfg.lease_s and w.process.is_alive():
                w.fenced = True
                self.events.write("fenced", node=w.name, silent_s=round(silent, 2))
                self.display.message(f"node {w.name} stopped answering for {silent:.1f} s; "
                                     f"fenced with SIGKILL")
                w.process.kill()

    def _drain(self, w: _Worker) -> bool:
        """Handle every message waiting on `w`'s pipe; True when it reported a lost peer."""
        peer_lost = False
        try:
            while w.conn.poll():
                peer_lost |= self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass
        return peer_lost

    def _handle(self, w: _Worker, msg: dict) -> bool:
        kind = msg["kind"]
        if kind == "phase_a_done":
            self._on_phase_a(msg)
        elif kind == "round_done":
            self._on_round(msg)
        elif kind == "step":
            self._on_step_report(msg)
        elif kind == "params":
            for layer_index, tensors in msg["layers"]:
                self.params[layer_index] = tensors
        elif kind == "done":
            w.done = True
            active = set(self.roles.active_ranks())
            if all(x.done for x in self.workers.values() if x.rank in active):
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
        if self.debug:
            print(msg["traceback"], file=sys.stderr, flush=True)
        return f"worker {w.name} ({self._where(w.rank)}) failed in step {msg['step']}: {msg['error']}"

    def _where(self, rank: int) -> str:
        d = self.roles.pipeline_of(rank)
        stages = self.roles.stages_of(rank)
        if d is None or not stages:
            return "standby"
        return f"pipeline {d}, stage{'s' if len(stages) > 1 else ''} " + \
            " and ".join(map(str, stages))

    # -- the step protocol ------------------------------------------------------------------

    def _set(self, key: str, value: str) -> None:
        if key not in self.written:
            self.written.add(key)
            self.store.set(key, value)

    def _live_active(self) -> set[int]:
        return set(self.roles.active_ranks())

    def _on_phase_a(self, msg: dict) -> None:
        step, epoch = msg["step"], msg["epoch"]
        if epoch < self.roles.epoch:
            self._set(f"go/{step}/{epoch}", "abort")
            return
        done = self.phase_a.setdefault((step, epoch), set())
        done.add(msg["rank"])
        if done >= self._live_active():
            self._set(f"go/{step}/{epoch}", "go")

    def _on_round(self, msg: dict) -> None:
        step, epoch = msg["step"], msg["epoch"]
        if epoch < self.roles.epoch:
            self._set(f"decide/{step}/{epoch}", "redo")
            return
        reports = self.rounds.setdefault((step, epoch), {})
        reports[msg["rank"]] = msg
        if not msg["ok"] and self.round_failed_at is None:
            self.round_failed_at = time.monotonic()
        if set(reports) >= self._live_active() and all(r["ok"] for r in reports.values()):
            self._set(f"decide/{step}/{epoch}", "commit")
            self._commit(step, reports)

    def _commit(self, step: int, reports: dict[int, dict]) -> None:
        self.round_failed_at = None
        mb_losses = sorted(x for r in reports.values() for x in r["losses"])
        loss = math.fsum(l * w for _, l, w in mb_losses)
        now = time.monotonic()
        self.pending[step] = _PendingStep(step, loss, now - self.last_commit_t, self._live_active())
        self.last_commit_t = now
        self.committed = step + 1
        self.losses.append(loss)
        self._emit_steps()

    def _on_step_report(self, msg: dict) -> None:
        pending = self.pending.get(msg["step"])
        if pending is not None:
            pending.reports[msg["rank"]] = msg
            self._emit_steps()

    def _emit_steps(self) -> None:
        """Write step_done for every committed step whose reports are all in, in order."""
        dead = set(self.roles.dead)
        while self.pending:
            first = min(self.pending)
            p = self.pending[first]
            if not (p.expected - dead) <= set(p.reports):
                return
            del self.pending[first]
            self._step_done(p)

    def _step_done(self, p: _PendingStep) -> None:
        reports = list(p.reports.values())
        record = {"step": p.step, "loss": p.loss, "wall_s": p.wall_s,
                  "grad_norm": reports[0]["grad_norm"] if reports else None,
                  "lr": reports[0]["lr"] if reports else None,
                  "attempts": max((r["attempts"] for r in reports), default=1),
                  "nodes": [self._node_timers(r) for r in sorted(reports, key=lambda r: r["rank"])]}
        self.step_records.append(record)
        self.events.write("step_done", **record)
        self._check_digests(reports, p.step)
        self._close_failures(p.step, reports)
        samples = self.cfg.global_micro_batches * self.cfg.micro_batch_size
        self.display.step(p.step, p.loss, samples / max(p.wall_s, 1e-9),
                          [1000 * r["step_s"] for r in sorted(reports, key=lambda r: r["rank"])])

    @staticmethod
    def _node_timers(r: dict) -> dict:
        keys = ("step_s", "compute_s", "frc_s", "wait_s", "reduce_s", "optim_s")
        return {"node": f"n{r['rank']}", "stages": r["stages"]} | \
            {k: round(r[k], 6) for k in keys} | \
            {k: r[k] for k in ("bytes_sent", "bytes_replica", "saved_bytes", "frc_saved_bytes",
                               "state_bytes")}

    def _check_digests(self, reports: list[dict], step: int) -> None:
        if not self.check_replicas:
            return
        primaries, replicas = {}, {}
        for r in reports:
            for name, digest in r["digests"].items():
                (replicas if name.startswith("replica") else primaries)[
                    (self.roles.pipeline_of(r["rank"]), int(name.removeprefix("replica")
                                                           .removeprefix("stage")))] = digest
        for key, digest in replicas.items():
            if key in primaries and primaries[key] != digest:
                self._fail(f"replica of stage {key[1]} in pipeline {key[0]} differs from its "
                           f"primary after step {step}")
        self.events.write("replicas_checked", step=step, replicas=len(replicas))

    # -- lost nodes -------------------------------------------------------------------------

    def _on_exit(self, w: _Worker) -> None:
        w.exited = True
        self._drain(w)
        code = w.process.exitcode
        if w.done and code == 0:
            return
        if code is not None and code < 0:
            self._on_lost(w, signal.Signals(-code).name)
            return
        if not w.done:
            self._fail(f"worker {w.name} ({self._where(w.rank)}) exited with code {code} "
                       f"before finishing (see events.jsonl)")

    def _on_lost(self, w: _Worker, signame: str) -> None:
        w.lost = True
        step = self.committed
        phase = PHASES[self.progress[2 * w.rank + 1]] if self.progress[2 * w.rank] == step \
            else "between steps"
        where = self._where(w.rank)
        if self.roles.pipeline_of(w.rank) is None:
            self.standby_losses += 1
            self.events.write("node_lost", node=w.name, step=step, phase="standby",
                              handled_as="standby", signal=signame)
            return
        if not self.rc:
            self.events.write("node_lost", node=w.name, step=step, phase=phase,
                              handled_as="stopped", signal=signame)
            why = ("--redundancy off keeps no copy of its stage" if self.cfg.redundancy == "off"
                   else "a one-stage pipeline keeps no replica")
            self._fail(f"node {w.name} ({where}) was lost in step {step} ({signame}); {why}, so "
                       f"the run stops here", exit_code=3)
        try:
            plan = plan_failover(self.roles, w.rank)
        except Unrecoverable as e:
            self.events.write("node_lost", node=w.name, step=step, phase=phase,
                              handled_as="stopped", signal=signame, error=str(e))
            self._fail(f"node {w.name} ({where}) was lost in step {step} ({signame}); {e}",
                       exit_code=3)
        old_epoch = self.roles.epoch
        self.roles = plan.roles
        self.store.set(f"epoch/{self.roles.epoch}", self.roles.to_json())
        self._set(f"go/{step}/{old_epoch}", "abort")
        self._set(f"decide/{step}/{old_epoch}", "redo")
        self.round_failed_at = None
        shadow = plan.takeovers[0].new_holder if plan.takeovers else None
        failure = _Failure(node=w.name, rank=w.rank, step=step, phase=phase,
                           handled_as=plan.handled_as, shadow=f"n{shadow}" if shadow is not None
                           else None, t=time.monotonic() - self.t0, signal=signame)
        self.failures.append(failure)
        self.events.write("fault_detected", node=w.name, step=step, phase=phase, signal=signame,
                          handled_as=plan.handled_as, shadow=failure.shadow,
                          roles=self.roles.holders)
        self.display.message(f"node {w.name} ({where}) lost in step {step} during {phase}; "
                             f"{plan.handled_as.replace('_', ' ')} by {failure.shadow}")
        self._emit_steps()
        # A role change also completes a go/commit that only the lost node was missing.
        for (s, e), done in list(self.phase_a.items()):
            if e == self.roles.epoch and done >= self._live_active():
                self._set(f"go/{s}/{e}", "go")

    def _close_failures(self, step: int, reports: list[dict]) -> None:
        here = [f for f in self.failures if f.step == step and not f.counts]
        if not here:
            return
        totals = {k: sum(r[k] for r in reports) for k in ("frc_reused", "brc", "resent_grads")}
        extra = max(0.0, self.step_records[-1]["wall_s"] - self._median_clean_step())
        for f in here:
            f.counts = totals
            f.pause_s = extra / len(here)
            self.events.write("node_lost", node=f.node, step=f.step, phase=f.phase,
                              handled_as=f.handled_as, shadow=f.shadow, signal=f.signal,
                              pause_s=round(f.pause_s, 4), **totals)

    def _median_clean_step(self) -> float:
        failed = {f.step for f in self.failures}
        clean = [r["wall_s"] for r in self.step_records[1:] if r["step"] not in failed]
        return statistics.median(clean) if clean else 0.0

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
        for layer_index in sorted(self.params):
            out += [(f"layers.{layer_index}.{n}", t) for n, t in self.params[layer_index]]
        return out

    def _save_model(self) -> None:
        params = self._ordered_params()
        if params:
            buffer = io.BytesIO()
            torch.save(dict(params), buffer)
            write_atomic(self.rundir.path / "model.pt", buffer.getvalue())

    def _summary(self, *, status: str, error: str | None) -> dict[str, Any]:
        params = self._ordered_params()
        l2 = math.sqrt(math.fsum(float(t.double().square().sum()) for _, t in params))
        sha = hashlib.sha256()
        for _, t in params:
            sha.update(t.contiguous().numpy().tobytes())
        steps = len(self.losses)
        samples = steps * self.cfg.global_micro_batches * self.cfg.micro_batch_size
        wall = time.monotonic() - self.t0
        kinds = [f.handled_as for f in self.failures]
        step_walls = [r["wall_s"] for r in self.step_records[1:]]
        return {
            "status": status, "error": error,
            "steps_completed": steps, "samples": samples, "losses": self.losses,
            "param_l2": l2 if params else None,
            "param_sha256": sha.hexdigest() if params else None,
            "preemptions": len(self.failures) + self.standby_losses,
            "failovers": kinds.count("failover"), "drains": 0,
            "peer_restores": kinds.count("peer_restore"), "checkpoint_restores": 0,
            "standby_losses": self.standby_losses, "reconfigurations": 0,
            "redone_steps": 0, "pause_s": [round(f.pause_s, 4) for f in self.failures],
            "wall_s": wall, "throughput": samples / wall if wall > 0 else 0.0,
            "median_step_s": statistics.median(step_walls) if step_walls else None,
            "config": self.cfg.summary_fields(),
        }


def run_local(cfg: JobConfig, run: RunDir, display: ProgressDisplay,
              extra_faults: dict[int, list[Fault]] | None = None,
              debug: bool = False, check_replicas: bool = False) -> dict[str, Any]:
    """Train `cfg` on a local cluster; the summary, or RunFailed."""
    return LocalCluster(cfg, run, display, extra_faults, debug, check_replicas).run()
