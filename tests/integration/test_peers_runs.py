"""benchmarks/peers end to end: one small job under Bamboo, torchrun + DCP and torchft, failure-free
and under one SIGKILL sent from outside, to its table, plot and judgements."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.peers.report import judge

pytestmark = pytest.mark.procs  # every test here starts processes

REPO = Path(__file__).resolve().parents[2]


# One run of the driver: six runs of ~30 s each on a slow day of a 2-core machine (186 s seen),
# so the bound leaves room for a machine twice as slow; a try that fails is tried once more
# (drive_peers) and --report-only runs nothing, hence each test's pytest bound.
DRIVE_S = 360


def drive(out: Path, *flags: str, timeout_s: float = DRIVE_S
          ) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """The driver's run into `out`: the finished process and its records by run name."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.peers.run", "--reps", "1",
                           "--boot-s", "1", "--stall-s", "60", "--out", str(out), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = {r["run"]: r for r in json.loads((out / "results.json").read_text())}
    return done, records


def drive_peers(out: Path, steps: int, *flags: str
                ) -> tuple[subprocess.CompletedProcess, dict[str, dict], Path]:
    """`drive` of `steps` steps for runs with torchft (skipped where the extra is missing),
    every run held to have run them all. torchft 0.2.0 hangs now and then after a kill (seen
    once in hundreds of benchmark runs; the driver records such a run as failed), so a run of
    the driver where only torchft failed is tried once more, into a directory of its own."""
    pytest.importorskip("torchft", reason="torchft is the peers extra: pip install -e '.[peers]'")
    flags = ("--steps", str(steps), *flags)
    where = out / "try1"
    done, records = drive(where, *flags)
    failed = [name for name, r in records.items() if r.get("error") is not None]
    if failed and all(name.startswith("torchft-") for name in failed):
        where = out / "try2"
        done, records = drive(where, *flags)
    for name, record in records.items():
        assert record.get("error") is None, record
        assert record["steps_completed"] == steps, name
        assert record.get("status", "completed") == "completed", name
    return done, records, where


def table_rows(out: Path) -> dict[str, list[str]]:
    """table.md's rows by system: the cells after the system's name."""
    rows = {}
    for line in (out / "table.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ("bamboo", "torchrun", "torchft"):
            rows[cells[0]] = cells[1:]
    return rows


def first_number(cell: str) -> float:
    return float(cell.split()[0])


@pytest.mark.timeout(2 * DRIVE_S + 120)
def test_three_systems_one_job_one_kill_to_a_table_and_a_plot(tmp_path: Path) -> None:
    flags = ["--systems", "bamboo,torchrun,torchft", "--workers", "2", "--micro-batches", "4",
             "--kills", "@15", "--bamboo-stages", "1", "--checkpoint-every", "10"]
    done, records, out = drive_peers(tmp_path, 40, *flags)
    assert sorted(records) == sorted(f"{s}-{k}-0" for s in ("bamboo", "torchrun", "torchft")
                                     for k in ("free", "kills-@15"))

    # the kill reached every system: Bamboo counts its preemption, the driver its SIGKILL
    assert records["bamboo-kills-@15-0"]["preemptions"] == 1
    assert records["torchrun-kills-@15-0"]["kills_sent"] == 1
    assert records["torchft-kills-@15-0"]["kills_sent"] == 1
    assert records["bamboo-free-0"]["preemptions"] == 0

    # Bamboo's invariant through the kill; torchrun replays the steps since its checkpoint
    # from the same data, so it ends with the same bits
    _, bamboo_equal, _ = judge(records["bamboo-kills-@15-0"], records["bamboo-free-0"])
    assert bamboo_equal
    torchrun_bits, _, _ = judge(records["torchrun-kills-@15-0"], records["torchrun-free-0"])
    assert torchrun_bits

    rows = table_rows(out)
    assert sorted(rows) == ["bamboo", "torchft", "torchrun"]
    for system, (free, goodput, _lost, equal) in rows.items():
        assert first_number(free) > 0 and first_number(goodput) > 0, system
        assert equal.startswith(("bit-equal", "yes", "no")), system
    assert rows["torchrun"][3] == "bit-equal"
    assert rows["bamboo"][3].startswith(("bit-equal", "yes"))
    assert first_number(rows["torchrun"][2]) > 0  # a restart from the checkpoint costs time
    assert (out / "peers.png").stat().st_size > 0
    # the Lighthouse's per-quorum lines stay out of the driver's terminal
    assert "torchft::lighthouse" not in done.stdout + done.stderr

    # --report-only rebuilds the same table (and the plot) from results.json, running nothing
    table = (out / "table.md").read_text()
    (out / "table.md").unlink()
    (out / "peers.png").unlink()
    drive(out, "--steps", "40", *flags, "--report-only", timeout_s=100)
    assert (out / "table.md").read_text() == table
    assert (out / "peers.png").stat().st_size > 0


@pytest.mark.timeout(2 * DRIVE_S + 60)
def test_a_job_of_two_stages_against_torchft_pipelines(tmp_path: Path) -> None:
    _, records, out = drive_peers(
        tmp_path, 30, "--systems", "bamboo,torchft", "--workers", "4", "--micro-batches", "8",
        "--kills", "@12", "--bamboo-stages", "2", "--torchft-stages", "2")
    assert sorted(records) == ["bamboo-free-0", "bamboo-kills-@12-0", "torchft-free-0",
                               "torchft-kills-@12-0"]
    assert records["bamboo-kills-@12-0"]["preemptions"] == 1
    assert records["torchft-kills-@12-0"]["kills_sent"] == 1
    _, bamboo_equal, _ = judge(records["bamboo-kills-@12-0"], records["bamboo-free-0"])
    assert bamboo_equal
    rows = table_rows(out)
    assert sorted(rows) == ["bamboo", "torchft"]
    assert rows["bamboo"][3].startswith(("bit-equal", "yes"))
