"""The engine: one node's dispatcher over its instruction list, with in-flight failover.

A step has three phases:

A. micro-batches: the node runs `node_schedule` for the stages it holds (1F1B, and
   eager FRC of its replica stage in the waits); gradients are summed in float32
   (float64 with `--exact`);
B. the commit round (`commit.py`): data-parallel sums, the replica's gradient, the
   global norm; the coordinator says "commit" only if every survivor's round worked;
C. the optimizer step, on every stage the node holds and on its replica.

Between steps, `evaluate` runs the held-out pass: forward only, no state changes, closed by
a vote of its own; a loss during it means new roles and the pass again under them.

When a peer is lost the node asks the coordinator for the new role map and applies
it to the step under way: a shadow adopts the lost stage (from its replica, with the
eager FRC results, or restored from a peer pipeline) and its list grows by that
stage's work, all of whose backward passes it redoes; the lost stage's successor
sends its output gradients of this step again and takes every activation again; the
rest of the step goes on. Nothing restarts and the step ends with the bits a
failure-free step gives.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bamboo.data import Batch, Task
from bamboo.faults import FaultPlan
from bamboo.models import ModelPreset, boundary_shapes, loss_fn
from bamboo.pipeline import schedule as S
from bamboo.pipeline.comm import (ACTIVATION, EVAL, GRADIENT, MANIFEST, RESTORE, P2P, GroupFormer,
                                  Interrupted, Key, PeerLost, form_interruptibly)
from bamboo.pipeline.commit import RoundResult, commit_round
from bamboo.pipeline.layout import Layout
from bamboo.pipeline.memory import SavedTensors, StepMemory, storage_bytes
from bamboo.pipeline.optim import clip_coefficient, learning_rate
from bamboo.pipeline.stage import StageState
from bamboo.pipeline.votes import BoundaryFlag, Decision, Go, StepReport, Votes
from bamboo.redundancy.roles import RoleMap, Takeover

__all__ = ["TrainingHyper", "NodeEngine", "GenerationEnded", "EVAL_FAULT_INDEX"]

EVAL_FAULT_INDEX = -1
"""A fault's instruction index that means: in the evaluation after `step` steps, after each
of this node's val micro-batches."""

_FORWARD, _BACKWARD, _COMMIT, _OPTIMIZER = range(4)
"""Phase indices a node marks its progress with (`bamboo.cluster.protocol.PHASES` names them)."""


class GenerationEnded(Exception):
    """The coordinator abandoned this generation mid-step (a loss no copy covers in flight):
    the step under way is dropped and the node's state is that of the last commit."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingHyper:
    """The optimisation settings every stage shares."""

    lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    grad_clip: float


@dataclass(slots=True)
class _Step:
    """Everything a node keeps during one step (dropped at the commit)."""

    step: int
    done: set = field(default_factory=set)
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    saved_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    out_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    in_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    sent_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    received_acts: set[tuple[int, int]] = field(default_factory=set)
    dup_recvs: list[tuple[Any, int]] = field(default_factory=list)
    sent: dict[Key, torch.Tensor] = field(default_factory=dict)
    """Every activation and gradient this node sent in this step (strict: resent to a peer
    that did not get it before the group was rebuilt)."""
    peer_has: set[Key] = field(default_factory=set)
    """Transfers their receiver already holds (strict, after a rebuild): not sent again."""
    memory: StepMemory = field(default_factory=StepMemory)
    """What the step holds on top of the stages' state (saved activations, kept outputs, FRC)."""
    restores: list[tuple[str, Takeover]] = field(default_factory=list)
    """Peer restores of the latest role change still to carry out: ("send" | "recv", move)."""
    frc: dict[int, tuple[torch.Tensor, torch.Tensor, float | None]] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    batches: dict[int, Batch] = field(default_factory=dict)
    adopted: set[int] = field(default_factory=set)
    seen_forward: bool = False
    report: StepReport | None = None


