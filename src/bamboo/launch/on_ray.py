"""Nodes as Ray actors: `bamboo train --ray ADDRESS`, `bamboo.Job(..., ray=ADDRESS)`.

The coordinator is the Ray driver. Each Bamboo node lives in one Ray actor
(`bamboo.node.ray_actor.NodeActor`) that runs `bamboo agent` beside it, joined to this
coordinator's listener with a token made for the run; from there a node on Ray is an agent's
worker (`bamboo.launch.agents.Agents`, which this launcher wraps): the same worker, wire and
invariant as everywhere. The launcher keeps --max-nodes actors asked of Ray (default --nodes;
one waiting for room is placed when a Ray node with room appears, by `ray start` or the
autoscaler), and turns what Ray reports into Bamboo's events, polled every second:

- a Ray node reported dead: its nodes are fenced (`expired`), a second source beside the
  agent's connection, which ends as soon as the machine's processes die;
- a Ray node draining (`ray drain-node`, the autoscaler's preemption of a spot node): a
  preemption notice to its nodes, which drain at the next step boundary;
- an actor that ended (its node lost, its agent drained) is replaced by a new ask.

Every node event names its Ray node (`ray_node_id`). At the end (completed, failed,
interrupted) every actor of the run is killed; a driver killed outright takes its actors
along (Ray ends the actors a dead driver owns) and each agent ends with its actor.
"""
from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from bamboo.config import JobConfig
from bamboo.launch.agent_link import AgentListener
from bamboo.launch.agents import Agents
from bamboo.node.output import LOG_DIR
from bamboo.node.ray_actor import NodeActor, probe_run_dir, ray_node_of
from bamboo.protocol.launch import LaunchError, Offer, Started, StoreAddress, WorkerSpec
from bamboo.protocol.messages import NoticeOrder, Progress

__all__ = ["RayNodes", "import_ray", "RAY_EXTRA"]

log = logging.getLogger(__name__)

RAY_EXTRA = "pip install 'bamboo-train[ray]'"
_POLL_S = 1.0
_CONNECT_S = 10.0
"""How long the driver waits for the cluster's head to accept a connection."""
_PROBE_S = 30.0
_REJOIN_S = 10.0


def import_ray(flag: str) -> Any:
    """The `ray` module, or LaunchError naming the extra to install (`flag`: how the caller
    asked for Ray, `--ray` or `ray=`)."""
    try:
        import ray
    except ImportError:
        raise LaunchError(f"{flag} needs Ray, which is not installed here: {RAY_EXTRA}") from None
    return ray


def _connect(ray: Any, address: str, working_dir: str | None) -> bool:
    """ray.init at `address` (True: this call connected, so `close` disconnects); LaunchError
    with one line when no cluster is there."""
    if ray.is_initialized():
        return False  # the caller's own session (a script that called ray.init)
    where = "RAY_ADDRESS or a head started on this machine" if address == "auto" else address
    _reachable(address, where)
    runtime_env = {"working_dir": working_dir} if working_dir else None
    try:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False,
                 logging_level=logging.ERROR, configure_logging=False)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LaunchError(f"no Ray cluster answers at {where} ({first}): start one (ray start "
                          f"--head) or give --ray the head's HOST:PORT") from None
    return True


def _reachable(address: str, where: str) -> None:
    """LaunchError unless the cluster's head (its GCS port) accepts a connection within
    _CONNECT_S: ray.init itself retries an address where nothing listens for ever."""
    from ray._private import services  # how ray.init itself resolves "auto" and localhost
    try:
        resolved = services.canonicalize_bootstrap_address_or_die(address)
        host, port = services.extract_ip_port(resolved)
    except (ConnectionError, ValueError) as e:
        first = str(e).strip().splitlines()[0]
        raise LaunchError(f"no Ray cluster at {where} ({first}): start one (ray start --head) "
                          f"or give --ray the head's HOST:PORT") from None
    try:
        socket.create_connection((host, port), timeout=_CONNECT_S).close()
    except OSError as e:
        raise LaunchError(f"no Ray cluster at {where}: {host}:{port} "
                          f"{e.strerror or 'does not answer'}: start one (ray start --head) "
                          f"or give --ray the head's HOST:PORT") from None


