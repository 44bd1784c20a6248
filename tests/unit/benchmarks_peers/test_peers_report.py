"""The peers harness's pure parts (benchmarks/peers/report.py, loaded by path as the other
benchmark tests load theirs): the kill schedule, the trace Bamboo replays, goodput and
seconds lost per preemption, and the table."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _report():
    path = REPO / "benchmarks" / "peers" / "report.py"
    spec = importlib.util.spec_from_file_location("peers_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("peers_report", module)
    spec.loader.exec_module(module)
    return module


R = _report()


def test_a_schedule_reads_seconds_or_steps() -> None:
    assert R.parse_schedule("8, 20s,31.5") == [R.Kill(8.0, "s"), R.Kill(20.0, "s"), R.Kill(31.5, "s")]
    assert R.parse_schedule("@15,@32") == [R.Kill(15, "step"), R.Kill(32, "step")]
    assert R.parse_schedule("") == []


@pytest.mark.parametrize("text, says", [("8,x", "bad kill 'x'"), ("@1.5", "bad kill '@1.5'"),
                                         ("-2", "never negative"), ("8,@9", "mix"),
                                         ("9,8", "out of order")])
def test_a_bad_schedule_says_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        R.parse_schedule(text)


def test_kills_never_hit_worker_zero_and_the_trace_replaces_each_victim() -> None:
    assert [R.victim(i, 4) for i in range(5)] == [1, 2, 3, 1, 2]
    trace = R.bamboo_trace(R.parse_schedule("3,7,9.5,12"), 4, 2.0).splitlines()
    assert trace[:4] == ["0,add,n0", "0,add,n1", "0,add,n2", "0,add,n3"]
    assert trace[4:] == ["3000,remove,n1", "5000,add,n4", "7000,remove,n2", "9000,add,n5",
                         "9500,remove,n3", "11500,add,n6", "12000,remove,n4", "14000,add,n7"]


def test_goodput_and_the_seconds_each_preemption_cost() -> None:
    free = R.Outcome("ddp", useful_samples=1920, train_s=30.0)
    killed = R.Outcome("ddp", useful_samples=1920, train_s=60.0, kills=3)
    assert free.goodput == 64.0 and killed.goodput == 32.0
    assert R.seconds_lost(killed, free.goodput) == pytest.approx(10.0)
    # samples dropped (a lost replica's share) count as time lost at the failure-free rate
    dropped = R.Outcome("ft", useful_samples=1600, train_s=30.0, kills=2)
    assert R.seconds_lost(dropped, 64.0) == pytest.approx((30.0 - 25.0) / 2)
    assert R.seconds_lost(free, 64.0) is None
    assert R.Outcome("x", 10, 0.0).goodput == 0.0


def test_the_table_has_a_row_per_system_and_the_multiples_of_the_baseline() -> None:
    free = [R.Outcome("torchrun", 640, 10.0), R.Outcome("bamboo", 640, 20.0),
            R.Outcome("torchrun", 640, 10.0)]
    killed = [R.Outcome("torchrun", 640, 20.0, kills=2, equal=True),
              R.Outcome("bamboo", 640, 20.0, kills=2, equal=False, gap=2.5e-9)]
    rows = R.summarize(free, killed)
    assert [r.system for r in rows] == ["torchrun", "bamboo"]
    assert rows[0].free_rate == [64.0, 64.0] and rows[0].lost_s == [5.0]
    assert rows[1].lost_s == [0.0]
    table = R.markdown_table(rows, baseline="torchrun").splitlines()
    assert len(table) == 4 and table[0].startswith("| system | failure-free samples/s")
    assert table[2] == ("| torchrun | 64.0, 64.0 (1.00x; pairs: median 1.00x, 1.00-1.00) "
                        "| 32.0 (1.00x) | 5.0 | yes |")
    assert table[3] == "| bamboo | 32.0 (0.50x) | 32.0 (1.00x) | 0.0 | no (L2 off by 2.5e-09) |"
    assert R.markdown_table(rows).splitlines()[3] == "| bamboo | 32.0 | 32.0 | 0.0 | no (L2 off by 2.5e-09) |"


def test_pair_ratios_match_interleaved_repetitions_one_to_one() -> None:
    assert R.pair_ratios([90.0, 100.0, 120.0], [100.0, 100.0, 100.0]) == pytest.approx([0.9, 1.0, 1.2])
    assert R.pair_ratios([90.0, 100.0], [100.0]) == []  # unequal counts: no pairs
    assert R.pair_ratios([90.0], [0.0]) == []


def test_each_kill_hits_a_worker_that_has_booted_and_never_worker_zero() -> None:
    kills = R.parse_schedule("1,1,1,1,2,5")
    hit = R.assign_workers(kills, 4, boot_s=3.0)
    # four at once: three workers, the fourth finds all booting and is dropped; at 2 s still
    # all booting; at 5 s the rotation goes on from worker 1
    assert [(k.at, k.worker) for k in hit] == [(1.0, 1), (1.0, 2), (1.0, 3), (5.0, 1)]
    spaced = R.assign_workers(R.parse_schedule("1,10,20,30"), 4, boot_s=3.0)
    assert [k.worker for k in spaced] == [1, 2, 3, 1]
    steps = R.assign_workers(R.parse_schedule("@3,@3"), 3, boot_s=3.0)
    assert [k.worker for k in steps] == [1, 2]


def test_a_trace_window_is_the_densest_or_the_quietest_with_a_removal() -> None:
    text = "\n".join(["0,add,a", "0,add,b", "0,add,c", "100000,remove,a", "4000000,remove,b",
                      "4100000,remove,c", "4100000,add,d", "7300000,remove,d"])
    removals = R.trace_removals(text)
    assert removals == [100.0, 4000.0, 4100.0, 7300.0]
    assert R.trace_window(removals, "dense", 3600) == (3600, [400.0, 500.0])
    assert R.trace_window(removals, "quiet", 3600) == (0, [100.0])  # the empty window is not quiet
    kills, what = R.named_schedule("p3-dense", text, scale=10, window_s=3600)
    assert kills == [R.Kill(40.0, "s"), R.Kill(50.0, "s")] and "2 removals" in what
    every, _ = R.named_schedule("every:60", text, scale=10, horizon_s=200)
    assert [k.at for k in every] == [60, 120, 180]
    with pytest.raises(ValueError, match="every:S"):
        R.named_schedule("every:x", text, scale=10)


def test_the_trace_bamboo_replays_has_the_kills_own_workers() -> None:
    kills = R.assign_workers(R.parse_schedule("2,2,9"), 3, boot_s=4.0)
    assert [k.worker for k in kills] == [1, 2, 1]
    assert R.bamboo_trace(kills, 3, 4.0).splitlines()[3:] == [
        "2000,remove,n1", "6000,add,n3", "2000,remove,n2", "6000,add,n4",
        "9000,remove,n3", "13000,add,n5"]


def test_a_run_is_judged_by_the_contracts_tolerances_and_its_bits_told_apart() -> None:
    free = {"param_sha256": "a", "losses": [2.0, 1.0], "param_l2": 60.0}
    assert R.judge(dict(free), free) == (True, True, None)
    reordered = {"param_sha256": "b", "losses": [2.0, 1.000001], "param_l2": 60.000003}
    bits, equal, gap = R.judge(reordered, free)
    assert (bits, equal) == (False, True) and gap == pytest.approx(3e-6)
    drifted = {"param_sha256": "c", "losses": [2.0, 1.0], "param_l2": 60.4}
    assert R.judge(drifted, free)[:2] == (False, False)
    loss_off = {"param_sha256": "d", "losses": [2.0, 1.001], "param_l2": 60.0}
    assert R.judge(loss_off, free)[:2] == (False, False)
    short = {"param_sha256": "e", "losses": [2.0], "param_l2": 60.0}
    assert R.judge(short, free)[:2] == (False, False)


def test_the_equality_column_says_bit_equal_within_tolerance_or_no() -> None:
    killed = [R.Outcome("b", 64, 1.0, kills=1, equal=True, bits=True),
              R.Outcome("b", 64, 1.0, kills=1, equal=True, gap=3e-6, bits=False),
              R.Outcome("b", 64, 1.0, kills=1, equal=False, gap=0.4, bits=False)]
    row = R.summarize([], killed)[0]
    cell = R.markdown_table([row]).splitlines()[2].split("|")[-2].strip()
    assert cell == "bit-equal, yes (L2 off by 3.0e-06), no (L2 off by 4.0e-01)"
