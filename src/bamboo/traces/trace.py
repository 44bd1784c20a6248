"""Preemption traces for the simulator: parsing real ones, generating synthetic ones.

A trace is a time-ordered list of membership events, ``add`` or ``remove`` of one
named spot instance, in seconds since the trace began. Three file formats are
read, detected from the content (never from the file name):

* Bamboo CSV rows ``ms,add|remove,nodeName`` (the authors' p3 trace);
* count rows ``YYYY-MM-DD, HH:MM:SS, count`` (number of live instances over time;
  a rise adds that many nodes, a fall removes that many live nodes, chosen by a
  fixed pseudo-random sequence so the same file always gives the same trace);
* JSON rows ``[ms, "add"|"remove"|"no-op", {"nodes": [...], ...}]``, one per line
  (JSON lines) or as one JSON array (other keys of the object are ignored).

Rows out of time order are sorted (stable) with a one-line warning; a row that
does not parse raises :class:`TraceError` naming the file and line.

Synthetic traces (``synthetic:p=0.10`` or ``synthetic:mtbf=1h``) follow the
Bamboo paper's generator: each live node is preempted with an hourly probability
``p`` at a uniform time inside the hour (or, with ``mtbf``, the cluster sees one
preemption per mean interval, a Poisson process, the victim chosen uniformly),
and each missing instance of the requested ``nodes`` is granted within an hour
with probability ``alloc``, at a uniform time inside that hour.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ADD",
    "REMOVE",
    "READY",
    "Trace",
    "TraceError",
    "SyntheticSpec",
    "load_trace",
    "parse_trace_text",
    "parse_synthetic_spec",
    "generate_synthetic",
]

ADD = 1
REMOVE = -1
READY = 0
"""Kind of the derived 'instance is ready' events of :meth:`Trace.events` (never in a file)."""


class TraceError(ValueError):
    """A trace file or synthetic spec that cannot be used; the message says why."""


@dataclass(slots=True)
class Trace:
    """Membership events, sorted by time: parallel lists for speed."""

    name: str
    times: list[float]
    """Seconds since the start of the trace, non-decreasing."""
    kinds: list[int]
    """ADD (+1) or REMOVE (-1)."""
    nodes: list[int]
    """Dense node ids (0..n-1), one per distinct instance name."""
    duration: float
    """Seconds the trace covers (time of its last row, or the synthetic horizon)."""
    node_names: list[str] = field(default_factory=list)
    unsorted_rows: int = 0
    """How many rows had to be moved to restore time order."""
    _events: dict = field(default_factory=dict, repr=False, compare=False)
    """Cache of :meth:`events` by allocation delay (the trace is shared by every policy)."""

    def events(self, alloc_delay: float) -> tuple[list[float], list[int], list[int], list[int]]:
        """The rows merged with one READY event ``alloc_delay`` seconds after each add.

        Returns parallel lists (times, kinds, nodes, serials); ``serial`` is the index of
        the add row (for an add, its own index; for a READY, the add it follows), so a
        replay can tell a READY of the current incarnation of a node from a stale one.
        Ties: a READY comes before rows at the same time (but after its own add, when the
        delay is 0), and READYs keep add order (the delay is constant). Computed once per delay and cached: callers must not mutate.
        """
        got = self._events.get(alloc_delay)
        if got is not None:
            return got
        times, kinds, nodes = self.times, self.kinds, self.nodes
        adds = [i for i, k in enumerate(kinds) if k == ADD]
        rt = [times[i] + alloc_delay for i in adds]
        et: list[float] = []
        ek: list[int] = []
        en: list[int] = []
        es: list[int] = []
        j, m = 0, len(adds)
        inf = math.inf
        r_next = rt[0] if m else inf
        for i, t in enumerate(times):
            while r_next <= t and adds[j] < i:  # a READY never precedes its own add (delay 0)
                a = adds[j]
                et.append(r_next)
                ek.append(READY)
                en.append(nodes[a])
                es.append(a)
                j += 1
                r_next = rt[j] if j < m else inf
            et.append(t)
            ek.append(kinds[i])
            en.append(nodes[i])
            es.append(i)
        for jj in range(j, m):
            a = adds[jj]
            et.append(rt[jj])
            ek.append(READY)
            en.append(nodes[a])
            es.append(a)
        got = self._events[alloc_delay] = (et, ek, en, es)
        return got

    @property
    def preemptions(self) -> int:
        return sum(1 for k in self.kinds if k == REMOVE)

    @property
    def allocations(self) -> int:
        return sum(1 for k in self.kinds if k == ADD)


# ---------------------------------------------------------------- file formats

_COUNT_RE = re.compile(r"^\s*(\d{4}-\d{2}-\d{2})\s*,\s*(\d{1,2}:\d{2}:\d{2})\s*,\s*(-?\d+)\s*$")
_CSV_RE = re.compile(r"^\s*[^,]+,\s*[A-Za-z-]+\s*,")


def load_trace(path: str | Path) -> Trace:
    """Read a trace file in any supported format (detected from its content)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{p}: no such trace file (give a path, or a spec like synthetic:p=0.10)") from None
    except IsADirectoryError:
        raise TraceError(f"{p}: is a directory, not a trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a text file (expected CSV, count rows or JSON rows)") from None
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace file ({exc.strerror})") from None
    return parse_trace_text(text, str(p))


