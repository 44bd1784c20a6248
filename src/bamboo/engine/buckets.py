"""The data-parallel sum of a stage in buckets, begun during the backward (as DDP's reducer).

A stage held by several pipelines has its gradient summed over them (`commit.py`, phase 1).
Its flat gradient is cut into buckets: contiguous ranges of whole parameters, taken from
its last parameters backwards, about `bucket_bytes` each (DDP's `bucket_cap_mb`). Each
bucket is one collective on the stage's data-parallel group:

- default: an all-reduce of the bucket, in the sums' dtype;
- `--exact`: an all-gather of every member's float64 bucket, which each member adds in
  pipeline order (the bits the round's ordered sum gives on any layout).

**Begun early.** Once this node has run the last instruction that adds to a stage's sum in
this step, nothing more comes into it. Before that instruction (a 1F1B backward) a hook on
each parameter adds its gradient to the sum as autograd produces it, and a bucket's
collective is launched as soon as all of its parameters are in, while the backward goes on
to earlier layers and the node to the rest of its list; the commit round then only waits.
Buckets go out in one fixed order (0, 1, ...), whatever order the hooks fire in: every
member must issue a group's collectives alike. Whether a node begins early or at the round
does not matter to its peers (the same collectives, in the same order), so each node
decides alone. It begins early only in a step's first attempt (a failover or a redo drops
what was launched under the old roles: the next attempt has new roles, hence a new group;
what was launched under roles a recovery kept stays for the round), on the group of the
current roles already formed (by an earlier step's round: forming one waits for every
member), and at a stage where it serves no re-routed slot (its sum is then all it adds).
Under ZB-H1 the weight gradients come from `torch.autograd.grad` (no hook fires): the
buckets go out after the stage's last weight-gradient instruction. A parameter that gets no
gradient holds its bucket, and those after it, until the instruction has run.

A bucket's collective is bounded by `--comm-timeout` from its launch, as a posted send is.
Under `--exact` every member holds every member's float64 copy of a bucket from the launch
to the round (D copies, where the round's ordered sum held them at the root only).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from bamboo.engine.comm import P2P, Interrupted, PeerLost, bury
from bamboo.engine.stage import StageState
from bamboo.plan import schedule as S
from bamboo.plan.roles import RoleMap

__all__ = ["plan_buckets", "StageBuckets", "BucketReducer", "group_name"]


def group_name(epoch: int, stage: int) -> str:
    """The data-parallel group of `stage` under the roles of `epoch`."""
    return f"e{epoch}.dp{stage}"


def plan_buckets(sizes: Sequence[int], element_bytes: int, bucket_bytes: int
                 ) -> list[tuple[int, int]]:
    """[start, end) ranges of a flat gradient made of parameters of `sizes` (in order): whole
    parameters from the last backwards, a bucket closed once it holds `bucket_bytes` (0: one
    bucket for all). The same on every member: it depends on the stage's layers only."""
    out, end, held = [], sum(sizes), 0
    offset = end
    for n in reversed(sizes):
        offset -= n
        held += n * element_bytes
        if bucket_bytes > 0 and held >= bucket_bytes and offset > 0:
            out.append((offset, end))
            end, held = offset, 0
    out.append((0, end))
    return out


@dataclass(slots=True)
class _Bucket:
    start: int
    end: int
    waiting: int = 0
    """Parameters whose gradient the armed backward has not produced yet."""
    work: Any = None
    payload: torch.Tensor | None = None
    """What this node sent (an all-reduce sums into it: a view of the stage's total, or
    its host copy)."""
    gathered: list[torch.Tensor] = field(default_factory=list)
    """--exact: every member's bucket, in group order."""
    failed: bool = False


