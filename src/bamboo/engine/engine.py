"""The engine: one node's dispatcher over its instruction list, with in-flight failover.

A step has three phases: A. micro-batches: the node runs `node_schedule` for the stages it
holds (1F1B or ZB-H1, and eager FRC of its replica stage in the waits); gradients summed in
float32 (float64 with `--exact`); B. the commit round (`commit.py`): data-parallel sums, the
replica's gradient, the global norm; the coordinator says "commit" only if every
survivor's round worked; C. the optimizer step on every stage held and on the replica
(`update.py`). Between steps, `evaluate` runs the held-out pass (`evaluation.py`).

When a peer is lost the node applies the new role map to the step under way (`failover.py`):
a shadow adopts the lost stage and its list grows by that stage's work; the transport gets
the lost stage's successor what it needs again; the step ends with the bits a failure-free
step gives. Roles that abandon the generation stop the list at the next instruction.

This module is the dispatcher (as DeepSpeed's `_exec_schedule`) over the node's list
(`plan.program.node_instructions`): a method per instruction, the commit round, the
optimizer step; after each instruction and commit point it tells its hook (a fault plan).
Failover, the transport and the held-out pass get the node's facts (`context.NodeContext`)
and what it holds (`context.Held`), never the engine; what they produce comes back here,
the step's one writer, which builds the step's report once, when it commits.
"""
from __future__ import annotations

import functools
import resource
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from bamboo.config.presets import ModelPreset
from bamboo.data.datasets import Batch, on_device
from bamboo.engine.buckets import BucketReducer
from bamboo.engine.comm import P2P, Interrupted, PeerLost
from bamboo.engine.commit import RoundResult, commit_round, tied_stages
from bamboo.engine.context import Held, NodeContext
from bamboo.engine.evaluation import Losses, MetricRows, eval_pass
from bamboo.engine.failover import GenerationEnded, Recovery, recover
from bamboo.engine.forward import StageForward
from bamboo.engine.memory import storage_bytes
from bamboo.engine.options import Assignment, EngineOptions, Observers, Placement
from bamboo.engine.split_backward import Taping, input_gradient, weight_gradient
from bamboo.engine.stage import StageState, build_replica, build_stage
from bamboo.engine.step import StepState
from bamboo.engine.transfers import recv_activation, recv_grad, send_activation, send_grad
from bamboo.engine.transport import Transport, make_transport
from bamboo.engine.update import apply_update, holdings
from bamboo.model import boundary_shapes, loss_fn
from bamboo.model.structure import detach
from bamboo.plan import program
from bamboo.plan import schedule as S
from bamboo.plan.faults import EVAL_FAULT_INDEX
from bamboo.plan.loss_scale import LossScale
from bamboo.protocol.votes import BoundaryFlag, Decision, Go, StepReport

__all__ = ["EngineOptions", "Assignment", "Placement", "Observers", "NodeEngine",
           "GenerationEnded", "EVAL_FAULT_INDEX"]

_FORWARD, _BACKWARD, _COMMIT, _OPTIMIZER = range(4)
"""Phase indices a node marks its progress with (`bamboo.protocol.messages.PHASES` names them)."""
_global_order = functools.lru_cache(maxsize=64)(S.global_order)  # the same at every step
_COMMITTED, _ABORTED, _REDO = "committed", "aborted", "redo"
"""How one attempt at a step ended (`NodeEngine._attempt`)."""


