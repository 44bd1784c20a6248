"""A worker process: one node of the cluster, playing one spot instance.

A worker lives through *generations* (`bamboo.plan.planner`): it waits for the plan of the
next generation it belongs to, joins that generation's process group, gets the state
of the layers it lacks from the live nodes that hold them (or from a checkpoint when
no live copy exists), and runs the engine step after step until the coordinator ends
the generation at a step boundary (a join, a drain, a new layout) or abandons it
mid-step (a loss no copy covers in flight). A node that is not in a plan waits as a
standby; a draining node sends the state it is asked for, then leaves.

It reports to the coordinator over its own pipe (a worker killed mid-write corrupts
only its own channel). A background thread stamps a shared heartbeat slot, so a
frozen process (no thread runs) is noticed by its lease. SIGTERM is a preemption
notice: it is reported, and the coordinator drains the node at the next step boundary.
Any exception is reported with its traceback before the process exits; the process
also dies with its parent (the fork server, which dies with the coordinator or agent that
started it: `bamboo.node.forkserver`), so no worker outlives the run.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint

from bamboo.data.sizing import SIZING
from bamboo.data.user import job_task
from bamboo.engine import replica_steps
from bamboo.engine.comm import (
    P2P,
    RESTORE,
    GroupFormer,
    Interrupted,
    PeerLost,
    bury,
    form_interruptibly,
)
from bamboo.engine.engine import (
    Assignment,
    EngineOptions,
    GenerationEnded,
    NodeEngine,
    Observers,
    Placement,
)
from bamboo.engine.stage import StageState, build_stage
from bamboo.node import forkserver, output, procmem
from bamboo.node.boundary import BoundaryOrders, RunOver
from bamboo.node.devices import worker_device
from bamboo.node.holdings import Holdings
from bamboo.node.netif import collective_binding
from bamboo.node.pinning import pin_this_process
from bamboo.node.storage import StorageWrites, one_line
from bamboo.plan.faults import FaultPlan
from bamboo.plan.layout import Layout
from bamboo.plan.loss_scale import LossScale
from bamboo.plan.orders import OrderKind
from bamboo.plan.planner import GenerationPlan
from bamboo.protocol.launch import WorkerSpec
from bamboo.protocol.messages import (
    SHUTDOWN_KEY,
    BoundaryFlag,
    Done,
    GenerationEnd,
    GenerationReady,
    LayerParams,
    Left,
    Notice,
    Progress,
    Ready,
    WorkerError,
    plan_key,
)
from bamboo.run.checkpoint import load_layers
from bamboo.util import logs
from bamboo.wire.link import CoordinatorLink
from bamboo.wire.store import StoreConnections

__all__ = ["worker_main", "HEARTBEAT_S"]

from bamboo.config import HEARTBEAT_S

_log = logging.getLogger(__name__)


class TransferFailed(RuntimeError):
    """A state transfer of a new generation failed (a source or destination was lost)."""


def _process_group(backend: str, store: dist.Store, rank: int, size: int,
                   timeout: timedelta, bind: tuple[str | None, str | None]) -> dist.ProcessGroup:
    """A fresh process group for one generation (never the global default group, so
    generations can follow one another in one process). gloo binds `bind`: the address
    (or the user's GLOO_SOCKET_IFNAME interface) that reaches the other nodes."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    address, interface = bind
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface)
                        if address is None else
                        dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


