"""The engine: one node's dispatcher over its instruction list, with in-flight failover.

A step has three phases:

A. micro-batches: the node runs `node_schedule` for the stages it holds (1F1B or ZB-H1,
   and eager FRC of its replica stage in the waits); gradients are summed in float32
   (float64 with `--exact`);
B. the commit round (`commit.py`): data-parallel sums, the replica's gradient, the
   global norm; the coordinator says "commit" only if every survivor's round worked;
C. the optimizer step, on every stage the node holds and on its replica.

Between steps, `evaluate` runs the held-out pass (`evaluation.py`).

When a peer is lost the node asks the coordinator for the new role map and applies it to
the step under way (`failover.py`): a shadow adopts the lost stage and its list grows by
that stage's work; the transport (`transport.py`: strict or tagged) gets the lost stage's
successor what it needs again; the rest of the step goes on. Nothing restarts and the step
ends with the bits a failure-free step gives. What the step holds is `step.StepState`.

This module is the dispatcher: the step's loop over its instructions (as DeepSpeed's
`_exec_schedule`), one method per instruction, the commit round and the optimizer step.
"""
from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from bamboo.data.datasets import Batch, Task
from bamboo.plan.faults import FaultPlan
from bamboo.model import ModelPreset, boundary_shapes, loss_fn
from bamboo.plan import schedule as S
from bamboo.engine.comm import ACTIVATION, GRADIENT, P2P, GroupFormer, Interrupted, PeerLost
from bamboo.engine.commit import RoundResult, commit_round
from bamboo.engine.evaluation import EVAL_FAULT_INDEX, evaluate
from bamboo.engine.failover import GenerationEnded, recover
from bamboo.plan.layout import Layout
from bamboo.engine.memory import SavedTensors, storage_bytes
from bamboo.engine.optim import clip_coefficient, learning_rate
from bamboo.engine.split_backward import Tape, Taping, input_gradient, weight_gradient
from bamboo.engine.stage import StageState
from bamboo.engine.step import StepState, TransferLog
from bamboo.engine.transport import Transport, make_transport
from bamboo.plan.votes import BoundaryFlag, Decision, Go, StepReport, Votes
from bamboo.plan.roles import RoleMap

__all__ = ["TrainingHyper", "NodeEngine", "GenerationEnded", "EVAL_FAULT_INDEX"]

