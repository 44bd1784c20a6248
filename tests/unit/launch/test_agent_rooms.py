"""The rooms a joined agent offers the run: a worker killed while its machine stays is a spare
room, and a spare the run declines (the loss that freed it not handled yet) is offered again,
not lost (a run once waited 90 s for a room its only agent had)."""
from __future__ import annotations

import dataclasses
import os
import socket
import time

import pytest

from bamboo.launch.agent_link import AgentListener, RemoteProcess
from bamboo.launch.agents import Agents
from bamboo.protocol.frames import Channel, client_handshake
from bamboo.protocol.messages import Exit, Hello

_TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def joined():
    """Agents over a real listener, and the channel of one agent of 2 workers that joined."""
    listener = AgentListener(("127.0.0.1", 0), _TOKEN, join_timeout_s=10)
    channel = Channel(socket.create_connection(listener.address, timeout=5), io_timeout=5)
    client_handshake(channel, _TOKEN, dataclasses.asdict(
        Hello(pid=os.getpid(), host="here", workers=2, machine="m1")), 5)
    agents = Agents(listener)
    try:
        yield agents, channel
    finally:
        channel.close()
        agents.close("finished")


def _until(what, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)
    return got


def test_a_declined_spare_is_offered_again_until_the_run_takes_it(joined) -> None:
    agents, channel = joined
    arrivals = agents.offers(timeout_s=5)
    assert [o.spare for o in arrivals] == [False, False]
    agent = arrivals[0].ticket
    for k in (0, 1):  # the run started a worker on each room
        agent.free.remove(k)
        agent.workers[k] = RemoteProcess(agent, k, slot=k)
    channel.send(Exit(worker=0, code=-9))
    spares = _until(agents.offers)
    assert [o.spare for o in spares] == [True]
    assert agents.decline(spares[0], "2 nodes already (--max-nodes 2)") is None
    again = agents.offers()
    assert [o.spare for o in again] == [True]  # the same room, not lost
    assert agents.offers() == []  # taken: offered once until declined again
    channel.send(Exit(worker=1, code=-9))
    assert [o.spare for o in _until(agents.offers)] == [True]


def test_a_worker_that_finished_frees_no_spare_and_a_gone_agent_offers_none(joined) -> None:
    agents, channel = joined
    agent = agents.offers(timeout_s=5)[0].ticket
    for k in (0, 1):
        agent.free.remove(k)
        agent.workers[k] = RemoteProcess(agent, k, slot=k)
    channel.send(Exit(worker=0, code=0))
    _until(lambda: 0 not in agent.workers)
    assert agents.offers() == []
    channel.send(Exit(worker=1, code=-9))
    spare = _until(agents.offers)
    channel.close()
    _until(lambda: agent.gone)
    assert agents.decline(spare[0], "2 nodes already (--max-nodes 2)") is None
    assert agents.offers() == []
