"""A run's report: `report.txt` and PNG plots, rebuilt from summary.json and events.jsonl.

    write_report("runs/demo-20250101-120000")   # what `bamboo report RUN_DIR` runs (bamboo.cli.report)

Writes, into the run directory:

- `report.txt`: steps, first and last loss and the relative drop, throughput, wall time,
  every preemption and how it was handled, the pause each cost, reconfigurations, and
  the run's cost on spot against the same work on on-demand instances;
- `loss.png` (loss per step, a vertical line at each failure's step, coloured by how it
  was handled), `throughput.png` (samples/s of each step over time), `nodes.png` (live
  nodes over time), `cost.png` (cumulative $ on spot against on-demand, per step) and
  `pauses.png` (the wall time each failure cost) and `memory.png` (each worker's resident
  memory at the end of each step, over time).

It needs no torch and works on a finished, a failed and a cut-short run (one whose
launcher was killed: then summary.json may be missing and the figures come from the
events alone). Plots use matplotlib's Agg canvas directly, so no display is needed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bamboo.run.report_cost import cost, cost_lines
from bamboo.run.report_data import (
    COUNTERS,
    PLOT_SIZE_PX,
    Failure,
    Prices,
    ReportError,
    Run,
    end_time,
    eval_losses,
    failures_of,
    is_num,
    load_run,
    losses_of,
    pauses_of,
    samples_per_step,
    write_atomic,
)

__all__ = ["Prices", "Run", "ReportError", "load_run", "report_text", "write_report",
           "PLOT_SIZE_PX"]



# -- the text -----------------------------------------------------------------------------


def report_text(run: Run, prices: Prices | None = None) -> str:
    """The text of report.txt."""
    prices = prices or Prices()
    s, failures = run.summary, failures_of(run)
    losses, pauses = losses_of(run), pauses_of(run, failures)
    steps = int(s.get("steps_completed", len(losses)))
    samples = s.get("samples", steps * samples_per_step(run))
    wall = float(s["wall_s"]) if is_num(s.get("wall_s")) else end_time(run)
    throughput = float(s["throughput"]) if is_num(s.get("throughput")) else (
        samples / wall if wall > 0 else 0.0)
    out = [f"Bamboo run report: {run.path}", f"status: {run.status}"]
    cfg = run.config
    if cfg:
        out.append("job: " + ", ".join(f"{k} {cfg[k]}" for k in (
            "model", "nodes", "stages", "pipelines", "micro_batches", "micro_batch_size",
            "redundancy", "seed") if cfg.get(k) is not None))
    out.append(f"steps: {steps} completed ({int(samples)} samples)")
    if losses:
        first, last = losses[0], losses[-1]
        drop = (first - last) / first if first else 0.0
        out.append(f"loss: {first:.4f} first -> {last:.4f} last ({100 * drop:.1f}% drop)")
    else:
        out.append("loss: no completed step")
    evals = eval_losses(run)
    if evals:
        (a, first), (b, last) = evals[0], evals[-1]
        out.append(f"eval loss (held-out): {first:.4f} after {a} steps -> {last:.4f} after "
                   f"{b} steps ({len(evals)} evaluations)")
    median = s.get("median_step_s")
    out.append(f"throughput: {throughput:.2f} samples/s; wall time {wall:.2f} s"
               + (f"; median step {median:.3f} s" if is_num(median) else ""))
    out += _memory_lines(s)
    out += _failure_lines(run, failures, pauses)
    out += _mode_lines(run)
    out.append(f"reconfigurations: {int(s.get('reconfigurations', 0))}; "
               f"redone steps: {int(s.get('redone_steps', 0))}")
    out += cost_lines(cost(run, failures, prices), prices)
    out += [f"warning: {w}" for w in run.warnings]
    return "\n".join(out) + "\n"


def _memory_lines(s: dict[str, Any]) -> list[str]:
    """Peak resident memory per node, and how fast it grew over the run's second half."""
    names, peaks = s.get("memory_nodes"), s.get("rss_per_node_bytes")
    if not isinstance(names, list) or not isinstance(peaks, list) or not any(peaks):
        return []
    growth = s.get("rss_growth_per_step_bytes") or [None] * len(names)
    cells = []
    for name, peak, g in zip(names, peaks, growth):
        rate = f", {g / 2**20:+.2f} MiB/step" if is_num(g) else ""
        cells.append(f"{name} {peak / 2**20:.0f} MiB{rate}")
    return ["resident memory (peak, growth over the second half): " + "; ".join(cells)]


def _mode_lines(run: Run) -> list[str]:
    """`--redundancy auto`: the mode of every generation, with the figures it was chosen on."""
    out = []
    for e in run.of("redundancy_mode"):
        expected = e.get("expected") if isinstance(e.get("expected"), dict) else {}
        figures = ", ".join(f"{m} {v:.1f}" for m, v in expected.items() if is_num(v))
        rate = e.get("rate_per_node_hour")
        out.append(f"  t={float(e.get('t', 0)):.2f} s  generation {e.get('gen')} from step "
                   f"{e.get('step')}: {e.get('mode')}"
                   + (f" at {rate:.3f} preemptions/node-hour" if is_num(rate) else "")
                   + (f" (expected samples/s: {figures})" if figures else ""))
    return ["redundancy over time:"] + out if out else []


def _failure_lines(run: Run, failures: list[Failure], pauses: list[float]) -> list[str]:
    s = run.summary
    count = int(s.get("preemptions", len(failures)))
    if "preemptions" in s:
        kinds = ", ".join(f"{label} {int(s.get(key, 0))}" for key, label in COUNTERS)
    else:
        by: dict[str, int] = {}
        for f in failures:
            by[f.handled_as] = by.get(f.handled_as, 0) + 1
        kinds = ", ".join(f"{k} {v}" for k, v in by.items()) or "none"
    out = [f"preemptions: {count} ({kinds})"]
    for f in failures:
        where = f"step {f.step}" + (f" ({f.phase})" if f.phase else "")
        shadow = f", shadow {f.shadow}" if f.shadow else ""
        steps = " and ".join(map(str, f.reconfigured_at))
        reconf = (f" ({f.reconfiguration_s:.2f} s of it the reconfiguration"
                  f"{'s' if len(f.reconfigured_at) > 1 else ''} before step"
                  f"{'s' if len(f.reconfigured_at) > 1 else ''} {steps})"
                  if f.reconfiguration_s > 0 and f.reconfigured_at else "")
        out.append(f"  t={f.t:.2f} s  {f.node} lost in {where}: {f.handled_as}{shadow}, "
                   f"pause {f.pause_s:.2f} s{reconf}")
    if pauses:
        out.append(f"pause per failure: {', '.join(f'{p:.2f}' for p in pauses)} s (total "
                   f"{sum(pauses):.2f} s, mean {sum(pauses) / len(pauses):.2f} s)")
    else:
        out.append("pause per failure: none")
    return out


def write_report(run_dir: str | Path, prices: Prices | None = None) -> list[Path]:
    """Write report.txt and the five PNGs into `run_dir`; their paths, report.txt first."""
    prices = prices or Prices()
    run = load_run(run_dir)
    failures = failures_of(run)
    path = run.path
    try:
        text_path = path / "report.txt"
        write_atomic(text_path, report_text(run, prices).encode("utf-8"))
        from bamboo.run.report_plots import write_plots
        return [text_path, *write_plots(run, failures, prices, path)]
    except PermissionError as e:
        raise ReportError(f"cannot write the report into '{path}': {e.strerror}") from None

