"""One worker's step under Bamboo against the same step in a plain PyTorch loop, on one device.

The same model preset, micro-batches, micro-batch size, data, AdamW, one torch thread and
(on CUDA) TF32 matmuls; Bamboo through
`bamboo train --nodes 1 --stages 1` (its workers, its coordinator, its step report), the
plain loop in this process (forward and backward of each micro-batch, clipping, AdamW).
Prints both median step times (first steps excluded), their ratio, and Bamboo's own split
of its step (compute, optimizer, the sum, the rest) from its events: what a node spends
outside the model's own work, which on a fast accelerator is most of a small model's step.

    .venv/bin/python benchmarks/gpu_overhead.py --device cuda      # on a GPU machine
    .venv/bin/python benchmarks/gpu_overhead.py --device cpu --steps 20   # the harness here
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.peers.job import Job, Parts  # noqa: E402 (after sys.path is set)

from bamboo.engine.optim import make_optimizer  # noqa: E402 (after sys.path is set)
from bamboo.node.devices import configure_tf32  # noqa: E402 (after sys.path is set)


def plain_steps(args: argparse.Namespace) -> list[float]:
    """Seconds of each step of the plain loop (the device synchronized at each end)."""
    device = torch.device(args.device)
    parts = Parts(Job(model=args.model, steps=args.steps, micro_batches=args.micro_batches,
                      micro_batch_size=args.micro_batch_size, workers=1))
    model = parts.model.to(device)
    if device.type == "cuda":
        configure_tf32(exact=False)  # as a Bamboo worker without --exact: TF32 matmuls
    optimizer = make_optimizer(model, lr=3e-4, weight_decay=0.01, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for step in range(args.steps):
        sync()
        start = time.perf_counter()
        parts.share_loss(model, step, 0, 1, device)  # every micro-batch, each loss read back
        parts.clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
    return times


def bamboo_steps(args: argparse.Namespace, out: Path) -> tuple[list[float], dict[str, float]]:
    """Seconds of each of Bamboo's steps (step_done's wall_s) and the median of each of its
    node timers."""
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model, "--nodes", "1",
           "--stages", "1", "--micro-batches", str(args.micro_batches), "--micro-batch-size",
           str(args.micro_batch_size), "--steps", str(args.steps), "--device", args.device,
           "--json", "--quiet", "--no-report", "--out", str(out), *args.bamboo_flags]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=args.timeout)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"gpu_overhead: bamboo train failed (exit {proc.returncode}): {last}")
    walls, timers = [], {}
    for line in (out / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("event") == "step_done" and event["step"] >= args.warmup:
            walls.append(event["wall_s"])
            for k, v in event["nodes"][0].items():
                if k.endswith("_s"):
                    timers.setdefault(k, []).append(v)
    return walls, {k: statistics.median(v) for k, v in timers.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--bamboo-flags", nargs="*", default=[], help="more `bamboo train` flags")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_overhead: no CUDA device here; use --device cpu to check the harness")
        return 0
    if not 0 <= args.warmup < args.steps:
        raise SystemExit("need 0 <= --warmup < --steps")
    plain = plain_steps(args)[args.warmup:]
    with tempfile.TemporaryDirectory(prefix="gpu-overhead-") as tmp:
        walls, timers = bamboo_steps(args, Path(tmp))
    p, b = statistics.median(plain), statistics.median(walls)
    print(f"{args.model}, {args.micro_batches} x {args.micro_batch_size} samples a step, "
          f"{args.device}, steps {args.warmup}..{args.steps - 1}")
    print(f"plain PyTorch loop: {1e3 * p:.1f} ms a step")
    print(f"bamboo train (1 node): {1e3 * b:.1f} ms a step ({p / b:.2f}x the plain loop)")
    print("bamboo's node timers (medians): " + ", ".join(
        f"{k} {1e3 * v:.1f} ms" for k, v in sorted(timers.items()) if v))
    if args.json:
        Path(args.json).write_text(json.dumps({"plain_s": p, "bamboo_s": b, "timers": timers,
                                               "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
