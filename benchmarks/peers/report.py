"""The harness's pure parts: the kill schedule, the goodput and seconds-lost arithmetic, and
the table. No processes, no torch: tests/unit/benchmarks_peers checks them."""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean


@dataclass(frozen=True)
class Kill:
    """One preemption: at `at` seconds after the first step began (`unit` "s"), or when step
    `at` begins (`unit` "step")."""

    at: float
    unit: str


def parse_schedule(text: str) -> list[Kill]:
    """"8,20s,@30" -> kills at 8 s, 20 s and when step 30 begins; "" -> none. Times must be
    in order; a bad entry raises ValueError with one line saying how to write it."""
    kills: list[Kill] = []
    for raw in (t.strip() for t in text.split(",") if t.strip()):
        unit = "step" if raw.startswith("@") else "s"
        body = raw[1:] if unit == "step" else raw.removesuffix("s")
        try:
            at = float(body) if unit == "s" else int(body)
        except ValueError:
            raise ValueError(f"bad kill {raw!r}: write seconds (8 or 8s) or a step (@15)") from None
        if at < 0:
            raise ValueError(f"bad kill {raw!r}: a time or step is never negative")
        kills.append(Kill(at, unit))
    if len({k.unit for k in kills}) > 1:
        raise ValueError("kills mix seconds and steps: use one unit for the whole schedule")
    if [k.at for k in kills] != sorted(k.at for k in kills):
        raise ValueError("kills out of order: list them earliest first")
    return kills


def victim(i: int, workers: int) -> int:
    """The worker kill i hits: 1 + i % (W-1), never worker 0, whose record stays whole."""
    return 1 + i % (workers - 1)


def bamboo_trace(kills: list[Kill], workers: int, boot_s: float) -> str:
    """A trace (ms,add|remove,node) that kills worker 1 + i % (W-1) at each time and adds
    a replacement `boot_s` later."""
    live = [f"n{i}" for i in range(workers)]
    rows = [f"0,add,{n}" for n in live]
    for i, k in enumerate(kills):
        slot, new = victim(i, workers), f"n{workers + i}"
        rows += [f"{int(k.at * 1000)},remove,{live[slot]}", f"{int((k.at + boot_s) * 1000)},add,{new}"]
        live[slot] = new
    return "\n".join(rows) + "\n"


@dataclass
class Outcome:
    """One run of one system: samples that count toward the model, and the seconds from the
    first step's start to the last step's end (start-up and teardown left out)."""

    system: str
    useful_samples: float
    train_s: float
    kills: int = 0
    equal: bool | None = None  # final losses and parameters equal the failure-free run's
    gap: float | None = None  # |param_l2 - the failure-free run's|, where not equal
    detail: dict = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return self.useful_samples / self.train_s if self.train_s > 0 else 0.0


def seconds_lost(run: Outcome, failure_free_rate: float) -> float | None:
    """Per preemption, the seconds of `run` that produced nothing at the failure-free rate:
    (train_s - useful / rate) / kills. None without kills."""
    if run.kills == 0 or failure_free_rate <= 0:
        return None
    return (run.train_s - run.useful_samples / failure_free_rate) / run.kills


@dataclass
class Row:
    """A system's line of the table, over its repetitions."""

    system: str
    free_rate: list[float]
    goodput: list[float]
    lost_s: list[float]
    equal: list[bool | None]
    gap: list[float | None] = field(default_factory=list)


def summarize(free: list[Outcome], killed: list[Outcome]) -> list[Row]:
    """One row per system, in the order systems first appear; the seconds lost of each run
    under kills are against the mean failure-free rate of its system."""
    rows: dict[str, Row] = {}
    for o in free:
        rows.setdefault(o.system, Row(o.system, [], [], [], [])).free_rate.append(o.goodput)
    for o in killed:
        row = rows.setdefault(o.system, Row(o.system, [], [], [], []))
        row.goodput.append(o.goodput)
        row.equal.append(o.equal)
        row.gap.append(o.gap)
        lost = seconds_lost(o, mean(row.free_rate) if row.free_rate else 0.0)
        if lost is not None:
            row.lost_s.append(lost)
    return list(rows.values())


def _cell(values: list[float], digits: int = 1) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values) if values else "-"


def _equal(values: list[bool | None], gaps: list[float | None]) -> str:
    """yes / no, a "no" with its parameters' L2 distance from the failure-free run's."""
    if not values or all(v is None for v in values):
        return "-"
    gaps = gaps + [None] * (len(values) - len(gaps))
    words = ["yes" if v else "-" if v is None else "no" if g is None else f"no (L2 off by {g:.1e})"
             for v, g in zip(values, gaps)]
    return ", ".join(words)


def markdown_table(rows: list[Row], baseline: str | None = None) -> str:
    """The table as markdown; with `baseline` (a system's name), each failure-free and
    goodput mean also as a multiple of that system's."""
    base = next((r for r in rows if r.system == baseline), None)

    def ratio(values: list[float], ref: list[float]) -> str:
        if base is None or not values or not ref or mean(ref) == 0:
            return ""
        return f" ({mean(values) / mean(ref):.2f}x)"

    lines = ["| system | failure-free samples/s | goodput under kills, samples/s "
             "| s lost per preemption | ends equal to its failure-free run |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.system} | {_cell(r.free_rate)}{ratio(r.free_rate, base.free_rate if base else [])} "
                     f"| {_cell(r.goodput)}{ratio(r.goodput, base.goodput if base else [])} "
                     f"| {_cell(r.lost_s)} | {_equal(r.equal, r.gap)} |")
    return "\n".join(lines)
