"""The pause a durable checkpoint adds to training: a real `bamboo train` run that saves a
checkpoint every K steps, step wall times from its events.jsonl.

A checkpoint is requested at the boundary after step c (c + 1 a multiple of K). Its cost
shows in the steps from c until the step during which the coordinator's `checkpoint`
event (the checkpoint is whole and published) is written: the window. The pause of one
checkpoint = the sum over its window of (step wall time - median of the clean steps),
the clean steps being every step outside any window (step 0, the warm-up, excluded).

Whatever path the code under test takes is measured: before holder-written checkpoints,
every holder sent its layers to the coordinator, which wrote them; after, every holder
writes its own layers on a background thread and the coordinator writes the manifest.

    .venv/bin/python benchmarks/checkpoint_pause.py                      # gpt2-small
    .venv/bin/python benchmarks/checkpoint_pause.py --model gpt2-tiny --steps 13
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bamboo.data.sizing import SIZING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def default_model() -> str:
    """gpt2-small when the presets have it, else the largest preset."""
    from bamboo.config.presets import PRESETS, preset
    from bamboo.model import layer_param_counts
    if "gpt2-small" in PRESETS:
        return "gpt2-small"
    return max(PRESETS, key=lambda name: sum(layer_param_counts(preset(name))))


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args: argparse.Namespace, out: Path) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.nodes), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
           "--redundancy", args.redundancy, "--checkpoint-every", str(args.every),
           "--threads", str(args.threads), "--comm-timeout", "600",
           "--no-report", "--json", "--quiet", "--out", str(out)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return read_events(out / "events.jsonl"), took


def pauses(args: argparse.Namespace, ev: list[dict]) -> dict:
    steps = {e["step"]: e for e in ev if e["event"] == "step_done"}
    published = sorted((e["step"], e["t"], e.get("took_s")) for e in ev
                       if e["event"] == "checkpoint")
    boundaries = [c for c in range(args.steps) if (c + 1) % args.every == 0 and c + 1 < args.steps]
    windows = {}
    for c in boundaries:
        done = next((t for s, t, _ in published if s == c + 1), None)
        if done is None:
            raise SystemExit(f"checkpoint of step {c + 1} was never published: {published}")
        # The window: from step c to the first step that ended after the publication.
        last = next((k for k in range(c, args.steps) if steps[k]["t"] >= done), args.steps - 1)
        windows[c] = list(range(c, last + 1))
    busy = {k for w in windows.values() for k in w}
    clean = [steps[k]["wall_s"] for k in range(1, args.steps) if k not in busy]
    if not clean:
        raise SystemExit("no clean step left to compare with: use more --steps or a larger --every")
    median = statistics.median(clean)
    per = {c + 1: sum(steps[k]["wall_s"] - median for k in w) for c, w in windows.items()}
    # Against the nearest clean steps (two before, two after): step times drift in a run.
    local = {}
    for c, w in windows.items():
        near = [k for k in range(w[0] - 2, w[0]) if k >= 1 and k not in busy] + \
            [k for k in range(w[-1] + 1, w[-1] + 3) if k < args.steps and k not in busy]
        base = statistics.mean(steps[k]["wall_s"] for k in near) if near else median
        local[c + 1] = sum(steps[k]["wall_s"] - base for k in w)
    took = {s: took_s for s, _, took_s in published}
    return {"median_s": median, "stdev_s": statistics.stdev(clean) if len(clean) > 1 else 0.0,
            "clean": len(clean), "windows": windows, "pause_s": per, "local_s": local,
            "took_s": took, "walls": {k: steps[k]["wall_s"] for k in sorted(steps)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default gpt2-small (else the largest preset)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--every", type=int, default=3, help="--checkpoint-every")
    ap.add_argument("--redundancy", default="off")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=1, help="runs (pauses pooled)")
    ap.add_argument("--out", help="keep run directories here (default: a temporary one)")
    ap.add_argument("--from-runs", metavar="DIR", help="do not train: analyse the run-*/ "
                    "folders an earlier invocation left in DIR (its --out), with the same flags")
    args = ap.parse_args()
    args.model = args.model or default_model()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="checkpoint-pause-"))
    root.mkdir(parents=True, exist_ok=True)
    from bamboo.config.presets import preset
    from bamboo.model import layer_param_counts
    params = sum(layer_param_counts(preset(args.model, SIZING)))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; model "
          f"{args.model} ({params / 1e6:.1f} M parameters, state {3 * params * 4 / 1e9:.2f} GB "
          f"with AdamW), {args.nodes} workers, {args.stages} stages, M={args.micro_batches}, "
          f"B={args.micro_batch_size}, redundancy {args.redundancy}, {args.steps} steps, "
          f"checkpoint every {args.every}")
    all_pauses, all_local = [], []
    runs = sorted(Path(args.from_runs).glob("run-*")) if args.from_runs else \
        [root / f"run-{rep}" for rep in range(args.reps)]
    for out in runs:
        if args.from_runs:
            ev, took = read_events(out / "events.jsonl"), float("nan")
        else:
            ev, took = run(args, out)
        p = pauses(args, ev)
        print(f"{out.name}: " + (f"{took:.1f} s; " if took == took else "") +
              f"median clean step {p['median_s']:.3f} s (stdev "
              f"{p['stdev_s']:.3f} s over {p['clean']} steps)")
        print("  step wall s: " + ", ".join(f"{k}:{w:.2f}" for k, w in p["walls"].items()))
        for step, pause in p["pause_s"].items():
            took_s = p["took_s"].get(step)
            print(f"  checkpoint of step {step}: window steps {p['windows'][step - 1]}, pause "
                  f"{pause:+.3f} s ({pause / p['median_s']:+.2f} steps) against the median, "
                  f"{p['local_s'][step]:+.3f} s against the nearest clean steps; coordinator's "
                  f"checkpoint event took_s {took_s}")
            all_pauses.append(pause)
            all_local.append(p["local_s"][step])
    print(f"checkpoint pause against the median clean step: mean "
          f"{statistics.mean(all_pauses):+.3f} s, median {statistics.median(all_pauses):+.3f} s; "
          f"against the nearest clean steps: mean {statistics.mean(all_local):+.3f} s, median "
          f"{statistics.median(all_local):+.3f} s (over {len(all_pauses)} checkpoints)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
