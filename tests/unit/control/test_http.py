"""`--http`: the Prometheus metrics and the health endpoint of a run.

Unit: `RunMetrics` and `HealthServer` on a free loopback port, scraped and parsed with
prometheus_client's own parser. End to end: a real `bamboo train --http` run with a kill,
scraped while it trains; the scrape agrees with the run's summary.json and events.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bamboo.control.http import HealthServer, RunMetrics
from support.procs import BAMBOO, REPO, free_port, run_events


def _get(url: str, timeout: float = 5.0) -> tuple[int, str, str]:
    """(status, content type, body) of GET `url` (an HTTP error status is returned too)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics body."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- unit ------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_metrics_and_health_are_served() -> None:
    m = RunMetrics()
    m.set_step(12)
    m.set_loss(3.25)
    m.set_samples_per_second(640.0)
    m.set_live_nodes(3)
    m.set_stages_without_redundancy(2)
    m.add_preemptions("failover")
    m.add_preemptions("failover")
    m.add_preemptions("drain")
    m.add_preemptions("restart")  # any string the caller uses
    m.add_reconfigurations(2)
    m.observe_failover_pause(0.3)
    m.observe_failover_pause(7.0)
    health = {"ok": True}
    with HealthServer("127.0.0.1", 0, metrics=m,
                      health=lambda: (health["ok"], {"status": "training", "step": 12})) as srv:
        host, port = srv.address
        assert host == "127.0.0.1" and port > 0
        base = f"http://127.0.0.1:{port}"

        code, ctype, body = _get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        got = _samples(body)
        assert got[("bamboo_step", ())] == 12
        assert got[("bamboo_loss", ())] == 3.25
        assert got[("bamboo_samples_per_second", ())] == 640.0
        assert got[("bamboo_live_nodes", ())] == 3
        assert got[("bamboo_stages_without_redundancy", ())] == 2
        by_kind = {dict(k[1])["handled_as"]: v for k, v in got.items()
                   if k[0] == "bamboo_preemptions_total"}
        assert by_kind == {"failover": 2, "drain": 1, "restart": 1, "peer_restore": 0,
                           "checkpoint_restore": 0, "standby": 0}
        assert got[("bamboo_reconfigurations_total", ())] == 2
        assert got[("bamboo_failover_pause_seconds_count", ())] == 2
        assert got[("bamboo_failover_pause_seconds_sum", ())] == pytest.approx(7.3)
        assert got[("bamboo_failover_pause_seconds_bucket", (("le", "0.01"),))] == 0
        assert got[("bamboo_failover_pause_seconds_bucket", (("le", "0.5"),))] == 1
        assert got[("bamboo_failover_pause_seconds_bucket", (("le", "60.0"),))] == 2
        assert not any(k[0].startswith("python_") or k[0].startswith("process_") for k in got), \
            "the global registry's collectors leaked in"

        code, ctype, body = _get(base + "/healthz")
        assert (code, ctype) == (200, "application/json")
        assert json.loads(body) == {"status": "training", "step": 12}
        health["ok"] = False
        code, _, body = _get(base + "/healthz")
        assert code == 503 and json.loads(body)["status"] == "training"

        assert _get(base + "/")[0] == 404
        assert _get(base + "/metricsx")[0] == 404
        assert _get(base + "/metrics?debug=1")[0] == 200
    with pytest.raises(OSError):  # closed: the port no longer answers
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@pytest.mark.timeout(30)
def test_a_stalled_client_blocks_nobody(capfd: pytest.CaptureFixture[str]) -> None:
    with HealthServer("127.0.0.1", 0, metrics=RunMetrics()) as srv:
        port = srv.address[1]
        stalled = socket.create_connection(("127.0.0.1", port), timeout=5)
        half = socket.create_connection(("127.0.0.1", port), timeout=5)
        half.sendall(b"GET /metr")  # half a request line, never finished
        try:
            t = time.monotonic()
            for _ in range(3):
                code, _, body = _get(f"http://127.0.0.1:{port}/healthz", timeout=3)
                assert code == 200 and json.loads(body) == {"status": "ok"}
            assert time.monotonic() - t < 3
        finally:
            stalled.close()
            half.close()
    assert capfd.readouterr().err == ""  # no request log on stderr


@pytest.mark.timeout(10)
def test_a_taken_port_is_an_oserror() -> None:
    with HealthServer("127.0.0.1", 0) as srv:
        with pytest.raises(OSError):
            HealthServer("127.0.0.1", srv.address[1])


@pytest.mark.timeout(10)
def test_a_broken_health_check_is_503() -> None:
    def broken() -> tuple[bool, dict]:
        raise RuntimeError("no state yet")
    with HealthServer("127.0.0.1", 0, health=broken) as srv:
        code, _, body = _get(f"http://127.0.0.1:{srv.address[1]}/healthz")
        assert code == 503 and json.loads(body)["status"] == "error"
        assert _get(f"http://127.0.0.1:{srv.address[1]}/metrics")[0] == 200  # no registry: empty


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
                code, _, body = _get(base + "/healthz", timeout=2)
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
                got = _samples(_get(base + "/metrics", timeout=2)[2])
                statuses.add(json.loads(_get(base + "/healthz", timeout=2)[2])["status"])
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
    with pytest.raises(urllib.error.URLError):  # the run is over: so is the server
        _get(base + "/healthz", timeout=2)
