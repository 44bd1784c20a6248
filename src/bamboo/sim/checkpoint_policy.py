"""The ``checkpoint`` policy: no redundancy; a checkpoint every N seconds; any loss of a node in
the layout restarts every worker from the last checkpoint on the nodes available
(torchrun-style restart, Varuna-like morphing: checkpoint then restart when a new pipeline
fits)."""
from __future__ import annotations

import math

from bamboo.sim.core import CKPT, IDLE, REBALANCE, RESTART, RUN
from bamboo.sim.restarting import (
    RDV,
    RUNNING,
    SAVING,
    STOPPED,
    T_CKPT_DONE,
    T_CKPT_START,
    T_MORPH,
    T_RDV_DONE,
    RestartingPolicy,
)

__all__ = ["CheckpointPolicy"]


class CheckpointPolicy(RestartingPolicy):
    """Checkpoint every N seconds; any loss of a working node restarts all from the last checkpoint."""

    name = "checkpoint"

    def _reset(self) -> None:
        super()._reset()
        self.layout: set[int] = set()
        self.morph_pending = False
        self.then_restart = False
        self.save_s = self.ckpt_save_s()
        self.restart_s = self.ckpt_restart_s()

    def on_ready(self, t: float, node: int) -> None:
        st = self.status
        if st == STOPPED:
            self.start_restart(t, RESTART)
        elif st == RDV:
            self.members.add(node)
        else:
            self.standby[node] = None
            if (
                not self.morph_pending
                and self.D < self.max_d
                and (self.D * self.P + len(self.standby)) // self.P > self.D
            ):
                self.morph_pending = True
                if st == RUNNING:
                    self.push(self.next_boundary(t), T_MORPH)

    def on_lost(self, t: float, node: int) -> None:
        if self._loss_absorbed(node):
            return
        if node in self.layout:
            self.fatal_failures += 1
            self.bump("checkpoint_restores")
            self.drop_partial()
            self.rollback()
            self.start_restart(t, RESTART)

    def start_restart(self, t: float, mode: int) -> None:
        self.drop_partial()
        self.epoch += 1
        self.status = RDV
        self.mode = mode
        self.rdv_mode = mode
        self.members = set(self.ready)
        self.broken = False
        self.layout = set()
        self.standby = {}
        self.morph_pending = False
        self.then_restart = False
        self.push(t + self.restart_s, T_RDV_DONE)

    def schedule_checkpoint(self, t: float) -> None:
        every = self.cfg.checkpoint_every_s
        tau = self.tau
        rem = (1.0 - self.frac) * tau
        if every <= rem:
            tb = t + rem
        else:
            tb = t + rem + math.ceil((every - rem) / tau - 1e-9) * tau
        self.push(tb, T_CKPT_START)

    def begin_save(self, t: float, then_restart: bool) -> None:
        self.epoch += 1
        self.status = SAVING
        self.mode = CKPT
        self.then_restart = then_restart
        self.frac = 0.0
        self.lost += self.ptime  # normally ~0: saves start at step boundaries
        self.ptime = 0.0
        self.push(t + self.save_s, T_CKPT_DONE)

    def on_timer(self, t: float, kind: int, payload: object) -> None:
        if kind == T_RDV_DONE:
            if self.broken:
                self.members = set(self.ready)
                self.broken = False
                self.push(t + self.restart_s, T_RDV_DONE)
                self.bump("rendezvous_retries")
            else:
                self.form_layout(t)
        elif kind == T_CKPT_START:
            if self.status == RUNNING:
                self.begin_save(t, False)
        elif kind == T_MORPH:
            if self.status == RUNNING:
                self.begin_save(t, True)
        elif kind == T_CKPT_DONE:
            self.durable()
            if self.then_restart or self.morph_pending:
                self.start_restart(t, REBALANCE)
            else:
                self.status = RUNNING
                self.mode = RUN
                self.schedule_checkpoint(t)

    def form_layout(self, t: float) -> None:
        nodes = list(self.ready)
        D = min(len(nodes) // self.P, self.max_d)
        if D <= 0:
            self.status = STOPPED
            self.mode = IDLE
            return
        used = D * self.P
        self.layout = set(nodes[:used])
        self.standby = dict.fromkeys(nodes[used:])
        if self.started:
            self.reconfigurations += 1
        self.started = True
        self.status = RUNNING
        self.D = D
        plain = self.plain_s[D]
        self.start_running(plain, plain)
        self.schedule_checkpoint(t)
