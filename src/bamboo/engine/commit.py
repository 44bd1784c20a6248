"""The commit round: reduce gradients across pipelines, feed the replicas, agree on the norm.

The round runs in phases, the same on every node, each posted as one batch (`P2P.exchange`)
and finished before the next begins: so between any two nodes the messages of a direction
come in one fixed order (what NCCL's in-order matching needs, and what `--comm strict`
holds gloo to), and two nodes sending to each other in one phase do so in one group call.

1. data-parallel sums of every stage held by more than one pipeline, in buckets on the
   stage's data-parallel group (`buckets.py`: begun during the backward where they can be,
   launched here otherwise), in stage order:
   - `exact`: an all-gather of every member's float64 buckets, which each adds in pipeline
     order: any layout gives the same bits. Where a slot is re-routed, members send their
     sums to the stage's holder in pipeline 0 (UP) instead, which adds them in pipeline order
     and sends the total back (DOWN) (a peer serving a re-routed slot sends that pipeline's
     sum apart from its own, so the order is kept);
   - otherwise: all-reduces, in the sums' dtype;
2. TIE: tied weights on more than one stage (bamboo.model.ties): the first holder of
   each of the tie's stages sends its slice of the reduced gradient to the first holder of
   the tie's lowest stage (UP), which adds them in stage order and sends the sum to every
   holder of those stages (DOWN), who put it in place of their own slice;
3. REPLICA: each stage's reduced gradient (float32) to the node keeping its replica;
4. NORM: per-layer squared norms to the root (UP), the global norm back to all (DOWN).

Every message carries a status word and every node sends all it owes even when
something failed (with status 0), so a failed round leaves no message between two live
nodes unmatched, and the coordinator can simply ask every survivor to run it again.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bamboo.config.presets import ModelPreset
from bamboo.engine.buckets import BucketReducer
from bamboo.engine.comm import (
    DP_DOWN,
    DP_UP,
    NORM_DOWN,
    NORM_UP,
    P2P,
    REPLICA,
    TIE_DOWN,
    TIE_UP,
    Interrupted,
    Key,
    PeerLost,
)
from bamboo.engine.stage import StageState
from bamboo.model import model_ties
from bamboo.plan.roles import RoleMap

__all__ = ["RoundResult", "commit_round", "TiedStages", "tied_stages"]

TiedStages = list[tuple[str, list[int]]]
"""Each tie held by more than one stage: (key, its stages in order), by key."""


def tied_stages(preset: ModelPreset, parts: Sequence[range]) -> TiedStages:
    """The ties of `preset` whose uses are on more than one of the stages `parts` (the
    commit round adds them)."""
    stage_of = {layer: stage for stage, r in enumerate(parts) for layer in r}
    return [(tie.key, stages) for tie in model_ties(preset)
            if len(stages := sorted({stage_of[layer] for layer in tie.layers()})) > 1]


@dataclass(slots=True)
class RoundResult:
    ok: bool = True
    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    """Stage -> its gradient summed over all pipelines (the accumulation dtype)."""
    replica_grad: torch.Tensor | None = None
    """The replica stage's reduced gradient (float32), from its primary."""
    norm: float = 0.0
    bytes_replica: int = 0


def _sum_in_order(parts: list[tuple[bool, torch.Tensor | None]]
                  ) -> tuple[torch.Tensor | None, bool]:
    """The sum of `parts` ((arrived, tensor), a fixed order: the same bits on every layout)
    in a fresh tensor, and whether every part arrived (None once one did not)."""
    total, ok = None, True
    for got, part in parts:
        ok &= got and part is not None
        if ok:
            total = part.clone() if total is None else total.__iadd__(part)
    return (total if ok else None), ok


def _with_status(payload: torch.Tensor, ok: bool) -> torch.Tensor:
    status = torch.full((1,), 1.0 if ok else 0.0, dtype=payload.dtype, device=payload.device)
    return torch.cat([payload.reshape(-1), status])


