"""`bamboo report`: the text figures and the PNGs of hand-made run directories.

The run directories are written by hand, following the contract's summary.json and
events.jsonl (node_up, step_done with per-stage timers, node_lost handled as failover,
drain and peer_restore, a replacement node_up, run_done / run_failed), so no training
runs here.

Its tests that start processes: tests/integration/test_report_runs.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.cli.report import main
from bamboo.run.report import PLOT_SIZE_PX, Prices, ReportError, load_run, report_text, write_report

PLOTS = ("loss.png", "throughput.png", "nodes.png", "cost.png", "pauses.png", "memory.png")
CONFIG = {"nodes": 5, "stages": 2, "pipelines": 2, "micro_batches": 2, "micro_batch_size": 4,
          "redundancy": "eager", "model": "gpt2-tiny", "seed": 0, "steps": 10, "data": None}
SAMPLES_PER_STEP = 2 * 2 * 4


def _stages(wall: float) -> list[dict]:
    return [{"step_s": wall, "compute_s": wall * 0.6, "wait_s": wall * 0.3, "reduce_s": wall * 0.05,
             "optim_s": wall * 0.05, "bytes_sent": 524288} for _ in range(2)]


def _step(t: float, step: int, loss: float, wall: float = 0.5) -> dict:
    nodes = [{"node": f"n{i}", "step_s": wall, "rss_bytes": (300 + 10 * i + step) << 20}
             for i in range(4)]
    return {"t": t, "event": "step_done", "step": step, "loss": loss, "wall_s": wall,
            "grad_norm": 1.5, "lr": 0.003, "stages": _stages(wall), "nodes": nodes}


def _node_up(t: float, node: str, pid: int, pipeline: int | None, stage: int | None) -> dict:
    return {"t": t, "event": "node_up", "node": node, "pid": pid, "pipeline": pipeline,
            "stage": stage}


def _summary(losses: list[float], **extra) -> dict:
    steps = len(losses)
    base = {"status": "completed", "error": None, "steps_completed": steps,
            "samples": steps * SAMPLES_PER_STEP, "losses": losses, "param_l2": 34.7,
            "param_sha256": "ab" * 32, "preemptions": 0, "failovers": 0, "drains": 0,
            "peer_restores": 0, "checkpoint_restores": 0, "standby_losses": 0,
            "reconfigurations": 0, "redone_steps": 0, "pause_s": [], "wall_s": 7.0,
            "throughput": steps * SAMPLES_PER_STEP / 7.0, "median_step_s": 0.5, "config": CONFIG}
    return base | extra


def _write(path: Path, summary: dict | None, events: list[dict], tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = "".join(json.dumps(e) + "\n" for e in events)
    (path / "events.jsonl").write_text(lines + tail)
    return path


def _start_events() -> list[dict]:
    return [{"t": 0.0, "event": "run_start", "config": CONFIG},
            *[_node_up(1.0, f"n{i}", 1000 + i, i // 2, i % 2) for i in range(4)],
            _node_up(1.0, "n4", 1004, None, None)]


LOSSES = [5.0 - 0.2 * k for k in range(10)]


def failures_run(path: Path) -> Path:
    """10 steps on 5 nodes (2 x 2 + a standby); 3 failures, one replacement."""
    events = _start_events()
    steps = [_step(2.0 + 0.5 * k, k, LOSSES[k]) for k in range(10)]
    lost = [
        {"t": 3.6, "event": "node_lost", "node": "n3", "step": 3, "phase": "backward",
         "handled_as": "failover", "shadow": "n2", "frc_reused": 3, "brc": 4, "resent_grads": 2,
         "pause_s": 0.4},
        {"t": 4.6, "event": "node_lost", "node": "n1", "step": 5, "phase": "forward",
         "handled_as": "drain", "pause_s": 0.2},
        _node_up(4.8, "n5", 1005, 0, 1),
        {"t": 5.7, "event": "node_lost", "node": "n4", "step": 7, "phase": "forward",
         "handled_as": "peer_restore", "pause_s": 1.0},
        {"t": 5.9, "event": "reconfigure", "pipelines": 2, "stages": 2},
    ]
    merged = sorted(events + steps + lost, key=lambda e: e["t"])
    merged.append({"t": 7.0, "event": "run_done", "steps": 10, "wall_s": 7.0})
    summary = _summary(LOSSES, preemptions=3, failovers=1, drains=1, peer_restores=1,
                       reconfigurations=1, redone_steps=1, pause_s=[0.4, 0.2, 1.0],
                       memory_nodes=["n0", "n1"], rss_per_node_bytes=[309 << 20, 319 << 20],
                       rss_growth_per_step_bytes=[1 << 20, None])
    return _write(path, summary, merged)


def clean_run(path: Path) -> Path:
    events = _start_events()[:5] + [_step(2.0 + 0.5 * k, k, LOSSES[k]) for k in range(5)]
    events.append({"t": 4.6, "event": "run_done", "steps": 5, "wall_s": 4.6})
    return _write(path, _summary(LOSSES[:5], wall_s=4.6), events)


def failed_run(path: Path) -> Path:
    """A run stopped by a lost node in step 2 (no failover): status failed, run_failed."""
    message = "node n1 (pipeline 0, stage 1) was lost in step 2 (SIGKILL); this run stops here"
    events = _start_events()[:5] + [_step(2.0, 0, 5.0), _step(2.5, 1, 4.8),
                                    {"t": 2.7, "event": "node_lost", "node": "n1", "step": 2,
                                     "signal": "SIGKILL", "handled_as": "stopped"},
                                    {"t": 2.9, "event": "run_failed", "error": message}]
    return _write(path, _summary([5.0, 4.8], status="failed", error=message, wall_s=2.9,
                                 preemptions=0), events)


def partial_run(path: Path) -> Path:
    """The launcher itself was killed: no summary.json, the last event line cut short."""
    events = _start_events()[:5] + [_step(2.0, 0, 5.0), _step(2.5, 1, 4.8)]
    return _write(path, None, events, tail='{"t": 3.0, "event": "step_do')


def no_step_run(path: Path) -> Path:
    events = _start_events()[:5] + [{"t": 1.5, "event": "run_failed", "error": "boom"}]
    return _write(path, _summary([], status="failed", error="boom", wall_s=1.5, throughput=0.0),
                  events)


SCENARIOS = {"failures": failures_run, "clean": clean_run, "failed": failed_run,
             "partial": partial_run, "no_step": no_step_run}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("runs")
    return {name: write_report(make(root / name)) for name, make in SCENARIOS.items()}


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_plot_is_a_real_png(reports: dict[str, list[Path]], scenario: str) -> None:
    paths = reports[scenario]
    assert [p.name for p in paths] == ["report.txt", *PLOTS]
    for path in paths[1:]:
        data = path.read_bytes()
        assert _png_size(data) == PLOT_SIZE_PX, path.name
        assert len(data) > 5_000, f"{scenario}/{path.name} is nearly empty ({len(data)} bytes)"
    assert not list(paths[0].parent.glob(".*.tmp-*")), "temporary files left behind"


def test_text_has_the_runs_figures(reports: dict[str, list[Path]]) -> None:
    text = reports["failures"][0].read_text()
    for expected in [
        "status: completed",
        "steps: 10 completed (160 samples)",
        "loss: 5.0000 first -> 3.2000 last (36.0% drop)",
        "throughput: 22.86 samples/s; wall time 7.00 s",
        "preemptions: 3 (failover 1, drain 1, peer restore 1, checkpoint restore 0, standby 0, reroute 0)",
        "n3 lost in step 3 (backward): failover, shadow n2, pause 0.40 s",
        "n1 lost in step 5 (forward): drain, pause 0.20 s",
        "n4 lost in step 7 (forward): peer_restore, pause 1.00 s",
        "pause per failure: 0.40, 0.20, 1.00 s (total 1.60 s, mean 0.53 s)",
        "reconfigurations: 1; redone steps: 1",
        "resident memory (peak, growth over the second half): n0 309 MiB, +1.00 MiB/step; "
        "n1 319 MiB",
        # live nodes: 5 x 2.6 s + 4 x 1.0 + 3 x 0.2 + 4 x 0.9 + 3 x 1.3 = 25.1 node-seconds
        "cost on spot: $0.0063 for 25.1 node-seconds at $0.91/node-hour",
        # 2 x 2 nodes for 7.0 - 1.0 - 1.6 s = 4.4 s at $3.06/h = $0.0150
        "cost on on-demand: $0.0150 for 4 nodes x 4.4 s at $3.06/node-hour (spot saves 57.6%)",
        "assumption:",
    ]:
        assert expected in text, f"missing {expected!r} in:\n{text}"


def test_prices_are_configurable(tmp_path: Path) -> None:
    run = load_run(failures_run(tmp_path / "r"))
    text = report_text(run, Prices(spot=3.06, on_demand=3.06))
    assert "at $3.06/node-hour" in text
    assert "spot costs 42.6% more" in text  # 25.1 node-s against 17.6: spot pays its extra nodes


def test_failed_and_partial_runs_are_reported(reports: dict[str, list[Path]]) -> None:
    failed = reports["failed"][0].read_text()
    assert "status: failed: node n1 (pipeline 0, stage 1) was lost in step 2" in failed
    assert "steps: 2 completed (32 samples)" in failed
    assert "n1 lost in step 2: stopped" in failed
    partial = reports["partial"][0].read_text()
    assert "incomplete (no summary.json" in partial
    assert "loss: 5.0000 first -> 4.8000 last (4.0% drop)" in partial
    assert "events.jsonl line 8 is cut short" in partial
    assert "loss: no completed step" in reports["no_step"][0].read_text()
    assert "preemptions: 0" in reports["clean"][0].read_text()


def test_loss_plot_marks_each_failure_in_its_colour(reports: dict[str, list[Path]]) -> None:
    import numpy as np
    from matplotlib.image import imread

    def has(path: Path, rgb: tuple[int, int, int]) -> bool:
        pixels = (imread(path)[..., :3] * 255).round()
        return bool(np.any(np.all(np.abs(pixels - np.array(rgb)) <= 2, axis=-1)))

    orange, green, purple = (255, 127, 14), (44, 160, 44), (148, 103, 189)  # tab: colours
    loss = reports["failures"][1]
    assert has(loss, orange) and has(loss, green) and has(loss, purple)
    assert not has(reports["clean"][1], orange)


def test_malformed_event_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = clean_run(tmp_path / "r")
    lines = (run / "events.jsonl").read_text().splitlines(keepends=True)
    lines.insert(3, "{not json}\n")
    (run / "events.jsonl").write_text("".join(lines))
    with pytest.raises(ReportError, match=r"events.jsonl line 4: not valid JSON"):
        load_run(run)
    lines[3] = '{"t": 1.0, "event": "step_done", "step": "x", "loss": 1.0}\n'
    (run / "events.jsonl").write_text("".join(lines))
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 4: step_done needs an integer 'step'" in err


@pytest.mark.malformed_run_files
@pytest.mark.parametrize("case", ["missing", "empty", "file", "bad summary", "bad losses"])
def test_bad_run_directory_is_one_line_and_exit_2(tmp_path: Path, case: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "run"
    if case == "empty":
        target.mkdir()
    elif case == "file":
        target.write_text("x")
    elif case == "bad summary":
        _write(target, None, []).joinpath("summary.json").write_text("{\"losses\": [1,\n")
    elif case == "bad losses":
        _write(target, {"losses": "many"}, [])
    assert main([str(target)]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("bamboo report: error: ") and out.err.count("\n") == 1
    assert "Traceback" not in out.err and out.out == ""
