"""Cluster membership: which nodes are alive, by leases that their heartbeats renew.

One interface, `Membership`, and its backend `EtcdMembership` (`bamboo coordinator
--etcd URL`): a real etcd (3.4+) through its v3 JSON gateway, with the standard library
only (no etcd client package): a node's key is bound to an etcd lease, so etcd itself
deletes it when heartbeats (lease keep-alives) stop; changes come from a watch. Without
--etcd there is no membership service: leases are the heartbeat arrays
(`protocol.Progress`) and the agents' relays.

The coordinator calls `host(...)` (it sets the job's join token and TTL); a node calls
`connect(...)`, then `join(node_id, info, token)`, `heartbeat(node_id)` more often than
the TTL, and `leave(node_id)`. Anyone may read `alive()` or `watch(callback)`, which
reports `joined`, `left` and `expired` events. The join token keeps nodes of another job
out by mistake; it is not a defence against someone who can write to the store.

Every failure is a `MembershipError` whose str() is one line saying what to do.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import math
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Membership", "MembershipError", "LeaseExpired", "Lease", "MembershipEvent",
           "EtcdMembership"]

log = logging.getLogger(__name__)


class MembershipError(RuntimeError):
    """The backend refused or could not be reached; str() is one line to show."""


class LeaseExpired(MembershipError):
    """A heartbeat came after the node's lease ran out: it is no longer a member."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """A node's membership, kept alive by heartbeats."""

    node_id: str
    lease_id: str
    ttl_s: float
    """The TTL the backend granted (etcd may round up what was asked)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MembershipEvent:
    """A change of membership."""

    kind: str
    """joined, left (leave() was called) or expired (heartbeats stopped)."""
    node_id: str
    info: dict = field(default_factory=dict)


Callback = Callable[[MembershipEvent], None]


def _digest(token: str) -> str:
    return hashlib.sha256(("bamboo-join:" + token).encode()).hexdigest()


def _check_token(stored: str | None, token: str, where: str) -> None:
    if stored is None:
        raise MembershipError(f"no Bamboo job at {where}: start the coordinator first")
    if not hmac.compare_digest(stored, _digest(token)):
        raise MembershipError(f"join refused by {where}: wrong join token; pass the token "
                              f"the coordinator printed (--token)")


class Membership(ABC):
    """The coordinator's view of the nodes of one job."""

    ttl_s: float

    @abstractmethod
    def join(self, node_id: str, info: dict, token: str) -> Lease:
        """Become a member; refused if the token is wrong or node_id is already alive."""

    @abstractmethod
    def heartbeat(self, node_id: str) -> None:
        """Renew the node's lease; LeaseExpired if it already ran out."""

    @abstractmethod
    def leave(self, node_id: str) -> None:
        """Stop being a member now (a `left` event, not `expired`)."""

    @abstractmethod
    def alive(self) -> dict[str, dict]:
        """node_id -> info of every node whose lease is live."""

    @abstractmethod
    def watch(self, callback: Callback) -> None:
        """Call `callback` on a background thread for every change from now on."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads and let go of the backend."""

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _call_back(callback: Callback, event: MembershipEvent) -> None:
    try:
        callback(event)
    except Exception as e:  # noqa: BLE001 - a callback bug must not end the watch
        log.error("membership callback failed on %s: %s", event, e)


# ----------------------------------------------------------------------------- etcd