def parse_trace_text(text: str, name: str) -> Trace:
    """Parse trace text; ``name`` is used in error messages and as the trace name."""
    lines = text.splitlines()
    first = next(((i, ln.strip()) for i, ln in enumerate(lines) if ln.strip()), None)
    if first is None:
        raise TraceError(f"{name}: trace is empty (expected rows like '0,add,node1')")
    _, head = first
    if head.startswith("["):
        return _parse_json_rows(lines, name)
    if _COUNT_RE.match(head):
        return _parse_counts(lines, name)
    return _parse_csv(lines, name)


def _stable_sort(rows: list[tuple[float, int, str]]) -> tuple[list[tuple[float, int, str]], int]:
    """Sort rows by time (stable); return them and how many rows were out of order."""
    moved = 0
    latest = -math.inf
    for t, _, _ in rows:
        if t < latest:
            moved += 1
        else:
            latest = t
    if moved:
        rows = sorted(rows, key=lambda r: r[0])
    return rows, moved


def _build(name: str, rows: list[tuple[float, int, str]], duration: float | None = None) -> Trace:
    rows, moved = _stable_sort(rows)
    ids: dict[str, int] = {}
    times: list[float] = []
    kinds: list[int] = []
    nodes: list[int] = []
    for t, kind, node in rows:
        nid = ids.get(node)
        if nid is None:
            nid = ids[node] = len(ids)
        times.append(t)
        kinds.append(kind)
        nodes.append(nid)
    end = times[-1] if times else 0.0
    return Trace(
        name=name,
        times=times,
        kinds=kinds,
        nodes=nodes,
        duration=max(end, duration or 0.0),
        node_names=list(ids),
        unsorted_rows=moved,
    )


def _parse_csv(lines: list[str], name: str) -> Trace:
    rows: list[tuple[float, int, str]] = []
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3:
            raise TraceError(
                f"{name}:{lineno}: expected 3 comma-separated fields 'ms,add|remove,node', got {len(parts)}: {line[:60]!r}"
            )
        ms, kind, node = parts
        try:
            t = float(ms) / 1000.0
        except ValueError:
            raise TraceError(f"{name}:{lineno}: time {ms!r} is not a number of milliseconds") from None
        if not math.isfinite(t) or t < 0:
            raise TraceError(f"{name}:{lineno}: time {ms!r} must be a finite, non-negative number of milliseconds")
        if kind not in ("add", "remove"):
            raise TraceError(f"{name}:{lineno}: event {kind!r} is neither 'add' nor 'remove'")
        if not node:
            raise TraceError(f"{name}:{lineno}: empty node name")
        rows.append((t, ADD if kind == "add" else REMOVE, node))
    _check_membership(rows, name)
    return _build(name, rows)


def _check_membership(rows: list[tuple[float, int, str]], name: str) -> None:
    """Reject a remove of a node that is not live (after sorting)."""
    live: set[str] = set()
    for t, kind, node in sorted(rows, key=lambda r: r[0]):
        if kind == ADD:
            live.add(node)
        elif node in live:
            live.discard(node)
        else:
            raise TraceError(f"{name}: node {node!r} is removed at {t * 1000:.0f} ms but is not live then")


