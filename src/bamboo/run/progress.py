"""Progress on stderr: a live panel on a terminal, plain log lines otherwise.

The panel shows the step, loss and samples/s, one row per pipeline (which node holds
which stage; a node holding two stages is a shadow that took over a lost one), and
the events as they happen. A display, not a log: it writes to stderr itself (`quiet` turns it
off), while the library's warnings and notes are logged (`bamboo.util.logs`); with the display
off, the run's own warnings are logged too.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bamboo.util.logs import by

log = logging.getLogger(__name__)
_WARNING = "warning: "

__all__ = ["ProgressDisplay", "pipeline_rows"]


def pipeline_rows(holders: Sequence[Sequence[int]], names: Sequence[str],
                  dead: Sequence[int] = (),
                  served: dict[tuple[int, int], Sequence[int]] | None = None) -> list[str]:
    """One line per pipeline: `n0:s0  n1:s1  n2:s2+s3 (shadow)`; a slot re-routed to
    data-parallel peers reads `s1 served by n3+n5`."""
    rows = []
    served = served or {}
    for d, row in enumerate(holders):
        cells: list[tuple[int, str]] = []
        seen: dict[int, list[int]] = {}
        for s, rank in enumerate(row):
            if (d, s) in served:
                cells.append((s, f"s{s} served by " + "+".join(names[p] for p in served[(d, s)])))
                continue
            seen.setdefault(rank, []).append(s)
        for rank, stages in seen.items():
            label = f"{names[rank]}:" + "+".join(f"s{s}" for s in stages)
            if rank in dead:
                label += " (lost)"
            elif len(stages) > 1:
                label += " (shadow)"
            cells.append((stages[0], label))
        rows.append(f"pipeline {d}: " + "  ".join(label for _, label in sorted(cells)))
    return rows


class ProgressDisplay:
    """Shows step, loss, samples/s, the layout per pipeline; prints events as they happen."""

    def __init__(self, total_steps: int, *, enabled: bool = True, prog: str | None = None
                 ) -> None:
        self.enabled = enabled
        self.prog = prog
        """The call that shows no display (`bamboo.train` under `quiet=True`): its run's
        warnings still reach the `bamboo` logger, in its words."""
        self.console = Console(stderr=True, highlight=False)
        self.live = enabled and self.console.is_terminal
        self.total = total_steps
        self._rows: list[str] = []
        self._standbys = ""
        self._eval = ""
        """The latest held-out loss, shown after the training loss."""
        self._progress: Progress | None = None
        self._live: Live | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console)
            self._task = self._progress.add_task("train", total=total_steps, info="starting")
            self._live = Live(self._render(), console=self.console, refresh_per_second=8,
                              transient=False)
            self._live.start()

    def _render(self) -> Group:
        table = Table.grid(padding=(0, 2))
        for row in self._rows:
            table.add_row(row)
        if self._standbys:
            table.add_row(f"[dim]{self._standbys}[/dim]")
        assert self._progress is not None
        return Group(self._progress, table)

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def message(self, text: str) -> None:
        if not self.enabled:
            if text.startswith(_WARNING):  # not lost with the display: a record a script sees
                log.warning("%s", text[len(_WARNING):], extra=by(self.prog) if self.prog else {})
            return
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def layout(self, rows: list[str], standbys: Sequence[str] = ()) -> None:
        """The current holders, one row per pipeline; printed as lines when not live."""
        if not self.enabled:
            return
        self._rows = rows
        self._standbys = ("standby: " + " ".join(standbys)) if standbys else ""
        if self._live is not None:
            self._refresh()
        else:
            for row in rows + ([self._standbys] if self._standbys else []):
                print(f"  {row}", file=sys.stderr, flush=True)

    def step(self, step: int, loss: float, samples_per_s: float, node_ms: list[float],
             rss_max_bytes: int = 0, metrics: dict[str, float] | None = None) -> None:
        """A committed step; `rss_max_bytes` is the largest worker's resident memory;
        `metrics` the job's (`--metric`), shown beside the loss."""
        if not self.enabled:
            return
        stages = "/".join(f"{ms:.0f}" for ms in node_ms)
        info = f"loss {loss:.4f}{_metrics_text(metrics)}{self._eval}  " \
               f"{samples_per_s:,.0f} samples/s  node ms {stages}"
        if rss_max_bytes:
            info += f"  rss {rss_max_bytes / 2**20:,.0f} MiB max"
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, info=info)
            self._refresh()
        else:
            print(f"step {step} ({step + 1}/{self.total} done)  {info}", file=sys.stderr, flush=True)

    def evaluation(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        """The held-out loss (and metrics) of the parameters after `step` steps (those step
        `step`, from 0, starts from): a line, and beside the loss from now on."""
        if not self.enabled:
            return
        self._eval = f"  eval {loss:.4f}{_metrics_text(metrics)} @{step}"
        self.message(f"eval after {step} steps: loss {loss:.4f}{_metrics_text(metrics)}")

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _metrics_text(metrics: dict[str, float] | None) -> str:
    """`  accuracy 0.8125` for each metric, or nothing."""
    return "".join(f"  {name} {value:.4g}" for name, value in (metrics or {}).items())
