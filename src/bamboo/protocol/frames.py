"""The agent <-> coordinator wire: length-prefixed JSON frames, and a token handshake.

Nothing read from the network is unpickled. A frame is a 4-byte big-endian length and that
many bytes of UTF-8 JSON; frames over `MAX_FRAME` are refused. Messages are this
project's frozen dataclasses, encoded as `{"__type__": name, field: value, ...}` and
decoded only into the classes registered here: an unknown type, a missing field or a
non-JSON value is a `WireError`, never code execution.

The handshake proves that the agent knows the job's token without sending it: the
coordinator sends a random challenge, the agent answers HMAC-SHA256(token, challenge)
with its `Hello`, and the coordinator compares in constant time. Every step has a
deadline, so a client that connects and says nothing, or sends garbage, is dropped.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import select
import socket
import struct
import threading
from typing import Any

__all__ = ["WireError", "Refusal", "Channel", "register", "encode", "decode", "serve_handshake",
           "client_handshake", "MAX_FRAME", "WIRE_VERSION"]

WIRE_VERSION = 1
MAX_FRAME = 16 << 20
"""No control message comes near this; a larger length prefix is garbage."""
_LENGTH = struct.Struct(">I")
_TYPES: dict[str, type] = {}


class WireError(RuntimeError):
    """A frame that is not a message of this protocol; str() is one line."""


class Refusal(RuntimeError):
    """The coordinator refused this agent (wrong token, version, full job)."""


def register(*classes: type) -> None:
    """Allow these dataclasses on the wire."""
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} is not a dataclass")
        _TYPES[cls.__name__] = cls


def encode(obj: Any) -> Any:
    """`obj` as JSON data: registered dataclasses become tagged dicts, tuples lists."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [encode(x) for x in obj]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("only string keys travel on the wire")
        return {k: encode(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if _TYPES.get(name) is not type(obj):
            raise TypeError(f"{name} is not registered for the wire")
        out = {"__type__": name}
        for f in dataclasses.fields(obj):
            out[f.name] = encode(getattr(obj, f.name))
        return out
    raise TypeError(f"a {type(obj).__name__} cannot travel on the wire")


def decode(data: Any) -> Any:
    if isinstance(data, list):
        return [decode(x) for x in data]
    if isinstance(data, dict):
        name = data.get("__type__")
        if name is None:
            return {k: decode(v) for k, v in data.items()}
        cls = _TYPES.get(name)
        if cls is None:
            raise WireError(f"unknown message type {str(name)[:40]!r}")
        fields = {k: decode(v) for k, v in data.items() if k != "__type__"}
        try:
            return cls(**fields)
        except TypeError as e:
            raise WireError(f"malformed {name}: {e}") from None
    return data


def to_bytes(obj: Any) -> bytes:
    body = json.dumps(encode(obj), separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise WireError(f"a {type(obj).__name__} of {len(body)} bytes is over the frame limit")
    return _LENGTH.pack(len(body)) + body


class Channel:
    """One TCP connection carrying frames. `send` is thread-safe; `recv` is for one reader
    thread. The socket keeps one I/O timeout (`io_timeout`: a started frame, or a send to
    a peer that does not read, fails after it); waiting for the next frame is a `select`,
    so a reader and a sender never change each other's timeouts."""

    def __init__(self, sock: socket.socket, io_timeout: float = 30.0) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False
        sock.settimeout(io_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def set_io_timeout(self, seconds: float) -> None:
        """Only while no other thread uses the channel (after the handshake)."""
        self.sock.settimeout(seconds)

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def peer(self) -> str:
        try:
            return str(self.sock.getpeername()[0])
        except OSError:
            return "?"

    def send(self, obj: Any) -> None:
        """Raises OSError when the peer is gone (or does not read within the I/O timeout)."""
        data = to_bytes(obj)
        with self._send_lock:
            if self.closed:
                raise OSError("channel closed")
            self.sock.sendall(data)

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                raise EOFError("connection closed")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message. TimeoutError when none starts within `timeout` s (None: wait
        for ever); EOFError when the peer closed; WireError for garbage."""
        if timeout is not None:
            readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
            if not readable:
                raise TimeoutError("no message")
        else:
            while not select.select([self.sock], [], [], 1.0)[0]:
                if self.closed:
                    raise EOFError("channel closed")
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if length > MAX_FRAME:
            raise WireError(f"frame of {length} bytes announced: not this protocol")
        body = self._read(length)
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            raise WireError("a frame that is not JSON") from None
        return decode(data)

    def _shut(self, how: int) -> None:
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(how)
        except OSError:
            pass

    def end_sending(self) -> None:
        """No more sends: the peer reads what was sent, then the end (a FIN). Reading goes
        on: closing while the peer's messages arrive unread would reset the connection and
        drop what is still queued to send (the last message among it)."""
        self._shut(socket.SHUT_WR)

    def close(self) -> None:
        self._shut(socket.SHUT_RDWR)
        self.sock.close()


def _mac(token: str, challenge: str) -> str:
    return hmac.new(token.encode(), challenge.encode(), hashlib.sha256).hexdigest()


def serve_handshake(channel: Channel, token: str, timeout: float) -> dict[str, Any]:
    """The coordinator's side: challenge, then the agent's proof and hello (a dict). Raises
    Refusal (after telling the agent) for a wrong proof, WireError/OSError/EOFError for a
    client that does not speak the protocol."""
    challenge = secrets.token_hex(32)
    channel.send({"bamboo": WIRE_VERSION, "challenge": challenge})
    answer = channel.recv(timeout=timeout)
    if not isinstance(answer, dict) or not isinstance(answer.get("proof"), str):
        raise WireError("the first frame is not a join request")
    if answer.get("bamboo") != WIRE_VERSION:
        why = (f"this coordinator speaks join protocol {WIRE_VERSION}, the agent "
               f"{answer.get('bamboo')!r}: run the same version of bamboo on both")
        channel.send({"refused": why})
        raise Refusal(why)
    if not hmac.compare_digest(answer["proof"], _mac(token, challenge)):
        channel.send({"refused": "wrong join token"})
        raise Refusal("wrong join token")
    hello = answer.get("hello")
    if not isinstance(hello, dict):
        raise WireError("a join request without a hello")
    channel.send({"welcome": True})
    return hello


def client_handshake(channel: Channel, token: str, hello: dict[str, Any], timeout: float
                     ) -> None:
    """The agent's side. Raises Refusal with the coordinator's reason."""
    greeting = channel.recv(timeout=timeout)
    if not isinstance(greeting, dict) or "challenge" not in greeting:
        raise WireError("the peer is not a bamboo coordinator")
    channel.send({"bamboo": WIRE_VERSION, "proof": _mac(token, str(greeting["challenge"])),
                  "hello": hello})
    answer = channel.recv(timeout=timeout)
    if isinstance(answer, dict) and "refused" in answer:
        raise Refusal(str(answer["refused"]))
    if not (isinstance(answer, dict) and answer.get("welcome")):
        raise WireError("unexpected answer to the join request")