def _parse_counts(lines: list[str], name: str) -> Trace:
    samples: list[tuple[float, int, int]] = []
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _COUNT_RE.match(line)
        if not m:
            raise TraceError(f"{name}:{lineno}: expected 'YYYY-MM-DD, HH:MM:SS, count', got {line[:60]!r}")
        try:
            stamp = _dt.datetime.strptime(f"{m.group(1)} {m.group(2)}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise TraceError(f"{name}:{lineno}: invalid date or time {m.group(1)} {m.group(2)!r}") from None
        count = int(m.group(3))
        if count < 0:
            raise TraceError(f"{name}:{lineno}: negative instance count {count}")
        samples.append((stamp.timestamp(), count, lineno))
    moved = 0
    latest = -math.inf
    for ts, _, _ in samples:
        if ts < latest:
            moved += 1
        else:
            latest = ts
    if moved:
        samples.sort(key=lambda s: s[0])
    t0 = samples[0][0]
    rows: list[tuple[float, int, str]] = []
    live: list[str] = []
    serial = 0
    pick = random.Random(0)  # fixed: the same file always gives the same trace
    for ts, count, _ in samples:
        t = ts - t0
        while len(live) < count:
            serial += 1
            node = f"n{serial}"
            live.append(node)
            rows.append((t, ADD, node))
        while len(live) > count:
            rows.append((t, REMOVE, live.pop(int(pick.random() * len(live)))))
    trace = _build(name, rows, duration=samples[-1][0] - t0)
    trace.unsorted_rows = moved
    return trace


def _json_row(obj: object, where: str) -> list[tuple[float, int, str]]:
    if not isinstance(obj, list) or len(obj) < 2:
        raise TraceError(f"{where}: expected a row [ms, \"add\"|\"remove\"|\"no-op\", {{\"nodes\": [...]}}]")
    ms, kind = obj[0], obj[1]
    if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
        raise TraceError(f"{where}: time {ms!r} must be a non-negative number of milliseconds")
    if kind not in ("add", "remove", "no-op"):
        raise TraceError(f"{where}: event {kind!r} is not 'add', 'remove' or 'no-op'")
    if kind == "no-op":
        return []
    info = obj[2] if len(obj) > 2 else None
    if not isinstance(info, dict) or not isinstance(info.get("nodes"), list):
        raise TraceError(f"{where}: an {kind!r} row needs a third element {{\"nodes\": [...]}}")
    k = ADD if kind == "add" else REMOVE
    out = []
    for node in info["nodes"]:
        if not isinstance(node, (str, int)) or isinstance(node, bool):
            raise TraceError(f"{where}: node name {node!r} must be a string or an integer")
        out.append((ms / 1000.0, k, str(node)))
    return out


def _parse_json_rows(lines: list[str], name: str) -> Trace:
    rows: list[tuple[float, int, str]] = []
    whole = "\n".join(lines).strip()
    try:
        data = json.loads(whole)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, list) and data and all(isinstance(x, list) for x in data):
        # One JSON array holding every row (possibly pretty-printed).
        for idx, obj in enumerate(data, start=1):
            rows.extend(_json_row(obj, f"{name}: row {idx}"))
    else:
        for lineno, raw in enumerate(lines, start=1):
            line = raw.strip().rstrip(",").strip()
            if not line or line in ("[", "]"):
                continue
            if line.startswith("[") and line.endswith("]]") and line.count("[") == line.count("]") - 1:
                line = line[:-1]  # last row of a multi-line array
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{name}:{lineno}: row is not valid JSON ({exc.msg}): {line[:60]!r}") from None
            rows.extend(_json_row(obj, f"{name}:{lineno}"))
    _check_membership(rows, name)
    return _build(name, rows)


# ---------------------------------------------------------------- synthetic

@dataclass(kw_only=True, slots=True)
class SyntheticSpec:
    """Parameters of a synthetic trace (see the module docstring)."""

    p: float | None = None
    """Hourly preemption probability of each live node (the paper swept 0.01-0.50)."""
    mtbf_s: float | None = None
    """Mean seconds between preemptions of the whole cluster (alternative to ``p``)."""
    alloc: float = 0.5
    """Hourly probability that a missing instance is granted."""
    nodes: int = 48
    """Instances requested (the initial cluster is all of them)."""
    hours: float = 12.0
    """Length of the trace."""

    @property
    def label(self) -> str:
        what = f"p={self.p:g}" if self.p is not None else f"mtbf={self.mtbf_s:g}s"
        return f"synthetic:{what},alloc={self.alloc:g},nodes={self.nodes},hours={self.hours:g}"


_DURATION_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(s|m|min|h)?$")


def _parse_duration(value: str, spec: str) -> float:
    m = _DURATION_RE.match(value.strip().lower())
    if not m:
        raise TraceError(f"{spec}: duration {value!r} must look like 10min, 30m, 1h, 6h or 600s")
    mult = {"s": 1.0, None: 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}[m.group(2)]
    seconds = float(m.group(1)) * mult
    if seconds <= 0:
        raise TraceError(f"{spec}: duration must be positive")
    return seconds


