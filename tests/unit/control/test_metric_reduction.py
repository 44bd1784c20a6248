"""The job's metrics (`--metric`) reduced over the global batch (`bamboo.control.metrics`):
the mean over distinct micro-batches, summed in micro-batch order, whichever nodes reported
them and however often; and where the values go (the scalar log, /metrics, the live line)."""
from __future__ import annotations

import math
import random

from bamboo.control.http import RunMetrics
from bamboo.control.metrics import reduce_metrics


def test_a_metric_is_the_mean_over_the_global_batch() -> None:
    rows = [(g, "accuracy", v) for g, v in enumerate([0.25, 0.5, 0.75, 1.0])]
    rows += [(g, "top2", 1.0) for g in range(4)]
    assert reduce_metrics(rows) == {"accuracy": 0.625, "top2": 1.0}
    assert reduce_metrics([]) == {}


def test_whichever_nodes_report_in_whatever_order_the_value_is_the_same() -> None:
    """Micro-batches split over pipelines, an eager FRC's copy of the last stage's micro-batch
    reported again by the shadow, lists off the wire instead of tuples: the same bits."""
    values = [0.1 * g + 1e-9 * g * g for g in range(16)]
    one_node = reduce_metrics((g, "m", v) for g, v in enumerate(values))
    rng = random.Random(3)
    for _ in range(20):
        rows = [[g, "m", v] for g, v in enumerate(values)]
        rows += [[g, "m", values[g]] for g in rng.sample(range(16), 5)]  # FRC copies
        rng.shuffle(rows)
        assert reduce_metrics(rows) == one_node
    assert one_node["m"] == math.fsum(values) / 16


def test_the_metrics_reach_the_prometheus_page() -> None:
    m = RunMetrics()
    m.set_metrics({"accuracy": 0.75})
    assert m.registry.get_sample_value("bamboo_metric", {"name": "accuracy"}) == 0.75


def test_the_live_line_shows_the_metrics_beside_the_loss(capsys) -> None:
    from bamboo.run.progress import ProgressDisplay
    display = ProgressDisplay(4, enabled=True)
    display.evaluation(2, 1.25, {"accuracy": 0.5})
    display.step(2, 1.5, 100.0, [10.0, 12.0], metrics={"accuracy": 0.25})
    display.step(3, 1.4, 100.0, [10.0, 12.0])
    display.close()
    lines = capsys.readouterr().err.splitlines()
    assert "eval after 2 steps: loss 1.2500  accuracy 0.5" in lines
    assert any(line.startswith("step 2 (3/4 done)  loss 1.5000  accuracy 0.25  eval 1.2500  "
                               "accuracy 0.5 @2") for line in lines), lines
    assert any(line.startswith("step 3 (4/4 done)  loss 1.4000  eval") for line in lines), lines
