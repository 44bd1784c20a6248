"""Results: step records, the trained model and the run's summary.

Every committed step becomes a `step_done` event (loss, wall time, per-node timers) and a
line of progress. After the last step each stage's first live holder writes its layers'
parameters to the job's checkpoint storage (`final-<steps>/`, one DCP folder per layer) and
reports them (`LayerParams`); once every layer is reported, they are read back from storage
(never sent here), assembled into `model.pt` (written atomically) and summarised
(`param_l2`, `param_sha256`) in `summary.json`, the contract's record of the run. Each
node's peak device and host bytes over the steps it reported (the engine's tensor
accounting, `StepReport.device_bytes`/`host_bytes`) become `memory_per_node_bytes` and
`host_memory_per_node_bytes`, in node order; their real memory (resident bytes, on CUDA
the allocator's) becomes `rss_per_node_bytes` and the rest of `MemoryWatch.fields`.
"""
from __future__ import annotations

import hashlib
import io
import math
import statistics
from typing import Any

import torch
import torch.distributed.checkpoint

from bamboo.control.node_memory import MemoryWatch
from bamboo.control.state import RunContext, Stop
from bamboo.control.steps import PendingStep
from bamboo.data.user import data_position
from bamboo.node import procmem
from bamboo.plan.redundancy_choice import NodeWork, redundant_work_floor
from bamboo.protocol.messages import LayerParams, StepReport
from bamboo.run.checkpoint import (
    CheckpointError,
    checkpoint_location,
    final_dir,
    load_layer_tensors,
)

__all__ = ["Results"]

_TIMERS = ("step_s", "compute_s", "frc_s", "wait_s", "reduce_s", "optim_s", "vote_s", "rebuild_s")
_COUNTERS = ("bytes_sent", "bytes_replica", "saved_bytes", "frc_saved_bytes", "state_bytes",
             "params_held", "device_bytes", "host_bytes", "replica_host_bytes", "rebuilds",
             "rss_bytes", "frc_forwards", "frc_in_waits", "restarts", "page_faults",
             "buckets_early")
_CUDA_COUNTERS = ("cuda_peak_bytes", "cuda_reserved_bytes")
"""Recorded only when a node measured them (it runs on CUDA)."""


def _node_order(name: str) -> tuple[int, str]:
    """Sort key of a node name: `n<number>` by its number, anything else after, by name."""
    digits = name[1:] if name.startswith("n") else ""
    return (int(digits), name) if digits.isdigit() else (1 << 62, name)


