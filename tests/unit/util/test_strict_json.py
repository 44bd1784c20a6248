"""Every file and `--json` output the project writes is strict JSON: a non-finite float is
written as null, and the conftest check holds every test's run files to the same rule."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bamboo.run.runlog import EventLog, RunDir
from bamboo.util import strict_json
from support.strict import NotStrictJson, check_run_files_strict, strict_loads

UNKNOWN = [float("nan"), float("inf"), -float("inf")]


def test_non_finite_floats_become_null_at_any_depth() -> None:
    obj = {"losses": [5.5, float("nan")], "t": (1.0, float("inf")), "x": {"y": [-float("inf")]},
           "ok": 2, "s": "NaN"}
    text = strict_json.dumps(obj)
    assert strict_loads(text, "dump") == {"losses": [5.5, None], "t": [1.0, None],
                                          "x": {"y": [None]}, "ok": 2, "s": "NaN"}


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)))
def test_any_value_is_written_strictly(obj) -> None:
    back = strict_loads(strict_json.dumps(obj), "dump")
    def same(a, b) -> bool:  # b: what was read back
        if isinstance(a, float) and not math.isfinite(a):
            return b is None
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b
    assert same(obj, back)


def test_summary_and_events_with_unknown_values_parse_strictly(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.create()
    run.write_json("summary.json", {"losses": [5.0, UNKNOWN[0]], "reconfiguration_s": UNKNOWN})
    log = EventLog(run.path / "events.jsonl", t0=0.0)
    log.write("step_done", step=1, loss=UNKNOWN[0], pause_s=UNKNOWN[1])
    log.close()
    check_run_files_strict(tmp_path)  # the conftest check every test ends with
    summary = strict_loads((run.path / "summary.json").read_text(), "summary")
    assert summary["losses"] == [5.0, None] and summary["reconfiguration_s"] == [None] * 3
    event = strict_loads((run.path / "events.jsonl").read_text(), "events")
    assert event["loss"] is None and event["pause_s"] is None


def test_the_conftest_check_catches_what_plain_json_writes(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"losses": [float("nan")]}))
    with pytest.raises(NotStrictJson, match="NaN"):
        check_run_files_strict(tmp_path)
    (tmp_path / "summary.json").unlink()
    (tmp_path / "events.jsonl").write_text('{"t": 1}\n{"t": Infinity}\n{"t": 2')  # last: cut short
    with pytest.raises(NotStrictJson, match="line 2"):
        check_run_files_strict(tmp_path)
    (tmp_path / "events.jsonl").unlink()
