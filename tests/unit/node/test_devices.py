"""Devices without a GPU: which GPU a worker takes (slots, LOCAL_RANK, the visible count),
the local launcher's slot allocation, TF32, the AdamW implementation per device (and that
the CPU's foreach path is bit-identical to the per-tensor loop whatever the stage split),
and benchmarks/gpu_check.py's no-GPU answer.

Its tests that start processes: tests/integration/test_devices_runs.py."""
from __future__ import annotations

import importlib.util
import random
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bamboo.config import JobConfig
from bamboo.config.presets import preset
from bamboo.engine.optim import adamw_options, make_optimizer, steps_on_param_device
from bamboo.launch.local import LocalWorkers, free_device_slot
from bamboo.model import build_layers
from bamboo.node.devices import choose_device_index, configure_tf32
from bamboo.node.devices import worker_device as _device
from bamboo.protocol.launch import Started, WorkerSpec
from bamboo.protocol.messages import Progress

REPO = Path(__file__).resolve().parents[3]


# -- which GPU ----------------------------------------------------------------------------------

def test_slot_picks_the_gpu_and_distinct_slots_get_distinct_gpus() -> None:
    assert [choose_device_index(k, None, 4) for k in range(4)] == [0, 1, 2, 3]
    assert choose_device_index(None, None, 4) == 0
    # More live workers than GPUs: they wrap around (and only then share one).
    assert [choose_device_index(k, None, 2) for k in range(4)] == [0, 1, 0, 1]


def test_local_rank_wins_over_the_slot() -> None:
    assert choose_device_index(0, "3", 4) == 3
    assert choose_device_index(5, "1", 8) == 1
    assert choose_device_index(2, "", 4) == 2  # set but empty: ignored
    assert choose_device_index(2, " ", 4) == 2
    assert choose_device_index(0, "5", 4) == 1  # past the visible devices: wraps
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        choose_device_index(0, "gpu0", 4)
    with pytest.raises(ValueError, match="negative"):
        choose_device_index(0, "-1", 4)


def test_no_visible_gpu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match="no GPU is visible.*CUDA_VISIBLE_DEVICES=''"):
        choose_device_index(0, None, 0)


