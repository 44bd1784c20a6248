"""The run's side of its launcher (`bamboo.protocol.launch.Launcher`): its first nodes, a
node on demand (a trace's add, a checkpoint-restart's fresh worker), and the rooms a
launcher offers while the run goes on (agents that join), which become standbys. The
command line or the Python API picks the launcher (`bamboo.launch`); nothing here knows
which one it is."""
from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Protocol

from bamboo.config import JobConfig
from bamboo.control.nodes import Node, Supervisor
from bamboo.control.preemptions import Preemptions
from bamboo.control.state import Events, RunContext, Stop
from bamboo.protocol.launch import Launcher, LaunchError, Offer, StoreAddress

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["NodeSupply", "CoordinatorCore"]

_PROGRESS_S = 2.0
"""How often the wait for the first nodes says where it stands."""


class CoordinatorCore(Protocol):
    """What the supply uses of the coordinator (`bamboo.control.core.CoordinatorCore` is the
    one): declared here so the supply need not import the core that calls it."""

    cfg: JobConfig
    ctx: RunContext
    nodes: Supervisor
    events: Events
    preemptions: Preemptions

    @property
    def committed(self) -> int:
        """Steps committed so far."""

    def spawn(self, *, first_gen: int, trace_node: int | None = None,
              owns_trace_node: bool = True) -> Node:
        """One more node from the launcher, announced with its role."""


class NodeSupply:
    """Nodes from one launcher, for one run."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.interrupted: int | None = None
        """The first of the user's signals, once one came (set by the process loop)."""

    def store_address(self) -> StoreAddress:
        return self.launcher.store_address()

    def initial(self, core: CoordinatorCore) -> None:
        """The run's first `--nodes` nodes: started at once where the launcher starts them on
        demand (each playing its trace node), else the first rooms offered within the
        launcher's patience (progress every 2 s); short of them, the run stops (exit 1)."""
        launcher = self.launcher
        if launcher.on_demand:
            replay = core.preemptions.replay
            for trace_node in (replay.initial if replay is not None
                               else [None] * core.cfg.layout.nodes):
                core.spawn(first_gen=0, trace_node=trace_node)
            return
        count, nodes = core.cfg.layout.nodes, core.nodes.nodes
        line = launcher.waiting(count)
        if line is not None:
            core.ctx.say(line)
        start = last = time.monotonic()
        while len(nodes) < count:
            signum = self.interrupted
            if signum is not None:
                raise Stop(f"interrupted by {signal.Signals(signum).name} while waiting for "
                           f"nodes", exit_code=128 + signum)
            self._admit(core, launcher.offers(timeout_s=0.2), first_gen=0,
                        room=count - len(nodes))
            now = time.monotonic()
            if now - start > launcher.patience_s():
                raise Stop(launcher.gave_up(len(nodes), count), exit_code=1)
            if now - last > _PROGRESS_S:
                last = now
                core.ctx.say(launcher.progress(len(nodes), count))

    def start_node(self, core: CoordinatorCore, first_gen: int) -> Node:
        """One more node now, where the launcher starts nodes on demand."""
        try:
            return core.nodes.admit(first_gen=first_gen)
        except LaunchError as e:
            raise Stop(str(e)) from None

    def poll(self, core: CoordinatorCore) -> None:
        """Once a tick: whether the launcher still works, and the rooms it offers now
        (standbys for the next generation)."""
        broken = self.launcher.broken()
        if broken is not None:
            raise Stop(broken)
        offers = self.launcher.offers()
        if offers:
            self._admit(core, offers, first_gen=core.ctx.plan.gen + 1)

    def none_coming(self, core: CoordinatorCore) -> bool:
        """Whether no node is coming that a waiting reconfiguration could use: nothing comes
        by itself to an on-demand launcher (only the trace adds nodes there); offers may
        come until the launcher's patience has passed since the reconfiguration began."""
        if self.launcher.on_demand:
            return True
        r = core.ctx.reconf
        return r is not None and core.ctx.clock() - r.started > self.launcher.patience_s()

    def awaited(self, core: CoordinatorCore) -> str:
        return self.launcher.awaited()

    def close(self, final_status: str | None) -> None:
        self.launcher.close(final_status)

    def _admit(self, core: CoordinatorCore, offers: Iterable[Offer], *, first_gen: int,
               room: int | None = None) -> None:
        """A node on each offered room, while --max-nodes, the run's slots and `room` allow
        and (a freed slot) steps are left; the rest declined. Each arrival is said once,
        with the nodes started on it."""
        arrivals: dict[str, list[str]] = {}
        for offer in offers:
            why = self._no_room(core, offer, room)
            if why is not None:
                refused = self.launcher.decline(offer, why)
                if refused is not None:
                    core.events.write("agent_refused", host=refused, why=why)
                continue
            n = core.nodes.admit(first_gen=first_gen, offer=offer)
            if room is not None:
                room -= 1
            if offer.arrival is not None:
                arrivals.setdefault(offer.arrival, []).append(n.name)
            # roles come with the first plan (placed across machines): `role`
            core.events.write("node_up", node=n.name, pid=n.process.pid, host=n.host,
                              machine=n.machine, worker=n.device_slot,
                              pipeline=None, stage=None, **n.labels)
        for arrival, names in arrivals.items():
            core.ctx.say(f"{arrival}: {', '.join(names)}")

    @staticmethod
    def _no_room(core: CoordinatorCore, offer: Offer, room: int | None) -> str | None:
        """Why `offer` gets no node (None: it gets one)."""
        if offer.spare and core.committed >= core.cfg.training.steps:
            return "the run has no steps left"
        alive, cap = core.nodes.alive_count(), core.cfg.node_cap
        if alive >= cap or not core.nodes.free_slots or (room is not None and room <= 0):
            return f"{alive} nodes already (--max-nodes {cap})"
        return None
