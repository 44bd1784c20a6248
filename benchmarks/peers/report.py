"""The harness's pure parts: the kill schedule, the goodput and seconds-lost arithmetic, and
the table. No processes, no torch: tests/unit/benchmarks_peers checks them."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from math import isfinite
from statistics import mean, median

from bamboo.chaos.bits import L2_REL, LOSS_REL


@dataclass(frozen=True)
class Kill:
    """One preemption: at `at` seconds after the first step began (`unit` "s"), or when step
    `at` begins (`unit` "step")."""

    at: float
    unit: str
    worker: int | None = None  # the worker it hits, once `assign_workers` chose it


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
    """The worker kill i hits in a rotation that never includes worker 0: 1 + i % (W-1)."""
    return 1 + i % (workers - 1)


def run_tag(system: str, schedule: str | None, rep: int) -> str:
    """The name of one run (its folder in --out, its `run` in results.json): failure-free
    where `schedule` is None."""
    label = "free" if schedule is None else f"kills-{schedule}".replace(":", "").replace(",", "_")
    return f"{system}-{label}-{rep}"


def kills_sent(record: dict, kills: list[Kill]) -> int:
    """How many of the schedule's kills reached a run (Bamboo's record counts preemptions)."""
    return int(record.get("kills_sent", record.get("preemptions", len(kills))))


def assign_workers(kills: list[Kill], workers: int, boot_s: float) -> list[Kill]:
    """Each kill with the worker it hits: the next in the rotation 1..W-1 (worker 0 never
    dies, so its record stays whole) whose replacement has booted (a kill in seconds within
    `boot_s` of the last one to hit a worker goes to another). A kill that finds every
    worker but 0 still booting is dropped: the trace removed an instance this job did not
    hold. Kills in steps keep the plain rotation."""
    if any(k.unit == "step" for k in kills):
        return [replace(k, worker=victim(i, workers)) for i, k in enumerate(kills)]
    up_at = dict.fromkeys(range(1, workers), float("-inf"))
    out: list[Kill] = []
    turn = 0
    for k in kills:
        for j in range(workers - 1):
            w = 1 + (turn + j) % (workers - 1)
            if up_at[w] <= k.at:
                out.append(replace(k, worker=w))
                up_at[w] = k.at + boot_s
                turn += j + 1
                break
    return out


def trace_removals(text: str) -> list[float]:
    """The seconds of each `remove` row of a trace (`ms,add|remove,node` rows)."""
    return [int(row.split(",")[0]) / 1000 for row in text.splitlines()
            if row.count(",") == 2 and row.split(",")[1].strip() == "remove"]


def trace_window(removals: list[float], which: str, window_s: float) -> tuple[float, list[float]]:
    """The start of the `window_s` window (aligned to multiples of it) with the most
    (`dense`) or the fewest but at least one (`quiet`) removals, and its removals' seconds
    from that start; ties go to the earliest."""
    counts = Counter(int(t // window_s) for t in removals)
    pick = max if which == "dense" else min
    index = pick(sorted(counts), key=lambda i: counts[i])
    start = index * window_s
    return start, [t - start for t in removals if start <= t < start + window_s]


def named_schedule(spec: str, trace_text: str, scale: float, window_s: float = 1800.0,
                   horizon_s: float = 3600.0) -> tuple[list[Kill], str]:
    """A schedule and a line saying what it is: `p3-dense` / `p3-quiet` (the trace's densest
    or quietest `window_s` window, its removals `scale` times faster, each removal a kill of
    one worker), `every:S` (a kill every S seconds up to `horizon_s`) or a literal
    schedule for `parse_schedule`."""
    if spec in ("p3-dense", "p3-quiet"):
        which = spec.split("-")[1]
        start, times = trace_window(trace_removals(trace_text), which, window_s)
        kills = [Kill(round(t / scale, 3), "s") for t in times]
        word = {"dense": "densest", "quiet": "quietest"}[which]
        return kills, (f"{spec}: the p3 trace's {word} {window_s / 60:.0f} min "
                       f"(from {start / 3600:.1f} h: {len(times)} removals) at {scale:g}x")
    if spec.startswith("every:"):
        try:
            every = float(spec.removeprefix("every:"))
        except ValueError:
            every = 0.0
        if every <= 0:
            raise ValueError(f"bad schedule {spec!r}: write every:S with S seconds > 0")
        n = int(horizon_s // every)
        return [Kill(every * (i + 1), "s") for i in range(n)], f"{spec}: a kill every {every:g} s"
    return parse_schedule(spec), spec or "none"


def bamboo_trace(kills: list[Kill], workers: int, boot_s: float) -> str:
    """A trace (ms,add|remove,node) that kills each kill's worker at its time and adds a
    replacement `boot_s` later (kills without a worker: `assign_workers` first)."""
    live = [f"n{i}" for i in range(workers)]
    rows = [f"0,add,{n}" for n in live]
    for i, k in enumerate(assign_workers(kills, workers, boot_s) if kills and kills[0].worker is None
                          else kills):
        slot, new = k.worker, f"n{workers + i}"
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
    equal: bool | None = None  # losses and param_l2 within the contract's tolerances
    gap: float | None = None  # |param_l2 - the failure-free run's|, where the bits differ
    detail: dict = field(default_factory=dict)
    bits: bool | None = None  # the same param_sha256 and losses, bit for bit

    @property
    def goodput(self) -> float:
        return self.useful_samples / self.train_s if self.train_s > 0 else 0.0


def judge(record: dict, free: dict) -> tuple[bool, bool, float | None]:
    """(bits, equal, gap) of a run's record against its system's failure-free record, by the
    rule every Bamboo run is held to (bamboo.chaos.bits): losses within LOSS_REL relative and
    param_l2 within L2_REL; bits equal where param_sha256 and every loss are identical."""
    bits = record["param_sha256"] == free["param_sha256"] and record["losses"] == free["losses"]
    if bits:
        return True, True, None
    got, want = record.get("losses") or [], free.get("losses") or []
    losses_ok = len(got) == len(want) and all(
        isfinite(a) and abs(a - b) <= LOSS_REL * abs(b) for a, b in zip(got, want))
    gap = abs(record["param_l2"] - free["param_l2"])
    return False, losses_ok and gap <= L2_REL * abs(free["param_l2"]), gap


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
    bits: list[bool | None] = field(default_factory=list)


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
        row.bits.append(o.bits)
        lost = seconds_lost(o, mean(row.free_rate) if row.free_rate else 0.0)
        if lost is not None:
            row.lost_s.append(lost)
    return list(rows.values())


def _cell(values: list[float], digits: int = 1) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values) if values else "-"


def _equal(values: list[bool | None], gaps: list[float | None],
           bits: list[bool | None] | None = None) -> str:
    """Per run: bit-equal; yes, within the tolerances, with its parameters' L2 distance from
    the failure-free run's; or no, with that distance."""
    if not values or all(v is None for v in values):
        return "-"
    gaps = gaps + [None] * (len(values) - len(gaps))
    bits = (bits or []) + [None] * (len(values) - len(bits or []))
    words = []
    for v, g, b in zip(values, gaps, bits):
        off = "" if g is None else f" (L2 off by {g:.1e})"
        words.append("-" if v is None else "bit-equal" if b else
                     f"yes{off}" if v else f"no{off}")
    return ", ".join(words)


