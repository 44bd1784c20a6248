"""`--http` end to end: a bad or taken `--http` value is one line and starts nothing, and a
real `bamboo train --http` run with a kill is scraped while it trains; the scrape agrees
with the run's summary.json and events. (`RunMetrics` and `HealthServer` alone:
tests/unit/control/test_http.py.)
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest

from support.procs import BAMBOO, REPO, free_port, run_events
from support.scrape import http_get, metric_samples

# -- the command line ------------------------------------------------------------------------

def _bamboo(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(BAMBOO + args, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["nonsense", "127.0.0.1:99999", ":80"])
def test_a_bad_http_value_is_one_line(tmp_path: Path, value: str) -> None:
    proc = _bamboo(["train", "--http", value, "--out", str(tmp_path / "run")], timeout=50)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bamboo train: error: --http"), lines
    assert not (tmp_path / "run").exists()


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_taken_http_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _bamboo(["train", "--nodes", "1", "--stages", "1", "--steps", "1", "--quiet",
                        "--no-report", "--http", f"127.0.0.1:{port}",
                        "--out", str(tmp_path / "run")], timeout=110)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"bamboo train: error: cannot serve --http 127.0.0.1:{port} "
                     f"(Address already in use)"], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_run_is_scraped_while_it_trains(tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "run"
    steps = 30
    proc = subprocess.Popen(
        BAMBOO + ["train", "--nodes", "2", "--stages", "2", "--steps", str(steps), "--kill",
                  "0:1@10", "--http", f"127.0.0.1:{port}", "--out", str(out), "--quiet",
                  "--no-report", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        health, deadline = None, time.monotonic() + 150
        while health is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                code, _, body = http_get(base + "/healthz", timeout=2)
                assert code == 200
                health = json.loads(body)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)
        assert health is not None, f"/healthz never answered; exit {proc.poll()}"
        assert health["status"] in ("starting", "training") and health["steps"] == steps
        statuses = {health["status"]}

        scraped = None
        while scraped is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                got = metric_samples(http_get(base + "/metrics", timeout=2)[2])
                statuses.add(json.loads(http_get(base + "/healthz", timeout=2)[2])["status"])
            except (urllib.error.URLError, ConnectionError):
                break  # the run ended between two scrapes
            failovers = got[("bamboo_preemptions_total", (("handled_as", "failover"),))]
            if got[("bamboo_step", ())] >= 15 and failovers == 1:
                scraped = got
            else:
                time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert scraped is not None, "never scraped step >= 15 with the failover counted"
    assert "training" in statuses

    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(stdout) == summary
    events = run_events(out)
    assert [e["address"] for e in events if e["event"] == "http"] == [f"127.0.0.1:{port}"]

    step = int(scraped[("bamboo_step", ())])
    assert 15 <= step <= steps
    assert scraped[("bamboo_loss", ())] == pytest.approx(summary["losses"][step - 1], abs=1e-6)
    # The last recorded step's throughput: the global batch over that step's wall time.
    batch = summary["samples"] // summary["steps_completed"]
    walls = {e["step"]: e["wall_s"] for e in events if e["event"] == "step_done"}
    candidates = [batch / walls[k] for k in range(step - 4, step) if k in walls]  # records lag
    assert any(scraped[("bamboo_samples_per_second", ())] == pytest.approx(c, rel=1e-6)
               for c in candidates)
    # One kill with a live replica: a failover, the other node left holding both stages
    # (nobody keeps a replica of either).
    assert summary["failovers"] == 1 and summary["preemptions"] == 1
    assert scraped[("bamboo_live_nodes", ())] == summary["config"]["nodes"] - 1 == 1
    assert scraped[("bamboo_stages_without_redundancy", ())] == 2
    assert scraped[("bamboo_reconfigurations_total", ())] == summary["reconfigurations"]
    assert scraped[("bamboo_failover_pause_seconds_count", ())] == 1
    assert scraped[("bamboo_failover_pause_seconds_sum", ())] == \
        pytest.approx(summary["pause_s"][0], abs=1e-4)
    for kind in ("drain", "peer_restore", "checkpoint_restore", "standby"):
        assert scraped[("bamboo_preemptions_total", (("handled_as", kind),))] == 0
    # The largest worker's resident memory at a recent step report (the records lag).
    rss = {e["step"]: max(n["rss_bytes"] for n in e["nodes"]) for e in events
           if e["event"] == "step_done"}
    assert scraped[("bamboo_worker_rss_bytes_max", ())] in \
        [rss[k] for k in range(step - 4, step) if k in rss]
    # lazy (the default): the survivor kept its successor's replica in host memory until
    # the failover, and the gauge keeps the largest
    assert scraped[("bamboo_replica_host_bytes_max", ())] == summary["replica_host_bytes"] > 0
    with pytest.raises(urllib.error.URLError):  # the run is over: so is the server
        http_get(base + "/healthz", timeout=2)
