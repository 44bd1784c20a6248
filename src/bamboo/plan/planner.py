"""The reconfiguration planner: the next generation's layout, who runs what, and where
every layer's state comes from. Pure data, no torch.

A *generation* is a stretch of training on one process group with one layout. Inside
it, lost nodes are failed over in flight (`redundancy.roles`); between two of them,
at a step boundary, the planner:

1. chooses (D, P) for the live nodes: P stays the configured number of stages while
   there are nodes for it (fewer stages otherwise, each holding more layers), D is as
   many whole pipelines as fit, never more than the global batch's micro-batches;
2. cuts the layers into P stages (the same exact partitioner the job started with);
3. gives each (pipeline, stage) slot the node that already holds most of the state
   the slot needs (its stage, plus its successor's as a replica), so as little state
   as possible moves;
4. names, for every layer a node lacks, a live node holding it (a primary, a replica
   or another pipeline's copy: all are identical at a step boundary), spreading the
   sends; a checkpoint is used only when some layer has no live copy at all.

Nodes beyond D x P wait as standbys outside the process group; draining nodes take
part only as sources of state, then leave. A layout can also be kept with fewer nodes
than slots (`keep_layout`: standbys that fill only some of the slots losses emptied): the
slots left empty are the plan's `holes`, each served from the start by its stage's
holders in the other pipelines, as a re-route (`with_holes`).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from bamboo.config.modes import RedundancyMode
from bamboo.plan.partition import partition
from bamboo.plan.placement import spread
from bamboo.plan.roles import Reroute, RoleMap

__all__ = ["NoLiveCopy", "GenerationPlan", "choose_layout", "plan_generation", "with_holes"]


class NoLiveCopy(RuntimeError):
    """Some layer is held by no live node; str() names it."""

    def __init__(self, message: str, layers: list[int]) -> None:
        super().__init__(message)
        self.layers = layers


@dataclass(kw_only=True, frozen=True)
class GenerationPlan:
    """Everything a node needs to enter generation `gen` (published as JSON). Frozen: every
    field is given when it is made (the coordinator completes a plan with the run's state
    by `dataclasses.replace`, once, before it publishes it)."""

    gen: int
    epoch: int
    """The role map's epoch at the start of the generation (epochs never repeat)."""
    members: list[str]
    """Node names in process-group rank order: D x P active nodes, then sources leaving."""
    pipelines: int
    stages: int
    parts: list[list[int]]
    """[start, stop) layer range of each stage."""
    start_step: int
    transfers: list[list[int]] = field(default_factory=list)
    """[layer, source rank, destination rank], in the order to post them."""
    checkpoint: str | None = None
    """Load every layer from this checkpoint directory instead (nothing live covers some layer)."""
    leavers: list[str] = field(default_factory=list)
    reason: str = ""
    fired_kills: list[str] = field(default_factory=list)
    """`--kill D:S@K` specs already carried out (steps may be redone after a restore)."""
    redundancy: RedundancyMode = RedundancyMode.EAGER
    """This generation's mode (`--redundancy auto` changes it between generations); the
    plan is its only carrier."""
    fresh_start: bool = False
    """Every layer is built from the seed: the run restarts from its initial state."""
    holes: list[list[int]] = field(default_factory=list)
    """[pipeline, stage] slots no node of their own holds: each is served by the holders of
    its stage in the other pipelines, as a re-route does (`RoleMap.reroutes`)."""
    stepwise: bool = False
    """The user's loop drives the run (`bamboo.Trainer`): at every step boundary the nodes
    wait for the coordinator's orders (bamboo.plan.orders) instead of running on."""
    lr_scale: float = 1.0
    """The factor on the scheduled learning rate in force at `start_step` (a step-by-step
    run's `set_lr_scale`, carried on by a resume); its orders set it step by step."""
    loss_scale: list[float] | None = None
    """`--precision fp16`: the loss scaler's state at `start_step` ([scale, growth tracker];
    bamboo.plan.loss_scale); each committed step moves it on every node alike."""

    def __post_init__(self) -> None:
        # from JSON: the word (the one write, while the frozen plan is made)
        object.__setattr__(self, "redundancy", RedundancyMode(self.redundancy))

    @property
    def active(self) -> int:
        """Ranks that train: one a slot, holes aside (the ranks after them only leave)."""
        return self.pipelines * self.stages - len(self.holes)

    def roles(self) -> RoleMap:
        """The generation's first role map: replicas where its mode keeps them."""
        roles = RoleMap.initial(stages=self.stages, pipelines=self.pipelines,
                                redundancy=self.redundancy.keeps_replica and self.stages > 1)
        roles.epoch = self.epoch
        return with_holes(roles, self.holes) if self.holes else roles

    def layer_ranges(self) -> list[range]:
        return [range(a, b) for a, b in self.parts]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GenerationPlan:
        return cls(**json.loads(text))


