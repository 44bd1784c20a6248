"""The six PNG plots of a run's report (`bamboo.run.report`): loss, throughput, live nodes,
cost, pauses and the workers' resident memory, drawn on matplotlib's Agg canvas (no display needed)."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from bamboo.run.report_cost import cost, live_nodes
from bamboo.run.report_data import (
    DPI,
    HANDLED_COLOURS,
    OTHER_COLOUR,
    PLOT_SIZE_PX,
    Failure,
    Prices,
    Run,
    eval_losses,
    is_num,
    losses_of,
    pauses_of,
    samples_per_step,
    write_atomic,
)

__all__ = ["write_plots"]


def write_plots(run: Run, failures: list[Failure], prices: Prices, path: Path) -> list[Path]:
    """loss.png, throughput.png, nodes.png, cost.png, pauses.png and memory.png in `path`."""
    return [_plot_loss(run, failures, path / "loss.png"),
            _plot_throughput(run, failures, path / "throughput.png"),
            _plot_nodes(run, failures, path / "nodes.png"),
            _plot_cost(run, failures, prices, path / "cost.png"),
            _plot_pauses(run, failures, path / "pauses.png"),
            _plot_memory(run, failures, path / "memory.png")]


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(PLOT_SIZE_PX[0] / DPI, PLOT_SIZE_PX[1] / DPI), dpi=DPI)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=13,
            color="0.35")


def _png(fig: Any, path: Path, bottom: float = 0.12) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig.subplots_adjust(left=0.09, right=0.97, top=0.92, bottom=bottom)  # tight_layout: slow
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    write_atomic(path, buffer.getvalue())
    return path


def _colour(handled_as: str) -> str:
    return HANDLED_COLOURS.get(handled_as, OTHER_COLOUR)


def _mark_failures(ax: Any, failures: list[Failure], x_of: Any) -> None:
    seen: set[str] = set()
    for f in failures:
        x = x_of(f)
        if x is None:
            continue
        label = None if f.handled_as in seen else f"{f.handled_as} ({f.node} lost)"
        seen.add(f.handled_as)
        ax.axvline(x, color=_colour(f.handled_as), linestyle="--", linewidth=1.5, label=label)


def _plot_loss(run: Run, failures: list[Failure], path: Path) -> Path:
    fig, ax = _figure("Training loss per step", "step", "loss")
    losses = losses_of(run)
    if losses:
        ax.plot(range(len(losses)), losses, marker="o" if len(losses) < 40 else None,
                markersize=3, color="tab:blue", label="loss")
    else:
        _empty(ax, "no completed step")
    evals = eval_losses(run)
    if evals:  # after k steps: the parameters step k's training loss was taken with
        ax.plot([k for k, _ in evals], [x for _, x in evals], marker="s", markersize=4,
                color="tab:green", label="eval loss (held-out)")
    _mark_failures(ax, failures, lambda f: f.step)
    if losses or failures:
        ax.legend(loc="upper right", fontsize=8)
    return _png(fig, path)


def _plot_throughput(run: Run, failures: list[Failure], path: Path) -> Path:
    fig, ax = _figure("Throughput of each step", "time since start (s)", "samples/s")
    per_step = samples_per_step(run)
    points = [(float(e["t"]), per_step / float(e["wall_s"])) for e in run.of("step_done")
              if is_num(e.get("wall_s")) and e["wall_s"] > 0]
    if points:
        ax.plot(*zip(*points), marker=".", color="tab:blue", label="samples/s")
        ax.set_ylim(bottom=0)
    else:
        _empty(ax, "no timed step")
    _mark_failures(ax, failures, lambda f: f.t)
    if points or failures:
        ax.legend(loc="lower right", fontsize=8)
    return _png(fig, path)


def _plot_nodes(run: Run, failures: list[Failure], path: Path) -> Path:
    fig, ax = _figure("Live nodes", "time since start (s)", "nodes")
    series = live_nodes(run)
    ts, ns = zip(*series)
    ax.step(ts, ns, where="post", color="tab:blue", label="live nodes")
    ax.set_ylim(bottom=0, top=max(ns) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    if len(series) <= 2:
        _empty(ax, "no node_up event")
    _mark_failures(ax, failures, lambda f: f.t)
    ax.legend(loc="best", fontsize=8)
    return _png(fig, path)


def memory_series(run: Run) -> dict[str, list[tuple[float, int]]]:
    """Node -> [(t, resident bytes at the end of a step)], from the step_done records."""
    series: dict[str, list[tuple[float, int]]] = {}
    for e in run.of("step_done"):
        for n in e.get("nodes") or []:
            if isinstance(n, dict) and is_num(n.get("rss_bytes")) and n["rss_bytes"] > 0:
                series.setdefault(str(n.get("node")), []).append((float(e["t"]),
                                                                  int(n["rss_bytes"])))
    return series


def _plot_memory(run: Run, failures: list[Failure], path: Path) -> Path:
    fig, ax = _figure("Resident memory of each worker", "time since start (s)", "MiB")
    series = memory_series(run)
    for name in sorted(series, key=lambda n: (len(n), n)):
        ts, bs = zip(*series[name])
        ax.plot(ts, [b / 2**20 for b in bs], marker="." if len(ts) < 40 else None,
                label=name)
    if series:
        ax.set_ylim(bottom=0)
    else:
        _empty(ax, "no step reported its memory")
    _mark_failures(ax, failures, lambda f: f.t)
    if series or failures:
        ax.legend(loc="lower right", fontsize=8, ncol=2)
    return _png(fig, path)


def _plot_cost(run: Run, failures: list[Failure], prices: Prices, path: Path) -> Path:
    c = cost(run, failures, prices)
    fig, ax = _figure("Cumulative cost of the same work", "steps completed", "cost ($)")
    ax.plot(c.steps, c.spot, color="tab:green", label=f"spot, live nodes (${prices.spot:.2f}/h)")
    ax.plot(c.steps, c.on_demand, color="tab:red",
            label=f"on-demand, {c.on_demand_nodes} nodes (${prices.on_demand:.2f}/h)")
    if len(c.steps) == 1:
        _empty(ax, "no completed step")
    ax.legend(loc="upper left", fontsize=8)
    return _png(fig, path)


def _plot_pauses(run: Run, failures: list[Failure], path: Path) -> Path:
    fig, ax = _figure("Time lost per failure", "failure", "pause (s)")
    pauses = pauses_of(run, failures)
    if pauses:
        # one bar per lost node, labelled by node and step (a summary without its events:
        # numbered)
        named = len(failures) == len(pauses)
        labels = [f"{f.node}@{f.step}\n{f.handled_as}" for f in failures] if named else \
            [f"#{i + 1}" for i in range(len(pauses))]
        colours = [_colour(f.handled_as) for f in failures] if named else ["tab:blue"] * len(pauses)
        ax.bar(range(len(pauses)), pauses, color=colours, tick_label=labels)
        for i, p in enumerate(pauses):
            ax.annotate(f"{p:.2f} s", (i, p), ha="center", va="bottom", fontsize=8)
    else:
        _empty(ax, "no failures: no time lost")
        ax.set_xticks([])
    return _png(fig, path, bottom=0.17)
