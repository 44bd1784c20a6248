"""Scraping a run's `--http` server as Prometheus and a health check would: GET a path, and
parse a /metrics body with prometheus_client's own parser."""
from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str, str]:
    """(status, content type, body) of GET `url` (an HTTP error status is returned too)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics body."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