class _FakeCuda:
    """torch.cuda as seen by `_device` on a machine with `count` visible GPUs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        self.chosen: list[int] = []
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "set_device", self.chosen.append)


@pytest.fixture
def tf32_flags():
    """Restores torch's TF32 switches after a test that sets them."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_device_uses_the_slot_not_the_node(monkeypatch: pytest.MonkeyPatch, tf32_flags) -> None:
    cuda = _FakeCuda(monkeypatch, 2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = JobConfig.of(device="cuda")
    assert _device(cfg, 7, 1) == (torch.device("cuda", 1), "nccl")  # node 7, slot 1
    assert _device(cfg, 6, None) == (torch.device("cuda", 0), "nccl")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _device(cfg, 0, 0) == (torch.device("cuda", 1), "nccl")
    assert cuda.chosen == [1, 0, 1]


def test_device_cpu_and_auto_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda(monkeypatch, 0)
    assert _device(JobConfig.of(device="cpu"), 0, 3) == (torch.device("cpu"), "gloo")
    assert _device(JobConfig.of(device="auto"), 0, 3) == (torch.device("cpu"), "gloo")
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        _device(JobConfig.of(device="cuda"), 0, 0)


def test_tf32_on_unless_exact(monkeypatch: pytest.MonkeyPatch, tf32_flags) -> None:
    assert configure_tf32(exact=False) is True
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert configure_tf32(exact=True) is False
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    _FakeCuda(monkeypatch, 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    _device(JobConfig.of(device="cuda"), 0, 0)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    _device(JobConfig.of(device="cuda", exact=True), 0, 0)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


# -- the local launcher's slots -----------------------------------------------------------------

def test_free_device_slot() -> None:
    # No GPU count (CPU workers): the lowest free slot.
    assert free_device_slot([]) == 0
    assert free_device_slot([0, 1, 2]) == 3
    assert free_device_slot([0, 2, 3]) == 1
    assert free_device_slot({5, 1}, 0) == 0
    # With 4 GPUs: the least used GPU, through a slot no one holds.
    assert free_device_slot([0, 1, 2], 4) == 3
    assert free_device_slot([0, 1, 3], 4) == 2
    assert free_device_slot([0, 1, 2, 3], 4) == 4  # all busy: GPU 0 again, slot 4
    assert free_device_slot([0, 1, 2, 3, 4], 4) == 5  # GPU 0 has two: GPU 1, slot 5
    assert free_device_slot([1, 3, 5, 2], 4) == 0  # GPU 0 has nobody
    assert free_device_slot([1, 2], 2) == 0  # both GPUs busy: GPU 0, through free slot 0


class _FakeProcess:
    pids = iter(range(10_000, 20_000))

    def __init__(self, target, args, name) -> None:
        self.spec = args[0]
        self.pid = next(self.pids)
        self.exitcode: int | None = None
        self.sentinel = -1

    def start(self) -> None:
        pass

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        pass


class _FakeContext:
    Process = _FakeProcess

    @staticmethod
    def Pipe(duplex: bool = False):
        end = SimpleNamespace(close=lambda: None)
        return end, end


def _launcher(monkeypatch: pytest.MonkeyPatch, gpus: int) -> Callable[[], Started]:
    """Starts of local workers as fake processes, on a machine with `gpus` visible GPUs
    (0: CPU workers)."""
    from bamboo.node import forkserver
    monkeypatch.setattr(forkserver, "context", lambda: _FakeContext)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    launcher = LocalWorkers()
    cfg = JobConfig.of(device="cuda" if gpus else "cpu", out="run")
    nodes = iter(range(10_000))
    heartbeats = Progress(None, None)

    def start() -> Started:
        spec = WorkerSpec(node=next(nodes), slot=0, first_gen=0, store_host="127.0.0.1",
                          store_port=1, config=cfg)
        return launcher.start(spec, heartbeats)
    return start


def _ended(n: Started) -> None:
    n.process.process.exitcode = 0  # type: ignore[attr-defined]  # the local handle's process


def _spec(n: Started) -> WorkerSpec:
    return n.process.process.spec  # type: ignore[attr-defined]  # the fake process keeps it


def test_replacement_takes_the_free_slot_not_node_mod_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    start = _launcher(monkeypatch, 0)
    nodes = [start() for _ in range(4)]
    assert [_spec(n).device_index for n in nodes] == [0, 1, 2, 3]
    assert [n.device_slot for n in nodes] == [0, 1, 2, 3]
    _ended(nodes[2])  # n2 ended: its GPU is free
    n4 = start()
    assert _spec(n4).node == 4 and _spec(n4).device_index == 2  # not 4 % 4 == 0
    n5 = start()
    assert _spec(n5).device_index == 4  # all of 0..3 live: the next one
    # SIGKILL already sent (a fence, a checkpoint-restart): the slot goes to the new one.
    nodes[0].process.kill()
    assert start().device_slot == 0
    # n1 with a notice (its SIGKILL comes later, never sent yet): it still trains and
    # drains, and keeps its slot.
    assert start().device_slot == 5


def test_gpus_of_a_local_run(monkeypatch: pytest.MonkeyPatch) -> None:
    start = _launcher(monkeypatch, 2)
    nodes = [start() for _ in range(3)]
    assert [n.device_slot for n in nodes] == [0, 1, 2]  # GPUs 0, 1, 0
    _ended(nodes[1])
    n3 = start()  # GPU 1 is free: slot 1 again, not 3 (GPU 1 too)
    assert n3.device_slot == 1 and _spec(n3).device_index == 1
    _ended(nodes[0])
    assert start().device_slot == 0


@pytest.mark.parametrize("gpus", [0, 1, 3, 4])
def test_never_two_live_workers_on_one_slot_nor_on_a_gpu_while_one_is_free(
        monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    """Random starts and ends of local workers: live workers' slots stay distinct; a new
    worker gets a GPU no live worker uses while there is one; and a run that never has
    more live workers than GPUs never puts two on one GPU."""
    start = _launcher(monkeypatch, gpus)
    rng = random.Random(gpus)
    live: list[Started] = []
    peak = 0
    for _ in range(400):
        if live and (rng.random() < 0.45 or len(live) >= 6):
            _ended(live.pop(rng.randrange(len(live))))
            continue
        before = {choose_device_index(n.device_slot, None, gpus) for n in live} if gpus else set()
        n = start()
        live.append(n)
        peak = max(peak, len(live))
        slots = [m.device_slot for m in live]
        assert len(set(slots)) == len(slots)
        assert _spec(n).device_index == n.device_slot
        if not gpus:
            continue
        gpu = choose_device_index(n.device_slot, None, gpus)
        if len(before) < gpus:
            assert gpu not in before
        if peak <= gpus:
            assert len({choose_device_index(s, None, gpus) for s in slots}) == len(slots)


# -- the AdamW implementation ---------------------------------------------------------------------

def test_adamw_options_per_device() -> None:
    assert adamw_options({"cuda"}) == {"fused": True}
    assert adamw_options({"cpu"}) == {"foreach": True}
    assert adamw_options(set()) == {"foreach": True}
    assert adamw_options({"cpu", "cuda"}) == {"foreach": False}
    assert adamw_options({"mps"}) == {"foreach": False}
    opt = make_optimizer(nn.Linear(3, 2), lr=1e-3, weight_decay=0.01)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_fused_step_counts_move_to_the_parameters_device() -> None:
    """State loaded from a state vector has a CPU step; the fused kernel wants it on the
    parameter's device ("meta" plays the GPU here)."""
    p = nn.Parameter(torch.empty(3, device="meta"))
    q = nn.Parameter(torch.zeros(3))
    opt = SimpleNamespace(state={p: {"step": torch.tensor(4.0), "exp_avg": None},
                                 q: {"step": torch.tensor(2.0)}})
    steps_on_param_device(opt, (), {})  # type: ignore[arg-type]  # a stand-in optimizer
    assert opt.state[p]["step"].device.type == "meta"
    assert opt.state[p]["step"].dtype == torch.float32
    assert opt.state[q]["step"].device.type == "cpu"


def _train_split(split: list[range], foreach_reference: bool) -> list[torch.Tensor]:
    """A few AdamW steps of gpt2-tiny's layers held as stages `split` (one optimizer per
    stage, from make_optimizer), or as one per-tensor-loop AdamW (`foreach_reference`);
    the same gradient for each parameter whatever the split. Returns every parameter and
    AdamW moment, in model order."""
    p = preset("gpt2-tiny")
    stages = [nn.Sequential(*build_layers(p, r, seed=0)) for r in split]
    if foreach_reference:
        whole = nn.Sequential(*stages)
        params = list(whole.parameters())
        optimizers = [torch.optim.AdamW(
            [{"params": [q for q in params if q.dim() >= 2], "weight_decay": 0.01},
             {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)]
    else:
        optimizers = [make_optimizer(s, lr=3e-3, weight_decay=0.01) for s in stages]
        assert all(o.defaults["foreach"] for o in optimizers)
    params = [q for s in stages for q in s.parameters()]
    for step in range(4):
        if step == 2:  # the state reloaded as StageState.load_layer_state sets it
            for o in optimizers:
                for q, st in list(o.state.items()):
                    o.state[q] = {"step": torch.tensor(float(st["step"]), dtype=torch.float32),
                                  "exp_avg": st["exp_avg"].clone(),
                                  "exp_avg_sq": st["exp_avg_sq"].clone()}
        gen = torch.Generator().manual_seed(step)
        for i, q in enumerate(params):
            scale = 10.0 ** ((i % 7) - 4)
            q.grad = torch.randn(q.shape, generator=gen) * scale
        for o in optimizers:
            for group in o.param_groups:
                group["lr"] = 3e-3 * (step + 1) / 4
            o.step()
    state = {q: o.state[q] for o in optimizers for q in o.state}
    assert len(state) == len(params)
    return [t for q in params
            for t in (q.detach(), state[q]["exp_avg"], state[q]["exp_avg_sq"])]


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_foreach_is_bit_identical_to_the_loop_for_every_split(threads: int) -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reference = _train_split([range(0, 8)], foreach_reference=True)
        for split in ([range(0, 8)], [range(0, 3), range(3, 8)],
                      [range(0, 1), range(1, 2), range(2, 6), range(6, 8)]):
            got = _train_split(split, foreach_reference=False)
            assert len(got) == len(reference)
            assert all(torch.equal(a, b) for a, b in zip(got, reference)), split
    finally:
        torch.set_num_threads(saved)


# -- benchmarks/gpu_check.py ----------------------------------------------------------------------

def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]  # the spec of a file always has a loader
    return module


def test_gpu_check_layouts_and_comparisons() -> None:
    gc = _gpu_check()
    def layouts(gpus: int, nodes: int, shared: str) -> list[tuple]:
        return [(x.nodes, x.kill_stage, x.backend) for x in gc.plan_layouts(gpus, nodes, shared)]

    assert gc.plan_layouts(4, 4, "auto") == [gc.Layout(4, 2, "", "nccl")]
    assert gc.plan_layouts(8, 4, "never") == [gc.Layout(4, 2, "", "nccl")]
    one = gc.plan_layouts(1, 4, "auto")  # the shared layout over gloo; no 1-worker NCCL run
    assert [(x.nodes, x.kill_stage, x.backend) for x in one] == [(4, 2, "gloo")]
    assert "Duplicate GPU" in one[0].note and "sharing 1 GPU" in one[0].note
    assert layouts(2, 4, "auto") == [(4, 2, "gloo"), (2, 1, "nccl")]
    assert layouts(3, 4, "auto") == [(4, 2, "gloo"), (3, 2, "nccl")]
    assert layouts(2, 4, "never") == [(2, 1, "nccl")]
    assert layouts(1, 4, "never") == [(1, None, "nccl")]
    assert layouts(1, 4, "always") == [(4, 2, "gloo")]
    assert layouts(4, 4, "always") == [(4, 2, "gloo")]
    assert gc.compare_losses([1.0, 2.0], [1.0, 2.01], 1e-2)[0]
    assert not gc.compare_losses([1.0, 2.0], [1.0, 2.5], 1e-2)[0]
    assert not gc.compare_losses([1.0], [1.0, 2.0], 1e-2)[0]
    assert not gc.compare_losses(None, [1.0], 1e-2)[0]
    assert gc.memory_lines({"memory_per_node_bytes": [2**20, 2**21]}) == [
        "memory_per_node_bytes [0]: 1.0 MiB", "memory_per_node_bytes [1]: 2.0 MiB"]
    assert gc.memory_lines({"memory_per_node_bytes": {"n0": 2**20}}) == [
        "memory_per_node_bytes n0: 1.0 MiB"]
    assert gc.memory_lines({"losses": [], "host_memory_per_node_bytes": [0, 2**20],
                            "memory_nodes": ["n0", "n4"]}) == [
        "host_memory_per_node_bytes n0: 0.0 MiB", "host_memory_per_node_bytes n4: 1.0 MiB"]
    assert "missing" in gc.memory_lines({"losses": []})[0]
