"""Progress on stderr: a live line on a terminal, plain log lines otherwise."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["ProgressDisplay"]


class ProgressDisplay:
    """Shows step, loss, samples/s and each node's step time; prints events as they happen."""

    def __init__(self, total_steps: int, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True, highlight=False)
        self.live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, info="starting")
            self._progress.start()
        self.total = total_steps

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def step(self, step: int, loss: float, samples_per_s: float, node_ms: list[float]) -> None:
        if not self.enabled:
            return
        stages = "/".join(f"{ms:.0f}" for ms in node_ms)
        info = f"loss {loss:.4f}  {samples_per_s:,.0f} samples/s  node ms {stages}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, info=info)
        else:
            print(f"step {step + 1}/{self.total}  {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
