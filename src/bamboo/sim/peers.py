"""The peers' policies: torchrun with DCP restarts and torchft's replica groups, on the same
trace and costs as bamboo's modes.

* ``torchrun``: torchrun elastic. Losing a worker, or a node arriving that would make one
  more pipeline, stops every worker; once at least ``SimConfig.torchrun_min_nodes`` are ready
  (default P; the whole world for ``--nnodes`` fixed) they restart from the newest checkpoint
  (``ckpt_restart_s``) on as many pipelines as fit, and the steps since it are done again. A
  checkpoint every ``SimConfig.checkpoint_every_steps`` steps (default: checkpoint_every_s)
  pauses training for ``ckpt_save_s``.
* ``torchft``: D replica groups of P workers, each computing its share of the global batch,
  with a quorum every step. A group that loses a worker drops out: the step under way is
  discarded for every group (the failed all-reduce) and costs ``quorum_s`` more, and the
  others go on, each step committing only the participants' shares. A ready node (a standby,
  or the next to be ready) takes the vacancy; when the group is whole again it heals from a
  peer (``heal_s``) and rejoins. Training starts when the first group is whole. torchft keeps
  no checkpoint here: when the last group in the quorum drops out, a group healing takes over
  at once (its heal copied the model when it began; the rest of ``heal_s`` is waiting for a
  quorum); with none, no peer holds the model, every step done is lost, and training begins
  again at step 0 with the next group to be whole.

Useful time is counted in whole global batches: a torchft step with k of D groups takes
k / D of a global batch, so it counts as a global step of D / k times its length (the
missing shares' time is in the breakdown's "redundant").
"""
from __future__ import annotations

from bamboo.sim.core import CKPT, IDLE, RESTART, RUN, ClusterPolicy

__all__ = ["TorchrunPolicy", "TorchftPolicy"]

T_START, T_SAVE, T_SAVED, T_HEALED = range(4)


