"""PNG plots of a simulation: live instances, throughput, cost per hour and value over time.

One line per policy, drawn from the timelines of run 0. Uses matplotlib's Agg
backend (no display needed); imported only when ``--plot`` is given.
"""

from __future__ import annotations

from pathlib import Path

from .core import RunResult

__all__ = ["write_plots"]


def _series(res: RunResult, bins: int = 120) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    tl = res.timeline or []
    H = res.duration_s
    width = H / bins if H > 0 else 1.0
    xs, live, thr, cph, val = [], [], [], [], []
    j = 0
    prev_samples, prev_cost = 0, 0.0
    last = (0.0, 0, 0, 0.0)
    for b in range(1, bins + 1):
        edge = b * width
        while j < len(tl) and tl[j][0] <= edge:
            last = tl[j]
            j += 1
        _, n, samples, cost = last
        xs.append(edge / 3600.0)
        live.append(n)
        thr.append((samples - prev_samples) / width)
        cph.append((cost - prev_cost) * 3600.0 / width)
        val.append(samples / cost if cost > 0 else 0.0)
        prev_samples, prev_cost = samples, cost
    return xs, live, thr, cph, val


def write_plots(results: dict[str, RunResult], out_dir: str | Path, title: str) -> list[Path]:
    """Write instances.png, throughput.png, cost.png, value.png and breakdown.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = {name: _series(r) for name, r in results.items()}
    panels = [
        ("instances.png", 1, "live instances (paid)"),
        ("throughput.png", 2, "throughput (samples/s)"),
        ("cost.png", 3, "cost ($/h)"),
        ("value.png", 4, "value so far (samples/$)"),
    ]
    paths = []
    for fname, idx, ylabel in panels:
        fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
        for name, s in series.items():
            ax.plot(s[0], s[idx], label=name, linewidth=1.2, drawstyle="steps-post" if idx < 4 else "default")
        ax.set_xlabel("time (hours)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, format="png", metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    names = list(results)
    cats = ["useful", "redundant", "checkpoint", "restart", "rebalance", "lost", "idle"]
    bottom = [0.0] * len(names)
    for c in cats:
        vals = [results[n].breakdown[c] / 3600.0 for n in names]
        ax.bar(names, vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("wall time (hours)")
    ax.set_title(f"{title}: where the time went")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "breakdown.png"
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    paths.append(path)
    return paths