class RayNodes:
    """Bamboo nodes as Ray actors (see the module docstring); `open` makes one."""

    on_demand = False

    def __init__(self, ray: Any, agents: Agents, *, target: int, ask: dict[str, float],
                 token: str, log_dir: Path, owns_session: bool) -> None:
        self.ray, self.agents, self.target, self.ask = ray, agents, target, ask
        self.token, self.log_dir, self.owns_session = token, log_dir, owns_session
        self.actors: dict[Any, Any] = {}
        """Each live actor's `serve` call -> the actor."""
        self.placed: dict[str, tuple[str, Any]] = {}
        """Node name -> (its Ray node id, its process), for deaths and drains."""
        self._asked = 0
        self._expired: list[tuple[str, str]] = []
        self._noticed: set[str] = set()
        self._dead: set[str] = set()
        self._last_poll = 0.0
        self._closed = False

    @classmethod
    def open(cls, cfg: JobConfig, run_path: Path, flag: str = "--ray") -> RayNodes:
        """Connect to the cluster, check the run directory on its nodes, open the way in for
        the actors' agents and ask Ray for the first nodes; LaunchError (one line)."""
        ray = import_ray(flag)
        section = cfg.ray
        assert section.address is not None, "a run on Ray has an address"
        owns = _connect(ray, section.address, section.working_dir)
        made = not run_path.exists()
        try:
            run_path.mkdir(parents=True, exist_ok=True)
            ask = section.resource_ask or _default_ask(ray)
            _check_run_dir(ray, run_path.resolve(), flag)
            host = ray.util.get_node_ip_address()
            token = secrets.token_hex(16)
            try:
                listener = AgentListener((host, 0), token, advertise=host,
                                         join_timeout_s=section.wait_s)
            except OSError as e:
                raise LaunchError(f"cannot listen on {host} for the Ray actors "
                                  f"({e.strerror or e})") from None
            nodes = cls(ray, Agents(listener), target=cfg.node_cap, ask=ask, token=token,
                        log_dir=run_path.resolve() / LOG_DIR, owns_session=owns)
            nodes._fill()
            return nodes
        except BaseException:
            if made and run_path.is_dir() and not any(run_path.iterdir()):
                run_path.rmdir()  # a run that never started leaves nothing behind
            if owns:
                ray.shutdown()
            raise

    # -- the Launcher interface ---------------------------------------------------------------

    def store_address(self) -> StoreAddress:
        return self.agents.store_address()

    def start(self, spec: WorkerSpec, heartbeats: Progress, offer: Offer | None = None
              ) -> Started:
        started = self.agents.start(spec, heartbeats, offer)
        node_id = ray_node_of(started.machine)
        self.placed[spec.name] = (node_id or "?", started.process)
        # Its machine is its Ray node (each actor's agent names itself apart): nodes that Ray
        # put on one machine are lost together, so the planner keeps a stage's replica off it.
        return dataclasses.replace(started, machine=node_id or started.machine,
                                   labels={"ray_node_id": node_id or "?"})

    def offers(self, timeout_s: float = 0.0) -> list[Offer]:
        self._poll()
        return self.agents.offers(timeout_s)

    def decline(self, offer: Offer, why: str) -> str | None:
        return self.agents.decline(offer, why)

    def expired(self) -> list[tuple[str, str]]:
        self._poll()
        out, self._expired = self._expired, []
        return out

    def broken(self, exit_code: int | None = None) -> str | None:
        return None

    def waiting(self, count: int) -> str | None:
        return (f"asking Ray for {self.target} node(s) of {_shown(self.ask)} "
                f"(the run starts with {count})")

    def progress(self, started: int, count: int) -> str:
        return f"  {started}/{count} nodes placed by Ray ({self._room()})"

    def gave_up(self, started: int, count: int) -> str:
        return (f"Ray placed {started}/{count} nodes within --ray-wait-s "
                f"{self.patience_s():g} s: each asks {_shown(self.ask)} and {self._room()}: "
                f"add Ray nodes, ask less with --ray-resources, or lower --nodes")

    def patience_s(self) -> float:
        return self.agents.patience_s()

    def awaited(self) -> str:
        return f"Ray to place a node of {_shown(self.ask)} ({self._room()})"

    def close(self, final_status: str | None) -> None:
        """Let the agents go (a finished run tells them), then kill every actor of the run
        and, when this launcher connected, disconnect."""
        if self._closed:
            return
        self._closed = True
        try:
            self.agents.close(final_status)
        finally:
            for actor in self.actors.values():
                try:
                    self.ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - an actor already gone is what we want
                    pass
            self.actors.clear()
            if self.owns_session:
                self.ray.shutdown()

    # -- what Ray says ------------------------------------------------------------------------

    def _fill(self) -> None:
        """Ask Ray for actors until --max-nodes are asked (placed or waiting for room)."""
        ask = dict(self.ask)
        options: dict[str, Any] = dict(num_cpus=ask.pop("CPU", 0.0),
                                       num_gpus=ask.pop("GPU", 0.0),
                                       max_restarts=0, max_concurrency=4,
                                       scheduling_strategy="SPREAD")
        if "memory" in ask:
            options["memory"] = ask.pop("memory")
        if ask:
            options["resources"] = ask
        remote = self.ray.remote(NodeActor).options(**options)
        host, port = self.agents.listener.address
        while len(self.actors) < self.target:
            actor = remote.remote(f"{host}:{port}", self.token, self._asked, str(self.log_dir),
                                  _REJOIN_S)
            self._asked += 1
            self.actors[actor.serve.remote()] = actor

    def _poll(self) -> None:
        """At most once a second: actors that ended, Ray nodes dead or draining."""
        now = time.monotonic()
        if self._closed or now - self._last_poll < _POLL_S:
            return
        self._last_poll = now
        ray = self.ray
        ended, _ = ray.wait(list(self.actors), num_returns=len(self.actors), timeout=0)
        for ref in ended:
            actor = self.actors.pop(ref)
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        try:
            nodes = ray.nodes()
            draining = _draining(ray)
        except Exception as e:  # noqa: BLE001 - the GCS unreachable for a moment: next poll
            log.warning("cannot read the Ray cluster's state (%s); asking again in a second", e)
            return
        dead = {n["NodeID"] for n in nodes if not n.get("Alive", False)}
        for name, (node_id, process) in self.placed.items():
            if node_id in dead and name not in self._dead:
                self._dead.add(name)
                if process.is_alive():
                    self._expired.append((name, f"its Ray node {node_id[:12]} died"))
            elif node_id in draining and name not in self._noticed and process.is_alive():
                self._noticed.add(name)
                left = draining[node_id]
                when = f", {left:.0f} s left" if left is not None else ""
                self.agents_notice(process, f"ray drain{when}")
        self._fill()

    def agents_notice(self, process: Any, source: str) -> None:
        """A preemption notice to an agent's worker, naming where it came from."""
        process.agent.send(NoticeOrder(worker=process.index, source=source))

    def _room(self) -> str:
        """The cluster's live nodes and what they have of what a node asks (total, free)."""
        try:
            total, free = self.ray.cluster_resources(), self.ray.available_resources()
            alive = sum(1 for n in self.ray.nodes() if n.get("Alive"))
        except Exception:  # noqa: BLE001 - said as unknown; the wait goes on
            return "the cluster's resources unknown"
        have = ", ".join(f"{k} {total.get(k, 0):g} ({free.get(k, 0):g} free)" for k in self.ask)
        return f"the cluster has {alive} live node(s) with {have}"