_Message = tuple[torch.Tensor, int, Key]


def _payload(received: tuple[bool, _Message]) -> tuple[bool, torch.Tensor]:
    """(arrived, the payload without its status word) of a phase's receive."""
    got, (buf, _, _) = received
    return got, buf[:-1]


@dataclass(frozen=True, slots=True)
class _Holdings:
    """What the node holds in the round: its roles, stages, replica and the ties among them."""

    roles: RoleMap
    rank: int
    stages: dict[int, StageState]
    replica: StageState | None
    ties: TiedStages
    num_layers: int


@dataclass(frozen=True, slots=True)
class _Means:
    """How the round sums: the peers' links, the bucketed sums, float64 pipeline order or
    collectives, and the two hooks (a change of roles interrupts; a fault hook after the
    sums)."""

    p2p: P2P
    reducer: BucketReducer
    exact: bool
    interrupt: Callable[[], bool]
    after_reduce: Callable[[], None]


class _Round:
    def __init__(self, held: _Holdings, means: _Means) -> None:
        self.roles, self.rank, self.stages = held.roles, held.rank, held.stages
        self.replica, self.ties, self.num_layers = held.replica, held.ties, held.num_layers
        self.p2p, self.reducer, self.exact = means.p2p, means.reducer, means.exact
        self.interrupt, self.after_reduce = means.interrupt, means.after_reduce
        self.pipeline = held.roles.pipeline_of(held.rank)
        self.result = RoundResult()
        self.device = next(iter(held.stages.values())).device

    def run(self) -> RoundResult:
        if self.exact:
            self._reduce_in_pipeline_order()
        else:
            self._reduce_with_collectives()
        if self.ties:
            self._add_tied()
        self.after_reduce()
        self._feed_replicas()
        self._agree_on_norm()
        self.reducer.round_over()
        return self.result

    # -- transport: one batch per phase ----------------------------------------------------

    def _phase(self, sends: list[_Message], recvs: list[_Message]) -> list[bool]:
        """Post a phase's messages as one batch; whether each receive arrived with status 1.

        With tags (gloo, --comm tagged) a receive is waited to its end even when the roles
        changed: a receive left posted would take the matching message of the next round.
        Under strict rules the group is dropped on any loss, so waits give way to new roles.
        """
        try:
            works = self.p2p.exchange(sends, recvs)
        except PeerLost:
            self.result.ok = False
            return [False] * len(recvs)
        arrived = []
        for (work, peer), (buf, _, _) in zip(works, recvs):
            try:
                if self.p2p.strict:
                    self.p2p.wait_interruptible(work, peer, self.interrupt)
                else:
                    self.p2p.wait(work, peer)
                arrived.append(bool(buf[-1] == 1.0))
            except (PeerLost, Interrupted):
                arrived.append(False)
        self.result.ok &= all(arrived)
        return arrived

    # -- 1. data-parallel sums ---------------------------------------------------------------

    def _local_sum(self, st: StageState) -> torch.Tensor:
        """This node's whole sum for the stage: its own pipeline's, plus the micro-batches of
        re-routed slots it served."""
        served = st.served_sums()
        if not served:
            return st.grad_sum
        total = st.grad_sum.clone()
        for flat in served.values():
            total += flat
        return total

    def _shared_stages(self) -> list[tuple[int, StageState, list[int]]]:
        out = []
        for stage, st in sorted(self.stages.items()):
            members = self.roles.stage_members(stage)
            if len(members) == 1 and not self.exact:
                self.result.reduced[stage] = self._local_sum(st)
            else:
                out.append((stage, st, members))
        return out

    def _contributions(self, stage: int) -> list[tuple[int, int]]:
        """(pipeline, rank) of every partial sum of `stage`, in pipeline order: one per
        pipeline, or for a re-routed slot one per serving peer, in peer order."""
        out = []
        for d in range(self.roles.pipelines):
            route = self.roles.route(d, stage)
            peers = [self.roles.holders[d][stage]] if route is None else \
                list(dict.fromkeys(route.peers))
            out += [(d, rank) for rank in peers]
        return out

    def _partial(self, st: StageState, pipeline: int) -> torch.Tensor:
        """This node's partial sum of `pipeline` at stage `st`."""
        if pipeline == self.pipeline:
            return st.grad_sum
        served = st.served_sums().get(pipeline)
        return served if served is not None else torch.zeros_like(st.grad_sum)

    def _bucketed(self, st: StageState, members: list[int], local: torch.Tensor) -> None:
        """`st`'s sum over `members` (in pipeline order) in buckets: those begun during the
        backward, or launched now."""
        try:
            buckets = self.reducer.take(st.stage, self.roles.epoch, self.p2p) or \
                self.reducer.start(st=st, members=members, p2p=self.p2p, epoch=self.roles.epoch,
                                   local=local, interrupt=self.interrupt)
        except (PeerLost, Interrupted):
            self.result.ok = False
            return
        total = buckets.finish(self.interrupt)
        if total is None:
            self.result.ok = False
        else:
            self.result.reduced[st.stage] = total

    def _one_per_pipeline(self, stage: int, members: list[int]) -> bool:
        """Whether every pipeline's sum of `stage` is one member's own (no re-routed slot)."""
        return 1 < len(members) == self.roles.pipelines and \
            all(self.roles.route(d, stage) is None for d in range(self.roles.pipelines))

    def _reduce_in_pipeline_order(self) -> None:
        """Stages with one member per pipeline: all-gathered buckets, added in pipeline
        order by every member. The others: every partial sum goes to the first contributor
        (the stage's holder in the lowest pipeline), which adds them in pipeline order and
        sends the total back."""
        shared = []
        for stage, st, members in self._shared_stages():
            if self._one_per_pipeline(stage, members):
                self._bucketed(st, members, st.grad_sum)
            else:
                shared.append((stage, st, members))
        plans = {stage: self._contributions(stage) for stage, _, _ in shared}
        sends, recvs = [], []
        for stage, st, _ in shared:
            parts = plans[stage]
            root = parts[0][1]
            if root != self.rank:
                sends += [(_with_status(self._partial(st, d), True), root, (DP_UP, stage, d))
                          for d, rank in parts if rank == self.rank]
            else:
                recvs += [(st.grad_sum.new_empty(st.numel + 1), rank, (DP_UP, stage, d))
                          for d, rank in parts if rank != self.rank]
        arrived = iter(zip(self._phase(sends, recvs), recvs))
        sends, recvs = [], []
        for stage, st, members in shared:
            parts = plans[stage]
            if parts[0][1] == self.rank:
                total, ok = _sum_in_order([(True, self._partial(st, d)) if rank == self.rank
                                           else _payload(next(arrived)) for d, rank in parts])
                if total is None:
                    total = torch.zeros_like(st.grad_sum)
                members = [m for m in members if m != self.rank]
                if ok:
                    self.result.reduced[stage] = total
                message = _with_status(total, ok)
                sends += [(message, m, (DP_DOWN, stage, 0)) for m in members]
            else:
                recvs.append((st.grad_sum.new_empty(st.numel + 1), parts[0][1], (DP_DOWN, stage, 0)))
        recv_stages = [stage for stage, _, _ in shared if plans[stage][0][1] != self.rank]
        for stage, got, (buf, _, _) in zip(recv_stages, self._phase(sends, recvs), recvs):
            if got:
                self.result.reduced[stage] = buf[:-1]

    def _reduce_with_collectives(self) -> None:
        """Each shared stage's buckets all-reduced, in stage order (a global order: no two
        nodes wait on each other's groups), on the group of its members under these roles."""
        for _, st, members in self._shared_stages():
            self._bucketed(st, members, self._local_sum(st))

    # -- 2. tied weights ----------------------------------------------------------------------

    def _tied_part(self, stage: int, key: str) -> torch.Tensor | None:
        """This node's slice of tie `key` in `stage`'s reduced gradient (None: not reduced)."""
        reduced = self.result.reduced.get(stage)
        return None if reduced is None else reduced[self.stages[stage].tied[key]]

    def _add_tied(self) -> None:
        """Every tie's slices of its stages' reduced gradients, added in stage order at the
        first holder of its lowest stage, and the sum put in place of each held stage's slice.
        Any member of a stage has its reduced gradient; the first one's is sent."""
        source = {s: self.roles.stage_members(s)[0] for _, stages in self.ties for s in stages}
        sends, recvs, plans = [], [], []
        for index, (key, stages) in enumerate(self.ties):
            root = source[stages[0]]
            plans.append((key, stages, root))
            for s in stages[1:]:
                if source[s] == self.rank and root != self.rank:
                    part = self._tied_part(s, key)
                    sends.append((_with_status(part if part is not None else
                                               self._zeros(s, key), part is not None),
                                  root, (TIE_UP, s, index)))
                elif root == self.rank and source[s] != self.rank:
                    recvs.append((self._zeros(stages[0], key, extra=1), source[s],
                                  (TIE_UP, s, index)))
        arrived = iter(zip(self._phase(sends, recvs), recvs))
        sends, recvs, sums = [], [], {}
        for index, (key, stages, root) in enumerate(plans):
            if root == self.rank:
                total, ok = _sum_in_order([(True, self._tied_part(s, key))
                                           if source[s] == self.rank
                                           else _payload(next(arrived)) for s in stages])
                message = _with_status(total if ok else self._zeros(stages[0], key), ok)
                sends += [(message, m, (TIE_DOWN, s, index)) for s in stages
                          for m in self.roles.stage_members(s) if m != self.rank]
                if ok:
                    sums[key] = total
            else:
                recvs += [(self._zeros(stages[0], key, extra=1), root, (TIE_DOWN, s, index))
                          for s in stages if s in self.stages and
                          self.rank in self.roles.stage_members(s)]
        for got, (buf, _, (_, _, index)) in zip(self._phase(sends, recvs), recvs):
            if got:
                sums[self.ties[index][0]] = buf[:-1]
        for key, stages in self.ties:
            for s in stages:
                if s in self.stages and s in self.result.reduced and key in sums:
                    reduced = self.result.reduced[s]
                    if reduced is self.stages[s].grad_sum:  # a failed round runs again on it
                        reduced = self.result.reduced[s] = reduced.clone()
                    reduced[self.stages[s].tied[key]] = sums[key]

    def _zeros(self, stage: int, key: str, extra: int = 0) -> torch.Tensor:
        """Zeros of a tie's slice (its size is the same on every stage that holds it), with
        `extra` more values, in the gradient sums' dtype."""
        held = next(st for st in self.stages.values() if key in st.tied)
        where = held.tied[key]
        return held.grad_sum.new_zeros(where.stop - where.start + extra)

    # -- 3. replicas -------------------------------------------------------------------------

    def _feed_replicas(self) -> None:
        sends, recvs = [], []
        for stage, st in sorted(self.stages.items()):
            holder = self.roles.replicas[self.pipeline][stage]
            if holder is None or holder == self.rank:
                continue
            reduced = self.result.reduced.get(stage)
            payload = reduced.to(torch.float32) if reduced is not None else \
                torch.zeros(st.numel, dtype=torch.float32, device=self.device)
            message = _with_status(payload, reduced is not None)
            self.result.bytes_replica += message.numel() * message.element_size()
            sends.append((message, holder, (REPLICA, stage, 0)))
        if self.replica is not None:
            primary = self.roles.holders[self.pipeline][self.replica.stage]
            buf = torch.empty(self.replica.numel + 1, dtype=torch.float32, device=self.device)
            recvs.append((buf, primary, (REPLICA, self.replica.stage, 0)))
        arrived = self._phase(sends, recvs)
        if recvs and arrived[0]:
            self.result.replica_grad = recvs[0][0][:-1]
        elif recvs:
            self.result.ok = False

    # -- 4. the global norm ------------------------------------------------------------------

    def _local_norms(self, every_stage_held: bool = False) -> torch.Tensor:
        """Per-layer squared norms of the reduced gradients this node counts (pipeline 0's
        stages; `every_stage_held`: every stage it holds), then 1.0 if its round was ok."""
        vec = torch.zeros(self.num_layers + 1, dtype=torch.float64, device=self.device)
        for stage, st in self.stages.items():
            counted = every_stage_held or self.roles.holders[0][stage] == self.rank
            if not counted or stage not in self.result.reduced:
                continue
            for layer, sq in st.layer_sq_norms(self.result.reduced[stage]):
                vec[layer] = sq
        vec[-1] = 1.0 if self.result.ok else 0.0
        return vec

    def _agree_on_norm(self) -> None:
        if self.roles.stages == 1:
            # Each active node holds the whole model's reduced gradient, the same bits as
            # every other's (the data-parallel sum gives them all one result), so the norm
            # the root would send is the one computed here; a failed round anywhere still
            # stops the commit through that node's vote.
            vec = self._local_norms(every_stage_held=True)
            self.result.norm = math.sqrt(float(vec[:-1].sum()))
            return
        root = min(self.roles.active_ranks())
        contributors = sorted({self.roles.holders[0][s] for s in range(self.roles.stages)})
        f64 = dict(dtype=torch.float64, device=self.device)
        vec = self._local_norms() if self.rank in contributors else None
        if self.rank != root:
            sends = [(vec, root, (NORM_UP, 0, 0))] if vec is not None else []
            self._phase(sends, [])
            buf = torch.empty(2, **f64)
            if self._phase([], [(buf, root, (NORM_DOWN, 0, 0))])[0]:
                self.result.norm = float(buf[0])
            return
        recvs = [(torch.empty(self.num_layers + 1, **f64), c, (NORM_UP, 0, 0))
                 for c in contributors if c != self.rank]
        self._phase([], recvs)
        total = vec.clone() if vec is not None else torch.zeros(self.num_layers + 1, **f64)
        for buf, _, _ in recvs:
            total[:-1] += buf[:-1]
        self.result.norm = math.sqrt(float(total[:-1].sum()))
        ok = self.result.ok and (vec is None or bool(vec[-1] == 1.0))
        message = torch.tensor([self.result.norm, 1.0 if ok else 0.0], **f64)
        self._phase([(message, peer, (NORM_DOWN, 0, 0)) for peer in self.roles.active_ranks()
                     if peer != self.rank], [])


def commit_round(*, roles: RoleMap, rank: int, stages: dict[int, StageState],
                 replica: StageState | None, p2p: P2P, num_layers: int, exact: bool = True,
                 interrupt: Callable[[], bool] = lambda: False,
                 after_reduce: Callable[[], None] = lambda: None,
                 ties: TiedStages | None = None,
                 reducer: BucketReducer | None = None) -> RoundResult:
    """Run the round; `ok` is False if any part failed anywhere this node could see.

    `after_reduce` runs between the gradient sums (data-parallel and tied) and the rest (a
    fault hook). `ties`: the ties on more than one stage. `reducer`: the node's bucketed sums
    (default: one bucket a stage, none begun early).
    """
    held = _Holdings(roles, rank, stages, replica, ties or [], num_layers)
    means = _Means(p2p, reducer or BucketReducer(bucket_bytes=0, exact=exact), exact,
                   interrupt, after_reduce)
    return _Round(held, means).run()
