"""When a job with `--eval-every` evaluates (`JobConfig.evaluates_at`); the runs that evaluate:
tests/integration/test_eval.py."""
from __future__ import annotations

from bamboo.config import JobConfig


def test_evaluation_points() -> None:
    cfg = JobConfig.of(steps=7, eval_every=3)
    assert [k for k in range(9) if cfg.evaluates_at(k)] == [3, 6, 7]
    assert not any(JobConfig.of(steps=7).evaluates_at(k) for k in range(9))
