"""The job every system trains (benchmarks/peers/job.py) and the driver's flags that shape it:
`--pin` travels to every system's workers and to Bamboo's `--pin-cpus auto`."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchmarks.peers import run
from benchmarks.peers.job import ENV, Job


def test_the_job_travels_whole_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    job = Job(steps=7, workers=2, pin=True)
    monkeypatch.setenv(ENV, job.to_env())
    assert Job.from_env() == job


def test_bamboo_is_pinned_only_when_the_job_is() -> None:
    assert "--pin-cpus" not in Job().bamboo_flags()
    flags = Job(workers=2, pin=True).bamboo_flags()
    assert flags[flags.index("--pin-cpus") + 1] == "auto"


def test_the_ray_systems_take_kills_in_seconds_only(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("ray", reason="the peers extra (make setup installs it)")
    a = run.parse_args(["--systems", "bamboo-ray,ray-train", "--kills", "15,40"])
    assert a.system_list == ["bamboo-ray", "ray-train"]
    with pytest.raises(SystemExit) as stop:
        run.parse_args(["--systems", "ray-train", "--kills", "@15"])
    assert stop.value.code == 2
    assert "ray-train takes kills in seconds only" in capsys.readouterr().err


def test_the_report_compares_with_ray_train_where_torchrun_did_not_run(tmp_path: Path) -> None:
    """A Ray run's records: the table's ratios are against ray-train unless --baseline says."""
    records = [{"run": f"{system}-free-0", "system": system, "schedule": "free",
                "losses": [2.0], "samples": 64, "wall_s": wall, "param_l2": 60.0,
                "param_sha256": "a"} for system, wall in (("bamboo-ray", 1.0), ("ray-train", 2.0))]
    (tmp_path / "results.json").write_text(json.dumps(records))
    base = ["--report-only", "--systems", "bamboo-ray,ray-train", "--kills", "", "--out",
            str(tmp_path)]
    assert run.main(base) == 0
    assert "| bamboo-ray | 64.0 (2.00x) |" in (tmp_path / "table.md").read_text()
    assert run.main([*base, "--baseline", "bamboo-ray"]) == 0
    assert "| ray-train | 32.0 (0.50x) |" in (tmp_path / "table.md").read_text()


def test_pin_with_more_workers_than_cores_is_refused(capsys: pytest.CaptureFixture) -> None:
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit) as stop:
        run.parse_args(["--pin", "--workers", str(too_many), "--micro-batches", str(too_many),
                        "--kills", ""])
    assert stop.value.code == 2
    assert "--pin needs a core per worker" in capsys.readouterr().err


def test_bamboo_auto_gives_the_planner_the_global_batch() -> None:
    flags = Job(micro_batches=8, micro_batch_size=4).bamboo_flags("auto")
    assert flags[flags.index("--stages") + 1] == "auto"
    assert flags[flags.index("--global-batch-size") + 1] == "32"
    assert "--micro-batches" not in flags
    fixed = Job(micro_batches=8, workers=4).bamboo_flags(2)
    assert fixed[fixed.index("--micro-batches") + 1] == "4"  # 2 pipelines of 4: the same 32


def test_bamboo_auto_takes_seconds_schedules_only(capsys: pytest.CaptureFixture) -> None:
    assert run.parse_args(["--bamboo-stages", "auto", "--kills", "8,20"]).bamboo_stages == "auto"
    with pytest.raises(SystemExit) as stop:
        run.parse_args(["--bamboo-stages", "auto", "--kills", "@15,@32"])
    assert stop.value.code == 2
    assert "kills in seconds only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run.parse_args(["--bamboo-stages", "two"])
    assert "give a number of stages or auto" in capsys.readouterr().err


def test_report_only_rebuilds_the_table_from_the_records(tmp_path: Path) -> None:
    free = {"run": "torchrun-free-0", "schedule": "free", "losses": [2.0], "samples": 64,
            "wall_s": 1.0, "param_l2": 60.0, "param_sha256": "a"}
    killed = {**free, "run": "torchrun-kills-9-0", "schedule": "9", "wall_s": 2.0,
              "param_l2": 60.001, "param_sha256": "b", "kills_sent": 1}
    (tmp_path / "results.json").write_text(json.dumps([free, killed]))
    args = ["--report-only", "--systems", "torchrun", "--kills", "9", "--out", str(tmp_path)]
    assert run.main(args) == 0
    table = (tmp_path / "table.md").read_text()
    assert "| torchrun | 64.0 (1.00x) | 32.0 (1.00x) | 1.0 | no (L2 off by 1.0e-03) |" in table


def test_report_only_without_records_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run.main(["--report-only", "--kills", "", "--out", str(tmp_path / "none")]) == 2
    assert "run the command without --report-only first" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