class Results:
    def __init__(self, ctx: RunContext, display: Any) -> None:
        self.ctx = ctx
        self.display = display
        """The progress shown to the user (`step`, `evaluation`)."""
        self.records: list[dict] = []
        """Per committed step, what later decisions read: step, wall_s, the largest
        node's frc_s and the least time eager and lazy would have added to it
        (`redundant_work_floor`; meaningful in steps without replicas). The full record
        goes to the event log only: this list is kept for the whole run, so it stays a
        few numbers a step."""
        self.final: set[int] = set()
        """Layers whose final parameters a node reported written."""
        self.params: dict[int, list] | None = None
        """Layer -> [(name, tensor)], read back from storage once every layer is in."""
        self.memory: dict[str, list[int]] = {}
        """Node name -> [peak device bytes, peak host bytes] over the steps it reported."""
        self.real_memory = MemoryWatch(self._memory_warning)
        """The workers' resident memory, from the same reports."""
        self.largest_rss = 0
        """The largest resident memory among the reports of the last recorded step."""
        self.replica_host_bytes = 0
        """The largest replica a node reported keeping in host memory."""
        self.promotions: list[float] = []
        """Seconds each failover took to bring its replica to the device, in step order."""

    def record(self, p: PendingStep, reports: list[StepReport], names: list[str],
               own_processor: list[bool]) -> dict:
        """Step `p`'s record from its `reports`; `names` and `own_processor`: of the node
        of each report, in the same order."""
        record = {"step": p.step, "loss": p.loss, "wall_s": p.wall_s,
                  "grad_norm": reports[0].grad_norm if reports else None,
                  "lr": reports[0].lr if reports else None,
                  "attempts": max((r.attempts for r in reports), default=1),
                  **({"loss_scale": reports[0].loss_scale, "skipped": reports[0].skipped}
                     if reports and self.ctx.cfg.model.precision == "fp16" else {}),
                  **({"metrics": p.metrics} if p.metrics else {}),
                  "nodes": [self._node_timers(r, name) for r, name in zip(reports, names)]}
        work = [NodeWork(tuple(r.stages), r.compute_s, r.wait_s, r.optim_s, own)
                for r, own in zip(reports, own_processor)]
        self.records.append({"step": p.step, "wall_s": p.wall_s,
                             "frc_s": max((r.frc_s for r in reports), default=0.0),
                             "floor_s": redundant_work_floor(work, self._stages())})
        for r, name in zip(reports, names):
            self._note_memory(name, r)
            self.replica_host_bytes = max(self.replica_host_bytes, r.replica_host_bytes)
            self.promotions.extend(r.promotion_s)
        self.ctx.events.write("step_done", **record)
        for r, name in zip(reports, names):
            self.real_memory.note(name, r)
        self.largest_rss = max((r.rss_bytes for r in reports), default=0)
        cfg = self.ctx.cfg
        samples = cfg.global_micro_batches * cfg.layout.micro_batch_size
        self.display.step(p.step, p.loss, samples / max(p.wall_s, 1e-9),
                          [1000 * r.step_s for r in reports], self.largest_rss,
                          **({"metrics": p.metrics} if p.metrics else {}))
        return record

    def _stages(self) -> int:
        plan = self.ctx.plan
        return plan.stages if plan else self.ctx.cfg.layout.stages

    def _memory_warning(self, node: str, text: str, fields: dict) -> None:
        self.ctx.events.write("memory_growth", **fields)
        self.ctx.say(f"warning: {text}")

    def record_eval(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        """The held-out loss (and metrics) of the parameters after `step` steps."""
        self.ctx.eval_losses.append([step, loss])
        self.ctx.eval_losses.sort()
        extra = {"metrics": metrics} if metrics else {}
        if metrics:
            self.ctx.eval_metrics.append([step, metrics])
            self.ctx.eval_metrics.sort(key=lambda e: e[0])
        self.ctx.events.write("eval", step=step, loss=loss,
                              batches=self.ctx.cfg.evaluation.batches, **extra)
        self.display.evaluation(step, loss, **extra)

    def _note_memory(self, name: str, r: StepReport) -> None:
        """Keep node `name`'s running peaks of device and host bytes."""
        peak = self.memory.setdefault(name, [0, 0])
        peak[0] = max(peak[0], r.device_bytes)
        peak[1] = max(peak[1], r.host_bytes)

    def memory_fields(self) -> dict[str, list]:
        """The summary's memory lists: one entry per node that reported a step, in node
        order (n0, n1, ..., n10: by number), with the names in `memory_nodes`."""
        names = sorted(self.memory, key=_node_order)
        return {"memory_per_node_bytes": [self.memory[n][0] for n in names],
                "host_memory_per_node_bytes": [self.memory[n][1] for n in names],
                **self.real_memory.fields(names),
                "memory_nodes": names}

    def coordinator_fields(self, steps: int) -> dict[str, Any]:
        """What the coordinator process itself holds at the end: its resident memory, open
        descriptors, keys in its store and what this process appended to the event log
        (per step it ran, too). A figure that cannot be read is null: measuring never costs
        the run its summary."""
        try:
            keys: int | None = self.ctx.store.num_keys()
        except (RuntimeError, OSError):  # torch's DistStoreError is a RuntimeError
            keys = None
        events = self.ctx.events.bytes_written
        ran = steps - (self.ctx.resume_step or 0)
        own = procmem.sample()
        return {"rss_bytes": own.rss, "rss_peak_bytes": own.rss_peak,
                "open_fds": procmem.open_fds(), "store_keys": keys, "events_bytes": events,
                "events_bytes_per_step": round(events / ran) if ran > 0 else None}

    @staticmethod
    def _node_timers(r: StepReport, name: str) -> dict:
        return {"node": name, "stages": r.stages} | \
            {k: round(getattr(r, k), 6) for k in _TIMERS} | \
            {k: getattr(r, k) for k in _COUNTERS} | \
            {k: getattr(r, k) for k in _CUDA_COUNTERS if getattr(r, k)}

    def _fp16_fields(self, steps: int) -> dict[str, Any]:
        """`--precision fp16`: the steps skipped for an overflow, and the loss scale the
        next step would have had."""
        if self.ctx.cfg.model.precision != "fp16":
            return {}
        return {"skipped_steps": list(self.ctx.skipped_steps),
                "loss_scale": self.ctx.loss_scale_at(steps).scale}

    def final_dir(self) -> Any:
        return final_dir(checkpoint_location(self.ctx.cfg), self.ctx.end_step)

    def on_params(self, msg: LayerParams) -> None:
        if msg.error is not None:  # no other node writes those layers: the model is lost
            raise Stop(f"the trained model was not saved (model.pt not written): {msg.error}")
        self.final.update(msg.layers)

    def missing_layers(self) -> list[int]:
        """Layers whose final copy no node reported; once none is missing, every layer is
        read back (Stop when one cannot be: the run's result would be wrong)."""
        missing = sorted(set(range(len(self.ctx.param_counts))) - self.final)
        if not missing and self.params is None:
            try:
                self.params = self._read_final()
            except CheckpointError as e:
                raise Stop(f"the trained model cannot be read back: {e}") from None
        return missing

    def _read_final(self) -> dict[int, list]:
        where = self.final_dir()
        params = {}
        for i in range(len(self.ctx.param_counts)):
            tensors = load_layer_tensors(where, i)  # none for a layer without parameters
            if not all(n.startswith("param.") for n, _ in tensors):
                raise CheckpointError(f"{where}: layer-{i:04d} holds other tensors than "
                                      f"parameters")
            params[i] = [(n.removeprefix("param."), t) for n, t in tensors]
        return params

    def ordered_params(self) -> list[tuple[str, torch.Tensor]]:
        if self.params is None:  # the run did not get to every final layer
            return []
        out = []
        for layer_index in sorted(self.params):
            out += [(f"layers.{layer_index}.{n}", t) for n, t in self.params[layer_index]]
        return out

    def model_bytes(self) -> bytes | None:
        params = self.ordered_params()
        if not params:
            return None
        buffer = io.BytesIO()
        torch.save(dict(params), buffer)
        return buffer.getvalue()

    def summary(self, *, status: str, error: str | None, losses: list, standby_losses: int,
                reconfigurations: int, redone_steps: int, reconf_times: list[dict],
                pauses: list[float] | None = None) -> dict[str, Any]:
        """`pauses`: `pause_s`, one per lost node in event order (default: per `losses`)."""
        ctx = self.ctx
        params = self.ordered_params()
        l2 = math.sqrt(math.fsum(float(t.double().square().sum()) for _, t in params))
        sha = hashlib.sha256()
        for _, t in params:
            sha.update(t.contiguous().numpy().tobytes())
        steps = len(ctx.losses)
        batch = ctx.cfg.global_micro_batches * ctx.cfg.layout.micro_batch_size
        here = (steps - (ctx.resume_step or 0)) * batch  # this process's share
        wall = ctx.clock() - ctx.t0
        kinds = [str(x.handled_as) for x in losses]
        step_walls = [r["wall_s"] for r in self.records[1:]]
        return {
            "status": status, "error": error,
            "steps_completed": steps, "samples": steps * batch, "losses": ctx.losses,
            "eval_losses": ctx.eval_losses, "data": data_position(ctx.cfg, steps),
            "metrics": ctx.metrics, "eval_metrics": ctx.eval_metrics,
            "param_l2": l2 if params else None,
            "param_sha256": sha.hexdigest() if params else None,
            "preemptions": len(losses) + standby_losses,
            "failovers": kinds.count("failover"), "drains": kinds.count("drain"),
            "peer_restores": kinds.count("peer_restore"),
            "checkpoint_restores": kinds.count("checkpoint_restore"),
            "standby_losses": standby_losses, "stopped": kinds.count("stopped"),
            "reroutes": kinds.count("reroute"), "reconfigurations": reconfigurations,
            "redone_steps": redone_steps,
            "pause_s": pauses if pauses is not None else [round(x.cost_s, 4) for x in losses],
            # null: a generation that never became ready (a later one replaced it, or the
            # run stopped)
            "reconfiguration_s": [round(r["total_s"], 4) if "total_s" in r else None
                                  for r in reconf_times],
            "resumed_from_step": ctx.resume_step,
            "lr_scales": ctx.lr_scales,
            **self._fp16_fields(steps),
            "layouts": ctx.layouts,
            "wall_s": wall, "throughput": here / wall if wall > 0 else 0.0,
            "median_step_s": statistics.median(step_walls) if step_walls else None,
            **self.memory_fields(),
            "replica_host_bytes": self.replica_host_bytes, "promotion_s": self.promotions,
            "coordinator": self.coordinator_fields(steps),
            "config": ctx.cfg.summary_fields(),
        }