def pair_ratios(values: list[float], ref: list[float]) -> list[float]:
    """Repetition i of one system over repetition i of the other: the runs were interleaved,
    so each pair saw the machine at about the same speed (a ratio that holds while the
    machine drifts). Empty unless both have the same number of runs."""
    if len(values) != len(ref) or any(r == 0 for r in ref):
        return []
    return [v / r for v, r in zip(values, ref)]


def markdown_table(rows: list[Row], baseline: str | None = None) -> str:
    """The table as markdown; with `baseline` (a system's name), each failure-free and
    goodput mean also as a multiple of that system's."""
    base = next((r for r in rows if r.system == baseline), None)

    def ratio(values: list[float], ref: list[float]) -> str:
        if base is None or not values or not ref or mean(ref) == 0:
            return ""
        pairs = pair_ratios(values, ref)
        paired = f"; pairs: median {median(pairs):.2f}x, {min(pairs):.2f}-{max(pairs):.2f}" \
            if len(pairs) > 1 else ""
        return f" ({mean(values) / mean(ref):.2f}x{paired})"

    lines = ["| system | failure-free samples/s | goodput under kills, samples/s "
             "| s lost per preemption | ends equal to its failure-free run |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.system} | {_cell(r.free_rate)}{ratio(r.free_rate, base.free_rate if base else [])} "
                     f"| {_cell(r.goodput)}{ratio(r.goodput, base.goodput if base else [])} "
                     f"| {_cell(r.lost_s)} | {_equal(r.equal, r.gap, r.bits)} |")
    return "\n".join(lines)