def _shown(ask: dict[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in ask.items())


def _default_ask(ray: Any) -> dict[str, float]:
    """One GPU per node where the cluster has GPUs, else one CPU."""
    return {"GPU": 1.0} if ray.cluster_resources().get("GPU", 0) > 0 else {"CPU": 1.0}


def _draining(ray: Any) -> dict[str, float | None]:
    """Ray node id -> seconds left before it goes (None: no deadline), for every node Ray
    drains (`ray drain-node`, the autoscaler's preemptions)."""
    from ray._private import state  # the GCS's draining table; no public reader yet
    now_ms = time.time() * 1000
    return {node: (max(0.0, (deadline - now_ms) / 1000) if deadline else None)
            for node, deadline in state.state.get_draining_nodes().items()}


def _check_run_dir(ray: Any, run_dir: Path, flag: str) -> None:
    """LaunchError when a live Ray node cannot write the run directory (every node must: the
    checkpoints and the workers' logs go there)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    probe = ray.remote(num_cpus=0)(probe_run_dir)
    alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources")]
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                          ).remote(str(run_dir)) for node in alive]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=_PROBE_S)
    answers = []
    for ref in done:
        try:
            answers.append(ray.get(ref))
        except Exception:  # noqa: BLE001 - a node that died meanwhile (or cannot run a task) holds no node
            continue
    if refs and not answers:
        raise LaunchError(f"no Ray node ran the check of the run directory within {_PROBE_S:g} "
                          f"s: is the cluster up (ray status)?")
    for node, host, wrong in answers:
        if wrong is not None:
            raise LaunchError(f"the run directory must be one every Ray node can write (a "
                              f"path all nodes mount): on Ray node {node[:12]} ({host}) "
                              f"{wrong}; give {'--out' if flag == '--ray' else 'out='} such "
                              f"a path")