def with_holes(roles: RoleMap, holes: Sequence[Sequence[int]]) -> RoleMap:
    """`roles` (a generation's first role map, rank k on the k-th slot) with `holes` left
    empty: the ranks go to the other slots in slot order, and each hole is served by the
    holders of its stage in the other pipelines. A slot whose predecessor is a hole keeps
    no replica (the peer serving the hole replicates its own pipeline's slot)."""
    empty = {(d, s) for d, s in holes}
    P = roles.stages
    ranks = iter(range(roles.pipelines * P))
    holders = [[-1 if (d, s) in empty else next(ranks) for s in range(P)]
               for d in range(roles.pipelines)]
    reroutes = []
    for d, s in sorted(empty):
        peers = [holders[e][s] for e in range(roles.pipelines) if (e, s) not in empty]
        if not peers:
            raise ValueError(f"stage {s} has a hole in every pipeline")
        reroutes.append(Reroute(stage=s, pipeline=d, peers=peers))
        holders[d][s] = peers[0]
    replicas: list[list[int | None]] = [
        [holders[d][(s - 1) % P] if roles.replicas[d][s] is not None and (d, s) not in empty
         and (d, (s - 1) % P) not in empty else None for s in range(P)]
        for d in range(roles.pipelines)]
    return RoleMap(stages=P, pipelines=roles.pipelines, holders=holders, replicas=replicas,
                   epoch=roles.epoch, reroutes=reroutes)