class StageBuckets:
    """One stage's bucketed sum over its data-parallel `members` in one attempt of a step."""

    def __init__(self, *, st: StageState, members: list[int], p2p: P2P, epoch: int,
                 exact: bool, bucket_bytes: int, local: torch.Tensor) -> None:
        self.st, self.members, self.p2p, self.exact = st, members, p2p, exact
        self.epoch = epoch
        self.local = local
        """This node's sum for the stage (its own pipeline's, and any served slot's; begun
        early: the stage's gradient sum itself, complete by the time a bucket goes out)."""
        sizes = [p.numel() for p, _, _ in st.param_slices()]
        self.buckets = [_Bucket(a, b) for a, b in
                        plan_buckets(sizes, st.grad_sum.element_size(), bucket_bytes)]
        self.next = 0
        """The first bucket not launched yet."""
        self.total: torch.Tensor | None = None
        """The stage's sum over its members, bucket by bucket (a failed round runs again on
        the local sum, which is never summed in place)."""
        self._hooks: list[Any] = []
        self.on_host = p2p.host_staged(st.device)

    @property
    def name(self) -> str:
        return group_name(self.epoch, self.st.stage)

    # -- launching ---------------------------------------------------------------------------

    def arm(self) -> None:
        """Hook every parameter that takes a gradient: the next backward adds it to the sum
        as it comes and launches each bucket once complete (in order)."""
        index = len(self.buckets) - 1  # the buckets run from the last parameters backwards
        for (p, a, b), view in zip(self.st.param_slices(), self.st.sum_views()):
            if not p.requires_grad or a == b:  # StageState.accumulate takes these
                continue
            while not self.buckets[index].start <= a < self.buckets[index].end:
                index -= 1
            self.buckets[index].waiting += 1
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, view=view, index=index: self._ready(p, view, index)))

    def _ready(self, p: torch.nn.Parameter, view: torch.Tensor, index: int) -> None:
        view.add_(p.grad)  # what StageState.accumulate does, one parameter at a time
        p.grad = None
        self.buckets[index].waiting -= 1
        while self.next < len(self.buckets) and self.buckets[self.next].waiting <= 0:
            self._launch(self.buckets[self.next])
            self.next += 1

    def disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def launch_rest(self) -> None:
        """Launch every bucket not launched yet, in order (the group must exist)."""
        self.disarm()
        while self.next < len(self.buckets):
            self._launch(self.buckets[self.next])
            self.next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self.total is None:
            self.total = torch.empty(self.st.numel, dtype=self.st.grad_sum.dtype,
                                     device=self.st.device)
        mine = self.local[bucket.start:bucket.end]
        if not self.exact:  # summed in place: into the total, not the local sum
            mine = self.total[bucket.start:bucket.end].copy_(mine)
        bucket.payload = mine.to("cpu", copy=True) if self.on_host else mine
        try:
            group = self.p2p.subgroup_if_formed(self.name)
            if group is None:
                raise PeerLost(f"process group {self.name} is not formed")
            if self.exact:
                bucket.gathered = [torch.empty_like(bucket.payload) for _ in self.members]
                bucket.work = group.allgather([bucket.gathered], [bucket.payload])
            else:
                bucket.work = group.allreduce([bucket.payload])
        except RuntimeError:  # PeerLost too: the round reports the stage not summed
            bucket.failed, bucket.work = True, None

    # -- the round ---------------------------------------------------------------------------

    def finish(self, interrupt: Callable[[], bool]) -> torch.Tensor | None:
        """Wait for every bucket; the stage's sum over its members (None: a transfer failed,
        and what was launched is dropped). --exact adds the members' buckets in their order,
        which is pipeline order (`RoleMap.stage_members`)."""
        self.launch_rest()
        for bucket in self.buckets:
            try:
                if bucket.failed:
                    raise PeerLost(f"a bucket's collective on {self.name} could not start")
                self.p2p.wait_interruptible(bucket.work, -1, interrupt)
            except (PeerLost, Interrupted):
                self.abandon()
                return None
            self._add(bucket)
        return self.total

    def _add(self, bucket: _Bucket) -> None:
        """Bucket `bucket`'s sum into the total."""
        assert self.total is not None and bucket.payload is not None
        into = self.total[bucket.start:bucket.end]
        if not self.exact:
            if self.on_host:
                into.copy_(bucket.payload)
            return
        first, *rest = bucket.gathered
        into.copy_(first)  # the ordered sum of commit._sum_in_order
        for part in rest:
            into += part.to(into.device)

    def abandon(self) -> None:
        """Drop what was launched, off this thread (`bury`: a gloo collective cannot be
        cancelled; its work keeps the tensors it reads and writes)."""
        self.disarm()
        launched = [(b.work, b.payload, b.gathered) for b in self.buckets if b.work is not None]
        if launched:
            bury((launched, self.total))