def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _prefix_end(prefix: str) -> str:
    """etcd's range_end for every key that starts with `prefix`."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdMembership(Membership):
    """Membership in etcd through its v3 JSON gateway (http://HOST:2379/v3/...).

    Keys: `/bamboo/JOB/token`, `/bamboo/JOB/ttl`, and `/bamboo/JOB/nodes/NODE`, whose
    value is {"info", "leaving"} and which is bound to the node's lease. etcd rounds a
    TTL up to its minimum (about 1.5 x the election timeout); heartbeat at least every
    ttl/3.
    """

    def __init__(self, url: str = "http://127.0.0.1:2379", *, job: str = "default",
                 timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.job = job
        self.timeout_s = timeout_s
        self.root = f"/bamboo/{job}/"
        self.nodes = self.root + "nodes/"
        self._leases: dict[str, str] = {}
        self._infos: dict[str, dict] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[http.client.HTTPConnection] = []
        self.ttl_s = float(self._value(self.root + "ttl") or 0.0)

    @classmethod
    def connect(cls, url: str, *, job: str = "default", timeout_s: float = 5.0) -> EtcdMembership:
        """A node's client; checks that etcd answers and that the job exists."""
        self = cls(url, job=job, timeout_s=timeout_s)
        if self._value(self.root + "token") is None:
            raise MembershipError(f"no Bamboo job '{job}' at etcd {self.url}: "
                                  f"start the coordinator first")
        return self

    @classmethod
    def host(cls, url: str, token: str, *, job: str = "default", ttl_s: float = 3.0,
             timeout_s: float = 5.0) -> EtcdMembership:
        """The coordinator's side: set the job's token and TTL."""
        self = cls(url, job=job, timeout_s=timeout_s)
        self._put(self.root + "token", _digest(token))
        self._put(self.root + "ttl", str(ttl_s))
        self.ttl_s = ttl_s
        return self

    def _call(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            with e:
                try:
                    message = json.loads(e.read()).get("message", e.reason)
                except ValueError:
                    message = e.reason
            raise MembershipError(f"etcd at {self.url} refused {path}: {message}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise MembershipError(f"etcd at {self.url} is unreachable: {reason}; "
                                  f"start etcd or pass --etcd URL") from None

    def _put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        self._call("/v3/kv/put", dict(body, lease=lease) if lease else body)

    def _range(self, key: str, prefix: bool = False) -> dict:
        body = {"key": _b64(key)}
        return self._call("/v3/kv/range", dict(body, range_end=_b64(_prefix_end(key))) if prefix else body)

    def _value(self, key: str) -> str | None:
        kvs = self._range(key).get("kvs", [])
        return _unb64(kvs[0]["value"]) if kvs else None

    def join(self, node_id: str, info: dict, token: str) -> Lease:
        _check_token(self._value(self.root + "token"), token, f"etcd {self.url} (job '{self.job}')")
        grant = self._call("/v3/lease/grant", {"TTL": max(1, math.ceil(self.ttl_s))})
        lease, key = grant["ID"], _b64(self.nodes + node_id)
        value = _b64(json.dumps({"info": info, "leaving": False}))
        txn = self._call("/v3/kv/txn", {
            "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": key, "value": value, "lease": lease}}]})
        if not txn.get("succeeded"):
            self._call("/v3/lease/revoke", {"ID": lease})
            raise MembershipError(f"join refused: node '{node_id}' is already a member; "
                                  f"pick another node id or wait for its lease to expire")
        self._leases[node_id], self._infos[node_id] = lease, info
        return Lease(node_id=node_id, lease_id=lease, ttl_s=float(grant["TTL"]))

    def heartbeat(self, node_id: str) -> None:
        if node_id not in self._leases:
            raise MembershipError(f"node '{node_id}' has not joined through this client")
        try:
            result = self._call("/v3/lease/keepalive", {"ID": self._leases[node_id]}).get("result", {})
        except MembershipError as e:
            if "lease not found" not in str(e):
                raise
            result = {}
        if int(result.get("TTL", 0)) <= 0:
            raise LeaseExpired(f"node '{node_id}' missed its heartbeats for {self.ttl_s} s "
                               f"and is no longer a member; join again")

    def leave(self, node_id: str) -> None:
        lease = self._leases.pop(node_id, None)
        if lease is None:
            return
        try:  # mark it, so that watchers tell a leave from an expiry, then drop the lease
            value = json.dumps({"info": self._infos.pop(node_id), "leaving": True})
            self._put(self.nodes + node_id, value, lease)
            self._call("/v3/lease/revoke", {"ID": lease})
        except MembershipError as e:
            if "lease not found" not in str(e):
                raise

    def alive(self) -> dict[str, dict]:
        kvs = self._range(self.nodes, prefix=True).get("kvs", [])
        return {_unb64(kv["key"])[len(self.nodes):]: json.loads(_unb64(kv["value"]))["info"]
                for kv in kvs}

    def watch(self, callback: Callback) -> None:
        start = int(self._range(self.root + "ttl")["header"]["revision"]) + 1
        self._threads.append(threading.Thread(target=self._watch, args=(callback, start),
                                              name="bamboo-etcd-watch", daemon=True))
        self._threads[-1].start()

    def _watch(self, callback: Callback, revision: int) -> None:
        """Follow the watch stream; reconnect from the next revision after a quiet spell."""
        parts = urllib.parse.urlsplit(self.url)
        while not self._stop.is_set():
            conn = http.client.HTTPConnection(parts.hostname, parts.port or 2379, timeout=30)
            self._conns.append(conn)
            try:
                body = {"create_request": {"key": _b64(self.nodes), "prev_kv": True,
                                           "range_end": _b64(_prefix_end(self.nodes)),
                                           "start_revision": str(revision)}}
                conn.request("POST", "/v3/watch", json.dumps(body))
                resp = conn.getresponse()
                for line in resp:
                    revision = self._on_message(json.loads(line), callback, revision)
            except (OSError, ValueError, http.client.HTTPException) as e:
                if not self._stop.is_set() and not isinstance(e, socket.timeout):
                    log.warning("etcd watch on %s broke (%s); reconnecting", self.url, e)
                    self._stop.wait(0.5)
            finally:
                conn.close()
                self._conns.remove(conn)

    def _on_message(self, message: dict, callback: Callback, revision: int) -> int:
        for ev in message.get("result", {}).get("events", []):
            kv, prev = ev["kv"], ev.get("prev_kv") or {}
            node = _unb64(kv["key"])[len(self.nodes):]
            revision = max(revision, int(kv["mod_revision"]) + 1)
            if ev.get("type") == "DELETE":
                value = json.loads(_unb64(prev["value"])) if prev.get("value") else {}
                kind = "left" if value.get("leaving") else "expired"
                _call_back(callback, MembershipEvent(kind=kind, node_id=node,
                                                     info=value.get("info", {})))
            elif kv.get("version") == "1":
                info = json.loads(_unb64(kv["value"]))["info"]
                _call_back(callback, MembershipEvent(kind="joined", node_id=node, info=info))
        return revision

    def close(self) -> None:
        self._stop.set()
        for conn in list(self._conns):
            if conn.sock is not None:  # wake the watch thread out of its read
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self._threads:
            thread.join(5.0)
        self._threads.clear()