def choose_layout(nodes: int, *, stages: int, layers: int, global_micro_batches: int,
                  max_pipelines: int | None = None) -> tuple[int, int]:
    """(D, P) for `nodes` live nodes; P is the configured `stages` when it fits, D at most
    `max_pipelines` (the user's --pipelines, when given)."""
    if nodes < 1:
        raise ValueError("no live node to train on")
    p = min(stages, layers, nodes)
    d = min(nodes // p, global_micro_batches, max_pipelines or nodes)
    return d, p


def _needs(parts: Sequence[range], stage: int, redundancy: bool) -> list[int]:
    """Layers slot `stage` needs: its own, plus its successor's as the replica."""
    need = list(parts[stage])
    if redundancy and len(parts) > 1:
        need += list(parts[(stage + 1) % len(parts)])
    return need


def plan_generation(*, gen: int, epoch: int, start_step: int, nodes: Sequence[str],
                    holdings: dict[str, set[int]], leaving: Sequence[str] = (),
                    stages: int, param_counts: Sequence[int], global_micro_batches: int,
                    redundancy: RedundancyMode, checkpoint: str | None = None,
                    max_pipelines: int | None = None, reason: str = "",
                    machine_of: Callable[[str], str | None] | None = None,
                    partition_costs: Sequence[float] | None = None,
                    keep_layout: tuple[int, int] | None = None) -> GenerationPlan:
    """The plan of generation `gen` over `nodes` (live, ready, in order of preference).

    Stages are cut by `partition_costs` (measured seconds per layer) when given, else by
    `param_counts`, which also weigh the state a node holds.
    `machine_of` names each node's machine (agents with several workers): replicas are
    then placed off their primary's machine where the machines allow.
    `holdings` maps every live node (`leaving` ones included) to the layers whose state
    it holds at this step boundary. With `checkpoint` set, every layer comes from it.
    Raises NoLiveCopy when a layer has no live holder and no checkpoint is given.
    `keep_layout` (D, P): keep this layout although `nodes` cannot fill it (fewer nodes
    than slots, at least one of each stage): the slots left empty are `holes`, served by
    their stage's holders in the other pipelines.
    Its steps are the four of the module docstring, in order.
    """
    layers = len(param_counts)
    if keep_layout is not None:
        d, p = keep_layout
    else:
        d, p = choose_layout(len(nodes), stages=stages, layers=layers,
                             global_micro_batches=global_micro_batches,
                             max_pipelines=max_pipelines)
    parts = partition(list(partition_costs or param_counts), p)
    rc = redundancy.keeps_replica and p > 1
    slots = [(dd, s) for dd in range(d) for s in range(p)]
    taken = _assign(slots, nodes, holdings, parts, rc, param_counts, p)
    holes = [list(slots[k]) for k in range(len(slots)) if k not in taken]
    if holes and {s for k, (_, s) in enumerate(slots) if k in taken} != set(range(p)):
        raise ValueError(f"{len(nodes)} nodes cannot hold every stage of a {d} x {p} layout")
    active = [taken[k] for k in range(len(slots)) if k in taken]
    roles = GenerationPlan(gen=gen, epoch=epoch, members=active, pipelines=d, stages=p,
                           parts=[], start_step=start_step, holes=holes,
                           redundancy=redundancy).roles()

    def needs(rank: int) -> list[int]:
        """Layers rank `rank` needs: its stage, and its replica's when it keeps one."""
        replica = roles.replica_of(rank)
        own = [i for s in roles.stages_of(rank) for i in parts[s]]
        return own + (list(parts[replica]) if replica is not None else [])

    if machine_of is not None and not holes:  # a replica off its primary's machine
        active = spread(active, machine_of, p, cost=lambda n, k: -sum(
            param_counts[i] for i in _needs(parts, k % p, rc) if i in holdings.get(n, ())))
    members, transfers = active, list[list[int]]()
    if checkpoint is None:
        members, transfers = _transfers(active, leaving, holdings, needs, param_counts)
    return GenerationPlan(gen=gen, epoch=epoch, members=members, pipelines=d, stages=p,
                          parts=[[r.start, r.stop] for r in parts], start_step=start_step,
                          transfers=transfers, checkpoint=checkpoint, leavers=list(leaving),
                          reason=reason, holes=holes, redundancy=redundancy)


def _assign(slots: list[tuple[int, int]], nodes: Sequence[str], holdings: dict[str, set[int]],
            parts: list[range], rc: bool, param_counts: Sequence[int], p: int) -> dict[int, str]:
    """Slot index -> its node. Every (slot, node) pair is scored by the state the node already
    holds for the slot; the best pairs are taken first (greedy matching), so nodes stay where
    their state is; the nodes left fill the free slots (`_fill_order`)."""
    order = {n: i for i, n in enumerate(nodes)}
    pairs = sorted(((sum(param_counts[i] for i in _needs(parts, s, rc)
                         if i in holdings.get(n, ())), -order[n], -k, n)
                    for k, (_, s) in enumerate(slots) for n in nodes), reverse=True)
    taken: dict[int, str] = {}

    def leaves_enough(k: int) -> bool:
        """With holes to come: taking slot k leaves a node for every stage still without."""
        if len(nodes) >= len(slots):
            return True
        covered = {slots[j][1] for j in taken} | {slots[k][1]}
        return len(nodes) - len(taken) - 1 >= p - len(covered)

    for score, _, neg_k, n in pairs:
        k = -neg_k
        if k not in taken and n not in taken.values() and score > 0 and leaves_enough(k):
            taken[k] = n
    free = [n for n in nodes if n not in taken.values()]
    fill = _fill_order(slots, taken, p) if len(nodes) < len(slots) else \
        [k for k in range(len(slots)) if k not in taken]
    for k in fill[:len(free)]:
        taken[k] = free.pop(0)
    return taken


def _transfers(active: list[str], leaving: Sequence[str], holdings: dict[str, set[int]],
               needs: Callable[[int], list[int]], param_counts: Sequence[int]
               ) -> tuple[list[str], list[list[int]]]:
    """(members, transfers [layer, from rank, to rank]): every layer a rank needs and does not
    hold, from a live holder (a leaving node first: it has nothing else to do, then the least
    loaded); the leaving nodes that send are members after the active ones. NoLiveCopy when
    no live node holds a layer."""
    sources = [n for n in leaving if n not in active]
    missing = sorted(set(range(len(param_counts))) - set().union(
        *(holdings.get(n, set()) for n in active + sources)))
    if missing:
        raise NoLiveCopy(f"no live node holds layer{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(map(str, missing))}", missing)
    candidates = active + sources
    order = {n: i for i, n in enumerate(candidates)}
    load = {n: 0 for n in candidates}
    moves: list[tuple[int, str, str]] = []
    for r, node in enumerate(active):
        for layer in needs(r):
            if layer in holdings.get(node, ()):
                continue
            src = min((n for n in candidates if layer in holdings.get(n, ())),
                      key=lambda n: (n not in leaving, load[n], order[n]))
            load[src] += param_counts[layer]
            moves.append((layer, src, node))
    used = {src for _, src, _ in moves}
    members = active + [n for n in sources if n in used]
    rank = {n: i for i, n in enumerate(members)}
    return members, [[layer, rank[src], rank[dst]] for layer, src, dst in moves]


def _fill_order(slots: Sequence[tuple[int, int]], taken: dict[int, str], p: int) -> list[int]:
    """The free slots in the order the nodes left take them: in slot order; where some slots
    stay holes, a stage with the fewest holders first (every stage needs one)."""
    held = [sum(1 for k in taken if slots[k][1] == s) for s in range(p)]
    out: list[int] = []
    for _ in range(len(slots) - len(taken)):
        k = min((k for k in range(len(slots)) if k not in taken and k not in out),
                key=lambda k: (held[slots[k][1]], k))
        held[slots[k][1]] += 1
        out.append(k)
    return out
