"""The role map: which node holds each stage of each pipeline, and each stage's replica.

Node (d, s) starts as the holder of stage s of pipeline d and keeps a replica of
its successor stage (s + 1) mod P. When a node is lost, `plan_failover` moves each of
its stages to a surviving copy: the replica's holder (a *failover*: the predecessor
becomes the shadow), or, when the replica died too, the same stage of another
pipeline, whose copy is identical at every step boundary (a *peer restore*, onto the
node that took the preceding stage, so every node holds a contiguous run of stages).
When no copy survives in flight, `Unrecoverable` says so in one line (the coordinator
then plans a new generation from whatever copies and restore points remain).

Under `--redundancy reroute` there are no replicas: `plan_reroute` gives a lost node's
stage to the live holders of the same stage in the other pipelines (a `Reroute`: "stage s
of pipeline d served by these peers"), which run its micro-batches with their own
identical parameters. Pure data, no torch.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["RoleMap", "Takeover", "Reroute", "FailoverPlan", "Unrecoverable", "plan_failover",
           "plan_reroute", "slot_loads", "shadow_or_reroute"]


class Unrecoverable(RuntimeError):
    """Every copy of some stage is gone; str() is the message for the user."""


@dataclass(frozen=True, kw_only=True)
class Takeover:
    """Stage `stage` of pipeline `pipeline` moves from the lost node to `new_holder`."""

    stage: int
    pipeline: int
    new_holder: int
    kind: str
    """`failover` (from the replica) or `peer_restore` (from `source`, another pipeline)."""
    source: int | None = None


@dataclass(frozen=True, kw_only=True)
class Reroute:
    """Stage `stage` of pipeline `pipeline` served by `peers`: the live holders of that stage
    in other pipelines, in pipeline order. Local micro-batch i of the pipeline goes to
    peers[i % len(peers)]: spread as evenly as the peers allow, the same on every node."""

    stage: int
    pipeline: int
    peers: list[int]

    def peer_for(self, index: int) -> int:
        return self.peers[index % len(self.peers)]


@dataclass(kw_only=True)
class RoleMap:
    """holders[d][s]: the rank running stage s of pipeline d; replicas[d][s]: the rank
    keeping a replica of it (None when no live node does)."""

    stages: int
    pipelines: int
    holders: list[list[int]]
    replicas: list[list[int | None]]
    epoch: int = 0
    dead: list[int] = field(default_factory=list)
    takeovers: list[Takeover] = field(default_factory=list)
    """The moves of the latest change, in the order to apply."""
    abandon: bool = False
    """The generation ends here: no copy covers the loss in flight, so every node drops the
    step under way and the coordinator plans a new generation (`bamboo.plan.planner`)."""
    reroutes: list[Reroute] = field(default_factory=list)
    """Slots served by data-parallel peers (`--redundancy reroute`); `holders` names the first
    peer of each, so the stage's copies and the data-parallel group read as they are."""
    rerouted: bool = False
    """This change re-routed a stage: every node starts the step under way again under it."""

    @classmethod
    def initial(cls, *, stages: int, pipelines: int, redundancy: bool) -> RoleMap:
        holders = [[d * stages + s for s in range(stages)] for d in range(pipelines)]
        replicas: list[list[int | None]] = [
            [holders[d][(s - 1) % stages] if redundancy and stages > 1 else None
             for s in range(stages)] for d in range(pipelines)]
        return cls(stages=stages, pipelines=pipelines, holders=holders, replicas=replicas)

    def route(self, pipeline: int, stage: int) -> Reroute | None:
        """The peers serving slot (pipeline, stage), if it is re-routed."""
        for r in self.reroutes:
            if r.pipeline == pipeline and r.stage == stage:
                return r
        return None

    def worker(self, pipeline: int, stage: int, index: int) -> int:
        """The rank that runs local micro-batch `index` of `pipeline` at `stage`."""
        r = self.route(pipeline, stage)
        return self.holders[pipeline][stage] if r is None else r.peer_for(index)

    def pipeline_of(self, rank: int) -> int | None:
        """The pipeline this rank belongs to (a peer serving a re-routed slot of another
        pipeline still belongs to its own)."""
        served = {(r.pipeline, r.stage) for r in self.reroutes}
        for d, row in enumerate(self.holders):
            if any(h == rank and (d, s) not in served for s, h in enumerate(row)):
                return d
        for d, replica_row in enumerate(self.replicas):
            if rank in replica_row:
                return d
        return None

    def stages_of(self, rank: int) -> list[int]:
        """Stages this rank runs as primary, in pipeline order starting at the lowest."""
        d = self.pipeline_of(rank)
        return [] if d is None else [s for s in range(self.stages) if self.holders[d][s] == rank
                                     and self.route(d, s) is None]

    def served_by(self, rank: int) -> list[Reroute]:
        """The re-routed slots this rank serves part of."""
        return [r for r in self.reroutes if rank in r.peers]

    def replica_of(self, rank: int) -> int | None:
        """The stage this rank keeps a replica of, if any."""
        d = self.pipeline_of(rank)
        if d is None:
            return None
        held = [s for s in range(self.stages) if self.replicas[d][s] == rank]
        return held[0] if held else None

    def active_ranks(self) -> list[int]:
        return sorted({r for row in self.holders for r in row})

    def stage_members(self, stage: int) -> list[int]:
        """Holders of `stage` in every pipeline, in pipeline order (its data-parallel group);
        a peer serving a re-routed slot is named once, at its own pipeline."""
        out: list[int] = []
        for d in range(self.pipelines):
            if self.route(d, stage) is None and self.holders[d][stage] not in out:
                out.append(self.holders[d][stage])
        return out

    def to_json(self) -> str:
        return json.dumps({"stages": self.stages, "pipelines": self.pipelines,
                           "holders": self.holders, "replicas": self.replicas,
                           "epoch": self.epoch, "dead": self.dead,
                           "takeovers": [asdict(t) for t in self.takeovers],
                           "abandon": self.abandon,
                           "reroutes": [asdict(r) for r in self.reroutes],
                           "rerouted": self.rerouted})

    @classmethod
    def from_json(cls, text: str) -> RoleMap:
        fields = json.loads(text)
        fields["takeovers"] = [Takeover(**t) for t in fields.get("takeovers", [])]
        fields["reroutes"] = [Reroute(**r) for r in fields.get("reroutes", [])]
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class FailoverPlan:
    roles: RoleMap
    takeovers: list[Takeover]

    @property
    def handled_as(self) -> str:
        """How the lost node is accounted: failover unless some stage needed a peer."""
        if self.roles.rerouted:
            return "reroute"
        kinds = {t.kind for t in self.takeovers}
        return "peer_restore" if "peer_restore" in kinds else "failover"


