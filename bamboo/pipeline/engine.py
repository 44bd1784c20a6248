"""The engine: one node's dispatcher over its stage's instruction list.

A node builds only its stage's layers, runs the schedule's instructions in order,
accumulates every micro-batch's parameter gradients in float64 (so the sum, and
the data-parallel all-reduce, give the same bits whatever the layout), clips by the
global gradient norm over all stages and applies one AdamW step.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from bamboo.data import Task
from bamboo.faults import FaultPlan
from bamboo.models import ModelPreset, boundary_shapes, build_layers, loss_fn
from bamboo.pipeline import schedule as S
from bamboo.pipeline.comm import ACTIVATION, GRADIENT, P2P, PeerLost, tag_for
from bamboo.pipeline.layout import Layout
from bamboo.pipeline.optim import clip_coefficient, learning_rate, make_optimizer

__all__ = ["StepReport", "StageEngine", "TrainingHyper"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingHyper:
    """The optimisation settings every stage shares."""

    lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    grad_clip: float


@dataclass(kw_only=True, slots=True)
class StepReport:
    """What one node tells the coordinator after a step."""

    step: int
    rank: int
    pipeline: int
    stage: int
    losses: list[tuple[int, float, float]] = field(default_factory=list)
    """(global micro-batch, mean loss, weight) for each micro-batch this node ended."""
    grad_norm: float = 0.0
    lr: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    reduce_s: float = 0.0
    optim_s: float = 0.0
    step_s: float = 0.0
    bytes_sent: int = 0


class StageEngine:
    """Runs stage `layout.role(rank).stage` of its pipeline, one step at a time."""

    def __init__(self, *, preset: ModelPreset, parts: Sequence[range], layout: Layout, rank: int,
                 task: Task, hyper: TrainingHyper, seed: int, device: torch.device,
                 dp_group: dist.ProcessGroup | None, norm_group: dist.ProcessGroup | None,
                 faults: FaultPlan | None = None) -> None:
        role = layout.role(rank)
        assert role.stage is not None and role.pipeline is not None, "a standby runs no engine"
        self.rank, self.stage, self.pipeline = rank, role.stage, role.pipeline
        self.layout, self.task, self.hyper, self.device = layout, task, hyper, device
        self.dp_group, self.norm_group = dp_group, norm_group
        self.faults = faults or FaultPlan([])
        self.layer_indices = parts[self.stage]
        self.num_layers = preset.layers
        self.module = nn.Sequential(*build_layers(preset, self.layer_indices, seed, device))
        self.module.train()
        self.loss = loss_fn(preset)
        self.optimizer = make_optimizer(self.module, lr=hyper.lr, weight_decay=hyper.weight_decay)
        self._init_grad_buffer()
        self.global_mbs = layout.micro_batches(self.pipeline)
        self.weight = 1.0 / layout.global_micro_batches
        self.schedule = S.one_f_one_b(self.stage, layout.stages, len(self.global_mbs))
        specs = boundary_shapes(preset, task.micro_batch_size)
        self.in_spec = specs[self.layer_indices.start - 1] if self.stage > 0 else None
        self.out_spec = specs[self.layer_indices.stop - 1]
        self.p2p = P2P()
        self._dispatch: dict[type, Callable[[S.Instruction], None]] = {
            S.Forward: self._forward, S.Backward: self._backward,
            S.SendActivation: self._send_activation, S.RecvActivation: self._recv_activation,
            S.SendGrad: self._send_grad, S.RecvGrad: self._recv_grad,
            S.ReduceGrads: self._reduce, S.OptimizerStep: self._optimizer_step,
        }

    def _init_grad_buffer(self) -> None:
        self.params = [p for p in self.module.parameters()]
        total = sum(p.numel() for p in self.params)
        self.flat_grad = torch.zeros(total, dtype=torch.float64, device=self.device)
        self.grad_views, self.layer_spans, offset = [], [], 0
        for layer_index, layer in zip(self.layer_indices, self.module):
            start = offset
            for p in layer.parameters():
                self.grad_views.append(self.flat_grad[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            self.layer_spans.append((layer_index, start, offset))

    # -- one step -------------------------------------------------------------------------

    def run_step(self, step: int) -> StepReport:
        """Execute the whole instruction list of `step`."""
        self._step = step
        self._report = StepReport(step=step, rank=self.rank, pipeline=self.pipeline,
                                  stage=self.stage)
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._input_grads: dict[int, torch.Tensor] = {}
        self._received_grads: dict[int, torch.Tensor] = {}
        self.p2p.wait_s, self.p2p.bytes_sent = 0.0, 0
        start = time.perf_counter()
        seen_forward = False
        for index, instr in enumerate(self.schedule):
            self._dispatch[type(instr)](instr)
            is_forward = isinstance(instr, S.Forward)
            self.faults.check(step, index, is_forward, seen_forward)
            seen_forward |= is_forward
        r = self._report
        r.step_s = time.perf_counter() - start
        r.wait_s += self.p2p.wait_s
        r.bytes_sent = self.p2p.bytes_sent
        return r

    def _timed_compute(self, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        fn()
        self._report.compute_s += time.perf_counter() - start

    def _forward(self, instr: S.Forward) -> None:
        g = self.global_mbs[instr.mb]

        def run() -> None:
            if self.stage == 0:
                x = self.task.batch(self._step, g).inputs.to(self.device)
            else:
                x = self._inputs[instr.mb]
            out = self.module(x)
            if self.stage == self.layout.stages - 1:
                targets = self.task.batch(self._step, g).targets.to(self.device)
                loss = self.loss(out, targets)
                self._report.losses.append((g, float(loss.detach()), self.weight))
                out = loss * self.weight
            self._outputs[instr.mb] = out
        self._timed_compute(run)

    def _backward(self, instr: S.Backward) -> None:
        def run() -> None:
            out = self._outputs.pop(instr.mb)
            if self.stage == self.layout.stages - 1:
                out.backward()
            else:
                torch.autograd.backward(out, grad_tensors=self._received_grads.pop(instr.mb))
            if self.stage > 0:
                self._input_grads[instr.mb] = self._inputs.pop(instr.mb).grad
            for view, p in zip(self.grad_views, self.params):
                if p.grad is not None:
                    view.add_(p.grad)
                    p.grad = None
        self._timed_compute(run)

    def _peer(self, stage: int) -> int:
        return self.layout.rank(self.pipeline, stage)

    def _send_activation(self, instr: S.SendActivation) -> None:
        out = self._outputs[instr.mb].detach()
        self.p2p.send(out, self._peer(instr.stage + 1), tag_for(ACTIVATION, instr.stage, instr.mb))

    def _recv_activation(self, instr: S.RecvActivation) -> None:
        assert self.in_spec is not None
        buf = torch.empty(self.in_spec.shape, dtype=self.in_spec.dtype, device=self.device)
        self.p2p.recv(buf, self._peer(instr.stage - 1), tag_for(ACTIVATION, instr.stage - 1, instr.mb))
        self._inputs[instr.mb] = buf.requires_grad_(buf.is_floating_point())

    def _send_grad(self, instr: S.SendGrad) -> None:
        grad = self._input_grads.pop(instr.mb)
        self.p2p.send(grad, self._peer(instr.stage - 1), tag_for(GRADIENT, instr.stage, instr.mb))

    def _recv_grad(self, instr: S.RecvGrad) -> None:
        buf = torch.empty(self.out_spec.shape, dtype=self.out_spec.dtype, device=self.device)
        self.p2p.recv(buf, self._peer(instr.stage + 1), tag_for(GRADIENT, instr.stage + 1, instr.mb))
        self._received_grads[instr.mb] = buf

    def _reduce(self, instr: S.ReduceGrads) -> None:
        self.p2p.flush()
        start = time.perf_counter()
        if self.dp_group is not None:
            try:
                dist.all_reduce(self.flat_grad, group=self.dp_group)
            except RuntimeError as e:
                raise PeerLost(f"gradient all-reduce of stage {self.stage} failed: {e}") from e
        self._report.reduce_s += time.perf_counter() - start

    def _global_norm(self) -> float:
        """sqrt of the sum over all layers of squared gradients, summed in layer order.

        Each layer's sum is computed by its holder in pipeline 0 and the per-layer sums
        are added in layer order, so every layout gets the same bits.
        """
        per_layer = torch.zeros(self.num_layers, dtype=torch.float64, device=self.device)
        if self.pipeline == 0:
            for layer_index, start, end in self.layer_spans:
                per_layer[layer_index] = self.flat_grad[start:end].square().sum()
        if self.norm_group is not None:
            try:
                dist.all_reduce(per_layer, group=self.norm_group)
            except RuntimeError as e:
                raise PeerLost(f"global-norm all-reduce failed: {e}") from e
        return float(per_layer.sum().sqrt())

    def _optimizer_step(self, instr: S.OptimizerStep) -> None:
        start = time.perf_counter()
        norm = self._global_norm()
        self._report.reduce_s += time.perf_counter() - start
        start = time.perf_counter()
        coef = clip_coefficient(norm, self.hyper.grad_clip)
        if coef != 1.0:
            self.flat_grad.mul_(coef)
        for view, p in zip(self.grad_views, self.params):
            p.grad = view.to(torch.float32)
        h = self.hyper
        lr = learning_rate(self._step, peak=h.lr, warmup=h.warmup_steps, total=h.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.flat_grad.zero_()
        self._report.grad_norm, self._report.lr = norm, lr
        self._report.optim_s += time.perf_counter() - start

    # -- results --------------------------------------------------------------------------

    def parameters_by_layer(self) -> list[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """(layer index, [(name, float32 CPU tensor)]) for every layer this node holds."""
        return [(i, [(n, p.detach().to("cpu", torch.float32).clone())
                     for n, p in layer.named_parameters()])
                for i, layer in zip(self.layer_indices, self.module)]
