"""One stage a node holds: its layers, optimizer and float64 gradient sum.

The same class serves a primary stage and a replica: a replica applies the same
reduced gradient with the same optimizer step, so it stays bit-identical to the
primary without shipping parameters or optimizer state.
"""
from __future__ import annotations


import torch
from torch import nn

from bamboo.models import ModelPreset, build_layers
from bamboo.pipeline.optim import make_optimizer

__all__ = ["StageState"]


class StageState:
    """Stage `stage` (layers `layer_indices`) on this node."""

    def __init__(self, *, preset: ModelPreset, stage: int, layer_indices: range, seed: int,
                 device: torch.device, lr: float, weight_decay: float) -> None:
        self.stage, self.layer_indices, self.device = stage, layer_indices, device
        self.module = nn.Sequential(*build_layers(preset, layer_indices, seed, device))
        self.module.train()
        self.optimizer = make_optimizer(self.module, lr=lr, weight_decay=weight_decay)
        self.params = list(self.module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.grad_sum = torch.zeros(self.numel, dtype=torch.float64, device=device)
        self._views = self._split(self.grad_sum)
        self.layer_spans: list[tuple[int, int, int]] = []
        offset = 0
        for layer_index, layer in zip(layer_indices, self.module):
            size = sum(p.numel() for p in layer.parameters())
            self.layer_spans.append((layer_index, offset, offset + size))
            offset += size

    def _split(self, flat: torch.Tensor,
               params: list[nn.Parameter] | None = None) -> list[torch.Tensor]:
        """Views of `flat` shaped like `params` (default: all of the stage's), in order."""
        views, offset = [], 0
        for p in self.params if params is None else params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def accumulate(self) -> None:
        """Add this micro-batch's parameter gradients to the float64 sum."""
        for view, p in zip(self._views, self.params):
            if p.grad is not None:
                view.add_(p.grad)
                p.grad = None

    def layer_sq_norms(self, reduced: torch.Tensor) -> list[tuple[int, float]]:
        """(layer index, sum of squares) of a reduced float64 gradient of this stage."""
        return [(i, float(reduced[a:b].square().sum())) for i, a, b in self.layer_spans]

    def apply(self, grad32: torch.Tensor, coef: float, lr: float) -> None:
        """One optimizer step with the reduced gradient `grad32` (float32) scaled by `coef`."""
        grad = grad32 * coef if coef != 1.0 else grad32
        for view, p in zip(self._split(grad), self.params):
            p.grad = view
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def reset_grads(self) -> None:
        self.grad_sum.zero_()
        for p in self.params:
            p.grad = None

    # -- state transfer (peer restore, reconfiguration, checkpoints) -------------------------

    def state_vector(self) -> torch.Tensor:
        """The whole stage's state: its layers' `layer_state` vectors, in layer order."""
        return torch.cat([self.layer_state(i).to(self.device) for i in self.layer_indices])

    def state_size(self) -> int:
        return sum(3 * (b - a) + 1 for _, a, b in self.layer_spans)

    def load_state_vector(self, vector: torch.Tensor) -> None:
        offset = 0
        for i, a, b in self.layer_spans:
            size = 3 * (b - a) + 1
            self.load_layer_state(i, vector[offset:offset + size])
            offset += size

    def _layer_params(self, layer_index: int) -> list[torch.nn.Parameter]:
        position = self.layer_indices.index(layer_index)
        return list(self.module[position].parameters())

    def layer_state(self, layer_index: int) -> torch.Tensor:
        """One layer's parameters, AdamW moments and step count as a float32 CPU vector
        (the unit a reconfiguration moves and a checkpoint stores: layers, not stages,
        since the partition may change)."""
        params = self._layer_params(layer_index)
        state = self.optimizer.state
        parts = [torch.cat([p.detach().reshape(-1) for p in params])]
        for key in ("exp_avg", "exp_avg_sq"):
            parts.append(torch.cat([state[p][key].reshape(-1) if p in state
                                    else torch.zeros(p.numel(), device=self.device)
                                    for p in params]))
        steps = float(state[params[0]]["step"]) if params[0] in state else 0.0
        parts.append(torch.tensor([steps], dtype=torch.float32, device=self.device))
        return torch.cat(parts).to("cpu", torch.float32)

    def load_layer_state(self, layer_index: int, vector: torch.Tensor) -> None:
        params = self._layer_params(layer_index)
        n = sum(p.numel() for p in params)
        if vector.numel() != 3 * n + 1:
            raise ValueError(f"layer {layer_index}: state of {vector.numel()} values, expected "
                             f"{3 * n + 1} (a different model or layer)")
        vector = vector.to(self.device, torch.float32)
        with torch.no_grad():
            for view, p in zip(self._split(vector[:n], params), params):
                p.copy_(view)
        steps = float(vector[3 * n])
        for p, a, b in zip(params, self._split(vector[n:2 * n], params),
                           self._split(vector[2 * n:3 * n], params)):
            if steps == 0:
                self.optimizer.state.pop(p, None)
            else:
                self.optimizer.state[p] = {"step": torch.tensor(steps, dtype=torch.float32),
                                           "exp_avg": a.clone(), "exp_avg_sq": b.clone()}

    def digest(self) -> str:
        """sha256 of the parameters' float32 bytes (replica checks)."""
        import hashlib
        sha = hashlib.sha256()
        for p in self.params:
            sha.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return sha.hexdigest()

    def parameters_by_layer(self) -> list[tuple[int, list[tuple[str, torch.Tensor]]]]:
        return [(i, [(n, p.detach().to("cpu", torch.float32).clone())
                     for n, p in layer.named_parameters()])
                for i, layer in zip(self.layer_indices, self.module)]
