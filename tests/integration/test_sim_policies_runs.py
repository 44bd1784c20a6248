"""`bamboo simulate` as a command: policies over the real p3 trace, as a user runs them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.procs import REPO

TRACES = REPO / "traces"
P3 = TRACES / "aws-p3-2xlarge.csv"

pytestmark = pytest.mark.procs  # every test here starts processes


def _sim(*args):
    return subprocess.run([sys.executable, "-m", "bamboo.sim", *args], capture_output=True, text=True)


def test_same_seed_gives_byte_identical_json():
    args = ["--trace", "synthetic:p=0.1,hours=4", "--runs", "8", "--seed", "3", "--json",
            "--policies", "bamboo,checkpoint,on-demand,adaptive"]
    a, b = _sim(*args), _sim(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    c = _sim(*args[:-3], "4", *args[-2:])
    assert c.stdout != a.stdout
    d = json.loads(a.stdout)
    for name, e in d["policies"].items():
        for key, typ in (("throughput", float), ("cost_per_hour", float), ("value", float), ("preemptions", int),
                         ("fatal_failures", int), ("reconfigurations", int), ("steps", int)):
            assert isinstance(e[key], typ), (name, key)
        assert abs(e["value"] - 3600 * e["throughput"] / e["cost_per_hour"]) < 1e-3 * e["value"]


def test_every_format_end_to_end_and_plots(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps([i * 60000, "add", {"nodes": [f"n{i}"]}]) for i in range(30)) + "\n"
                  + json.dumps([3_600_000, "remove", {"nodes": ["n3"]}]) + "\n")
    for trace in (str(P3), str(TRACES / "gcp-a100-counts.txt"), str(jl), "synthetic:mtbf=30min,hours=3"):
        r = _sim("--trace", trace, "--json", "--model", "bert")
        assert r.returncode == 0, (trace, r.stderr)
        assert set(json.loads(r.stdout)["policies"]) == {"bamboo", "checkpoint", "on-demand"}
    r = _sim("--trace", str(P3), "--plot", str(tmp_path / "plots"), "--policies", "bamboo,checkpoint")
    assert r.returncode == 0, r.stderr
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert len(pngs) == 5
    for p in pngs:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


@pytest.mark.timeout(60)
def test_every_format_json_end_to_end_and_same_seed_same_bytes(tmp_path):
    """Each trace format through `python -m bamboo.sim --json`: valid contract JSON, and byte-identical
    stdout when run twice with the same seed (a file trace with --runs uses seeded random placement)."""
    rows = [[i * 60000, "add", {"nodes": [f"n{i}"]}] for i in range(26)]
    rows += [[3_600_000, "remove", {"nodes": ["n3"], "zone": "a"}], [3_700_000, "no-op", {}],
             [3_800_000, "remove", {"nodes": ["n4", "n5"]}], [7_200_000, "add", {"nodes": ["n3b"]}]]
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    arr = tmp_path / "t.json"
    arr.write_text(json.dumps(rows, indent=1))
    counts = tmp_path / "c.txt"
    counts.write_text("\n".join(f"2024-01-01, {h:02d}:00:00, {n}" for h, n in enumerate([30, 28, 31, 24, 26])) + "\n")
    traces = [str(P3), str(TRACES / "gcp-a100-counts.txt"), str(counts), str(jl), str(arr),
              "synthetic:p=0.25,hours=3", "synthetic:mtbf=20min,hours=3"]
    pols = "bamboo,checkpoint,on-demand,adaptive"
    for trace in traces:
        args = ["--trace", trace, "--json", "--policies", pols, "--seed", "7", "--runs", "3", "--jobs", "1"]
        a, b = _sim(*args), _sim(*args)
        assert a.returncode == 0, (trace, a.stderr)
        assert a.stdout == b.stdout, trace
        d = json.loads(a.stdout)
        assert set(d) >= {"trace", "model", "hours", "policies"} and set(d["policies"]) == set(pols.split(","))
        for e in d["policies"].values():
            assert e["throughput"] >= 0 and e["cost_per_hour"] > 0 and e["steps"] >= 0, (trace, e)


def test_user_errors_are_one_line(tmp_path):
    for args in (["--trace", str(P3), "--model", "llama"], ["--trace", str(P3), "--policies", "magic"],
                 ["--trace", str(P3), "--costs", str(tmp_path / "none.json")], ["--trace", "synthetic:p=7"],
                 ["--trace", str(P3), "--runs", "-1"], ["--trace", str(P3), "--bogus"]):
        r = _sim(*args)
        assert r.returncode == 2, args
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, (args, r.stderr)