class NodeEngine:
    """Runs the stages its roles give its rank, one step at a time: the `model` with the job's
    `options`, as assigned (`runs`), where `place`d, told to `observers` (`options.py`), its
    stages taken from those `kept` (current, from the node's last engine) or built."""

    def __init__(self, *, model: ModelPreset, options: EngineOptions, runs: Assignment,
                 place: Placement, observers: Observers | None = None,
                 kept: Mapping[int, StageState] | None = None) -> None:
        rank, layout, parts, roles = runs.rank, runs.layout, runs.parts, runs.roles
        self.preset, self.options, self.parts, self.layout = model, options, parts, layout
        self.rank, self.roles, self.task, self.device = rank, roles, place.task, place.device
        self.tied_stages = tied_stages(model, parts)
        self.build = functools.partial(build_stage, model, options, parts, self.device)  # by index
        seen = observers or Observers()
        self.link, self.hook, self.memory = place.link, seen.hook or program.NoHook(), seen.memory
        self.progress = seen.progress or (lambda step, phase: None)
        self.flags: set[BoundaryFlag] = set()  # what the coordinator asked after the last commit
        self.lr_scale = 1.0
        """The next step's factor on the scheduled learning rate (a step-by-step run's order)."""
        self.loss_scale = LossScale()
        """`--precision fp16`: the dynamic loss scale at the next step (bamboo.plan.loss_scale;
        the generation's plan gives it, each committed step moves it)."""
        self.eager = runs.redundancy.runs_frc
        self.keep_outputs = shadowed = runs.redundancy.keeps_replica  # a shadow needs inputs
        self.P = layout.stages
        self.order_of = functools.partial(_global_order, self.P, schedule=options.schedule)
        """The `--schedule`'s global order for a pipeline of M micro-batches (local ids)."""
        self.pipeline = roles.pipeline_of(rank)
        self.blocks = [layout.micro_batches(d) for d in range(layout.pipelines)]
        """Global micro-batch ids of each pipeline: the engine's instructions, buffers and
        transfer keys name micro-batches by these ids, so work of two pipelines on one node
        (a re-routed slot) never shares a key."""
        self.local_index = {g: (d, i) for d, block in enumerate(self.blocks)
                            for i, g in enumerate(block)}
        self.global_mbs = self.blocks[self.pipeline]
        self.weight = 1.0 / layout.global_micro_batches
        self.specs = boundary_shapes(model, self.task.micro_batch_size)
        self.loss = self.task.loss or loss_fn(model)
        self.stages = {s: (kept or {}).get(s) or self.build(s) for s in roles.stages_of(rank)}
        replica = roles.replica_of(rank) if shadowed else None
        self.replica = build_replica(self.build, replica, runs_forward=self.eager)
        self.ctx = NodeContext(rank=rank, pipeline=self.pipeline, P=self.P, parts=parts,
                               specs=self.specs, device=self.device, global_mbs=self.global_mbs,
                               link=self.link, former=place.former)
        self.transport: Transport = make_transport(self.ctx, options.comm, place.group)
        self.forwards = StageForward(options=options, device=self.device, P=self.P, parts=parts,
                                     specs=self.specs, loss=self.loss, weight=self.weight,
                                     metrics=self.task.metrics)
        self.link.on_epoch = self.p2p.wake.set
        self.reducer = BucketReducer(bucket_bytes=options.bucket_bytes, exact=options.exact)
        self._dispatch: dict[type, Callable[[StepState, Any], None]] = {
            S.Forward: self._forward, S.Backward: self._backward,
            S.BackwardInput: self._backward_input, S.BackwardWeight: self._backward_weight,
            S.SendActivation: self._send_activation, S.RecvActivation: self._recv_activation,
            S.SendGrad: self._send_grad, S.RecvGrad: self._recv_grad,
            S.RedundantForward: self._redundant_forward,
        }

    # -- one step ---------------------------------------------------------------------------

    def run_step(self, step: int) -> StepReport:
        """Run `step` to its commit, surviving lost peers on the way."""
        start = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        s = StepState(step)
        self.p2p.wait_s, self.p2p.bytes_sent, self.link.vote_s = 0.0, 0, 0.0
        before = (self.transport.counts.rebuilds, self.transport.counts.rebuild_s,
                  self.transport.counts.resent_grads, self.reducer.launched_early)
        self.hook.begin(step, self._holds)
        fp16 = self.options.precision == "fp16"
        self.forwards.loss_scale = self.loss_scale.scale if fp16 else 1.0
        s.tally.loss_scale = self.forwards.loss_scale
        while True:
            wait, outcome = False, _REDO
            try:
                outcome = self._attempt(s)
                if outcome == _COMMITTED:
                    break
            except PeerLost as e:
                # Wait for the new roles, unless this peer's loss is already in ours.
                wait = e.peer not in self.roles.dead
            except Interrupted:
                pass
            self._recover(s, wait)
            s.tally.attempts += outcome == _REDO  # an aborted go is no attempt of its own
        report = self._report(s, start, faults, before)
        del s  # the step's buffers are dropped before the process's memory is sampled
        if self.memory is not None:
            m = self.memory()
            report.update(rss_bytes=m.rss, rss_peak_bytes=m.rss_peak,
                          cuda_peak_bytes=m.cuda_peak, cuda_reserved_bytes=m.cuda_reserved)
        return StepReport(**report)  # built once, here

    def _attempt(self, s: StepState) -> str:
        """The step's remaining micro-batch work, its votes and commit round: `_COMMITTED`;
        `_ABORTED` when the go vote said abort, `_REDO` when the commit said redo (either
        way the step goes on under new roles)."""
        length = self._micro_batches(s)
        self.progress(s.step, _COMMIT)
        self._passed(s.step, length, program.MICRO_BATCHES_DONE)
        if self.link.phase_a_done(s.step, self.roles.epoch) is not Go.GO:
            return _ABORTED
        result = self._commit_round(s, length)
        self._passed(s.step, length, program.ROUND_DONE)
        losses = [(g, loss, self.weight) for g, loss in sorted(s.losses.items())]
        metrics = [(g, name, value) for g in sorted(s.losses)
                   for name, value in s.metrics.get(g, {}).items()]
        verdict = self.link.round_done(s.step, self.roles.epoch, result.ok, losses, result.norm,
                                       metrics)
        if verdict.decision is not Decision.COMMIT:
            return _REDO
        self.flags = set(verdict.flags)
        self._apply(s, result)
        self._passed(s.step, length, program.APPLIED)
        return _COMMITTED

    def _report(self, s: StepState, start: float, faults: int,
                before: tuple[int, float, int, int]) -> dict[str, Any]:
        """The committed step's report's fields but the process's memory; `before`: the
        transport's counts and the reducer's at its start, as `run_step` takes them."""
        c = self.transport.counts
        return dict(step=s.step, rank=self.rank,
                    losses=[(g, loss, self.weight) for g, loss in sorted(s.losses.items())],
                    step_s=time.perf_counter() - start,
                    page_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                    wait_s=self.p2p.wait_s, vote_s=self.link.vote_s, bytes_sent=self.p2p.bytes_sent,
                    rebuilds=c.rebuilds - before[0], rebuild_s=c.rebuild_s - before[1],
                    resent_grads=c.resent_grads - before[2],
                    buckets_early=self.reducer.launched_early - before[3],
                    **s.tally.as_report(),
                    **holdings(s, self.stages, self.replica, self.options.check_replicas))

    def _passed(self, step: int, length: int, point: program.CommitPoint) -> None:
        """The step passed a point of its commit round: instruction `length` + k of its
        program, where the list of its micro-batch work has `length` instructions."""
        self.hook.on_instruction(step, length + program.COMMIT_POINTS.index(point), point)

    @property
    def p2p(self) -> P2P:
        """The transfers of the current group (strict: replaced after every loss)."""
        return self.transport.p2p

    def _recover(self, s: StepState, wait: bool) -> None:
        """Catch up with the roles the coordinator published (`failover.recover`) and hold
        what they give this node (buckets of older roles dropped); GenerationEnded when it
        abandoned the generation."""
        recovery = Recovery(transport=self.transport, build=self.build,
                            frc_results_complete=self.forwards.frc_results_complete)
        changes = recover(self.ctx, recovery, self._held(), s, wait)
        try:
            while True:  # each change to the step applied before the failover goes on
                s.apply(self.ctx, next(changes))
        except StopIteration as done:
            self._install(done.value)
        except GenerationEnded as end:
            self._install(end.held)
            raise
        finally:
            self.reducer.settle(self.roles.epoch, self.p2p)

    def _held(self) -> Held:
        return Held(self.roles, dict(self.stages), self.replica)

    def _install(self, held: Held) -> None:
        """Hold what a failover returned: the roles, the stages and the replica."""
        self.roles, self.stages, self.replica = held.roles, held.stages, held.replica

    def evaluate(self, step: int, batches: int) -> Losses:
        """The held-out loss of the parameters after `step` steps (`evaluation.eval_pass`),
        closed by a vote: if the roles changed meanwhile (a node was lost), every node
        applies the new roles (a failover, as between steps) and runs the pass again, so
        the result is the failure-free run's. GenerationEnded as in `run_step`."""
        self.hook.begin(step, self._holds)
        scratch = StepState(step)  # what a role change applies to: nothing of a step is done yet
        while True:
            wait = False
            try:
                metrics: MetricRows = []
                losses = eval_pass(self.ctx, self._held(), self.p2p, batches, task=self.task,
                                   loss=self.loss, forward=self.forwards.held_out,
                                   after_batch=lambda i: self.hook.on_instruction(
                                       step, i, program.EvalMicroBatch(i)), metrics=metrics)
                if self.link.eval_done(step, self.roles.epoch, losses, metrics) is Go.GO:
                    return losses
            except PeerLost as lost:
                wait = lost.peer not in self.roles.dead
            except Interrupted:
                pass
            self._recover(scratch, wait)

    def catch_up(self, step: int) -> None:
        """At the boundary before `step` (nothing of it begun): take on the roles published
        since this node's (a node lost between steps), as a failover between steps does;
        GenerationEnded when the coordinator abandoned the generation."""
        if not self.interrupted():
            return
        self._recover(StepState(step), wait=False)

    def instructions(self) -> list[S.Instruction]:
        """This node's list now (`program.node_instructions`): its own pipeline's work on
        the stages it holds, with eager FRC of its replica, and its share of each re-routed
        slot it serves; micro-batches named by global id."""
        frc = self.replica.stage if self.replica is not None and self.eager else None
        return program.node_instructions(self.roles, self.rank, list(self.stages), self.blocks,
                                 self.options.schedule, frc_stage=frc,
                                 pipeline=self.pipeline, order_of=self.order_of)

    def _micro_batches(self, s: StepState) -> int:
        """Phase A: the remaining instructions of this node's list; the list's length."""
        self.transport.prepare(self.roles)
        schedule = self.instructions()
        self.reducer.plan(roles=self.roles, stages=self.stages, p2p=self.p2p, schedule=schedule,
                          done=s.done)
        for index, instr in enumerate(schedule):
            if instr in s.done:
                continue
            if self.ctx.abandoned(self.roles):  # the recovery meets it: GenerationEnded
                raise Interrupted
            self.progress(s.step, _BACKWARD if isinstance(instr, (*S.BACKWARDS, S.SendGrad, S.RecvGrad))
                       else _FORWARD)
            with self.reducer.around(instr):  # a stage's sum complete: its buckets go out
                self._dispatch[type(instr)](s, instr)
            s.done.add(instr)
            self.hook.on_instruction(s.step, index, instr)
        while self._frc_at_wait(s, in_wait=False):  # what no wait took, before the commit round
            pass
        dead = set(self.roles.dead)
        self.p2p.flush(dead, self.interrupted)
        while s.transfers.dup_recvs:
            work, peer = s.transfers.dup_recvs[0]
            if peer not in dead:
                self.p2p.wait_interruptible(work, peer, self.interrupted)
            s.transfers.dup_recvs.pop(0)
        return len(schedule)

    def interrupted(self) -> bool:
        """True when the coordinator published roles newer than this node's."""
        return self.link.latest_epoch > self.roles.epoch

    def _commit_round(self, s: StepState, length: int) -> RoundResult:
        start = time.perf_counter()
        result = commit_round(roles=self.roles, rank=self.rank, stages=self.stages,
                              replica=self.replica, p2p=self.p2p,
                              num_layers=self.preset.layers, exact=self.options.exact,
                              interrupt=self.interrupted,
                              after_reduce=lambda: self._passed(s.step, length, program.REDUCED),
                              ties=self.tied_stages, reducer=self.reducer)
        s.tally.reduce_s += time.perf_counter() - start
        s.tally.bytes_replica = result.bytes_replica
        return result

    def _apply(self, s: StepState, result: RoundResult) -> None:
        """Phase C: one optimizer step on every stage held and on the replica
        (`update.apply_update`)."""
        self.progress(s.step, _OPTIMIZER)
        start = time.perf_counter()
        done = apply_update(stages=self.stages, replica=self.replica, result=result,
                            options=self.options, step=s.step, lr_scale=self.lr_scale,
                            loss_scale=self.loss_scale, scale=self.forwards.loss_scale)
        self.loss_scale = done.loss_scale
        s.tally.grad_norm, s.tally.lr, s.tally.skipped = done.grad_norm, done.lr, done.skipped
        s.tally.optim_s += time.perf_counter() - start

    # -- instructions -----------------------------------------------------------------------

    def worker(self, stage: int, mb: int) -> int:
        """The rank that runs `stage` of global micro-batch `mb` (a re-routed slot's peer)."""
        d, index = self.local_index[mb]
        return self.roles.worker(d, stage, index)

    def _data(self, s: StepState, mb: int) -> torch.Tensor:
        """Stage 0's input for micro-batch `mb`: any node can build it from (seed, step, mb)."""
        return on_device(self._batch(s, mb).inputs, self.device)

    def _batch(self, s: StepState, mb: int) -> Batch:
        """Micro-batch `mb` of this step, built once (the last stage needs its targets, and
        may also run stage 0's FRC on its inputs)."""
        if mb not in s.batches:
            s.batches[mb] = self.task.batch(s.step, mb)
        return s.batches[mb]

    def _forward(self, s: StepState, i: S.Forward) -> None:
        start = time.perf_counter()
        key = (i.stage, i.mb)
        x = self._data(s, i.mb) if i.stage == 0 else s.inputs[key]
        f = self.forwards.run(self.stages[i.stage], i.mb, x, s.step,
                              targets=lambda: self._batch(s, i.mb).targets)
        s.forwarded(i.stage, i.mb, f, frc=False)
        s.outputs[key] = out = f.out
        meter = s.memory
        if key in s.transfers.received_acts:  # the received input, held until the backward
            meter.hold(("fwd", *key), storage_bytes(x))
        if f.loss is not None:
            s.losses[i.mb] = f.loss
        elif self.keep_outputs:
            s.saved_out[key] = detach(out)
            meter.hold(("kept", *key), storage_bytes(out))  # for a shadow: the whole step
        else:
            meter.hold(("fwd", *key), storage_bytes(out))  # until its backward
        s.tally.compute_s += time.perf_counter() - start

    def _redundant_forward(self, s: StepState, i: S.RedundantForward) -> None:
        """Its input is ready here: run it now (`--frc-at slot`), or at the node's next wait."""
        if self.options.frc_at == "waits":
            s.frc_pending.append(i)
        else:
            self._run_frc(s, i)

    def _frc_at_wait(self, s: StepState, in_wait: bool = True) -> bool:
        """While a transfer is under way: run one pending FRC; False when none is left. A
        replica given up since (a failover adopted it, the roles changed) drops its FRC."""
        while s.frc_pending:
            i = s.frc_pending.pop(0)
            if self.replica is not None and self.replica.stage == i.stage and i.mb not in s.frc:
                self._run_frc(s, i)
                s.tally.frc_in_waits += in_wait
                return True
        return False

    def _run_frc(self, s: StepState, i: S.RedundantForward) -> None:
        start = time.perf_counter()
        assert self.replica is not None
        x = self._data(s, i.mb) if i.stage == 0 else \
            self.ctx.boundary_spec(i.stage, input_side=True).as_input(
                s.saved_out[(i.stage - 1, i.mb)])
        with self.forwards.frc_stream():
            f = self.forwards.run(self.replica, i.mb, x, s.step,
                                  targets=lambda: self._batch(s, i.mb).targets, frc=True)
        s.forwarded(i.stage, i.mb, f, frc=True)
        s.frc[i.mb] = (x, f.out, f.loss)
        if f.loss is None:  # the FRC output stays on the device until a failover or the end
            s.memory.hold(("frc", i.stage, i.mb), storage_bytes(f.out))
        s.tally.frc_s += time.perf_counter() - start
        s.tally.frc_forwards += 1

    def _backward(self, s: StepState, i: S.Backward) -> None:
        start = time.perf_counter()
        key = (i.stage, i.mb)
        out = s.outputs.pop(key)
        if i.stage == self.P - 1:
            out.backward()
        else:
            outs, grads = self.ctx.boundary_spec(i.stage, input_side=False).grad_pairs(
                out, s.out_grads.pop(key))
            torch.autograd.backward(outs, grad_tensors=grads)
        if i.stage > 0:
            spec = self.ctx.boundary_spec(i.stage, input_side=True)
            s.in_grads[key] = spec.input_grads(s.inputs.pop(key))
        self._backward_done(s, i.stage, i.mb, start)

    def _backward_done(self, s: StepState, stage: int, mb: int, start: float) -> None:
        """A micro-batch's parameter gradients are in .grad: into the sum; its saved
        tensors are freed."""
        self._accumulate(stage, mb)
        meter = s.memory
        if not meter.release(("fwd", stage, mb)):
            meter.release(("frc", stage, mb))  # an adopted FRC forward's (after a failover)
        if stage in s.adopted:
            s.tally.brc += 1
        s.tally.compute_s += time.perf_counter() - start

    def _accumulate(self, stage: int, mb: int) -> None:
        """Into the stage's gradient sum; a served pipeline's micro-batch into its own."""
        d = self.local_index[mb][0]
        self.stages[stage].accumulate(None if d == self.pipeline else d)

    def _backward_input(self, s: StepState, i: S.BackwardInput) -> None:
        """ZB-H1's first half: the input's gradient, and the gradients of every parameter
        that is not a taped linear layer's own; the linear layers' wait (`split_backward`)."""
        start = time.perf_counter()
        key = (i.stage, i.mb)
        st = self.stages[i.stage]
        out, grad = s.outputs.pop(key), None
        if i.stage != self.P - 1:
            out, grad = self.ctx.boundary_spec(i.stage, input_side=False).grad_pairs(
                out, s.out_grads.pop(key))
        x = s.inputs.pop(key) if i.stage > 0 else None
        spec = self.ctx.boundary_spec(i.stage, input_side=True) if x is not None else None
        # no tape: a stage that does not defer its weights (`defers_weight`), or an adopted
        # FRC forward run under --frc-offload; its whole backward runs here
        tape = s.tapes.pop(key, None)
        dxs = input_gradient(out, grad, spec.grad_inputs(x) if spec else [],
                             Taping.other_params(st.params, tape), tape)
        dx = spec.grads_of(x, dxs) if spec else None
        if dx is not None:
            s.in_grads[key] = dx
        self._accumulate(i.stage, i.mb)
        if tape is not None:
            s.weight_work[key] = tape
        s.tally.compute_s += time.perf_counter() - start

    def _backward_weight(self, s: StepState, i: S.BackwardWeight) -> None:
        """ZB-H1's second half: the linear layers' gradients of micro-batch `mb`, into the sum."""
        start = time.perf_counter()
        key = (i.stage, i.mb)
        tape = s.weight_work.pop(key, None)
        if tape is not None:
            weight_gradient(tape, self.forwards.autocast)
        self._backward_done(s, i.stage, i.mb, start)

    def _send_activation(self, s: StepState, i: S.SendActivation) -> None:
        _put(s.inputs, (i.stage + 1, i.mb),
             send_activation(self.ctx, self.p2p, s, i, self.worker(i.stage + 1, i.mb)))

    def _recv_activation(self, s: StepState, i: S.RecvActivation) -> None:
        _put(s.inputs, (i.stage, i.mb), recv_activation(
            self.ctx, self.p2p, s, i, self.worker(i.stage - 1, i.mb), self.interrupted,
            idle=lambda: self._frc_at_wait(s)))

    def _send_grad(self, s: StepState, i: S.SendGrad) -> None:
        _put(s.out_grads, (i.stage - 1, i.mb),
             send_grad(self.ctx, self.p2p, s, i, self.worker(i.stage - 1, i.mb)))
        del s.in_grads[(i.stage, i.mb)]

    def _recv_grad(self, s: StepState, i: S.RecvGrad) -> None:
        _put(s.out_grads, (i.stage, i.mb), recv_grad(
            self.ctx, self.p2p, s, i, self.worker(i.stage + 1, i.mb), self.interrupted,
            idle=lambda: self._frc_at_wait(s)))

    def _holds(self, pipeline: int, stage: int) -> bool:
        """Whether this node holds `stage` of `pipeline` now (a fault's target)."""
        return pipeline < self.roles.pipelines and stage < self.P and \
            self.roles.holders[pipeline][stage] == self.rank

    def held(self) -> list[StageState]:
        """Every stage this node holds state for: its primaries, then its replica."""
        return list(self.stages.values()) + ([self.replica] if self.replica is not None else [])


def _put(buffers: dict, key: tuple[int, int], value: Any) -> None:
    """What a transfer gave the step (None: nothing, a send to a peer or a receive passed
    in memory), into its buffer."""
    if value is not None:
        buffers[key] = value