class WorkerNode:
    """One worker's life: generations one after another."""

    def __init__(self, spec: WorkerSpec, link: CoordinatorLink, store: dist.Store,
                 device: torch.device, backend: str, progress: Progress,
                 cpus: list[int] | None = None) -> None:
        self.spec, self.link, self.store, self.device, self.backend = spec, link, store, device, backend
        self.cpus = tuple(cpus or ())
        self.bind = collective_binding(spec.store_host, spec.store_port)
        self.progress = progress
        cfg = self.cfg = spec.config
        self.preset = cfg.model_preset(SIZING)
        self.task = job_task(cfg, self.preset)
        self.options = EngineOptions.from_config(cfg)
        self.timeout = timedelta(seconds=cfg.runtime.comm_timeout_s)
        self.holdings = Holdings()
        """What the last generation left: the state this node can give, its stages to reuse."""
        self.faults = FaultPlan(list(spec.faults))
        self.store_connections = StoreConnections(spec.store_host, spec.store_port,
                                                  self.timeout)
        """The store connections of group formations (`_former`)."""
        self.stepwise = False
        """The current generation runs a step-by-step run's orders (`BoundaryOrders`)."""
        self.boundary = BoundaryOrders(store)
        self.storage = StorageWrites(cfg, link)
        """Checkpoint parts and final layers, written on this node's writer thread."""
        self.end_step = cfg.training.steps
        """The step the run ends at: its --steps, or where a step-by-step run finished."""

    def _mark(self, step: int, phase: int) -> None:
        self.progress.mark(self.spec.slot, step, phase)

    def wait_plan(self, gen: int) -> GenerationPlan | None:
        """The plan of generation `gen`, or None when the run is over."""
        key = plan_key(gen)
        while True:  # polled: a store wait that times out logs a warning each time
            if self.store.check([key]):
                return GenerationPlan.from_json(self.store.get(key).decode())
            if self.store.check([SHUTDOWN_KEY]):
                return None
            time.sleep(0.05)

    def live(self) -> None:
        own = self.device.type != "cpu" or bool(self.cpus) or \
            self.spec.local_workers <= len(os.sched_getaffinity(0))
        self.link.report(Ready, cpus=self.cpus, own_processor=own)
        # the node's waits are idle time of its own: the replica's step takes them
        replica_steps.yield_to_the_step(own and self.options.replica_step_yields)
        gen = self.spec.first_gen
        if gen > 0 and self.store.check([plan_key(gen - 1)]):  # joining a run under way
            self._build_ahead(GenerationPlan.from_json(self.store.get(plan_key(gen - 1)).decode()))
        while True:
            plan = self.wait_plan(gen)
            if plan is None:
                self.link.report(Done)
                return
            if self.spec.name not in plan.members:
                if self.spec.name in plan.leavers:
                    self.link.report(Left, gen=plan.gen)
                    return
                self._build_ahead(plan)
                gen = plan.gen + 1  # a standby in this generation
                continue
            try:
                if self._generation(plan) == "finished":
                    return
            except RunOver:  # a step-by-step run's coordinator ended it at a boundary
                self.link.report(Done)
                return
            gen = plan.gen + 1

    def _build_ahead(self, plan: GenerationPlan) -> None:
        """At one stage, build the stage a standby will hold (`Holdings.spare`), unless it
        holds one already (a member turned standby: the model twice on its device)."""
        if plan.stages == 1 and self.holdings.spare is None and not self.holdings.kept \
                and not self.holdings.packed:
            self.holdings.spare = build_stage(self.preset, self.options, plan.layer_ranges(),
                                              self.device, 0)

    # -- one generation ---------------------------------------------------------------------

    def _generation(self, plan: GenerationPlan) -> str:
        rank = plan.members.index(self.spec.name)
        self.link.rank = rank
        self.faults.forget(plan.fired_kills)
        if self.holdings.step != plan.start_step or plan.fresh_start:
            self.holdings.clear()  # a standby's old state: never current
        try:
            group = self.join_group(plan, rank)
        except TransferFailed as e:
            return self._failed(plan, e)
        if rank >= plan.active:  # leaving: only a source of state
            try:
                self._transfer(plan, rank, group, {})
            except TransferFailed:
                pass
            self.link.report(Left, gen=plan.gen)
            return "finished"
        engine, reused = self._engine(plan, rank, group)
        try:
            loaded = self._load_state(plan, rank, group, [
                st for st in engine.held() if all(st is not r for r in reused)])
        except TransferFailed as e:
            self._retire(engine)
            return self._failed(plan, e)
        self.holdings.clear()  # in the engine now; taken again at its end
        self.link.report(GenerationReady, gen=plan.gen, stages=sorted(engine.stages),
                         replica=engine.replica.stage if engine.replica is not None else None,
                         **loaded)
        done_step, finished = self._steps(engine, plan.start_step)
        if finished:
            # The first live holder of each stage writes its final layers to storage (after
            # any checkpoint write still going); the coordinator reads them back.
            layers, error = self.storage.final(engine, self.end_step)
            self.link.report(LayerParams, layers=layers, error=error)
            self.link.report(Done)
            if self.storage.serve_final_requests(engine, self.end_step, self.store,
                                                 self.spec.name):
                return "finished"  # the run shut down
            # abandoned after the last step: this node's state goes into the next generation
        engine.p2p.close()
        primaries = {s: st for s, st in engine.stages.items()  # not a takeover still under way
                     if s in engine.roles.stages_of(rank)}
        self.holdings.take(engine.held(), primaries, done_step)
        sizes = self.holdings.sizes()
        self.link.report(GenerationEnd, gen=plan.gen, layers=list(sizes), step=done_step,
                         layer_bytes=list(sizes.values()))
        self._retire(engine)
        return "next"

    def _engine(self, plan: GenerationPlan, rank: int, group: dist.ProcessGroup
                ) -> tuple[NodeEngine, list[StageState]]:
        """The generation's engine at `rank`, and the stages it took as this node held them
        (`Holdings.reusable`: the rest is built, or taken as built ahead, and loaded by
        `_load_state`)."""
        parts, roles = plan.layer_ranges(), plan.roles()
        own = {s: parts[s] for s in roles.stages_of(rank)}
        reused = {} if plan.checkpoint is not None else self.holdings.reusable(
            own, {layer for layer, _, dst in plan.transfers if dst == rank})
        built = {s: st for s in own if s not in reused
                 and (st := self.holdings.built(s, own[s])) is not None}
        self.holdings.spare = None  # a member now: one built for another layout is not needed
        layout = Layout(nodes=len(plan.members) + len(plan.holes), pipelines=plan.pipelines,
                        stages=plan.stages, global_micro_batches=self.cfg.global_micro_batches)
        engine = NodeEngine(
            model=self.preset, options=self.options,
            runs=Assignment(rank=rank, layout=layout, parts=parts, roles=roles,
                            redundancy=plan.redundancy),
            place=Placement(task=self.task, device=self.device, link=self.link, group=group,
                            former=self._former(plan, rank)),
            observers=Observers(hook=self.faults, progress=self._mark,
                                memory=self._sample_memory),
            kept={**built, **reused})
        engine.lr_scale, self.stepwise = plan.lr_scale, plan.stepwise
        engine.loss_scale = LossScale.from_json(plan.loss_scale)
        return engine, list(reused.values())

    def _retire(self, engine: NodeEngine) -> None:
        """The generation is over here: its engine, with the process groups it holds, is
        dropped off this thread (`bury`: a group may hold bytes a peer sent that will never
        be read, or a collective still blocked). The engine sits in cycles of its own (its
        dispatch table, its transport and buckets), which a full collection would take
        tenths of a second of every worker to find: emptying it breaks them, and its parts
        go by their reference counts."""
        self.faults.detach()
        parts = dict(vars(engine))
        vars(engine).clear()
        bury(parts)

    def _steps(self, engine: NodeEngine, start: int) -> tuple[int, bool]:
        """The generation's steps from `start`, each after its held-out pass when one is
        due, until the run's last step, a reconfiguration or an abandoned generation:
        (the first step not done, whether the run's steps are all done)."""
        cfg = self.cfg
        done_step = start
        for step in range(start, cfg.training.steps + 1):
            try:
                if cfg.evaluates_at(step):  # the parameters after `step` steps
                    engine.evaluate(step, cfg.evaluation.batches)
                if self.stepwise and self._carry_out_orders(engine, step) is OrderKind.FINISH:
                    self.end_step = step
                    return done_step, True
                if step == cfg.training.steps:
                    return done_step, True
                report = engine.run_step(step)
            except GenerationEnded:
                break
            done_step = step + 1
            self.link.send(report)
            if BoundaryFlag.CHECKPOINT in engine.flags:
                self.storage.checkpoint_part(engine, step + 1)
            if BoundaryFlag.RECONFIGURE in engine.flags:
                break
        return done_step, False

    def _carry_out_orders(self, engine: NodeEngine, step: int) -> OrderKind:
        """A step-by-step run: the orders of the boundary after `step` steps, in turn
        (bamboo.plan.orders); the kind of the one that closes it, STEP (its learning-rate
        scale set on the engine) or FINISH."""
        for order in self.boundary.orders(step):
            match order.kind:
                case OrderKind.EVAL:
                    engine.evaluate(step, self.cfg.evaluation.batches)
                case OrderKind.SAVE:
                    self.storage.checkpoint_part(engine, step)
                case OrderKind.CATCH_UP:
                    engine.catch_up(step)
                case OrderKind.STEP:
                    engine.lr_scale = order.lr_scale
        return order.kind

    def _sample_memory(self) -> procmem.MemorySample:
        """The process's real memory at the end of a step (the engine's report carries it)."""
        return procmem.sample(self.device if self.device.type == "cuda" else None)

    def join_group(self, plan: GenerationPlan, rank: int) -> dist.ProcessGroup:
        """The generation's process group. Building it waits for every member, so it is
        built on a helper thread and given up when the coordinator abandons the generation
        (a member was lost before it connected).

        The group gets a store connection no other call is using: an abandoned formation
        keeps waiting in the store until its timeout, and on a shared connection that wait
        would hold up this node's every later store call (its next plan, its votes) for as
        long. A formation that ended hands its connection on (`_former`)."""
        try:
            return form_interruptibly(self._former(plan, rank), "all",
                                      range(len(plan.members)),
                                      lambda: self.link.latest_epoch > plan.epoch)
        except Interrupted:
            raise TransferFailed(f"generation {plan.gen} was abandoned while its process "
                                  f"group formed") from None
        except PeerLost as e:
            raise TransferFailed(f"process group of generation {plan.gen} failed: "
                                  f"{e}") from None

    def _former(self, plan: GenerationPlan, rank: int) -> GroupFormer:
        """Forms a process group of generation `plan.gen` among some of its ranks (the
        generation's own, and under strict communication the survivors' group after a loss,
        the gradient lane, a data-parallel group), each on a store connection no other call
        is using. A formation that ended leaves its connection to the next one; an abandoned
        or failed one keeps its own."""
        def form(name: str, ranks: list[int]) -> dist.ProcessGroup:
            own = self.store_connections.take()
            group = _process_group(self.backend, dist.PrefixStore(f"gen{plan.gen}/{name}", own),
                                   ranks.index(rank), len(ranks), self.timeout, self.bind)
            self.store_connections.give_back(own)
            return group
        return form

    def _failed(self, plan: GenerationPlan, error: Exception) -> str:
        """The generation could not start here: report the state of the last boundary."""
        self.link.report(GenerationEnd, gen=plan.gen, layers=list(self.holdings.sizes()),
                         step=self.holdings.step, failed=str(error))
        return "next"

    def _load_state(self, plan: GenerationPlan, rank: int, group: dist.ProcessGroup,
                    held: list[StageState]) -> dict[str, Any]:
        """Load the state of `held`; where it came from, its bytes and seconds (for
        GenerationReady)."""
        start = time.perf_counter()
        if plan.checkpoint is not None:  # only the layers this node holds, from storage
            states = load_layers(plan.checkpoint, [i for st in held for i in st.layer_indices])
            for st in held:
                for i in st.layer_indices:
                    st.load_layer_state(i, states[i])
            return {"state_from": "checkpoint", "state_s": round(time.perf_counter() - start, 4),
                    "state_bytes": sum(t.numel() * t.element_size()
                                       for v in states.values() for t in v.values())}
        received = self._transfer(plan, rank, group, {i: st.layer_layout(i).nbytes
                                                      for st in held for i in st.layer_indices})
        for st in held:
            for i in st.layer_indices:
                vector = received[i] if i in received else self.holdings.layer(i)
                if vector is not None:  # else a fresh start: the layer as built from the seed
                    st.load_layer_state(i, vector)
        got = sum(v.numel() * v.element_size() for v in received.values())
        return {"state_from": "peers" if got else "", "state_bytes": got,
                "state_s": round(time.perf_counter() - start, 4) if got else 0.0}

    def _transfer(self, plan: GenerationPlan, rank: int, group: dist.ProcessGroup,
                  needed: dict[int, int]) -> dict[int, torch.Tensor]:
        """Post this node's sends and receives of the plan (`needed`: the bytes of each
        layer's packed state this node takes); wait for all of them."""
        sends, recvs, received = [], [], {}
        p2p = P2P(group, strict=self.cfg.runtime.comm == "strict", device=self.device)
        engine_wake, self.link.on_epoch = self.link.on_epoch, p2p.wake.set
        abandoned = lambda: self.link.latest_epoch > plan.epoch  # noqa: E731 (a one-line test, passed as a callable)
        try:
            # One batch in the plan's order, which every node shares (strict: no tags).
            for layer, src, dst in plan.transfers:
                key = (RESTORE, layer, dst)
                if src == rank:
                    held = self.holdings.layer(layer)
                    assert held is not None, f"layer {layer} is not held here"
                    sends.append((held.to(self.device), dst, key))
                elif dst == rank:
                    buf = torch.empty(needed[layer], dtype=torch.uint8, device=self.device)
                    recvs.append((buf, src, key))
                    received[layer] = buf
            works = p2p.exchange(sends, recvs) + [(w, dst) for w, _, dst in p2p.pending]
            for work, peer in works:
                # A peer that waits on a lost node never sends: the abandoned generation's
                # new epoch, not the communication timeout, ends the wait.
                p2p.wait_interruptible(work, peer, abandoned)
        except Interrupted as e:
            raise TransferFailed(f"generation {plan.gen} was abandoned during its state "
                                  f"transfer") from e
        except (RuntimeError, PeerLost) as e:
            raise TransferFailed(f"state transfer of generation {plan.gen} failed: "
                                  f"{str(e).splitlines()[0][:200]}") from e
        finally:
            self.link.on_epoch = engine_wake
            p2p.close()
        return {i: v for i, v in received.items() if i in needed}


