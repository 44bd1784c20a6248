"""Cluster membership: which nodes are alive, by leases that their heartbeats renew.

One interface, `Membership`, and two backends with the same behaviour:

- `EmbeddedMembership` (default, zero set-up): state lives in a torch `TCPStore` hosted
  by the coordinator process; a reaper thread there expires nodes whose heartbeat
  counter has not moved for `ttl_s`, and publishes the live view and an event log.
- `EtcdMembership`: a real etcd (3.4+) through its v3 JSON gateway, with the standard
  library only (no etcd client package): a node's key is bound to an etcd lease, so etcd
  itself deletes it when heartbeats (lease keep-alives) stop; changes come from a watch.

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
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

__all__ = ["Membership", "MembershipError", "LeaseExpired", "Lease", "MembershipEvent",
           "EmbeddedMembership", "EtcdMembership"]

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


# ----------------------------------------------------------------------------- embedded

def _probe(host: str, port: int, timeout_s: float) -> None:
    """Fail with one line (not torch's C++ log) when nothing listens at host:port."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise MembershipError(
            f"coordinator store at {host}:{port} is unreachable: {e.strerror or e}; "
            f"start the coordinator or pass --join ADDR:PORT") from None


def _client(host: str, port: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    _probe(host, port, timeout_s)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MembershipError(f"coordinator store at {host}:{port} is unreachable: {first}; "
                              f"start the coordinator or pass --join ADDR:PORT") from None
    return dist.PrefixStore(EmbeddedMembership.PREFIX, store)


class EmbeddedMembership(Membership):
    """Membership in a TCPStore hosted by the coordinator (see the module docstring).

    Keys under `bamboo/membership/`: `token`, `ttl`, the lease counter `leases`,
    `lease/N` (node and info), its counters `lease/N/hb`, `/left`, `/expired`,
    `owner/NODE` (the live lease), `view` (JSON of live nodes) and the event log
    `events` (a counter) with `event/K`.
    """

    PREFIX = "bamboo/membership/"

    def __init__(self, host: str, port: int, *, timeout_s: float = 5.0,
                 poll_s: float = 0.05) -> None:
        """A client of the store at host:port (use `connect` or `host`)."""
        self.addr = f"{host}:{port}"
        self._host, self._port = host, port
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._store = _client(host, port, timeout_s)
        self._lock = threading.Lock()
        self._leases: dict[str, int] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: Any = None
        self.ttl_s = float(self._get("ttl") or 0.0)

    @classmethod
    def connect(cls, addr: str, *, timeout_s: float = 5.0) -> EmbeddedMembership:
        """A node's client of the coordinator at `HOST:PORT`."""
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise MembershipError(f"coordinator address '{addr}' is malformed: write HOST:PORT")
        return cls(host, int(port), timeout_s=timeout_s)

    @classmethod
    def host(cls, token: str, *, ttl_s: float = 3.0, host: str = "127.0.0.1", port: int = 0,
             store: Any = None) -> EmbeddedMembership:
        """The coordinator's side: serve (or reuse) a TCPStore and run the reaper."""
        import torch.distributed as dist

        server = store or dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=10))
        prefixed = dist.PrefixStore(cls.PREFIX, server)
        prefixed.set("ttl", str(ttl_s))
        prefixed.set("view", "{}")
        prefixed.set("token", _digest(token))
        self = cls(server.host, server.port)
        self._server = server  # the store lives as long as this object
        self._spawn(_Reaper(self, ttl_s).run, "bamboo-membership-reaper")
        return self

    # --- store helpers (the client is shared by threads: one call at a time)
    def _get(self, key: str) -> str | None:
        with self._lock:
            if not self._store.check([key]):
                return None
            return self._store.get(key).decode()

    def _add(self, key: str, n: int = 0) -> int:
        with self._lock:
            return self._store.add(key, n)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _view(self) -> dict[str, dict]:
        return json.loads(self._get("view") or "{}")

    def _wait_view(self, done: Callable[[dict], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s + self.ttl_s
        while not done(self._view()):
            if time.monotonic() > deadline:
                raise MembershipError(f"coordinator at {self.addr} did not confirm {what} "
                                      f"within {self.timeout_s + self.ttl_s:.0f} s")
            time.sleep(self.poll_s)

    # --- Membership
    def join(self, node_id: str, info: dict, token: str) -> Lease:
        _check_token(self._get("token"), token, f"coordinator at {self.addr}")
        n = self._add("leases", 1)
        with self._lock:
            owner = self._store.compare_set(f"owner/{node_id}", "", str(n)).decode()
            record = {"node": node_id, "info": info, "refused": owner != str(n)}
            self._store.set(f"lease/{n}", json.dumps(record))
        if owner != str(n):
            raise MembershipError(f"join refused: node '{node_id}' is already a member; "
                                  f"pick another node id or wait for its lease to expire")
        self._leases[node_id] = n
        self._wait_view(lambda v: v.get(node_id, {}).get("lease") == n, f"{node_id}'s join")
        return Lease(node_id=node_id, lease_id=str(n), ttl_s=self.ttl_s)

    def _lease(self, node_id: str) -> int:
        if node_id not in self._leases:
            raise MembershipError(f"node '{node_id}' has not joined through this client")
        return self._leases[node_id]

    def heartbeat(self, node_id: str) -> None:
        n = self._lease(node_id)
        if self._add(f"lease/{n}/expired") > 0:
            raise LeaseExpired(f"node '{node_id}' missed its heartbeats for {self.ttl_s} s "
                               f"and is no longer a member; join again")
        self._add(f"lease/{n}/hb", 1)

    def leave(self, node_id: str) -> None:
        n = self._leases.pop(node_id, None)
        if n is None:
            return
        self._add(f"lease/{n}/left", 1)
        self._wait_view(lambda v: v.get(node_id, {}).get("lease") != n, f"{node_id}'s leave")

    def alive(self) -> dict[str, dict]:
        return {node: entry["info"] for node, entry in self._view().items()}

    def watch(self, callback: Callback) -> None:
        store = _client(self._host, self._port, self.timeout_s)
        seen = store.add("events", 0)

        def run() -> None:
            nonlocal seen
            while not self._stop.wait(self.poll_s):
                try:
                    count = store.add("events", 0)
                    for k in range(seen + 1, count + 1):
                        event = json.loads(store.get(f"event/{k}"))
                        _call_back(callback, MembershipEvent(**event))
                    seen = count
                except Exception as e:  # noqa: BLE001 - the coordinator went away
                    log.warning("membership watch on %s stopped: %s", self.addr, e)
                    return
        self._spawn(run, "bamboo-membership-watch")

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5.0)
        self._threads.clear()
        self._server = None


class _Reaper:
    """The coordinator's thread: admits joins, notices leaves, expires silent nodes."""

    def __init__(self, owner: EmbeddedMembership, ttl_s: float) -> None:
        self.owner, self.ttl_s = owner, ttl_s
        self.store = _client(owner._host, owner._port, owner.timeout_s)
        self.next = 1
        self.live: dict[int, dict[str, Any]] = {}
        """lease -> node, info, last heartbeat count, when it last changed."""
        self.pending_since: float | None = None

    def run(self) -> None:
        tick = max(0.02, min(0.2, self.ttl_s / 10))
        while not self.owner._stop.wait(tick):
            try:
                changed = self._admit() | self._check()
                if changed:
                    view = {e["node"]: {"info": e["info"], "lease": n} for n, e in self.live.items()}
                    self.store.set("view", json.dumps(view))
            except Exception as e:  # noqa: BLE001 - keep reaping; say so once a tick
                log.error("membership reaper: %s", e)

    def _emit(self, kind: str, entry: dict) -> None:
        k = self.store.add("events", 1)
        self.store.set(f"event/{k}", json.dumps({"kind": kind, "node_id": entry["node"],
                                                 "info": entry["info"]}))

    def _admit(self) -> bool:
        changed = False
        while self.next <= self.store.add("leases", 0):
            n = self.next
            if not self.store.check([f"lease/{n}"]):  # a joiner between its two writes
                self.pending_since = self.pending_since or time.monotonic()
                if time.monotonic() - self.pending_since < self.ttl_s:
                    break  # wait for it; a joiner that died there is skipped after a TTL
            else:
                record = json.loads(self.store.get(f"lease/{n}"))
                if not record.get("refused"):
                    hb = self.store.add(f"lease/{n}/hb", 0)
                    self.live[n] = dict(record, hb=hb, at=time.monotonic())
                    self._emit("joined", record)
                    changed = True
            self.next, self.pending_since = n + 1, None
        return changed

    def _check(self) -> bool:
        changed = False
        for n, entry in list(self.live.items()):
            if self.store.add(f"lease/{n}/left", 0) > 0:
                kind = "left"
            else:
                hb = self.store.add(f"lease/{n}/hb", 0)
                if hb != entry["hb"]:
                    entry["hb"], entry["at"] = hb, time.monotonic()
                    continue
                if time.monotonic() - entry["at"] <= self.ttl_s:
                    continue
                kind = "expired"
                self.store.add(f"lease/{n}/expired", 1)
            del self.live[n]
            self.store.delete_key(f"owner/{entry['node']}")
            self._emit(kind, entry)
            changed = True
        return changed


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
