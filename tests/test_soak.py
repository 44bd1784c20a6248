"""`bamboo soak`: the user's job, failure-free and then with faults sent from outside."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bamboo.soak import COUNTERS, compare
from conftest import BAMBOO, REPO

BASE = {"losses": [5.0, 4.5, 4.0], "param_l2": 10.0, "param_sha256": "abc",
        "reconfigurations": 0, "preemptions": 0, **{k: 0 for k in COUNTERS}}


def test_compare_says_what_differs() -> None:
    assert compare(BASE, BASE) == ""
    one_loss = dict(BASE, preemptions=1, failovers=1)
    assert compare(BASE, one_loss) == ""
    assert "the loss of step 1" in compare(BASE, dict(BASE, losses=[5.0, 4.6, 4.0]))
    assert "2 losses" in compare(BASE, dict(BASE, losses=[5.0, 4.5]))
    assert "param_l2" in compare(BASE, dict(BASE, param_l2=10.1))
    assert "param_sha256 differs" in compare(BASE, dict(BASE, param_sha256="abd"))
    assert compare(BASE, dict(BASE, param_sha256="abd", reconfigurations=1)) == ""
    assert "counters sum to 0" in compare(BASE, dict(BASE, preemptions=1))
    assert "is nan" in compare(BASE, dict(BASE, losses=[5.0, float("nan"), 4.0]))


@pytest.mark.parametrize("args,expected", [
    (["--faults", "kill,meteor"], "--faults 'kill,meteor': choose from kill, stop"),
    (["--trials", "0"], "--trials must be a positive integer"),
    (["--resume", "auto"], "--out, --resume and --json are the soak's own"),
])
def test_bad_soak_flags_are_one_line(args: list[str], expected: str,
                                     capsys: pytest.CaptureFixture) -> None:
    from bamboo.cli import main
    with pytest.raises(SystemExit) as info:
        main(["soak", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_a_short_soak_of_a_small_job_is_equal_every_trial(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    proc = subprocess.run(BAMBOO + ["soak", "--nodes", "4", "--stages", "2", "--steps", "6",
                                    "--lease", "2", "--trials", "3", "--faults",
                                    "kill,stop,notice", "--seed", "1", "--out", str(out),
                                    "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=380)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert {k: result[k] for k in ("trials", "equal", "clear_stop", "hang", "wrong")} == {
        "trials": 3, "equal": 3, "clear_stop": 0, "hang": 0, "wrong": 0}, proc.stderr
    for case in result["cases"]:
        assert case["outcome"] == "equal" and case["command"].startswith("bamboo train ")
        assert case["faults"] and all("node" in f for f in case["faults"]), case
        lost = [json.loads(line) for line in
                (out / f"trial-{case['index']:03d}" / "events.jsonl").read_text().splitlines()
                if '"node_lost"' in line]
        assert lost, f"trial {case['index']}: no node was lost"
    assert "trials 3: equal 3" in proc.stderr