class TorchrunPolicy(ClusterPolicy):
    """Every worker restarts from the newest checkpoint whenever the membership changes."""

    name = "torchrun"

    def _reset(self) -> None:
        super()._reset()
        self.P = self.preset.stages
        self.D = 0
        self.min_nodes = max(self.cfg.torchrun_min_nodes, self.P)
        self.layout: set[int] = set()
        self.restarting = False
        self.started = False
        self.save_s = self.ckpt_save_s()
        self.restart_s = self.ckpt_restart_s()

    def on_ready(self, t: float, node: int) -> None:
        if self.layout and self.D < self.max_d and len(self.ready) // self.P > self.D:
            self._stop(t)  # a node waiting to join: the elastic agent restarts every worker
        self._maybe_restart(t)

    def on_lost(self, t: float, node: int) -> None:
        if node in self.layout:
            self.fatal_failures += 1
            self._stop(t)
        self._maybe_restart(t)

    def _stop(self, t: float) -> None:
        """Every worker stops; what was done since the newest checkpoint is lost."""
        self.bump("checkpoint_restores")
        self.drop_partial()
        self.rollback()
        self.epoch += 1  # the running layout's timers are void
        self.layout = set()
        self.mode = IDLE

    def _maybe_restart(self, t: float) -> None:
        if self.layout or self.restarting or len(self.ready) < self.min_nodes:
            return
        self.restarting = True
        self.mode = RESTART
        self.push(t + self.restart_s, T_START)

    def on_timer(self, t: float, kind: int, payload: object) -> None:
        if kind == T_START:
            self.restarting = False
            D = min(len(self.ready) // self.P, self.max_d)
            if D * self.P < self.min_nodes:  # lost while restarting: wait for more
                self.mode = IDLE
                return
            self.D = D
            self.layout = set(list(self.ready)[: D * self.P])
            if self.started:
                self.reconfigurations += 1
            self.started = True
            self.start_running(self.plain_s[D], self.plain_s[D])
            self._schedule_save(t)
        elif kind == T_SAVE:
            self.mode = CKPT
            self.push(t + self.save_s, T_SAVED)
        elif kind == T_SAVED:
            self.durable()
            self.mode = RUN
            self._schedule_save(t)

    def _schedule_save(self, t: float) -> None:
        """The next save, at the step boundary `every` steps on (checkpoint_every_steps, else
        checkpoint_every_s in whole steps)."""
        c, tau = self.cfg, self.plain_s[self.D]
        every = c.checkpoint_every_steps or max(1, round(c.checkpoint_every_s / tau))
        self.push(t + every * tau, T_SAVE)


class TorchftPolicy(ClusterPolicy):
    """Replica groups that drop out when a worker is lost and heal from a peer when whole."""

    name = "torchft"

    def _reset(self) -> None:
        super()._reset()
        self.P = self.preset.stages
        self.D = self.max_d
        self.groups: list[list[int | None]] = [[None] * self.P for _ in range(self.D)]
        self.group_of: dict[int, int] = {}
        self.live: set[int] = set()
        """Groups in the quorum."""
        self.healing: dict[int, int] = {}
        """Group -> the token of its heal under way (a heal of an earlier filling is void)."""
        self.standby: list[int] = []
        self.base = self.plain_s[self.D]

    def step_time(self, k: int) -> float:
        """Seconds of one step with k groups in the quorum: the same work per group on a
        processor each; on `shared_cores` processors, the k groups' P workers each share them."""
        cores = self.cfg.shared_cores
        if not cores:
            return self.base
        return self.base * max(k * self.P, cores) / max(self.D * self.P, cores)

    def _set_quorum(self, t: float) -> None:
        k = len(self.live)
        if k == 0:
            self.mode = IDLE
            return
        tau = self.step_time(k)
        tau_global = tau * self.D / k
        if self.mode != RUN:
            self.start_running(tau_global, self.base)
        else:
            self.set_tau(tau_global, self.base)

    def on_ready(self, t: float, node: int) -> None:
        self._place(t, node)

    def _place(self, t: float, node: int) -> None:
        """The node fills a vacancy, or waits as a standby; a group it makes whole joins at
        once before training began (at its first instant), else after healing."""
        g = next((g for g, members in enumerate(self.groups) if None in members), None)
        if g is None:
            self.standby.append(node)
            return
        members = self.groups[g]
        members[members.index(None)] = node
        self.group_of[node] = g
        if None in members:
            return
        if self.first_run_t is None or t == self.first_run_t or not self.live:
            self.live.add(g)  # before training began, or from step 0 again: nothing to heal from
            self._set_quorum(t)
        else:
            self.healing[g] = token = self.seq
            self.push(t + self.preset.heal_s, T_HEALED, (g, token))

    def on_lost(self, t: float, node: int) -> None:
        if node in self.standby:
            self.standby.remove(node)
            return
        g = self.group_of.pop(node, None)
        if g is None:
            return
        members = self.groups[g]
        members[members.index(node)] = None
        self.healing.pop(g, None)
        if g in self.live:
            self.live.discard(g)
            self.bump("groups_dropped")
            self.drop_partial()  # the failed all-reduce voids the step for every group
            if not self.live:
                self._lose_the_model()
            self._set_quorum(t)
            if self.mode == RUN and self.preset.quorum_s > 0:
                self.stall(self.preset.quorum_s)
        if self.standby:
            self._place(t, self.standby.pop(0))

    def _lose_the_model(self) -> None:
        """No group is left in the quorum: the groups healing hold the model and go on; with
        none, every step is lost."""
        if not self.healing:
            self.rollback()
            self.bump("restarts_from_zero")
        for g in list(self.healing):
            del self.healing[g]
            self.live.add(g)
            self.bump("heals")

    def on_timer(self, t: float, kind: int, payload: object) -> None:
        if kind != T_HEALED:
            return
        g, token = payload
        if self.healing.get(g) == token:
            del self.healing[g]
            self.live.add(g)
            self.bump("heals")
            self._set_quorum(t)