def _copy(roles: RoleMap) -> RoleMap:
    return RoleMap.from_json(roles.to_json())


def plan_failover(roles: RoleMap, lost: int) -> FailoverPlan:
    """The role map after losing rank `lost`, or Unrecoverable."""
    new = _copy(roles)
    new.epoch += 1
    new.takeovers = []
    new.rerouted = False
    new.dead = sorted(set(new.dead) | {lost})
    d = roles.pipeline_of(lost)
    takeovers: list[Takeover] = []
    if d is None:
        return FailoverPlan(roles=new, takeovers=takeovers)
    P = roles.stages
    lost_stages = [s for s in range(P) if roles.holders[d][s] == lost]
    if len(lost_stages) == P:
        raise Unrecoverable(f"pipeline {d} lost every copy of its stages with node n{lost}, "
                            f"its last node")
    if lost_stages:
        # Walk the lost run in pipeline order, starting after a surviving stage.
        start = next(s for s in lost_stages if roles.holders[d][(s - 1) % P] != lost)
        ordered = sorted(lost_stages, key=lambda s: (s - start) % P)
        for s in ordered:
            takeovers.append(_take_over(roles, new, d, s, lost))
    for row in new.replicas:
        for s, holder in enumerate(row):
            if holder == lost:
                row[s] = None
    new.takeovers = list(takeovers)
    return FailoverPlan(roles=new, takeovers=takeovers)


def _take_over(old: RoleMap, new: RoleMap, d: int, s: int, lost: int) -> Takeover:
    P = old.stages
    replica = old.replicas[d][s]
    if replica is not None and replica != lost and replica not in old.dead:
        new.holders[d][s] = replica
        new.replicas[d][s] = None
        return Takeover(stage=s, pipeline=d, new_holder=replica, kind="failover")
    peers = [e for e in range(old.pipelines) if e != d and old.holders[e][s] not in new.dead]
    prev_holder = new.holders[d][(s - 1) % P]
    if not peers or prev_holder in new.dead or P == 1:
        node = f"n{lost}"
        raise Unrecoverable(
            f"stage {s} of pipeline {d} lost every copy with node {node} (its replica's holder "
            f"is gone too) and no other pipeline can hand it over in flight")
    new.holders[d][s] = prev_holder
    new.replicas[d][s] = None
    return Takeover(stage=s, pipeline=d, new_holder=prev_holder, kind="peer_restore",
                    source=old.holders[peers[0]][s])


