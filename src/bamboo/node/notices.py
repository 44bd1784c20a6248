"""Preemption notices: the warning a cloud gives before it takes a spot instance.

Each source answers `poll() -> Notice | None`; a `NoticeWatcher` polls a list of them on
a background thread and calls back once per notice. Sources:

- `AwsSpotNotice`: EC2 instance metadata, IMDSv2 (a token from PUT /latest/api/token,
  then GET /latest/meta-data/spot/instance-action; 404 means no notice). About 2 min.
- `GcpPreemptedNotice`: GCE metadata GET /computeMetadata/v1/instance/preempted with
  `Metadata-Flavor: Google`; body TRUE or FALSE. About 30 s.
- `AzurePreemptNotice`: Azure Scheduled Events (GET /metadata/scheduledevents with
  `Metadata: true`); a `Preempt` event naming this VM. At least 30 s.
- `SigtermNotice`: SIGTERM, as Kubernetes sends before it deletes a pod.

Every endpoint's base URL is a constructor argument (defaults: the real link-local
services), so tests and emulators point them at 127.0.0.1. Only the standard library is
used; every HTTP call has a timeout.

    watcher = NoticeWatcher([AwsSpotNotice(), SigtermNotice()], on_notice, interval_s=1.0)
    watcher.start(); ...; watcher.stop()
"""
from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

__all__ = [
    "Notice", "NoticeSource", "NoticeError", "AwsSpotNotice", "GcpPreemptedNotice",
    "AzurePreemptNotice", "SigtermNotice", "NoticeWatcher", "make_source", "SOURCES",
]

log = logging.getLogger(__name__)

AWS_URL = "http://169.254.169.254"
AZURE_URL = "http://169.254.169.254"
GCP_URL = "http://metadata.google.internal"


class NoticeError(RuntimeError):
    """A source could not be read (unreachable, bad answer); str() is one line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Notice:
    """A warning that this instance is about to be taken."""

    source: str
    """The source's name: aws, gcp, azure or sigterm."""
    action: str
    """What will happen: terminate, stop, hibernate (AWS), or preempt."""
    deadline: float | None = None
    """Unix time at which the instance goes, when the source says; else None."""
    detail: str = ""
    """The source's own words (an event id, the raw time), for the log."""

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds until the deadline (negative once passed), or None if unknown."""
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)


class NoticeSource(ABC):
    """One place a preemption notice can come from."""

    name: str = "?"

    @abstractmethod
    def poll(self) -> Notice | None:
        """The current notice, or None; raises NoticeError if the source cannot be read."""

    def close(self) -> None:  # noqa: B027 (a default: most sources hold nothing)
        """Release what the source holds (a signal handler); polling may not follow."""


def _http(method: str, url: str, headers: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
    """One HTTP request; returns (status, body) for any HTTP status, NoticeError if none."""
    req = urllib.request.Request(url, method=method, headers=headers,
                                 data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise NoticeError(f"{method} {url} failed: {reason}") from None


def _parse_iso(text: str) -> float | None:
    """`2026-05-01T12:00:00Z` to Unix time; None if it does not parse."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


def _parse_http_date(text: str) -> float | None:
    """`Mon, 19 Sep 2016 18:29:47 GMT` (Azure's NotBefore) to Unix time; None if empty."""
    try:
        dt = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return _parse_iso(text)
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