class NodeEngine:
    """Runs the stages `roles` gives this rank, one step at a time."""

    def __init__(self, *, preset: ModelPreset, parts: Sequence[range], layout: Layout,
                 rank: int, roles: RoleMap, task: Task, hyper: TrainingHyper, seed: int,
                 device: torch.device, link: Votes, redundancy: str,
                 group: Any, former: GroupFormer | None = None, slot: int | None = None,
                 faults: FaultPlan | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 check_replicas: bool = False, frc_offload: bool = False,
                 comm: str = "tagged", precision: str = "fp32", exact: bool = False,
                 activation_checkpointing: bool = False) -> None:
        self.preset, self.parts, self.layout, self.rank = preset, parts, layout, rank
        self.roles, self.task, self.hyper, self.seed, self.device = roles, task, hyper, seed, device
        self.link, self.faults, self.progress = link, faults or FaultPlan([]), progress
        self.slot = rank if slot is None else slot
        self.faults.holds = self._holds
        self.flags: set[BoundaryFlag] = set()
        """What the coordinator asked for after the last commit: `ckpt`, `reconf`."""
        self.eager, self.check_replicas = redundancy == "eager", check_replicas
        self.keep_outputs = redundancy != "off"  # a shadow adopting a stage needs its inputs
        self.frc_offload = frc_offload
        self.comm, self.precision, self.exact = comm, precision, exact
        self.activation_checkpointing = activation_checkpointing
        self.P = layout.stages
        self.pipeline = roles.pipeline_of(rank)
        self.global_mbs = layout.micro_batches(self.pipeline)
        self.M = len(self.global_mbs)
        self.order = S.global_order(self.P, self.M)
        self.weight = 1.0 / layout.global_micro_batches
        self.specs = boundary_shapes(preset, task.micro_batch_size)
        self.loss = loss_fn(preset)
        self.stages = {s: self._build(s) for s in roles.stages_of(rank)}
        replica = roles.replica_of(rank) if redundancy != "off" else None
        self.replica = self._build(replica) if replica is not None else None
        self.strict = comm == "strict"
        self.former = former
        self.p2p = P2P(group, strict=self.strict, device=device, former=former, name="g")
        self._side_stream: Any = None
        """CUDA: the stream eager FRC runs on (`_frc_stream`)."""
        link.on_epoch = self.p2p.wake.set
        self._dispatch: dict[type, Callable[[_Step, Any], None]] = {
            S.Forward: self._forward, S.Backward: self._backward,
            S.SendActivation: self._send_activation, S.RecvActivation: self._recv_activation,
            S.SendGrad: self._send_grad, S.RecvGrad: self._recv_grad,
            S.RedundantForward: self._redundant_forward,
        }

    def _build(self, stage: int) -> StageState:
        """A fresh stage: seeded parameters, gradient sums in float64 under --exact."""
        return StageState(preset=self.preset, stage=stage, layer_indices=self.parts[stage],
                          seed=self.seed, device=self.device, lr=self.hyper.lr,
                          weight_decay=self.hyper.weight_decay,
                          accumulate_dtype=torch.float64 if self.exact else torch.float32)

    # -- one step ---------------------------------------------------------------------------

    def run_step(self, step: int) -> StepReport:
        """Run `step` to its commit, surviving lost peers on the way."""
        start = time.perf_counter()
        s = _Step(step)
        s.report = StepReport(step=step, rank=self.rank, stages=[])
        self.p2p.wait_s, self.p2p.bytes_sent = 0.0, 0
        while True:
            wait = False
            try:
                length = self._micro_batches(s)
                self._mark(step, _COMMIT)
                self.faults.check(step, length, False, True)
                if self.link.phase_a_done(step, self.roles.epoch) is not Go.GO:
                    self._recover(s, wait=False)
                    continue
                result = self._commit_round(s, length)
                self.faults.check(step, length + 2, False, True)
                losses = [(g, loss, self.weight) for g, loss in sorted(s.losses.items())]
                verdict = self.link.round_done(step, self.roles.epoch, result.ok, losses)
                if verdict.decision is Decision.COMMIT:
                    self.flags = set(verdict.flags)
                    self._apply(s, result)
                    self.faults.check(step, length + 3, False, True)
                    break
            except PeerLost as e:
                # Wait for the new roles, unless this peer's loss is already in ours.
                wait = e.peer not in self.roles.dead
            except Interrupted:
                pass
            self._recover(s, wait)
            s.report.attempts += 1
        r = s.report
        r.stages = sorted(self.stages)
        r.losses = [(g, loss, self.weight) for g, loss in sorted(s.losses.items())]
        r.step_s = time.perf_counter() - start
        r.wait_s = self.p2p.wait_s
        r.bytes_sent = self.p2p.bytes_sent
        r.state_bytes = sum(3 * 4 * st.numel for st in self.held())  # fp32 params + two AdamW moments
        r.device_bytes, r.host_bytes = self._memory_peak(s)
        if self.check_replicas:
            r.digests = {f"stage{k}": st.digest() for k, st in self.stages.items()}
            if self.replica is not None:
                r.digests[f"replica{self.replica.stage}"] = self.replica.digest()
        return r

    def _mark(self, step: int, phase: int) -> None:
        if self.progress is not None:
            self.progress(step, phase)

    def _schedule(self) -> list[S.Instruction]:
        frc = self.replica.stage if self.replica is not None and self.eager else None
        return S.node_schedule(sorted(self.stages), self.P, self.M, order=self.order, frc_stage=frc)

    def _micro_batches(self, s: _Step) -> int:
        """Phase A: the remaining instructions of this node's list; its length (fault index)."""
        if self.strict and self.p2p.gradient_group is None:
            self._open_gradient_lane()
        schedule = self._schedule()
        for index, instr in enumerate(schedule):
            if instr in s.done:
                continue
            self._mark(s.step, _BACKWARD if isinstance(instr, (S.Backward, S.SendGrad, S.RecvGrad))
                       else _FORWARD)
            self._dispatch[type(instr)](s, instr)
            s.done.add(instr)
            is_forward = isinstance(instr, S.Forward)
            self.faults.check(s.step, index, is_forward, s.seen_forward)
            s.seen_forward |= is_forward
        dead = set(self.roles.dead)
        self.p2p.flush(dead, self._interrupted)
        while s.dup_recvs:
            work, peer = s.dup_recvs[0]
            if peer not in dead:
                self.p2p.wait_interruptible(work, peer, self._interrupted)
            s.dup_recvs.pop(0)
        return len(schedule)

    def _interrupted(self) -> bool:
        """True when the coordinator published roles newer than this node's."""
        return self.link.latest_epoch > self.roles.epoch

    def _commit_round(self, s: _Step, length: int) -> RoundResult:
        start = time.perf_counter()
        result = commit_round(roles=self.roles, rank=self.rank, stages=self.stages,
                              replica=self.replica, p2p=self.p2p,
                              num_layers=self.preset.layers, exact=self.exact,
                              interrupt=self._interrupted,
                              after_reduce=lambda: self.faults.check(s.step, length + 1, False, True))
        s.report.reduce_s += time.perf_counter() - start
        s.report.bytes_replica = result.bytes_replica
        return result

    def _apply(self, s: _Step, result: RoundResult) -> None:
        """Phase C: one optimizer step on every stage held and on the replica."""
        self._mark(s.step, _OPTIMIZER)
        start = time.perf_counter()
        h = self.hyper
        coef = clip_coefficient(result.norm, h.grad_clip)
        lr = learning_rate(s.step, peak=h.lr, warmup=h.warmup_steps, total=h.total_steps)
        for stage, st in self.stages.items():
            st.apply(result.reduced[stage].to(torch.float32), coef, lr)
            st.reset_grads()
        if self.replica is not None:
            assert result.replica_grad is not None
            if self.frc_offload:  # the replica's AdamW moments live in host memory
                self.replica.offload_optimizer()
            self.replica.apply(result.replica_grad, coef, lr)
        s.report.grad_norm, s.report.lr = result.norm, lr
        s.report.optim_s += time.perf_counter() - start

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, step: int, batches: int) -> list[tuple[int, float, float]]:
        """The held-out loss of the parameters after `step` steps: val micro-batches
        0..batches-1 (pipeline d takes those with index % D == d) go forward through the
        pipeline with nothing saved and nothing updated; the last stage's holder returns
        (index, loss, weight) for its pipeline's share. The pass ends with a vote: if the
        roles changed meanwhile (a node was lost), every node applies the new roles (a
        failover, as between steps) and runs the pass again, so the result is that of
        the failure-free run. GenerationEnded as in `run_step`."""
        scratch = _Step(step)  # what a role change applies to: nothing of a step is done yet
        scratch.report = StepReport(step=step, rank=self.rank, stages=[])
        while True:
            wait = False
            try:
                losses = self._eval_pass(step, batches)
                if self.link.eval_done(step, self.roles.epoch, losses) is Go.GO:
                    return losses
            except PeerLost as e:
                wait = e.peer not in self.roles.dead
            except Interrupted:
                pass
            self._recover(scratch, wait)

    def _eval_pass(self, step: int, batches: int) -> list[tuple[int, float, float]]:
        # Each node walks its val micro-batches in order and, within one, its stages in
        # order: between any two nodes the messages of a direction come in one order on
        # both sides (what strict communication needs), whatever stages each holds. The
        # epoch is in the tagged key: a message of a pass cut short never matches a later one.
        pipelines = self.roles.pipelines
        mine = sorted(self.stages)
        losses = []
        for index in range(self.pipeline, batches, pipelines):
            seq = ((self.roles.epoch % 64) << 12) | index
            batch, x = None, None
            for stage in mine:
                source = self._holder(stage - 1) if stage > 0 else self.rank
                if stage == 0:
                    batch = self.task.eval_batch(index)
                    x = batch.inputs.to(self.device)
                elif source != self.rank:
                    spec = self.specs[self.parts[stage].start - 1]
                    x = self.p2p.recv_interruptible(spec.shape, spec.dtype, self.device, source,
                                                    (EVAL, stage - 1, seq), self._interrupted)
                with torch.no_grad(), self._autocast():
                    out = self.stages[stage].module(x)
                if stage == self.P - 1:
                    batch = batch or self.task.eval_batch(index)
                    loss = self.loss(out.float(), batch.targets.to(self.device))
                    losses.append((index, float(loss), 1.0 / batches))
                    continue
                x = out.to(self.specs[self.parts[stage].stop - 1].dtype)
                target = self._holder(stage + 1)
                if target != self.rank:
                    self.p2p.send(x, target, (EVAL, stage, seq))
            self.faults.check(step, EVAL_FAULT_INDEX, False, True)
        self.p2p.flush(set(self.roles.dead), self._interrupted)
        return losses

    # -- instructions -----------------------------------------------------------------------

    def _holder(self, stage: int) -> int:
        return self.roles.holders[self.pipeline][stage]

    def _data(self, s: _Step, mb: int) -> torch.Tensor:
        """Stage 0's input for micro-batch `mb`: any node can build it from (seed, step, mb)."""
        return self._batch(s, mb).inputs.to(self.device)

    def _batch(self, s: _Step, mb: int) -> Batch:
        """Micro-batch `mb` of this step, built once (the last stage needs its targets, and
        may also run stage 0's FRC on its inputs)."""
        if mb not in s.batches:
            s.batches[mb] = self.task.batch(s.step, self.global_mbs[mb])
        return s.batches[mb]

    def _autocast(self) -> Any:
        """The context forwards run under: bf16 autocast for --precision bf16 (parameters,
        gradients and optimizer state stay fp32), nothing for fp32."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _memory_peak(self, s: _Step) -> tuple[int, int]:
        """(device, host) bytes this node peaked at in step `s`, by tensor accounting: every
        held stage's state (parameters, gradient sum, optimizer state: the replica's on the
        host when offloaded), one stage's transient .grad (a backward's, until it is added
        to the sum), and the step's peak of saved activations, kept outputs and FRC."""
        meter = s.memory
        held = [st.memory() for st in self.held()]
        grads = max((sum(p.numel() * p.element_size() for p in st.params)
                     for st in self.stages.values()), default=0)
        return (sum(d for d, _ in held) + grads + meter.peak_device,
                sum(h for _, h in held) + meter.peak_host)

    def _layers(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`module` on `x`; with --activation-checkpointing each layer is a checkpoint
        (only its input is saved; its activations are recomputed in the backward)."""
        if not self.activation_checkpointing:
            return module(x)
        for layer in module:
            x = checkpoint(layer, x, use_reentrant=False)
        return x

    def _run(self, module: nn.Module, stage: int, mb: int, x: torch.Tensor,
             s: _Step, frc: bool = False) -> tuple[torch.Tensor, float | None]:
        """Forward of `stage` on `x`; the last stage returns its weighted loss and value.

        Runs under the precision's autocast; a stage's output leaves in its boundary
        spec's dtype (what the successor's receive buffers are), the loss is taken in fp32.
        Counts the bytes autograd keeps for the backward (parameters and the input leaf
        excluded: they are held anyway), the activation memory of this forward, into the
        report and the step's meter (held until the backward releases it); eager FRC's go
        to host memory under --frc-offload.
        """
        saved = SavedTensors(offload=frc and self.frc_offload)
        with saved.hooks():
            with self._autocast():
                out = self._layers(module, x)
            if stage != self.P - 1:
                out = out.to(self.specs[self.parts[stage].stop - 1].dtype)
                loss = None
            else:
                targets = self._batch(s, mb).targets.to(self.device)
                loss = self.loss(out.float(), targets)
        if frc:
            s.report.frc_saved_bytes += saved.device_bytes + saved.host_bytes
        else:
            s.report.saved_bytes += saved.device_bytes
        s.memory.hold(("frc" if frc else "fwd", stage, mb),
                                  saved.device_bytes, saved.host_bytes)
        if loss is None:
            return out, None
        return loss * self.weight, float(loss.detach())

    def _forward(self, s: _Step, i: S.Forward) -> None:
        start = time.perf_counter()
        key = (i.stage, i.mb)
        x = self._data(s, i.mb) if i.stage == 0 else s.inputs[key]
        out, loss = self._run(self.stages[i.stage].module, i.stage, i.mb, x, s)
        s.outputs[key] = out
        meter = s.memory
        if key in s.received_acts:  # the received input, held until the backward
            meter.hold(("fwd", *key), storage_bytes(x))
        if loss is not None:
            s.losses[self.global_mbs[i.mb]] = loss
        elif self.keep_outputs:
            s.saved_out[key] = out.detach()
            meter.hold(("kept", *key), storage_bytes(out))  # for a shadow: the whole step
        else:
            meter.hold(("fwd", *key), storage_bytes(out))  # until its backward
        s.report.compute_s += time.perf_counter() - start

    def _redundant_forward(self, s: _Step, i: S.RedundantForward) -> None:
        start = time.perf_counter()
        assert self.replica is not None
        if i.stage == 0:
            x = self._data(s, i.mb)
        else:
            x = s.saved_out[(i.stage - 1, i.mb)].detach().requires_grad_()
        with self._frc_stream():
            out, loss = self._run(self.replica.module, i.stage, i.mb, x, s, frc=True)
        s.frc[i.mb] = (x, out, loss)
        if loss is None:  # the FRC output stays on the device until a failover or the end
            s.memory.hold(("frc", i.stage, i.mb), storage_bytes(out))
        s.report.frc_s += time.perf_counter() - start

    def _frc_stream(self) -> Any:
        """On CUDA, eager FRC runs on a stream of its own, after the work that produced its
        input, so it overlaps the pipeline's waits instead of queueing behind them (not yet
        run: no GPU here). Its results are used only by a failover, which waits for it."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def _backward(self, s: _Step, i: S.Backward) -> None:
        start = time.perf_counter()
        key = (i.stage, i.mb)
        out = s.outputs.pop(key)
        if i.stage == self.P - 1:
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=s.out_grads.pop(key))
        if i.stage > 0:
            s.in_grads[key] = s.inputs.pop(key).grad
        self.stages[i.stage].accumulate()
        meter = s.memory  # this forward's saved tensors are freed
        if not meter.release(("fwd", *key)):
            meter.release(("frc", *key))  # an adopted FRC forward's (after a failover)
        if i.stage in s.adopted:
            s.report.brc += 1
        s.report.compute_s += time.perf_counter() - start

    def _send_activation(self, s: _Step, i: S.SendActivation) -> None:
        out = s.outputs[(i.stage, i.mb)].detach()
        peer = self._holder(i.stage + 1)
        if peer != self.rank:
            key = (ACTIVATION, i.stage, i.mb)
            if key not in s.peer_has:
                self.p2p.send(out, peer, key)
                s.sent[key] = out
        elif S.Forward(i.stage + 1, i.mb) not in s.done:
            s.inputs[(i.stage + 1, i.mb)] = out.detach().requires_grad_()

    def _recv_activation(self, s: _Step, i: S.RecvActivation) -> None:
        key = (i.stage, i.mb)
        peer = self._holder(i.stage - 1)
        if peer == self.rank:
            return  # passed in memory by this node's own SendActivation, earlier in the list
        spec = self.specs[self.parts[i.stage].start - 1]
        buf = self.p2p.recv_interruptible(spec.shape, spec.dtype, self.device, peer,
                                          (ACTIVATION, i.stage - 1, i.mb), self._interrupted)
        s.inputs[key] = buf.requires_grad_(buf.is_floating_point())
        s.received_acts.add(key)

    def _send_grad(self, s: _Step, i: S.SendGrad) -> None:
        grad = s.in_grads[(i.stage, i.mb)]  # kept until sent: a failed send is retried
        peer = self._holder(i.stage - 1)
        if peer != self.rank:
            key = (GRADIENT, i.stage, i.mb)
            if key not in s.peer_has:
                self.p2p.send(grad, peer, key)
                s.sent[key] = grad
            s.sent_grads[(i.stage, i.mb)] = grad
        elif S.Backward(i.stage - 1, i.mb) not in s.done:
            s.out_grads[(i.stage - 1, i.mb)] = grad
        del s.in_grads[(i.stage, i.mb)]

    def _recv_grad(self, s: _Step, i: S.RecvGrad) -> None:
        peer = self._holder(i.stage + 1)
        if peer == self.rank:
            return  # passed in memory by this node's own SendGrad
        spec = self.specs[self.parts[i.stage].stop - 1]
        s.out_grads[(i.stage, i.mb)] = self.p2p.recv_interruptible(
            spec.shape, spec.dtype, self.device, peer, (GRADIENT, i.stage + 1, i.mb),
            self._interrupted)

    # -- failover ---------------------------------------------------------------------------

    def _recover(self, s: _Step, wait: bool) -> None:
        """Catch up with the roles; a peer lost while applying them (a restore's source, a
        member of the group being formed) only means more roles to wait for."""
        while True:
            try:
                self._catch_up(s, wait)
                return
            except PeerLost as e:
                wait = e.peer not in self.roles.dead
            except Interrupted:
                wait = False  # newer roles are already published

    def _catch_up(self, s: _Step, wait: bool) -> None:
        """Apply every role map the coordinator published since ours, then (strict) form the
        survivors' group and settle the step's transfers on it, then carry out restores."""
        maps = self.link.next_epochs(self.roles.epoch, wait)
        if maps and self.strict:
            self.p2p.abandon()  # a member is gone: nothing more is sent on this group
        for roles in maps:
            self._apply_roles(s, roles)
        if self.strict and self.p2p.abandoned:
            self._rebuild(s)
        for action, t in [r for r in s.restores if r[0] == "send"]:
            state = self.stages[t.stage].state_vector()
            self.p2p.send(state, t.new_holder, (RESTORE, t.stage, 0))
            s.restores.remove((action, t))
        while s.restores:
            _, t = s.restores[0]
            st = self._build(t.stage)
            buf = torch.empty(st.state_size(), dtype=torch.float32, device=self.device)
            # A lost source raises PeerLost: the coordinator, seeing the source gone
            # mid-restore, abandons the generation (and this node never claims the stage).
            work = self.p2p.post_recv(buf, t.source, (RESTORE, t.stage, 0))
            self.p2p.wait_interruptible(work, t.source, self._interrupted)
            st.load_state_vector(buf)
            self._install(s, t, st)
            s.restores.pop(0)

    def _holds(self, pipeline: int, stage: int) -> bool:
        return pipeline < self.roles.pipelines and stage < self.P and \
            self.roles.holders[pipeline][stage] == self.rank

    def _apply_roles(self, s: _Step, new: RoleMap) -> None:
        if new.abandon:
            raise GenerationEnded()
        self.roles = new
        if not self.strict:
            self.p2p.forget(set(new.dead))
        for t in new.takeovers:
            if t.pipeline == self.pipeline and t.new_holder == self.rank:
                self._adopt(s, t)
            elif not self.strict and t.pipeline == self.pipeline and \
                    (t.stage + 1) % self.P in self.stages and t.stage != self.P - 1:
                self._retarget(s, t.stage, t.new_holder)
            if t.source == self.rank:
                s.restores.append(("send", t))
        if self.replica is not None and new.replica_of(self.rank) != self.replica.stage:
            self.replica = None

    def _adopt(self, s: _Step, t: Takeover) -> None:
        """Take over stage `t.stage` for the rest of this step and after: at once from the
        replica, or once its state has arrived from `t.source` (`s.restores`)."""
        if t.kind == "failover":
            assert self.replica is not None and self.replica.stage == t.stage
            st, self.replica = self.replica, None
            st.to_device_optimizer()  # --frc-offload kept its AdamW moments in host memory
            if self._side_stream is not None:  # the FRC results it adopts are complete
                torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
            self._install(s, t, st)
        else:
            s.restores.append(("recv", t))

    def _install(self, s: _Step, t: Takeover, st: StageState) -> None:
        """Make `st` this node's stage `t.stage` and set up the step's work on it."""
        stage = t.stage
        self.stages[stage] = st
        s.adopted.add(stage)
        for mb in range(self.M):
            key = (stage, mb)
            if stage > 0 and (stage - 1, mb) in s.saved_out:
                s.inputs[key] = s.saved_out[(stage - 1, mb)].detach().requires_grad_()
                s.done.add(S.RecvActivation(stage, mb))
            if mb in s.frc and t.kind == "failover":
                x, out, loss = s.frc.pop(mb)
                s.inputs[key], s.outputs[key] = x, out
                if loss is not None:
                    s.losses[self.global_mbs[mb]] = loss
                else:
                    s.saved_out[key] = out.detach()
                s.done.update({S.RecvActivation(stage, mb), S.Forward(stage, mb)})
                s.report.frc_reused += 1
            if (stage + 1, mb) in s.sent_grads and S.Backward(stage, mb) not in s.done:
                s.out_grads[key] = s.sent_grads[(stage + 1, mb)]  # this node is also the successor
        s.frc.clear()

    def _retarget(self, s: _Step, stage: int, new_holder: int) -> None:
        """(tagged) As the lost stage's successor: send this step's gradients again, take
        every activation again (the new holder sends all of them)."""
        successor = stage + 1
        for (st, mb), grad in sorted(s.sent_grads.items()):
            if st == successor:
                self.p2p.send(grad, new_holder, (GRADIENT, st, mb))
                s.report.resent_grads += 1
        spec = self.specs[self.parts[successor].start - 1]
        for st, mb in sorted(s.received_acts):
            if st == successor:
                buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                work = self.p2p.post_recv(buf, new_holder, (ACTIVATION, stage, mb))
                s.dup_recvs.append((work, new_holder))

    # -- strict: a new group among the survivors, and the step's transfers settled on it -----

    def _rebuild(self, s: _Step) -> None:
        """Form the survivors' group for the current roles; Interrupted when newer roles come
        first (a member was lost meanwhile: the next catch-up forms that epoch's group)."""
        start = time.perf_counter()
        members = self.roles.active_ranks()
        name = f"e{self.roles.epoch}"
        assert self.former is not None, "strict communication needs a group former"
        group = form_interruptibly(self.former, name, members, self._interrupted)
        gradients = form_interruptibly(self.former, f"{name}.grad", members, self._interrupted)
        self.p2p = P2P(group, strict=True, gradient_group=gradients, ranks=members,
                       device=self.device, former=self.former, name=name)
        self.link.on_epoch = self.p2p.wake.set
        self._settle_transfers(s)
        s.report.rebuild_s += time.perf_counter() - start
        s.report.rebuilds += 1

    def _open_gradient_lane(self) -> None:
        """strict: the generation's group carries activations and control messages; gradients
        get a group of their own among the active nodes, formed before the first step."""
        assert self.former is not None, "strict communication needs a group former"
        members = self.roles.active_ranks()
        self.p2p.gradient_group = form_interruptibly(self.former, "g.grad", members,
                                                     self._interrupted)
        self.p2p.gradient_ranks = members

    def _boundaries(self) -> list[tuple[int, int, bool]]:
        """(t, peer, upstream) for each stage boundary t|t+1 of this node's pipeline that this
        node shares with another: upstream when this node holds t (it sends activations and
        receives gradients there). In boundary order, which both sides share."""
        row = self.roles.holders[self.pipeline]
        out = []
        for t in range(self.P - 1):
            a, b = row[t], row[t + 1]
            if a != b and self.rank in (a, b):
                out.append((t, b if a == self.rank else a, a == self.rank))
        return out

    def _settle_transfers(self, s: _Step) -> None:
        """After a rebuild, what was in flight on the dropped group is gone. At each shared
        boundary the two nodes swap manifests (one batch: which activations and gradients of
        this step each has sent and has received there), then the sender sends again, in
        micro-batch order, what it sent and the receiver lacks; what the receiver already has
        (from the lost node, say) is not sent again. The schedule then goes on."""
        M = self.M
        boundaries = self._boundaries()
        mine, theirs = [], []
        for t, peer, upstream in boundaries:
            acts = [(ACTIVATION, t, mb) for mb in range(M)]
            grads = [(GRADIENT, t + 1, mb) for mb in range(M)]
            if upstream:
                flags = [k in s.sent for k in acts] + \
                    [S.RecvGrad(t, mb) in s.done for mb in range(M)]
            else:
                flags = [S.RecvActivation(t + 1, mb) in s.done for mb in range(M)] + \
                    [k in s.sent for k in grads]
            mine.append((torch.tensor(flags, dtype=torch.int32, device=self.device), peer,
                         (MANIFEST, t, 0)))
            theirs.append((torch.zeros(2 * M, dtype=torch.int32, device=self.device), peer,
                           (MANIFEST, t, 0)))
        self._exchange(mine, theirs)
        s.peer_has = set()
        sends, recvs, sinks = [], [], []
        for (t, peer, upstream), (flags, _, _) in zip(boundaries, theirs):
            flags = flags.tolist()
            out_kind, out_stage, in_kind, in_stage = (ACTIVATION, t, GRADIENT, t + 1) if upstream \
                else (GRADIENT, t + 1, ACTIVATION, t)
            spec = self.specs[self.parts[t].stop - 1]
            for mb in range(M):
                key = (out_kind, out_stage, mb)
                if flags[mb if upstream else M + mb] == 0 and key in s.sent:
                    sends.append((s.sent[key], peer, key))
                    s.report.resent_grads += out_kind == GRADIENT
                elif flags[mb if upstream else M + mb]:
                    s.peer_has.add(key)
            for mb in range(M):
                instr = S.RecvGrad(t, mb) if upstream else S.RecvActivation(t + 1, mb)
                if flags[M + mb if upstream else mb] and instr not in s.done:
                    buf = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                    recvs.append((buf, peer, (in_kind, in_stage, mb)))
                    sinks.append(instr)
        self._exchange(sends, recvs)
        for instr, (buf, _, _) in zip(sinks, recvs):
            if isinstance(instr, S.RecvGrad):
                s.out_grads[(instr.stage, instr.mb)] = buf
            else:
                s.inputs[(instr.stage, instr.mb)] = buf.requires_grad_(buf.is_floating_point())
                s.received_acts.add((instr.stage, instr.mb))
            s.done.add(instr)

    def _exchange(self, sends: list, recvs: list) -> None:
        for work, peer in self.p2p.exchange(sends, recvs):
            self.p2p.wait_interruptible(work, peer, self._interrupted)

    # -- results ----------------------------------------------------------------------------

    def held(self) -> list[StageState]:
        """Every stage this node holds state for: its primaries, then its replica."""
        return list(self.stages.values()) + ([self.replica] if self.replica is not None else [])