class BucketReducer:
    """A node's bucketed data-parallel sums: the stages it begins early in a step's first
    attempt, and the round's sum of every stage that is one collective per member."""

    def __init__(self, *, bucket_bytes: int, exact: bool) -> None:
        self.bucket_bytes, self.exact = bucket_bytes, exact
        self.early_allowed = bucket_bytes > 0
        """Whether this attempt may begin early: a step's first, after a round."""
        self.pending: dict[int, StageBuckets] = {}
        """Stage -> its buckets begun early in this attempt."""
        self._last: dict[S.Instruction, StageBuckets] = {}
        """The instruction after which a stage's sum is complete -> its buckets."""
        self.launched_early = 0
        """Buckets launched before a commit round since the reducer was made (the step's
        report takes each step's difference)."""

    def plan(self, *, roles: RoleMap, stages: dict[int, StageState], p2p: P2P,
             schedule: Sequence[S.Instruction], done: set) -> None:
        """At the start of an attempt's micro-batch work: the stages this node begins early,
        and the instruction after which each one's sum is complete."""
        self._last = {}
        if not self.early_allowed:
            return
        last: dict[int, S.Instruction] = {}
        for instr in schedule:
            if isinstance(instr, S.BACKWARDS) and instr.stage in stages:
                last[instr.stage] = instr
        for stage, instr in last.items():
            members = roles.stage_members(stage)
            if len(members) < 2 or instr in done or \
                    any(roles.route(d, stage) is not None for d in range(roles.pipelines)) or \
                    p2p.subgroup_if_formed(group_name(roles.epoch, stage)) is None:
                continue
            st = stages[stage]
            self._last[instr] = StageBuckets(st=st, members=members, p2p=p2p,
                                             epoch=roles.epoch, exact=self.exact,
                                             bucket_bytes=self.bucket_bytes, local=st.grad_sum)

    @contextmanager
    def around(self, instr: S.Instruction) -> Iterator[None]:
        """Run `instr` inside: if it completes a stage's sum, a 1F1B backward launches the
        stage's buckets as their gradients come (hooks), and every bucket not launched by
        then goes out once it ran. If it fails, the recovery's `settle` disarms them."""
        buckets = self._last.get(instr)
        if buckets is None:
            yield
            return
        if isinstance(instr, S.Backward):
            buckets.arm()
        yield
        del self._last[instr]
        buckets.launch_rest()
        self.pending[buckets.st.stage] = buckets
        self.launched_early += len(buckets.buckets)

    def take(self, stage: int, epoch: int, p2p: P2P) -> StageBuckets | None:
        """The round's: `stage`'s buckets begun early under these roles, if any."""
        buckets = self.pending.pop(stage, None)
        if buckets is not None and (buckets.epoch != epoch or buckets.p2p is not p2p):
            buckets.abandon()
            return None
        return buckets

    def start(self, *, st: StageState, members: list[int], p2p: P2P, epoch: int,
              local: torch.Tensor, interrupt: Callable[[], bool]) -> StageBuckets:
        """The round's: `st`'s buckets, launched now (its group formed first if need be)."""
        p2p.subgroup(group_name(epoch, st.stage), members, interrupt)
        buckets = StageBuckets(st=st, members=members, p2p=p2p, epoch=epoch,
                               exact=self.exact, bucket_bytes=self.bucket_bytes, local=local)
        buckets.launch_rest()
        return buckets

    def settle(self, epoch: int, p2p: P2P) -> None:
        """The step goes on after a recovery: nothing more begins early in it; buckets
        launched under other roles (or on another group) are dropped, those of these roles
        are kept for the round (their peers matched them: launching them again would put
        one collective twice on the group)."""
        for buckets in self._last.values():
            buckets.disarm()
        self._last = {}
        for stage, buckets in list(self.pending.items()):
            if buckets.epoch != epoch or buckets.p2p is not p2p:
                buckets.abandon()
                del self.pending[stage]
        self.early_allowed = False

    def round_over(self) -> None:
        """The commit round ran: anything it did not take is dropped (it took all it could),
        and the next step may begin early again (a redo of this one comes through `settle`)."""
        for buckets in [*self.pending.values(), *self._last.values()]:
            buckets.abandon()
        self.pending, self._last = {}, {}
        self.early_allowed = self.bucket_bytes > 0
