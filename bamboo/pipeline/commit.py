"""The commit round: reduce gradients across pipelines, feed the replicas, agree on the norm.

It runs on point-to-point transfers of the process group that outlives lost peers,
so a lost node never leaves a half-built collective behind. Every message carries a
status word, and every node posts all its receives first and sends everything it
owes even when something failed (with status 0), so every message between two live
nodes is matched within the round: a failed round leaves nothing in flight, and the
coordinator can simply ask every survivor to run it again.

Sums are taken in pipeline order and per layer, so any layout gives the same bits.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from bamboo.pipeline.comm import (DP_DOWN, DP_UP, NORM_DOWN, NORM_UP, P2P, REPLICA, PeerLost,
                                  tag_for)
from bamboo.pipeline.stage import StageState
from bamboo.redundancy.roles import RoleMap

__all__ = ["RoundResult", "commit_round"]


@dataclass(slots=True)
class RoundResult:
    ok: bool = True
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    """Stage -> its gradient summed over all pipelines (float64)."""
    replica_grad: torch.Tensor | None = None
    """The replica stage's reduced gradient (float32), from its primary."""
    norm: float = 0.0
    bytes_replica: int = 0


def _with_status(payload: torch.Tensor, ok: bool) -> torch.Tensor:
    status = torch.ones(1, dtype=payload.dtype, device=payload.device) * (1.0 if ok else 0.0)
    return torch.cat([payload.reshape(-1), status])


