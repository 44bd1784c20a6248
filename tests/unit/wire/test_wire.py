"""The agent <-> coordinator wire: JSON frames decoded only into registered messages, and
a token handshake that neither garbage nor a wrong token gets through."""
from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from bamboo.config import JobConfig, parse_kill
from bamboo.plan.faults import Fault
from bamboo.protocol.agent_wire import register_wire_types
from bamboo.protocol.frames import (
    Channel,
    Refusal,
    WireError,
    client_handshake,
    decode,
    encode,
    serve_handshake,
    to_bytes,
)
from bamboo.protocol.launch import WorkerSpec
from bamboo.protocol.messages import (
    Beat,
    FromWorker,
    Job,
    KillOrder,
    RoundDone,
    StepReport,
    WorkerError,
)

register_wire_types()


def _pair() -> tuple[Channel, Channel]:
    a, b = socket.socketpair()
    return Channel(a, io_timeout=5), Channel(b, io_timeout=5)


def test_messages_round_trip_as_json() -> None:
    cfg = JobConfig.of(nodes=4, stages=2, kills=[parse_kill("0:1@3+notice")])
    spec = WorkerSpec(node=3, slot=1, first_gen=0, store_host="10.0.0.1", store_port=29401,
                      config=cfg, faults=(Fault("kill", 3, pipeline=0, stage=1),))
    report = StepReport(step=2, rank=1, stages=[1], losses=[(0, 1.5, 0.25)],
                        digests={"1": "ab"})
    for msg in (Job(worker=0, spec=spec, etcd=None, lease_s=3.0), KillOrder(worker=2),
                Beat(slots=[[0, 0.1, 4, 1]]), FromWorker(worker=1, msg=report),
                FromWorker(worker=0, msg=RoundDone(rank=0, step=1, epoch=2, ok=True,
                                                   losses=[(1, 2.0, 0.5)])),
                WorkerError(rank=0, step=1, error="x", traceback="t", peer_lost=False)):
        a, b = _pair()
        a.send(msg)
        back = b.recv(timeout=5)
        assert type(back) is type(msg)
        assert encode(back) == encode(msg)
    a, b = _pair()
    a.send(Job(worker=0, spec=spec))
    got = b.recv(timeout=5).spec
    assert got.config.cluster.kills == cfg.cluster.kills and list(got.faults) == list(spec.faults)


def test_nothing_but_registered_plain_data_travels() -> None:
    with pytest.raises(TypeError, match="Tensor"):
        to_bytes(FromWorker(worker=0, msg=torch.zeros(2)))
    with pytest.raises(TypeError, match="string keys"):
        to_bytes({1: "x"})
    with pytest.raises(WireError, match="unknown message type"):
        decode({"__type__": "os.system", "command": "true"})
    with pytest.raises(WireError, match="malformed KillOrder"):
        decode({"__type__": "KillOrder", "nope": 1})


@pytest.mark.parametrize("garbage", [b"\xff" * 64, struct.pack(">I", 0xFFFFFFF0),
                                     struct.pack(">I", 5) + b"{{{{{"])
def test_garbage_frames_are_wire_errors(garbage: bytes) -> None:
    a, b = _pair()
    a.sock.sendall(garbage)
    with pytest.raises(WireError):
        b.recv(timeout=5)


def _handshake(server_token: str, client_token: str) -> tuple[object, object]:
    a, b = _pair()
    result: dict[str, object] = {}

    def serve() -> None:
        try:
            result["server"] = serve_handshake(a, server_token, timeout=5)
        except Exception as e:  # noqa: BLE001 (handed to the test's thread to assert on)
            result["server"] = e

    t = threading.Thread(target=serve)
    t.start()
    try:
        client_handshake(b, client_token, {"pid": 1, "host": "h"}, timeout=5)
        result["client"] = "ok"
    except Exception as e:  # noqa: BLE001 (handed to the test's thread to assert on)
        result["client"] = e
    t.join(10)
    return result["server"], result["client"]


def test_the_handshake_admits_the_token_and_refuses_any_other() -> None:
    server, client = _handshake("s" * 32, "s" * 32)
    assert server == {"pid": 1, "host": "h"} and client == "ok"
    server, client = _handshake("s" * 32, "t" * 32)
    assert isinstance(server, Refusal) and isinstance(client, Refusal)
    assert "wrong join token" in str(client)


def test_a_silent_client_times_out_of_the_handshake() -> None:
    a, _b = _pair()
    with pytest.raises(TimeoutError):
        serve_handshake(a, "s" * 32, timeout=0.3)


def test_a_channel_that_ends_sending_still_reads_and_its_peer_reads_the_last_message() -> None:
    """`end_sending` (how a finished run lets an agent go): the peer reads the last message,
    then the end; what the peer still sends is read, not left to reset the connection."""
    coordinator, agent = _pair()
    coordinator.send(KillOrder(worker=1))
    coordinator.end_sending()
    with pytest.raises(OSError, match="channel closed"):
        coordinator.send(KillOrder(worker=2))
    agent.send(Beat(slots=[[0, 0.1, 4, 1]]))  # a beat already on its way
    assert isinstance(agent.recv(timeout=5), KillOrder)
    with pytest.raises(EOFError):
        agent.recv(timeout=5)
    assert isinstance(coordinator.recv(timeout=5), Beat)
    agent.close()
    with pytest.raises(EOFError):
        coordinator.recv(timeout=5)
    coordinator.close()