_FORWARD, _BACKWARD, _COMMIT, _OPTIMIZER = range(4)
"""Phase indices a node marks its progress with (`bamboo.wire.protocol.PHASES` names them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingHyper:
    """The optimisation settings every stage shares."""

    lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    grad_clip: float


class NodeEngine:
    """Runs the stages `roles` gives this rank, one step at a time."""

    def __init__(self, *, preset: ModelPreset, parts: Sequence[range], layout: Layout,
                 rank: int, roles: RoleMap, task: Task, hyper: TrainingHyper, seed: int,
                 device: torch.device, link: Votes, redundancy: str,
                 group: Any, former: GroupFormer | None = None, slot: int | None = None,
                 faults: FaultPlan | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 check_replicas: bool = False, frc_offload: bool = False,
                 frc_at: str = "waits", schedule: str = "1f1b",
                 comm: str = "strict", precision: str = "fp32", exact: bool = False,
                 activation_checkpointing: bool = False) -> None:
        self.preset, self.parts, self.layout, self.rank = preset, parts, layout, rank
        self.roles, self.task, self.hyper, self.seed, self.device = roles, task, hyper, seed, device
        self.link, self.faults, self.progress = link, faults or FaultPlan([]), progress
        self.slot = rank if slot is None else slot
        self.faults.holds = self._holds
        self.flags: set[BoundaryFlag] = set()
        """What the coordinator asked for after the last commit: `ckpt`, `reconf`."""
        self.eager, self.check_replicas = redundancy == "eager", check_replicas
        shadowed = redundancy in ("eager", "lazy")
        self.keep_outputs = shadowed  # a shadow adopting a stage needs its inputs
        self.frc_offload, self.frc_at = frc_offload, frc_at
        self.comm, self.precision, self.exact = comm, precision, exact
        self.activation_checkpointing = activation_checkpointing
        self.P = layout.stages
        self.pipeline = roles.pipeline_of(rank)
        self.blocks = [layout.micro_batches(d) for d in range(layout.pipelines)]
        """Global micro-batch ids of each pipeline: the engine's instructions, buffers and
        transfer keys name micro-batches by these ids, so work of two pipelines on one node
        (a re-routed slot) never shares a key."""
        self.local_index = {g: (d, i) for d, block in enumerate(self.blocks)
                            for i, g in enumerate(block)}
        self.global_mbs = self.blocks[self.pipeline]
        self.M = len(self.global_mbs)
        self.schedule_name = schedule
        self._orders: dict[int, dict[S.Instruction, int]] = {}
        self.order = self.order_of(self.M)
        self.weight = 1.0 / layout.global_micro_batches
        self.specs = boundary_shapes(preset, task.micro_batch_size)
        self.loss = loss_fn(preset)
        self.stages = {s: self.build(s) for s in roles.stages_of(rank)}
        replica = roles.replica_of(rank) if shadowed else None
        self.replica = self.build(replica) if replica is not None else None
        self.former = former
        self.transport: Transport = make_transport(self, comm, group)
        self._side_stream: Any = None
        """CUDA: the stream eager FRC runs on (`_frc_stream`)."""
        link.on_epoch = self.p2p.wake.set
        self._dispatch: dict[type, Callable[[StepState, Any], None]] = {
            S.Forward: self._forward, S.Backward: self._backward,
            S.BackwardInput: self._backward_input, S.BackwardWeight: self._backward_weight,
            S.SendActivation: self._send_activation, S.RecvActivation: self._recv_activation,
            S.SendGrad: self._send_grad, S.RecvGrad: self._recv_grad,
            S.RedundantForward: self._redundant_forward,
        }

    def build(self, stage: int) -> StageState:
        """A fresh stage: seeded parameters, gradient sums in float64 under --exact; under
        zb-h1 its linear layers taped in every forward (`split_backward`)."""
        st = StageState(preset=self.preset, stage=stage, layer_indices=self.parts[stage],
                        seed=self.seed, device=self.device, lr=self.hyper.lr,
                        weight_decay=self.hyper.weight_decay,
                        accumulate_dtype=torch.float64 if self.exact else torch.float32)
        if S.defers_weight(self.schedule_name, stage):
            st.taping = Taping(st.module)
        return st

    # -- one step ---------------------------------------------------------------------------

    def run_step(self, step: int) -> StepReport:
        """Run `step` to its commit, surviving lost peers on the way."""
        start = time.perf_counter()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        s = StepState(step)
        s.report = StepReport(step=step, rank=self.rank, stages=[])
        self.p2p.wait_s, self.p2p.bytes_sent = 0.0, 0
        self.faults.aim(step)
        while True:
            wait = False
            try:
                length = self._micro_batches(s)
                self._mark(step, _COMMIT)
                self.faults.check(step, length, False, True)
                if self.link.phase_a_done(step, self.roles.epoch) is not Go.GO:
                    recover(self, s, wait=False)
                    continue
                result = self._commit_round(s, length)
                self.faults.check(step, length + 2, False, True)
                losses = [(g, loss, self.weight) for g, loss in sorted(s.losses.items())]
                verdict = self.link.round_done(step, self.roles.epoch, result.ok, losses,
                                               result.norm)
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
            recover(self, s, wait)
            s.report.attempts += 1
        r = s.report
        r.stages = sorted(self.stages)
        r.losses = [(g, loss, self.weight) for g, loss in sorted(s.losses.items())]
        r.step_s = time.perf_counter() - start
        r.page_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        r.wait_s = self.p2p.wait_s
        r.bytes_sent = self.p2p.bytes_sent
        r.state_bytes = sum(3 * 4 * st.numel for st in self.held())  # fp32 params + two AdamW moments
        r.device_bytes, r.host_bytes = self._memory_peak(s)
        if self.check_replicas:
            r.digests = {f"stage{k}": st.digest() for k, st in self.stages.items()}
            if self.replica is not None:
                r.digests[f"replica{self.replica.stage}"] = self.replica.digest()
        return r

    @property
    def p2p(self) -> P2P:
        """The transfers of the current group (strict: replaced after every loss)."""
        return self.transport.p2p

    def evaluate(self, step: int, batches: int) -> list[tuple[int, float, float]]:
        """The held-out pass after `step` steps (`bamboo.engine.evaluation`)."""
        return evaluate(self, step, batches)

    def _mark(self, step: int, phase: int) -> None:
        if self.progress is not None:
            self.progress(step, phase)

    def order_of(self, micro_batches: int) -> dict[S.Instruction, int]:
        """The `--schedule`'s global order for a pipeline of `micro_batches` (local ids)."""
        if micro_batches not in self._orders:
            self._orders[micro_batches] = S.global_order(self.P, micro_batches, self.schedule_name)
        return self._orders[micro_batches]

    def _schedule(self) -> list[S.Instruction]:
        """This node's list, micro-batches named by global id: its own pipeline's work, and
        the share of each re-routed slot it serves (`schedule.merge_pipelines`)."""
        frc = self.replica.stage if self.replica is not None and self.eager else None
        own = S.node_schedule(sorted(self.stages), self.P, self.M, order=self.order, frc_stage=frc)
        served = S.served_work(self.roles.served_by(self.rank), self.rank, self.blocks,
                               self.order_of)
        return S.merge_pipelines([(self.pipeline, own), *served], self.blocks, self.order_of)

    def _micro_batches(self, s: StepState) -> int:
        """Phase A: the remaining instructions of this node's list; its length (fault index)."""
        self.transport.prepare()
        schedule = self._schedule()
        for index, instr in enumerate(schedule):
            if instr in s.done:
                continue
            self._mark(s.step, _BACKWARD if isinstance(instr, (*S.BACKWARDS, S.SendGrad, S.RecvGrad))
                       else _FORWARD)
            self._dispatch[type(instr)](s, instr)
            s.done.add(instr)
            is_forward = isinstance(instr, S.Forward)
            self.faults.check(s.step, index, is_forward, s.seen_forward)
            s.seen_forward |= is_forward
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
                              num_layers=self.preset.layers, exact=self.exact,
                              interrupt=self.interrupted,
                              after_reduce=lambda: self.faults.check(s.step, length + 1, False, True))
        s.report.reduce_s += time.perf_counter() - start
        s.report.bytes_replica = result.bytes_replica
        return result

    def _apply(self, s: StepState, result: RoundResult) -> None:
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

    # -- instructions -----------------------------------------------------------------------

    def holder(self, stage: int, pipeline: int | None = None) -> int:
        """The holder of `stage` in `pipeline` (default this node's)."""
        return self.roles.holders[self.pipeline if pipeline is None else pipeline][stage]

    def worker(self, stage: int, mb: int) -> int:
        """The rank that runs `stage` of global micro-batch `mb` (a re-routed slot's peer)."""
        d, index = self.local_index[mb]
        return self.roles.worker(d, stage, index)

    def _data(self, s: StepState, mb: int) -> torch.Tensor:
        """Stage 0's input for micro-batch `mb`: any node can build it from (seed, step, mb)."""
        return self._batch(s, mb).inputs.to(self.device)

    def _batch(self, s: StepState, mb: int) -> Batch:
        """Micro-batch `mb` of this step, built once (the last stage needs its targets, and
        may also run stage 0's FRC on its inputs)."""
        if mb not in s.batches:
            s.batches[mb] = self.task.batch(s.step, mb)
        return s.batches[mb]

    def autocast(self) -> Any:
        """The context forwards run under: bf16 autocast for --precision bf16 (parameters,
        gradients and optimizer state stay fp32), nothing for fp32."""
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _memory_peak(self, s: StepState) -> tuple[int, int]:
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

    def _run(self, st: StageState, mb: int, x: torch.Tensor,
             s: StepState, frc: bool = False) -> tuple[torch.Tensor, float | None]:
        """Forward of `stage` on `x`; the last stage returns its weighted loss and value.

        Runs under the precision's autocast; a stage's output leaves in its boundary
        spec's dtype (what the successor's receive buffers are), the loss is taken in fp32.
        Counts the bytes autograd keeps for the backward (parameters and the input leaf
        excluded: they are held anyway), the activation memory of this forward, into the
        report and the step's meter (held until the backward releases it); eager FRC's go
        to host memory under --frc-offload. Under zb-h1 the forward's tape (what the weight
        gradient needs) goes to `s.tapes` (an FRC forward's to `s.frc_tapes`).
        """
        stage = st.stage
        saved = SavedTensors(offload=frc and self.frc_offload)
        # Under --frc-offload an FRC forward keeps nothing on the device for a tape: if a
        # failover adopts it, its backward runs whole in the input half.
        taped = st.taping is not None and not (frc and self.frc_offload)
        tape = Tape() if taped else None
        taping = st.taping.recording(tape) if tape is not None else contextlib.nullcontext()
        with saved.hooks(), taping:
            with self.autocast():
                out = self._layers(st.module, x)
            if stage != self.P - 1:
                out = out.to(self.specs[self.parts[stage].stop - 1].dtype)
                loss = None
            else:
                targets = self._batch(s, mb).targets.to(self.device)
                loss = self.loss(out.float(), targets)
        if tape is not None:
            if frc:
                s.frc_tapes[mb] = tape
            else:
                s.tapes[(stage, mb)] = tape
        if frc:
            s.report.frc_saved_bytes += saved.device_bytes + saved.host_bytes
        else:
            s.report.saved_bytes += saved.device_bytes
        s.memory.hold(("frc" if frc else "fwd", stage, mb),
                                  saved.device_bytes, saved.host_bytes)
        if loss is None:
            return out, None
        return loss * self.weight, float(loss.detach())

    def _forward(self, s: StepState, i: S.Forward) -> None:
        start = time.perf_counter()
        key = (i.stage, i.mb)
        x = self._data(s, i.mb) if i.stage == 0 else s.inputs[key]
        out, loss = self._run(self.stages[i.stage], i.mb, x, s)
        s.outputs[key] = out
        meter = s.memory
        if key in s.transfers.received_acts:  # the received input, held until the backward
            meter.hold(("fwd", *key), storage_bytes(x))
        if loss is not None:
            s.losses[i.mb] = loss
        elif self.keep_outputs:
            s.saved_out[key] = out.detach()
            meter.hold(("kept", *key), storage_bytes(out))  # for a shadow: the whole step
        else:
            meter.hold(("fwd", *key), storage_bytes(out))  # until its backward
        s.report.compute_s += time.perf_counter() - start

    def _redundant_forward(self, s: StepState, i: S.RedundantForward) -> None:
        """Its input is ready here: run it now (`--frc-at slot`), or at the node's next wait."""
        if self.frc_at == "waits":
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
                s.report.frc_in_waits += in_wait
                return True
        return False

    def _run_frc(self, s: StepState, i: S.RedundantForward) -> None:
        start = time.perf_counter()
        assert self.replica is not None
        if i.stage == 0:
            x = self._data(s, i.mb)
        else:
            x = s.saved_out[(i.stage - 1, i.mb)].detach().requires_grad_()
        with self._frc_stream():
            out, loss = self._run(self.replica, i.mb, x, s, frc=True)
        s.frc[i.mb] = (x, out, loss)
        if loss is None:  # the FRC output stays on the device until a failover or the end
            s.memory.hold(("frc", i.stage, i.mb), storage_bytes(out))
        s.report.frc_s += time.perf_counter() - start
        s.report.frc_forwards += 1

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

    def frc_results_complete(self) -> None:
        """Before a failover adopts eager FRC results: on CUDA, wait for their stream."""
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)

    def _backward(self, s: StepState, i: S.Backward) -> None:
        start = time.perf_counter()
        key = (i.stage, i.mb)
        out = s.outputs.pop(key)
        if i.stage == self.P - 1:
            out.backward()
        else:
            torch.autograd.backward(out, grad_tensors=s.out_grads.pop(key))
        if i.stage > 0:
            s.in_grads[key] = s.inputs.pop(key).grad
        self._backward_done(s, i.stage, i.mb, start)

    def _backward_done(self, s: StepState, stage: int, mb: int, start: float) -> None:
        """A micro-batch's parameter gradients are in .grad: into the sum; its saved
        tensors are freed."""
        self._accumulate(stage, mb)
        meter = s.memory
        if not meter.release(("fwd", stage, mb)):
            meter.release(("frc", stage, mb))  # an adopted FRC forward's (after a failover)
        if stage in s.adopted:
            s.report.brc += 1
        s.report.compute_s += time.perf_counter() - start

    def _accumulate(self, stage: int, mb: int) -> None:
        """Into the stage's gradient sum; a served pipeline's micro-batch into its own."""
        d = self.local_index[mb][0]
        self.stages[stage].accumulate(None if d == self.pipeline else d)

    def restart_step(self, s: StepState) -> None:
        """A stage was re-routed: drop everything of the step under way (its buffers, its
        transfer log, the gradient sums) so it runs again, whole, under the new roles. Peer
        restores still to carry out are kept: a stage's state still has to arrive."""
        for st in self.stages.values():
            st.reset_grads()
        s.done.clear()
        for buffers in (s.inputs, s.outputs, s.saved_out, s.out_grads, s.in_grads, s.tapes,
                        s.frc_tapes, s.weight_work, s.frc, s.losses):
            buffers.clear()
        s.frc_pending.clear()  # s.restores stay: a peer restore moves a stage's state, not the step's
        s.adopted.clear()
        s.transfers = TransferLog()
        s.memory.release_all()
        s.restarted = True
        s.report.restarts += 1

    def _backward_input(self, s: StepState, i: S.BackwardInput) -> None:
        """ZB-H1's first half: the input's gradient, and the gradients of every parameter
        that is not a taped linear layer's own; the linear layers' wait (`split_backward`)."""
        start = time.perf_counter()
        key = (i.stage, i.mb)
        st = self.stages[i.stage]
        out = s.outputs.pop(key)
        grad = None if i.stage == self.P - 1 else s.out_grads.pop(key)
        x = s.inputs.pop(key) if i.stage > 0 else None
        # no tape: a stage that does not defer its weights (`defers_weight`), or an adopted
        # FRC forward run under --frc-offload; its whole backward runs here
        tape = s.tapes.pop(key, None)
        dx = input_gradient(out, grad, x, Taping.other_params(st.params, tape), tape)
        if dx is not None:
            s.in_grads[key] = dx
        self._accumulate(i.stage, i.mb)
        if tape is not None:
            s.weight_work[key] = tape
        s.report.compute_s += time.perf_counter() - start

    def _backward_weight(self, s: StepState, i: S.BackwardWeight) -> None:
        """ZB-H1's second half: the linear layers' gradients of micro-batch `mb`, into the sum."""
        start = time.perf_counter()
        key = (i.stage, i.mb)
        tape = s.weight_work.pop(key, None)
        if tape is not None:
            weight_gradient(tape, self.autocast)
        self._backward_done(s, i.stage, i.mb, start)

    def backward_begun(self, s: StepState, stage: int, mb: int) -> bool:
        """Whether this node has run the backward (1F1B) or input gradient (ZB-H1) of
        (`stage`, `mb`) in this step."""
        return S.Backward(stage, mb) in s.done or S.BackwardInput(stage, mb) in s.done

    def _send_activation(self, s: StepState, i: S.SendActivation) -> None:
        out = s.outputs[(i.stage, i.mb)].detach()
        peer = self.worker(i.stage + 1, i.mb)
        if peer != self.rank:
            key = (ACTIVATION, i.stage, i.mb)
            if key not in s.transfers.peer_has:
                self.p2p.send(out, peer, key)
                s.transfers.sent[key] = out
        elif S.Forward(i.stage + 1, i.mb) not in s.done:
            s.inputs[(i.stage + 1, i.mb)] = out.detach().requires_grad_()

    def _recv_activation(self, s: StepState, i: S.RecvActivation) -> None:
        key = (i.stage, i.mb)
        peer = self.worker(i.stage - 1, i.mb)
        if peer == self.rank:
            return  # passed in memory by this node's own SendActivation, earlier in the list
        spec = self.specs[self.parts[i.stage].start - 1]
        buf = self.p2p.recv_interruptible(spec.shape, spec.dtype, self.device, peer,
                                          (ACTIVATION, i.stage - 1, i.mb), self.interrupted,
                                          idle=lambda: self._frc_at_wait(s))
        s.inputs[key] = buf.requires_grad_(buf.is_floating_point())
        s.transfers.received_acts.add(key)

    def _send_grad(self, s: StepState, i: S.SendGrad) -> None:
        grad = s.in_grads[(i.stage, i.mb)]  # kept until sent: a failed send is retried
        peer = self.worker(i.stage - 1, i.mb)
        if peer != self.rank:
            key = (GRADIENT, i.stage, i.mb)
            if key not in s.transfers.peer_has:
                self.p2p.send(grad, peer, key)
                s.transfers.sent[key] = grad
            s.transfers.sent_grads[(i.stage, i.mb)] = grad
        elif not self.backward_begun(s, i.stage - 1, i.mb):
            s.out_grads[(i.stage - 1, i.mb)] = grad
        del s.in_grads[(i.stage, i.mb)]

    def _recv_grad(self, s: StepState, i: S.RecvGrad) -> None:
        peer = self.worker(i.stage + 1, i.mb)
        if peer == self.rank:
            return  # passed in memory by this node's own SendGrad
        spec = self.specs[self.parts[i.stage].stop - 1]
        s.out_grads[(i.stage, i.mb)] = self.p2p.recv_interruptible(
            spec.shape, spec.dtype, self.device, peer, (GRADIENT, i.stage + 1, i.mb),
            self.interrupted, idle=lambda: self._frc_at_wait(s))

    # -- results ----------------------------------------------------------------------------

    def _holds(self, pipeline: int, stage: int) -> bool:
        """Whether this node holds `stage` of `pipeline` now (a fault's target)."""
        return pipeline < self.roles.pipelines and stage < self.P and \
            self.roles.holders[pipeline][stage] == self.rank

    def held(self) -> list[StageState]:
        """Every stage this node holds state for: its primaries, then its replica."""
        return list(self.stages.values()) + ([self.replica] if self.replica is not None else [])