def plan_reroute(roles: RoleMap, lost: int) -> FailoverPlan:
    """The role map after losing rank `lost` under `--redundancy reroute`, or Unrecoverable.

    Each slot the lost node held as its own is served by the live holders of its stage in
    the other pipelines; a re-routed slot it was serving keeps its other peers. Every node
    then starts the step under way again (`rerouted`): the lost node's part of it is gone,
    and nothing of it was kept elsewhere (no replicas)."""
    new = _copy(roles)
    new.epoch += 1
    new.takeovers = []
    new.dead = sorted(set(new.dead) | {lost})
    new.rerouted = True
    dead = set(new.dead)
    kept: list[Reroute] = []
    for r in roles.reroutes:
        peers = [p for p in r.peers if p not in dead]
        if not peers:
            raise Unrecoverable(f"stage {r.stage} of pipeline {r.pipeline} lost its last "
                                f"serving peer with node n{lost}")
        kept.append(Reroute(stage=r.stage, pipeline=r.pipeline, peers=peers))
    new.reroutes = kept
    d = roles.pipeline_of(lost)
    own = [] if d is None else roles.stages_of(lost)
    for s in own:
        peers = [roles.holders[e][s] for e in range(roles.pipelines)
                 if e != d and roles.route(e, s) is None and roles.holders[e][s] not in dead]
        if not peers:
            raise Unrecoverable(f"stage {s} was lost in every pipeline (node n{lost} held its "
                                f"last copy)")
        assert d is not None
        new.reroutes.append(Reroute(stage=s, pipeline=d, peers=peers))
    new.reroutes.sort(key=lambda r: (r.pipeline, r.stage))
    for r in new.reroutes:
        new.holders[r.pipeline][r.stage] = r.peers[0]
        new.replicas[r.pipeline][r.stage] = None  # its primary's gradient is nowhere whole
    for row in new.replicas:
        for s, holder in enumerate(row):
            if holder in dead:
                row[s] = None
    if not any(h not in dead for row in new.holders for h in row):
        raise Unrecoverable("no live node is left")
    return FailoverPlan(roles=new, takeovers=[])


def slot_loads(roles: RoleMap) -> dict[int, float]:
    """The work of each live rank, in slots: 1 for each stage it holds as its own, and for
    each re-routed slot it serves its share of that slot's micro-batches."""
    loads: dict[int, float] = {}
    for d in range(roles.pipelines):
        for s in range(roles.stages):
            route = roles.route(d, s)
            if route is None:
                holder = roles.holders[d][s]
                if holder not in roles.dead:
                    loads[holder] = loads.get(holder, 0.0) + 1.0
            else:
                for peer in route.peers:
                    loads[peer] = loads.get(peer, 0.0) + 1.0 / len(route.peers)
    return loads


def shadow_or_reroute(shadow: FailoverPlan | None, reroute: FailoverPlan | None) -> FailoverPlan:
    """Per loss, with D >= 2 under eager or lazy: the plan whose busiest node carries less.

    The step time while degraded is set by the busiest node: a shadow runs two stages (2
    slots), a re-route adds 1/k of the lost slot to each of its k peers (1 + 1/k). So with
    D = 2 the two tie and the shadow is kept (it needs no restart of the step, and its FRC
    results count); with D >= 3 the peers carry less and the loss is re-routed. When one of
    the two cannot cover the loss, the other does; when neither can, Unrecoverable. (The
    coordinator weighs a shadow's failover only: where the shadow's path is a peer restore,
    the peer restore is kept, as before re-routing existed; and in a generation where a shadow
    or a peer restore already took a slot, only the shadow's plan is weighed.)
    """
    if shadow is None and reroute is None:
        raise Unrecoverable("neither a shadow nor a data-parallel peer covers the loss")
    if shadow is None or reroute is None:
        return shadow or reroute  # type: ignore[return-value]  # at most one is None here, so the result is a plan
    busiest = {plan is shadow: max(slot_loads(plan.roles).values(), default=0.0)
               for plan in (shadow, reroute)}
    return reroute if busiest[False] < busiest[True] - 1e-9 else shadow
