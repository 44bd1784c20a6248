"""`--http` for the coordinator: /healthz and Prometheus /metrics kept current from the
run's parts (bamboo.control.http serves them).

The server binds when the feed is made (a bad address is one line before anything else
starts). Once the core has started, `attach` listens to its events, so every loss is
counted the moment its `node_lost` event is written (its handling final); `update`, once
per coordinator loop iteration, copies only cheap reads of what the parts already keep.
"""
from __future__ import annotations

from typing import Any

from bamboo.config import JobConfig
from bamboo.control.http import HealthServer, HttpServeError, RunMetrics

__all__ = ["HealthFeed"]


class HealthFeed:
    def __init__(self, http: tuple[str, int], cfg: JobConfig) -> None:
        host, port = http
        self.cfg = cfg
        self.metrics = RunMetrics()
        self.health: dict[str, Any] = {"status": "starting", "step": 0, "steps": cfg.training.steps}
        self.standby_seen = self.reconfigurations_seen = 0
        self.parts: tuple[Any, ...] | None = None
        try:
            self.server = HealthServer(host, port, metrics=self.metrics,
                                       health=lambda: (True, self.health))
        except OSError as e:
            raise HttpServeError(f"cannot serve --http {host}:{port} "
                                 f"({e.strerror or e})") from None

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def attach(self, core: Any) -> None:
        """Read the run's state from `core` (a started `CoordinatorCore`) and count its
        losses from its events."""
        self.parts = (core.ctx, core.nodes, core.results, core.failures, core.gens)
        core.events.listeners.append(self.on_event)

    def on_event(self, event: dict) -> None:
        """A loss whose handling is final (its `node_lost` event); standbys are counted
        from the failure handler's total in `update`."""
        if event["event"] != "node_lost" or event.get("handled_as") == "standby":
            return
        self.metrics.add_preemptions(str(event["handled_as"]))
        if event["handled_as"] == "failover":
            self.metrics.observe_failover_pause(float(event.get("pause_s", 0.0)))

    def update(self, finished: bool = False) -> None:
        if self.parts is None:
            return
        ctx, nodes, results, failures, gens = self.parts
        m, cfg = self.metrics, self.cfg
        status = self.health["status"]
        if finished:
            status = "finished"
        elif status == "starting" and ctx.plan is not None and ctx.reconf is None \
                and gens.running():
            status = "training"
        live = nodes.alive_count()
        with m.lock:
            m.set_step(ctx.committed)
            if 0 < ctx.committed <= len(ctx.losses):
                m.set_loss(ctx.losses[ctx.committed - 1])
            if 0 < ctx.committed <= len(ctx.metrics):
                m.set_metrics(ctx.metrics[ctx.committed - 1])
            if results.records:
                samples = cfg.global_micro_batches * cfg.layout.micro_batch_size
                m.set_samples_per_second(samples / max(results.records[-1]["wall_s"], 1e-9))
            m.set_live_nodes(live)
            m.set_worker_rss(results.largest_rss)
            m.set_replica_host_bytes(results.replica_host_bytes)
            m.set_stages_without_redundancy(self._stages_without_redundancy())
            m.add_preemptions("standby", failures.standby_losses - self.standby_seen)
            self.standby_seen = failures.standby_losses
            m.add_reconfigurations(gens.reconfigurations - self.reconfigurations_seen)
            self.reconfigurations_seen = gens.reconfigurations
        self.health = {"status": status, "step": ctx.committed, "steps": cfg.training.steps,
                       "generation": ctx.plan.gen if ctx.plan is not None else None,
                       "reconfiguring": ctx.reconf is not None, "live_nodes": live}

    def _stages_without_redundancy(self) -> int:
        """Stages of the current role map (one per pipeline) with no live replica: every
        stage with redundancy off or one stage per pipeline, else those whose replica's
        holder is gone (a loss there cannot fail over in flight)."""
        ctx, nodes = self.parts[0], self.parts[1]
        roles = ctx.roles
        if roles is None:
            return 0
        if not ctx.rc or roles.stages == 1:
            return roles.stages * roles.pipelines
        gone = set(roles.dead) | {n.rank for n in nodes if n.rank is not None
                                  and (n.is_gone or n.exited)}
        return sum(1 for d in range(roles.pipelines) for s in range(roles.stages)
                   if roles.replicas[d][s] is None or roles.replicas[d][s] in gone
                   or roles.replicas[d][s] == roles.holders[d][s])

    def close(self) -> None:
        self.server.close()