def parse_synthetic_spec(spec: str, *, nodes: int = 48, hours: float = 12.0) -> SyntheticSpec:
    """Parse ``synthetic:p=0.10[,alloc=0.5][,nodes=48][,hours=12]`` or ``synthetic:mtbf=1h``."""
    if not spec.startswith("synthetic:"):
        raise TraceError(f"{spec}: a synthetic trace spec starts with 'synthetic:'")
    out = SyntheticSpec(nodes=nodes, hours=hours)
    body = spec[len("synthetic:"):]
    if not body:
        raise TraceError(f"{spec}: say p=PROB or mtbf=DURATION, e.g. synthetic:p=0.10")
    for item in body.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise TraceError(f"{spec}: {item!r} is not KEY=VALUE (keys: p, mtbf, alloc, nodes, hours)")
        try:
            if key == "p":
                out.p = float(value)
            elif key == "mtbf":
                out.mtbf_s = _parse_duration(value, spec)
            elif key == "alloc":
                out.alloc = float(value)
            elif key == "nodes":
                out.nodes = int(value)
            elif key == "hours":
                out.hours = float(value)
            else:
                raise TraceError(f"{spec}: unknown key {key!r} (keys: p, mtbf, alloc, nodes, hours)")
        except ValueError:
            raise TraceError(f"{spec}: {key}={value!r} is not a number") from None
    if (out.p is None) == (out.mtbf_s is None):
        raise TraceError(f"{spec}: give exactly one of p=PROB (hourly) or mtbf=DURATION")
    if out.p is not None and not 0.0 <= out.p <= 1.0:
        raise TraceError(f"{spec}: p={out.p} must be a probability in [0, 1]")
    if not 0.0 <= out.alloc <= 1.0:
        raise TraceError(f"{spec}: alloc={out.alloc} must be a probability in [0, 1]")
    if out.nodes < 1:
        raise TraceError(f"{spec}: nodes must be at least 1")
    if not 0 < out.hours <= 24 * 365:
        raise TraceError(f"{spec}: hours must be positive (and at most a year)")
    return out


def generate_synthetic(spec: SyntheticSpec, seed: int) -> Trace:
    """Generate one trace; the same spec and seed always give the same trace.

    Long because it is one loop over the horizon with one random stream: split, the order
    of draws would be easy to change by accident, and with it every trace."""
    rng = random.Random(seed)
    rand = rng.random
    horizon = spec.hours * 3600.0
    rows: list[tuple[float, int, int]] = []
    live: list[int] = list(range(spec.nodes))
    for n in live:
        rows.append((0.0, ADD, n))
    next_id = spec.nodes
    nhours = math.ceil(spec.hours)
    if spec.mtbf_s is not None:
        t_fail = rng.expovariate(1.0 / spec.mtbf_s)
    for hour in range(nhours):
        h0 = hour * 3600.0
        h1 = min(h0 + 3600.0, horizon)
        span = h1 - h0
        local: list[tuple[float, int, int]] = []
        if spec.p is not None:
            p = spec.p
            for n in live:
                if rand() < p:
                    local.append((h0 + rand() * span, REMOVE, n))
        else:
            while t_fail < h1:
                local.append((t_fail, REMOVE, -1))  # victim chosen when replayed
                t_fail += rng.expovariate(1.0 / spec.mtbf_s)
        missing = spec.nodes - len(live) + sum(1 for r in local if r[1] == REMOVE)
        for _ in range(missing):
            if rand() < spec.alloc:
                local.append((h0 + rand() * span, ADD, -1))
        local.sort(key=lambda r: r[0])
        alive = set(live)
        order = list(live)
        for t, kind, n in local:
            if kind == REMOVE:
                if n < 0:
                    if not order:
                        continue
                    n = order.pop(int(rand() * len(order)))
                elif n not in alive:
                    continue
                else:
                    order.remove(n)
                alive.discard(n)
                rows.append((t, REMOVE, n))
            else:
                if len(alive) >= spec.nodes:
                    continue
                n = next_id
                next_id += 1
                alive.add(n)
                order.append(n)
                rows.append((t, ADD, n))
        live = order
    rows.sort(key=lambda r: r[0])
    return Trace(
        name=spec.label,
        times=[r[0] for r in rows],
        kinds=[r[1] for r in rows],
        nodes=[r[2] for r in rows],
        duration=horizon,
        node_names=[],
    )
