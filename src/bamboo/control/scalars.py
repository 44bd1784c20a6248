"""`--tensorboard DIR` and `--wandb PROJECT`: the run's scalars where ML engineers look.

Both are fed from the run's own event stream (every `events.jsonl` record passes through
`ScalarLog.on_event`), so they show exactly what the run recorded, at the step it
happened. The x axis is the step's number, from 0, as in the events: train/loss at x = K is
the loss step K took with the parameters after K steps, and eval/loss at x = K is the
held-out loss of those same parameters, so the two curves line up.

    train/loss, train/lr, train/grad_norm      each committed step
    perf/samples_per_s, perf/step_s            each committed step
    cluster/live_nodes                         each committed step
    cluster/redundancy_mode                    2 eager, 1 lazy, 0 off; at the start and on
                                               every --redundancy auto choice
    eval/loss                                  each evaluation
    train/<metric>, eval/<metric>              the job's metrics (--metric), as the loss
    preemptions/<handled_as>, preemptions/total  cumulative, at each loss
    failover/pause_s                           each failover's pause in the step it hit
    preemptions/reconfiguration_s              a loss's share of a later reconfiguration
                                               it caused (`loss_cost`: a standby joining,
                                               layers moved), at the step that paid it;
                                               with the pause, summary.json's `pause_s`

A sink that fails (a full disk, a lost W&B connection) is switched off with one message;
the run goes on: logging never stops training.
"""
from __future__ import annotations

import collections
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from bamboo.config import JobConfig

__all__ = ["ScalarLog", "ScalarSink", "TensorBoardSink", "WandbSink", "MODE_CODES"]

MODE_CODES = {"eager": 2, "lazy": 1, "off": 0, "reroute": 3}


class ScalarSink(Protocol):
    name: str

    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def text(self, tag: str, value: str, step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Event files through torch's SummaryWriter (needs the tensorboard package)."""

    name = "--tensorboard"

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=5)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, value: str, step: int) -> None:
        self.writer.add_text(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run in `project` (WANDB_MODE=offline writes under the run
    directory and syncs later with `wandb sync`)."""

    name = "--wandb"

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=project, dir=str(run_dir), name=run_dir.name,
                              config=config, settings=wandb.Settings(silent=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log({"step": step, **values})

    def text(self, tag: str, value: str, step: int) -> None:
        self.run.log({"step": step, tag: value})

    def close(self) -> None:
        self.run.finish()


class ScalarLog:
    """Turns event records into scalars for every configured sink."""

    def __init__(self, cfg: JobConfig, run_dir: Path, say: Callable[[str], None],
                 live_nodes: Callable[[], int | None] = lambda: None) -> None:
        self.say = say
        self.live_nodes = live_nodes
        self.samples_per_step = cfg.global_micro_batches * cfg.layout.micro_batch_size
        self.preemptions: collections.Counter[str] = collections.Counter()
        self.sinks: list[Any] = []
        if cfg.logging.tensorboard is not None:
            self.sinks.append(TensorBoardSink(cfg.logging.tensorboard))
        if cfg.logging.wandb is not None:
            os.environ.setdefault("WANDB_SILENT", "true")
            self.sinks.append(WandbSink(cfg.logging.wandb, run_dir, cfg.to_dict()))
        if cfg.redundancy.mode in MODE_CODES:
            self._emit({"cluster/redundancy_mode": MODE_CODES[cfg.redundancy.mode]}, 0)

    def on_event(self, record: dict[str, Any]) -> None:
        kind = record.get("event")
        if kind == "step_done":
            wall = max(float(record["wall_s"]), 1e-9)
            values = {"train/loss": record["loss"], "perf/samples_per_s": self.samples_per_step / wall,
                      "perf/step_s": wall}
            for key in ("lr", "grad_norm"):
                if record.get(key) is not None:
                    values[f"train/{key}"] = record[key]
            values.update({f"train/{k}": v for k, v in (record.get("metrics") or {}).items()})
            live = self.live_nodes()
            if live is not None:
                values["cluster/live_nodes"] = live
            self._emit(values, record["step"])
        elif kind == "eval":
            self._emit({"eval/loss": record["loss"],
                        **{f"eval/{k}": v for k, v in (record.get("metrics") or {}).items()}},
                       record["step"])
        elif kind == "node_lost":
            handled = str(record.get("handled_as"))
            self.preemptions[handled] += 1
            values = {f"preemptions/{handled}": self.preemptions[handled],
                      "preemptions/total": sum(self.preemptions.values())}
            if handled == "failover" and record.get("pause_s") is not None:
                values["failover/pause_s"] = record["pause_s"]
            self._emit(values, int(record.get("step") or 0))
        elif kind == "loss_cost" and record.get("added_s") is not None:
            self._emit({"preemptions/reconfiguration_s": record["added_s"]},
                       int(record.get("at_step") or 0))
        elif kind == "redundancy_mode" and record.get("mode") in MODE_CODES:
            step = int(record.get("step") or 0)
            self._emit({"cluster/redundancy_mode": MODE_CODES[record["mode"]]}, step)
            self._text("cluster/redundancy", str(record["mode"]), step)

    def _emit(self, values: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in values.items()}
        for sink in list(self.sinks):
            self._guard(sink, lambda sink=sink: sink.scalars(values, step))

    def _text(self, tag: str, value: str, step: int) -> None:
        for sink in list(self.sinks):
            self._guard(sink, lambda sink=sink: sink.text(tag, value, step))

    def _guard(self, sink: Any, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 (logging never stops training)
            self.sinks.remove(sink)
            self.say(f"{sink.name} logging stopped: {type(e).__name__}: {e}".splitlines()[0])

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 (a sink's close never stops the run)
                self.say(f"{sink.name} logging did not close cleanly: {e}".splitlines()[0])
        self.sinks = []
