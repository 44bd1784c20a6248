"""`--http`: the Prometheus metrics and the health endpoint of a run.

`RunMetrics` and `HealthServer` on a free loopback port, scraped and parsed with
prometheus_client's own parser. (End to end, a real `bamboo train --http` run scraped while it
trains, and the command line's refusals: tests/integration/test_http_runs.py.)
"""
from __future__ import annotations

import json
import socket
import time

import pytest

from bamboo.control.http import HealthServer, RunMetrics
from support.scrape import http_get, metric_samples

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

        code, ctype, body = http_get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        got = metric_samples(body)
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

        code, ctype, body = http_get(base + "/healthz")
        assert (code, ctype) == (200, "application/json")
        assert json.loads(body) == {"status": "training", "step": 12}
        health["ok"] = False
        code, _, body = http_get(base + "/healthz")
        assert code == 503 and json.loads(body)["status"] == "training"

        assert http_get(base + "/")[0] == 404
        assert http_get(base + "/metricsx")[0] == 404
        assert http_get(base + "/metrics?debug=1")[0] == 200
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
                code, _, body = http_get(f"http://127.0.0.1:{port}/healthz", timeout=3)
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
        code, _, body = http_get(f"http://127.0.0.1:{srv.address[1]}/healthz")
        assert code == 503 and json.loads(body)["status"] == "error"
        assert http_get(f"http://127.0.0.1:{srv.address[1]}/metrics")[0] == 200  # no registry: empty
