"""The timeline model as text: a table of step times and bubbles, ASCII timelines of every
node (`render`, `ascii_timeline`), and the same figures as plain data (`summary`)."""
from __future__ import annotations

from typing import Any

from bamboo.plan.timeline import Comparison, Timeline

__all__ = ["ascii_timeline", "render", "summary"]


def ascii_timeline(tl: Timeline, width: int = 96, scale: float | None = None) -> list[str]:
    """One row per node: F forward, B backward, W weight gradient, R eager FRC, C commit,
    O optimizer, P a lazy replica's step past its node's idle time, . idle."""
    total = scale or tl.step_s or 1.0
    rows = []
    for nt in tl.nodes:
        cells = []
        for col in range(width):
            a, b = col * total / width, (col + 1) * total / width
            best, kind = 0.0, "." if a < tl.step_s else " "
            for i in nt.intervals:
                overlap = min(b, i.end) - max(a, i.start)
                if overlap > best:
                    best, kind = overlap, i.kind
            cells.append(kind if best >= 0.5 * (b - a) or kind in " ." else kind.lower())
        name = f"n{nt.node} s{'+'.join(map(str, nt.stages))}"
        rows.append(f"{name:<8}|{''.join(cells)}|")
    return rows


def render(cmp: Comparison, *, width: int = 96, show: bool = True) -> str:
    off = cmp.timelines["off"]
    where = "one processor per node" if off.cores is None else f"{off.cores} shared cores"
    where += f", FRC at {cmp.policy}, {cmp.schedule}"
    lines = [f"timeline model: P={off.stages} M={off.micro_batches}, {where}", "",
             f"{'mode':<6} {'step ms':>9} {'phase A ms':>11} {'overhead':>9}"]
    for mode, tl in cmp.timelines.items():
        lines.append(f"{mode:<6} {1e3 * tl.step_s:>9.2f} {1e3 * tl.phase_a_s:>11.2f} "
                     f"{100 * cmp.overhead(mode):>8.1f}%")
    lines += ["", (f"{'node':<6} {'mode':<6} {'busy ms':>8} {'idle ms':>8} {'bubbles':>8} "
                  f"{'FRC ms':>7} {'FRC in bubbles':>15}")]
    hidden = {n: (w, h) for n, w, h in cmp.frc_hidden()} if "eager" in cmp.timelines else {}
    for mode, tl in cmp.timelines.items():
        for nt in tl.nodes:
            extra = ""
            if mode == "eager" and nt.frc_s > 0:
                w, h = hidden[nt.node]
                extra = f"{1e3 * h:>7.2f} ({100 * h / w:.0f}%)"
            lines.append(f"n{nt.node:<5} {mode:<6} {1e3 * nt.busy():>8.2f} {1e3 * nt.idle_s:>8.2f} "
                         f"{len(nt.bubbles):>8} {1e3 * nt.frc_s:>7.2f} {extra:>15}")
    if show:
        scale = max(tl.step_s for tl in cmp.timelines.values())
        for mode, tl in cmp.timelines.items():
            lines += ["", (f"{mode}: {1e3 * tl.step_s:.2f} ms  (F forward, B backward, W weight "
                          f"gradient, R eager FRC, C commit, O optimizer, P lazy replica's "
                          f"step past the idle time, . idle; lower case: partly)")]
            lines += ascii_timeline(tl, width, scale)
    return "\n".join(lines)


def summary(cmp: Comparison) -> dict[str, Any]:
    """The figures of a comparison as plain data."""
    out: dict[str, Any] = {m: {"step_s": tl.step_s, "phase_a_s": tl.phase_a_s, "overhead": cmp.overhead(m),
               "idle_s": [nt.idle_s for nt in tl.nodes]} for m, tl in cmp.timelines.items()}
    if "eager" in cmp.timelines:
        out["frc_hidden"] = [{"node": n, "frc_s": w, "hidden_s": h} for n, w, h in cmp.frc_hidden()]
    return out
