"""`bamboo soak`, run for real: short soaks of a small job end with every round equal to
the failure-free run and accounted."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bamboo.chaos.bits import bits_must_match
from support.procs import BAMBOO, REPO

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.timeout(400)
def test_a_short_soak_of_a_small_job_is_equal_every_trial(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    proc = subprocess.run(BAMBOO + ["soak", "--nodes", "4", "--stages", "2", "--steps", "8",
                                    "--lease", "2", "--trials", "3", "--faults",
                                    "kill,stop,notice", "--seed", "1", "--out", str(out),
                                    "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=380)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {k: result[k] for k in ("trials", "equal", "clear_stop", "hang", "wrong")} == {
        "trials": 3, "equal": 3, "clear_stop": 0, "hang": 0, "wrong": 0}, proc.stderr
    for case in result["cases"]:
        assert case["outcome"] == "equal"
        assert case["command"].startswith("bamboo train " if case["faults"][0]["kind"] != "stop"
                                          else "bamboo soak "), case
        assert case["faults"] and all("node" in f for f in case["faults"]), case
        events = [json.loads(line) for line in
                  (out / f"trial-{case['index']:03d}" / "events.jsonl").read_text().splitlines()]
        lost = [e for e in events if e["event"] == "node_lost"]
        if [e["step"] for e in events if e["event"] == "notice"] == [7]:
            # noticed for the last step: the run ends at the boundary it would drain at
            assert case["faults"][0]["kind"] == "notice" and not lost, case
            continue
        assert lost, f"trial {case['index']}: no node was lost"
    assert "trials 3: equal 3" in proc.stderr


def _soak(out: Path, args: list[str]) -> tuple[dict, list[dict]]:
    proc = subprocess.run(BAMBOO + ["soak", "--model", "gpt2-tiny", *args, "--out", str(out),
                                    "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    summaries = [json.loads((out / f"trial-{c['index']:03d}" / "summary.json").read_text())
                 for c in result["cases"]]
    assert result["equal"] == result["trials"], proc.stderr
    return result, summaries


@pytest.mark.timeout(300)
def test_a_soak_of_re_routes_judges_them_equal(tmp_path: Path) -> None:
    """D = 3: every loss is re-routed (the fp32 sums change order, so the bits may differ)
    and every trial is equal by the contract's rule; the rerun lines carry the kills."""
    result, summaries = _soak(tmp_path / "soak", [
        "--nodes", "6", "--stages", "2", "--micro-batches", "2", "--steps", "8",
        "--trials", "2", "--faults", "kill", "--seed", "11"])
    for case, summary in zip(result["cases"], summaries):
        assert summary["reroutes"] >= 1 and any(x["rerouted"] for x in summary["layouts"])
        assert "--kill " in case["command"], case


@pytest.mark.timeout(300)
def test_a_soak_of_shadows_and_peer_restores_judges_them_equal(tmp_path: Path) -> None:
    """D = 2: a kill is a shadow's failover (the layout kept: the bits must match), a burst
    of both nodes of a pipeline a failover then a peer restore (seed 3 draws both)."""
    result, summaries = _soak(tmp_path / "soak", [
        "--nodes", "4", "--stages", "2", "--steps", "8", "--lease", "2", "--trials", "2",
        "--faults", "kill,burst", "--seed", "3"])
    assert sum(s["peer_restores"] for s in summaries) >= 1, summaries
    kept = [s for s in summaries if bits_must_match(s)]
    assert kept and all(s["failovers"] >= 1 for s in kept)
    base = json.loads((tmp_path / "soak" / "failure-free" / "summary.json").read_text())
    assert all(s["param_sha256"] == base["param_sha256"] for s in kept)