def _notice_handler(link: CoordinatorLink) -> Any:
    """SIGTERM is a preemption notice (as Kubernetes and most clouds' agents deliver it)."""
    noticed = threading.Event()

    def report() -> None:
        noticed.wait()
        link.report(Notice, source="SIGTERM")

    threading.Thread(target=report, daemon=True, name="notice").start()
    return lambda signum, frame: noticed.set()


def worker_main(spec: WorkerSpec, conn: Connection, beats: Any, cells: Any,
                log: str | None = None) -> None:
    """Entry point of a worker process; its stdout and stderr go to the file `log`
    (`bamboo.node.output`)."""
    forkserver.die_with_parent()
    if not forkserver.in_server_child():
        os._exit(1)  # the fork server died before the parent-death signal was set
    why = output.to_log(log, spec.name)
    logs.worker_output()  # the library's records go with its output: to the log file
    if why is not None:
        _log.warning("%s", why, extra=logs.by(f"bamboo worker {spec.name}"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    link = None
    progress = Progress(beats, cells)
    try:
        cfg = spec.config
        torch.set_num_threads(cfg.runtime.threads)
        cpus = pin_this_process(cfg.runtime.pin_cpus, spec.device_index or 0, spec.local_workers)
        timeout = timedelta(seconds=cfg.runtime.comm_timeout_s)
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        watch = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        link = CoordinatorLink(rank=spec.node, conn=conn, store=store,
                               timeout_s=cfg.runtime.comm_timeout_s, watch_store=watch)
        signal.signal(signal.SIGTERM, _notice_handler(link))
        threading.Thread(target=link.heartbeat_forever, args=(HEARTBEAT_S, progress, spec.slot),
                         daemon=True, name="heartbeat").start()
        device, backend = worker_device(cfg, spec.node, spec.device_index)
        WorkerNode(spec, link, store, device, backend, progress, cpus).live()
        output.flush()
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 (reported to the coordinator, which decides the run's fate)
        try:
            message = WorkerError(rank=spec.node, step=progress.step_of(spec.slot),
                                  peer_lost=isinstance(e, PeerLost),
                                  error=one_line(e), traceback=traceback.format_exc())
            if link is not None:
                with link.lock:
                    conn.send(message)
            else:
                conn.send(message)
        finally:
            output.flush()
            os._exit(1)