class _Round:
    def __init__(self, *, roles: RoleMap, rank: int, stages: dict[int, StageState],
                 replica: StageState | None, p2p: P2P, num_layers: int,
                 after_reduce: Callable[[], None]) -> None:
        self.roles, self.rank, self.stages, self.replica = roles, rank, stages, replica
        self.after_reduce = after_reduce
        self.p2p, self.num_layers = p2p, num_layers
        self.pipeline = roles.pipeline_of(rank)
        self.result = RoundResult()
        self.device = next(iter(stages.values())).device

    def _wait(self, work, peer: int) -> bool:
        try:
            self.p2p.wait(work, peer)
            return True
        except PeerLost:
            self.result.ok = False
            return False

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        try:
            self.p2p.send(tensor, peer, tag)
        except PeerLost:
            self.result.ok = False

    def run(self) -> RoundResult:
        self._post_receives()
        for stage, st in sorted(self.stages.items()):
            members = self.roles.stage_members(stage)
            if len(members) > 1 and members[0] != self.rank:
                self._send(_with_status(st.grad_sum, True), members[0], tag_for(DP_UP, stage))
        self._reduce_stages()
        self.after_reduce()
        self._feed_replicas()
        self._agree_on_norm()
        self._receive_replica()
        return self.result

    def _post_receives(self) -> None:
        f64 = dict(dtype=torch.float64, device=self.device)
        self.dp_in: dict[int, list[tuple[int, torch.Tensor, object]]] = {}
        self.dp_down: dict[int, tuple[int, torch.Tensor, object]] = {}
        for stage, st in sorted(self.stages.items()):
            members = self.roles.stage_members(stage)
            if len(members) == 1:
                continue
            if members[0] == self.rank:
                self.dp_in[stage] = []
                for m in members[1:]:
                    buf = torch.empty(st.numel + 1, **f64)
                    self.dp_in[stage].append((m, buf, self.p2p.post_recv(buf, m, tag_for(DP_UP, stage))))
            else:
                buf = torch.empty(st.numel + 1, **f64)
                self.dp_down[stage] = (members[0], buf,
                                       self.p2p.post_recv(buf, members[0], tag_for(DP_DOWN, stage)))
        self.replica_in = None
        if self.replica is not None:
            primary = self.roles.holders[self.pipeline][self.replica.stage]
            buf = torch.empty(self.replica.numel + 1, dtype=torch.float32, device=self.device)
            self.replica_in = (primary, buf,
                               self.p2p.post_recv(buf, primary, tag_for(REPLICA, self.replica.stage)))
        self.norm_root = min(self.roles.active_ranks())
        self.contributors = sorted({self.roles.holders[0][s] for s in range(self.roles.stages)})
        self.norm_in, self.norm_down = [], None
        if self.rank == self.norm_root:
            for c in self.contributors:
                if c != self.rank:
                    buf = torch.empty(self.num_layers + 1, **f64)
                    self.norm_in.append((c, buf, self.p2p.post_recv(buf, c, tag_for(NORM_UP, 0))))
        else:
            buf = torch.empty(2, **f64)
            self.norm_down = (self.norm_root, buf,
                              self.p2p.post_recv(buf, self.norm_root, tag_for(NORM_DOWN, 0)))

    def _reduce_stages(self) -> None:
        for stage, st in sorted(self.stages.items()):
            members = self.roles.stage_members(stage)
            if len(members) == 1:
                self.result.reduced[stage] = st.grad_sum
            elif stage in self.dp_in:
                total, ok = st.grad_sum.clone(), True
                for peer, buf, work in self.dp_in[stage]:
                    ok = self._wait(work, peer) and bool(buf[-1] == 1.0) and ok
                    if ok:
                        total += buf[:-1]
                self.result.ok &= ok
                if ok:
                    self.result.reduced[stage] = total
                message = _with_status(total, ok)
                for peer in members[1:]:
                    self._send(message, peer, tag_for(DP_DOWN, stage))
            else:
                peer, buf, work = self.dp_down[stage]
                if self._wait(work, peer) and buf[-1] == 1.0:
                    self.result.reduced[stage] = buf[:-1]
                else:
                    self.result.ok = False

    def _feed_replicas(self) -> None:
        for stage, st in sorted(self.stages.items()):
            holder = self.roles.replicas[self.pipeline][stage]
            if holder is None or holder == self.rank:
                continue
            reduced = self.result.reduced.get(stage)
            payload = reduced.to(torch.float32) if reduced is not None else \
                torch.zeros(st.numel, dtype=torch.float32, device=self.device)
            message = _with_status(payload, reduced is not None)
            self.result.bytes_replica += message.numel() * message.element_size()
            self._send(message, holder, tag_for(REPLICA, stage))

    def _local_norms(self) -> torch.Tensor:
        vec = torch.zeros(self.num_layers + 1, dtype=torch.float64, device=self.device)
        for stage, st in self.stages.items():
            if self.roles.holders[0][stage] != self.rank or stage not in self.result.reduced:
                continue
            for layer, sq in st.layer_sq_norms(self.result.reduced[stage]):
                vec[layer] = sq
        vec[-1] = 1.0 if self.result.ok else 0.0
        return vec

    def _agree_on_norm(self) -> None:
        contributes = self.rank in self.contributors
        vec = self._local_norms() if contributes else None
        if self.rank != self.norm_root:
            if contributes:
                self._send(vec, self.norm_root, tag_for(NORM_UP, 0))
            peer, buf, work = self.norm_down
            if self._wait(work, peer) and buf[1] == 1.0:
                self.result.norm = float(buf[0])
            else:
                self.result.ok = False
            return
        total = vec.clone() if vec is not None else \
            torch.zeros(self.num_layers + 1, dtype=torch.float64, device=self.device)
        ok = vec is None or bool(vec[-1] == 1.0)
        for peer, buf, work in self.norm_in:
            ok = self._wait(work, peer) and bool(buf[-1] == 1.0) and ok
            total[:-1] += buf[:-1]
        ok &= self.result.ok
        norm = math.sqrt(float(total[:-1].sum()))
        self.result.norm = norm
        self.result.ok &= ok
        message = torch.tensor([norm, 1.0 if ok else 0.0], dtype=torch.float64, device=self.device)
        for peer in self.roles.active_ranks():
            if peer != self.rank:
                self._send(message, peer, tag_for(NORM_DOWN, 0))

    def _receive_replica(self) -> None:
        if self.replica_in is None:
            return
        peer, buf, work = self.replica_in
        if self._wait(work, peer) and buf[-1] == 1.0:
            self.result.replica_grad = buf[:-1]
        else:
            self.result.ok = False


def commit_round(*, roles: RoleMap, rank: int, stages: dict[int, StageState],
                 replica: StageState | None, p2p: P2P, num_layers: int,
                 after_reduce: Callable[[], None] = lambda: None) -> RoundResult:
    """Run the round; `ok` is False if any part failed anywhere this node could see.

    `after_reduce` runs between the data-parallel sums and the rest (a fault hook).
    """
    return _Round(roles=roles, rank=rank, stages=stages, replica=replica, p2p=p2p,
                  num_layers=num_layers, after_reduce=after_reduce).run()