class AwsSpotNotice(NoticeSource):
    """EC2 spot interruption notice through IMDSv2."""

    name = "aws"

    def __init__(self, base_url: str = AWS_URL, *, timeout_s: float = 1.0,
                 token_ttl_s: int = 21600) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._token: str | None = None
        self._token_expires = 0.0

    def _get_token(self) -> str:
        """A session token, fetched again when less than a tenth of its TTL is left."""
        if self._token is None or time.monotonic() > self._token_expires:
            status, body = _http("PUT", f"{self.base_url}/latest/api/token",
                                 {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
                                 self.timeout_s)
            if status != 200:
                raise NoticeError(f"IMDSv2 token request to {self.base_url} answered {status}")
            self._token = body.decode().strip()
            self._token_expires = time.monotonic() + 0.9 * self.token_ttl_s
        return self._token

    def _action(self) -> tuple[int, bytes]:
        return _http("GET", f"{self.base_url}/latest/meta-data/spot/instance-action",
                     {"X-aws-ec2-metadata-token": self._get_token()}, self.timeout_s)

    def poll(self) -> Notice | None:
        status, body = self._action()
        if status == 401:  # the token expired or IMDS restarted: one fresh token, one retry
            self._token = None
            status, body = self._action()
        if status == 404:
            return None
        if status != 200:
            raise NoticeError(f"spot/instance-action at {self.base_url} answered {status}")
        try:
            doc = json.loads(body)
            action, when = str(doc["action"]), str(doc["time"])
        except (ValueError, KeyError, TypeError):
            raise NoticeError(f"spot/instance-action at {self.base_url} sent "
                              f"unreadable JSON: {body[:80]!r}") from None
        return Notice(source=self.name, action=action, deadline=_parse_iso(when), detail=when)


class GcpPreemptedNotice(NoticeSource):
    """GCE preemption (spot and preemptible VMs) through the metadata server."""

    name = "gcp"

    def __init__(self, base_url: str = GCP_URL, *, timeout_s: float = 1.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def poll(self) -> Notice | None:
        status, body = _http("GET", f"{self.base_url}/computeMetadata/v1/instance/preempted",
                             {"Metadata-Flavor": "Google"}, self.timeout_s)
        if status != 200:
            raise NoticeError(f"instance/preempted at {self.base_url} answered {status}")
        text = body.decode(errors="replace").strip().upper()
        if text == "FALSE":
            return None
        if text == "TRUE":
            return Notice(source=self.name, action="preempt", detail="instance/preempted=TRUE")
        raise NoticeError(f"instance/preempted at {self.base_url} sent {text[:40]!r}")


class AzurePreemptNotice(NoticeSource):
    """Azure Scheduled Events: a `Preempt` event whose Resources name this VM."""

    name = "azure"
    API = "2020-07-01"

    def __init__(self, base_url: str = AZURE_URL, *, instance: str | None = None,
                 timeout_s: float = 2.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.instance = instance
        """This VM's name; None: asked once from IMDS (compute/name)."""
        self.timeout_s = timeout_s

    def _instance_name(self) -> str:
        if self.instance is None:
            status, body = _http("GET", f"{self.base_url}/metadata/instance/compute/name"
                                        "?api-version=2021-02-01&format=text",
                                 {"Metadata": "true"}, self.timeout_s)
            if status != 200:
                raise NoticeError(f"Azure IMDS compute/name at {self.base_url} answered {status}")
            self.instance = body.decode().strip()
        return self.instance

    def poll(self) -> Notice | None:
        me = self._instance_name()
        status, body = _http("GET", f"{self.base_url}/metadata/scheduledevents"
                                    f"?api-version={self.API}", {"Metadata": "true"},
                             self.timeout_s)
        if status != 200:
            raise NoticeError(f"scheduledevents at {self.base_url} answered {status}")
        try:
            events = json.loads(body).get("Events", [])
        except (ValueError, AttributeError):
            raise NoticeError(f"scheduledevents at {self.base_url} sent unreadable JSON") from None
        for ev in events:
            if ev.get("EventType") == "Preempt" and me in ev.get("Resources", []):
                not_before = str(ev.get("NotBefore") or "")
                return Notice(source=self.name, action="preempt",
                              deadline=_parse_http_date(not_before) if not_before else None,
                              detail=f"EventId={ev.get('EventId')} NotBefore={not_before}")
        return None


class SigtermNotice(NoticeSource):
    """SIGTERM turned into a notice (Kubernetes' termination, a spot agent's signal).

    Installs its handler when built (which must be on the main thread) and puts the
    previous one back on `close()`. `grace_s` is the time a sender allows before SIGKILL
    (Kubernetes' terminationGracePeriodSeconds, 30 s by default).
    """

    name = "sigterm"

    def __init__(self, *, grace_s: float | None = 30.0) -> None:
        self.grace_s = grace_s
        self._received: float | None = None
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self._received is None:
            self._received = time.time()

    def poll(self) -> Notice | None:
        if self._received is None:
            return None
        deadline = None if self.grace_s is None else self._received + self.grace_s
        return Notice(source=self.name, action="terminate", deadline=deadline,
                      detail="SIGTERM received")

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


SOURCES: dict[str, type[NoticeSource]] = {
    "aws": AwsSpotNotice, "gcp": GcpPreemptedNotice,
    "azure": AzurePreemptNotice, "sigterm": SigtermNotice,
}


def make_source(name: str, base_url: str | None = None) -> NoticeSource:
    """A source by name (aws, gcp, azure, sigterm), at `base_url` if given."""
    if name not in SOURCES:
        raise ValueError(f"unknown notice source '{name}': choose from {', '.join(SOURCES)}")
    if name == "sigterm":
        return SigtermNotice()
    return SOURCES[name](base_url) if base_url else SOURCES[name]()


class NoticeWatcher:
    """Polls sources on a daemon thread; calls `callback(notice)` once per distinct notice.

    Nothing raises out of the thread: a source that fails is logged once (until it
    answers again) and polled again next round; a callback that raises is logged.
    """

    def __init__(self, sources: list[NoticeSource], callback: Callable[[Notice], None],
                 *, interval_s: float = 1.0) -> None:
        self.sources = list(sources)
        self.callback = callback
        self.interval_s = interval_s
        self.notices: list[Notice] = []
        self._seen: set[tuple[str, str, float | None]] = set()
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bamboo-notices", daemon=True)

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> NoticeWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def poll_once(self) -> list[Notice]:
        """Poll every source once; returns the notices not seen before (and calls back)."""
        fresh = []
        for source in self.sources:
            notice = self._poll(source)
            key = (notice.source, notice.action, notice.deadline) if notice else None
            if key is None or key in self._seen:
                continue
            self._seen.add(key)
            self.notices.append(notice)
            fresh.append(notice)
            try:
                self.callback(notice)
            except Exception as e:  # noqa: BLE001 - a callback bug must not stop the watch
                log.error("notice callback failed on %s: %s", notice, e)
        return fresh

    def _poll(self, source: NoticeSource) -> Notice | None:
        try:
            notice = source.poll()
        except Exception as e:  # noqa: BLE001 - logged once per failing streak
            if source.name not in self._failing:
                self._failing.add(source.name)
                log.warning("preemption notices from %s unavailable (will retry): %s",
                            source.name, e)
            return None
        if source.name in self._failing:
            self._failing.discard(source.name)
            log.debug("preemption notices from %s available again", source.name)
        return notice

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval_s)
