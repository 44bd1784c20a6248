"""A user's loop around `bamboo.Trainer`, as the step-by-step tests run it: a step per call,
the held-out loss every few steps, the learning rate halved on a plateau (a rule of the
loop's own, from the run's history, so a resumed loop applies it the same way), and an
early stop. Run as a script (`python -m support.trainer_loop OUT ...`) it prints the run's
result as one JSON line; a SIGINT while it sleeps between two steps (`--sleep-after K`)
lands in the loop's own code."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import bamboo

JOB = dict(model="gpt2-tiny", nodes=4, stages=2, micro_batches=2, micro_batch_size=2,
           steps=12, seed=3)
"""Two pipelines of two stages; its own synthetic data, held-out part included."""

PLATEAU = 0.4
"""An evaluation that improves on the best before it by less than this is a plateau."""


def pid_of(run: Path, pipeline: int, stage: int) -> int:
    """The pid of the worker that started in (`pipeline`, `stage`) (events.jsonl's node_up)."""
    for line in (run / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "node_up" and (e.get("pipeline"), e.get("stage")) == (pipeline, stage):
            return int(e["pid"])
    raise LookupError(f"no node_up of pipeline {pipeline} stage {stage} in {run}")


def run_loop(out: Path, *, stop_at: int, every: int = 3, kill: list[str] | None = None,
             kill_between: tuple[int, int, int] | None = None, resume: bool = False,
             rule: bool = True, sleep_after: int | None = None) -> Any:
    """The loop; its `RunResult`. `kill_between=(K, D, S)`: SIGKILL the first worker of
    pipeline D, stage S after K steps, between two calls (before the evaluation there)."""
    options: dict[str, Any] = dict(JOB, kill=kill or [])
    if resume:
        options |= {"resume": "auto", "out": str(out)}
    job = bamboo.Job(**options)
    with bamboo.Trainer(job, out=out) as trainer:
        while trainer.steps_done < stop_at:
            trainer.train_step()
            done = trainer.steps_done
            if kill_between is not None and done == kill_between[0]:
                os.kill(pid_of(out, *kill_between[1:]), signal.SIGKILL)
                time.sleep(1.0)  # its exit reaches the run before the next call
            if sleep_after is not None and done == sleep_after:
                (out / "sleeping").write_text(str(done))
                time.sleep(60)
            if rule and done % every == 0:
                held_out = trainer.evaluate().loss
                earlier = [loss for step, loss in trainer.eval_losses if step < done]
                if earlier and held_out > min(earlier) - PLATEAU:
                    trainer.set_lr_scale(trainer.lr_scale * 0.5)
    return trainer.result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-at", type=int, default=JOB["steps"])
    parser.add_argument("--sleep-after", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--no-rule", dest="rule", action="store_false")
    a = parser.parse_args(argv)
    if a.sleep_after is not None:
        # Ctrl-C raises KeyboardInterrupt, as in a script started from a shell: a process
        # inherits an ignored or blocked SIGINT, and the one that started this may have had
        # one left so by code run in it before.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    result = run_loop(a.out, stop_at=a.stop_at, resume=a.resume, rule=a.rule,
                      sleep_after=a.sleep_after)
    print(json.dumps({"losses": result.losses, "param_sha256": result.param_sha256}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
