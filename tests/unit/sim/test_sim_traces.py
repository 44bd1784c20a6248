"""Trace parsing (three formats, malformed rows, out-of-order rows) and synthetic generation.
Its tests that start processes: tests/integration/test_sim_traces_runs.py."""

import json
from pathlib import Path

import pytest

from bamboo.traces.trace import (
    ADD,
    REMOVE,
    TraceError,
    generate_synthetic,
    load_trace,
    parse_synthetic_spec,
)

TRACES = Path(__file__).resolve().parents[3] / "traces"
P3 = TRACES / "aws-p3-2xlarge.csv"
GCP = TRACES / "gcp-a100-counts.txt"


def test_bamboo_csv_p3_trace():
    tr = load_trace(P3)
    assert tr.preemptions == 167 and tr.allocations == 177
    assert tr.times == sorted(tr.times)
    assert abs(tr.duration - 40920.0) < 1e-9


def test_count_trace_becomes_adds_and_removes(tmp_path):
    f = tmp_path / "counts.txt"
    f.write_text("2021-12-11, 11:00:00, 3\n2021-12-11, 11:01:00, 1\n2021-12-11, 11:02:00, 4\n")
    tr = load_trace(f)
    assert tr.kinds.count(ADD) == 6 and tr.kinds.count(REMOVE) == 2
    assert tr.duration == 120.0
    live = 0
    for k in tr.kinds:
        live += k
    assert live == 4
    assert load_trace(GCP).allocations > 0


def test_json_rows_lines_and_array(tmp_path):
    rows = [[0, "add", {"nodes": ["a", "b"], "zone": "x"}], [500, "no-op", {}], [1000, "remove", {"nodes": ["a"]}]]
    f1 = tmp_path / "t.jsonl"
    f1.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    f2 = tmp_path / "t.json"
    f2.write_text(json.dumps(rows, indent=1))
    f3 = tmp_path / "t2.json"
    f3.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    for f in (f1, f2, f3):
        tr = load_trace(f)
        assert tr.kinds == [ADD, ADD, REMOVE] and tr.times == [0.0, 0.0, 1.0], f


@pytest.mark.parametrize(
    "content, line",
    [
        ("0,add,n1\n10,add,n2\nabc,add,n3\n", 3),
        ("0,add,n1\n10,explode,n2\n", 2),
        ("0,add,n1\n\n10,add\n", 3),
        ("2021-12-11, 11:00:00, 3\n2021-12-11, 11:01:00, x\n", 2),
        ('[0, "add", {"nodes": ["a"]}]\n[5, "add", {"nodes": ["b"]}\n', 2),
        ('[0, "add", {"nodes": ["a"]}]\n[5, "jump", {"nodes": ["b"]}]\n', 2),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, content, line):
    f = tmp_path / "bad.trace"
    f.write_text(content)
    with pytest.raises(TraceError) as exc:
        load_trace(f)
    assert f"{f}:{line}:" in str(exc.value)


def test_out_of_order_rows_are_sorted_stably(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("0,add,a\n5000,add,c\n1000,add,b\n1000,remove,a\n")
    tr = load_trace(f)
    assert tr.unsorted_rows == 2
    assert tr.times == [0.0, 1.0, 1.0, 5.0]
    assert [tr.node_names[n] for n in tr.nodes] == ["a", "b", "a", "c"]
    assert tr.kinds == [ADD, ADD, REMOVE, ADD]


def test_synthetic_is_deterministic_and_plausible():
    spec = parse_synthetic_spec("synthetic:p=0.25", nodes=48, hours=12)
    a, b, c = generate_synthetic(spec, 7), generate_synthetic(spec, 7), generate_synthetic(spec, 8)
    assert (a.times, a.kinds, a.nodes) == (b.times, b.kinds, b.nodes)
    assert (a.times, a.nodes) != (c.times, c.nodes)
    assert 0.5 * 0.25 * 48 * 12 * 0.5 < a.preemptions < 0.25 * 48 * 12 * 1.5
    live = 0
    for k in a.kinds:
        live += k
        assert 0 <= live <= 48
    m = generate_synthetic(parse_synthetic_spec("synthetic:mtbf=10min,hours=10"), 1)
    assert 30 < m.preemptions < 100  # about 60 expected


@pytest.mark.parametrize("spec", ["synthetic:", "synthetic:p=2", "synthetic:q=1", "synthetic:p=0.1,mtbf=1h",
                                  "synthetic:mtbf=soon"])
def test_bad_synthetic_spec(spec):
    with pytest.raises(TraceError):
        parse_synthetic_spec(spec)


def test_events_merge_ready_after_its_add_and_before_rows_at_the_same_time():
    from bamboo.traces.trace import ADD, READY, REMOVE, Trace

    tr = Trace(name="m", times=[0.0, 0.0, 10.0, 55.0], kinds=[ADD, ADD, REMOVE, ADD], nodes=[0, 1, 0, 2], duration=200.0)
    et, ek, en, es = tr.events(0.0)  # zero delay: READY right after its own add
    assert list(zip(et, ek, en)) == [(0.0, ADD, 0), (0.0, READY, 0), (0.0, ADD, 1), (0.0, READY, 1),
                                     (10.0, REMOVE, 0), (55.0, ADD, 2), (55.0, READY, 2)]
    et, ek, en, es = tr.events(45.0)  # READY at 45 and 55: before the row at 55
    assert list(zip(et, ek, en)) == [(0.0, ADD, 0), (0.0, ADD, 1), (10.0, REMOVE, 0), (45.0, READY, 0),
                                     (45.0, READY, 1), (55.0, ADD, 2), (100.0, READY, 2)]
    assert es[3] == 0 and es[4] == 1 and es[6] == 3  # serial = index of the add row
    assert tr.events(45.0) is tr.events(45.0)  # cached


def test_ready_of_a_node_removed_and_re_added_uses_the_new_add():
    from bamboo.sim.core import SimConfig
    from bamboo.sim.cost_presets import SimModel
    from bamboo.sim.policies import make_policy
    from bamboo.traces.trace import ADD, REMOVE, Trace

    tiny = SimModel(name="tiny", stages=2, samples_per_step=2, step_s={1: 1.0},
                       rebalance_s=5.0, restart_s=5.0, ckpt_save_s=1.0, ckpt_restart_s=5.0)
    # node 1 is lost at 10 s and re-added at 30 s: it must be ready at 75 s, not at the first add's 45 s.
    tr = Trace(name="r", times=[0.0, 0.0, 10.0, 30.0], kinds=[ADD, ADD, REMOVE, ADD], nodes=[0, 1, 1, 1],
               duration=300.0)
    r = make_policy("checkpoint", tiny, SimConfig(alloc_delay_s=45.0, fallback_every_s=0.0)).run(tr)
    # 0-45 idle; 45-50 restart with node 0 alone (no pipeline fits); 50-75 idle; 75-80 restart; runs from 80
    # (before the fix, the stale READY at 45 made node 1 ready 30 s early: idle 45, restart 5).
    assert abs(r.breakdown["idle"] - 70.0) < 1e-9 and abs(r.breakdown["restart"] - 10.0) < 1e-9
