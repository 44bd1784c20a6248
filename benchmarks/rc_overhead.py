"""Failure-free cost of redundant computation: eager and lazy RC against `--redundancy off`.

In one invocation:

1. runs `bamboo train` for off, lazy and eager, interleaved over `--reps`
   repetitions (the order rotates) so machine noise hits every mode alike, and takes
   the median step wall time after `--warmup` steps from each run's events.jsonl;
2. profiles each stage's forward, backward and optimizer step in this process (one
   thread, the engine's own StageState), and feeds those costs to the timeline model
   (`bamboo.plan.timeline`) for (a) one processor per node (a GPU per node) and
   (b) this machine's cores shared by all workers; it also shows the model on the
   costs as the eager runs' own timers saw them;
3. accounts memory per node from the runs' byte counters: parameters and AdamW state
   held (replica included), the float64 gradient sum, the activations 1F1B keeps in
   flight (stage s holds at most min(P - s, M) micro-batches), the stage outputs kept
   for the step (lazy and eager: the successor's input, which a shadow or FRC needs),
   and for eager the FRC activations kept the whole step. Tensor accounting, not
   process RSS.

    .venv/bin/python benchmarks/rc_overhead.py --steps 20 --reps 3

`eager` places each redundant forward where the node would wait (`--frc-at waits`, the
default); `eager-slot` runs it at its fixed slot (`--frc-at slot`). With `--pin-cpus auto`
and as many cores as stages, every worker has a processor of its own, so the pipeline's
bubbles are real idle time (as with a GPU per node):

    .venv/bin/python benchmarks/rc_overhead.py --model gpt2-mini --stages 2 \
        --micro-batches 2 --pin-cpus auto --steps 16 --reps 2
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

from bamboo.plan.timeline import Costs, compare  # noqa: E402 (after the path is set)
from bamboo.plan.timeline_text import render  # noqa: E402 (after sys.path is set)
from bamboo.run.measured import costs_from_events  # noqa: E402 (after sys.path is set)

MODES = ("off", "lazy", "eager", "eager-slot")
FLAGS = {"off": ["--redundancy", "off"], "lazy": ["--redundancy", "lazy"],
         "eager": ["--redundancy", "eager", "--frc-at", "waits"],
         "eager-slot": ["--redundancy", "eager", "--frc-at", "slot"]}


def run_train(args: argparse.Namespace, mode: str, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "bamboo", "train", "--model", args.model,
           "--nodes", str(args.stages), "--stages", str(args.stages),
           "--micro-batches", str(args.micro_batches),
           "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
           *FLAGS[mode], "--pin-cpus", args.pin_cpus, "--json", "--quiet", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def step_walls(events: list[dict], warmup: int) -> list[float]:
    return [e["wall_s"] for e in events if e["event"] == "step_done" and e["step"] >= warmup]


def early_late(events: list[dict], warmup: int) -> tuple[float, float]:
    """Median wall time of the first 3 steps after the warm-up, and of the last 3."""
    w = step_walls(events, warmup)
    return statistics.median(w[:3]), statistics.median(w[-3:])


def node_medians(events: list[dict], warmup: int) -> list[dict]:
    steps = [e for e in events if e["event"] == "step_done" and e["step"] >= warmup]
    out = []
    for i in range(len(steps[0]["nodes"])):
        rows = [s["nodes"][i] for s in steps]
        out.append({"node": rows[0]["node"], "stage": rows[0]["stages"][0]} |
                   {k: statistics.median(r[k] for r in rows)
                    for k in ("compute_s", "frc_s", "wait_s", "reduce_s", "optim_s", "step_s",
                              "saved_bytes", "frc_saved_bytes", "state_bytes", "bytes_replica",
                              "frc_forwards", "frc_in_waits")}
                   | {"page_faults": statistics.median(r.get("page_faults", 0) for r in rows)})
    return out


def profile_costs(args: argparse.Namespace, iters: int = 15) -> tuple[Costs, list[int]]:
    """Forward, backward and optimizer step of every stage, alone in this process."""
    import torch

    from bamboo.config.presets import preset
    from bamboo.data.datasets import make_task
    from bamboo.engine.stage import StageOptimizer, StageState
    from bamboo.model import layer_param_counts, loss_fn
    from bamboo.plan.partition import partition

    torch.set_num_threads(1)
    p = preset(args.model, SIZING)
    parts = partition(layer_param_counts(p), args.stages)
    task = make_task(p, seed=0, global_micro_batches=args.micro_batches,
                     micro_batch_size=args.micro_batch_size)
    loss = loss_fn(p)
    stages = [StageState(preset=p, stage=s, layer_indices=parts[s], seed=0,
                         device=torch.device("cpu"), optim=StageOptimizer(3e-3, 0.01))
              for s in range(args.stages)]
    fwd = {s: [] for s in range(args.stages)}
    bwd = {s: [] for s in range(args.stages)}
    opt = {s: [] for s in range(args.stages)}
    P = args.stages
    for it in range(iters + 3):
        x = None
        outs = []
        for s, st in enumerate(stages):  # forward chain on a real micro-batch
            t0 = time.perf_counter()
            if s == 0:
                inp = task.batch(it, 0).inputs
            else:
                inp = x.detach().requires_grad_()
            out = st.module(inp)
            if s == P - 1:
                out = loss(out, task.batch(it, 0).targets) / args.micro_batches
            t1 = time.perf_counter()
            outs.append((inp, out))
            x = out
            if it >= 3:
                fwd[s].append(t1 - t0)
        grad = None
        for s in reversed(range(P)):  # backward chain
            inp, out = outs[s]
            t0 = time.perf_counter()
            if s == P - 1:
                out.backward()
            else:
                torch.autograd.backward(out, grad_tensors=grad)
            grad = inp.grad if s > 0 else None
            stages[s].accumulate()
            t1 = time.perf_counter()
            if it >= 3:
                bwd[s].append(t1 - t0)
        for s, st in enumerate(stages):
            g = st.grad_sum.to(torch.float32)
            t0 = time.perf_counter()
            st.apply(g, 1.0, 1e-4)
            t1 = time.perf_counter()
            st.reset_grads()
            if it >= 3:
                opt[s].append(t1 - t0)
    def med(d: dict) -> tuple:
        return tuple(statistics.median(d[s]) for s in range(P))

    optim = med(opt)
    return (Costs(forward=med(fwd), backward=med(bwd), optim=optim, replica_optim=optim),
            [st.numel for st in stages])


def output_bytes(args: argparse.Namespace) -> list[int]:
    """Bytes of one micro-batch's output of each stage (0 for the last: its output is a loss)."""
    from bamboo.config.presets import preset
    from bamboo.model import boundary_shapes, layer_param_counts
    from bamboo.plan.partition import partition

    p = preset(args.model, SIZING)
    parts = partition(layer_param_counts(p), args.stages)
    specs = boundary_shapes(p, args.micro_batch_size)
    out = []
    for s in range(args.stages):
        if s == args.stages - 1:
            out.append(0)
            continue
        spec = specs[parts[s].stop - 1]
        n = 1
        for d in spec.shape:
            n *= d
        out.append(n * (8 if "64" in str(spec.dtype) else 4))
    return out


def mb(x: float) -> str:
    return f"{x / 2**20:7.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-tiny")
    ap.add_argument("--stages", type=int, default=4, help="one pipeline: nodes = stages")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="cores of this machine for the shared-cores prediction")
    ap.add_argument("--out", help="keep the run directories here (default: a temporary one)")
    ap.add_argument("--pin-cpus", default="off", choices=("off", "auto"))
    ap.add_argument("--ascii", action="store_true", help="print the model's timelines")
    args = ap.parse_args()
    P, M = args.stages, args.micro_batches
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rc-overhead-"))
    root.mkdir(parents=True, exist_ok=True)

    print(f"machine: {os.cpu_count()} cores, {sys.platform}, load average {os.getloadavg()[0]:.2f}; model {args.model}, P={P} stages "
          f"on {P} worker processes, M={M} micro-batches of {args.micro_batch_size}, "
          f"{args.steps} steps x {args.reps} reps per mode, first {args.warmup} steps left out")
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    run_medians: dict[str, list[float]] = {m: [] for m in MODES}
    events: dict[str, list[dict]] = {}
    drift: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
        for mode in order:
            ev = run_train(args, mode, root / f"{mode}-{rep}")
            w = step_walls(ev, args.warmup)
            walls[mode] += w
            run_medians[mode].append(statistics.median(w))
            events.setdefault(mode, ev)
            drift[mode].append(early_late(ev, args.warmup))
            print(f"  rep {rep} {mode:<10} median step {1e3 * statistics.median(w):7.1f} ms",
                  flush=True)

    base = statistics.median(walls["off"])
    print("\n== measured on this machine (median step wall time, all reps pooled) ==")
    print(f"{'mode':<10} {'median ms':>10} {'overhead':>9}   per-rep medians ms   "
          "first 3 -> last 3 steps, ms (per rep)")
    for mode in MODES:
        med = statistics.median(walls[mode])
        print(f"{mode:<10} {1e3 * med:>10.1f} {100 * (med / base - 1):>8.1f}%   "
              + " ".join(f"{1e3 * x:.1f}" for x in run_medians[mode]) + "   "
              + ", ".join(f"{1e3 * a:.0f} -> {1e3 * b:.0f}" for a, b in drift[mode]))

    q10 = {m: statistics.quantiles(walls[m], n=10)[0] for m in MODES}
    best = {m: min(run_medians[m]) for m in MODES}
    print("least disturbed (the machine is shared; background load only adds time): "
          + ", ".join(f"{m} p10 {1e3 * q10[m]:.1f} ms ({100 * (q10[m] / q10['off'] - 1):+.1f}%)"
                      for m in MODES)
          + "; best rep median " + ", ".join(
              f"{m} {1e3 * best[m]:.1f} ms ({100 * (best[m] / best['off'] - 1):+.1f}%)" for m in MODES))
    print("paired by repetition (each mode against the off run of the same rep): "
          + ", ".join(f"{m} " + " ".join(f"{100 * (a / b - 1):+.0f}%" for a, b in
                                          zip(run_medians[m], run_medians["off"]))
                      + f" (median {100 * statistics.median(a / b - 1 for a, b in zip(run_medians[m], run_medians['off'])):+.0f}%)"
                      for m in MODES[1:]))
    print("\n== per-node timers, median per step (first run of each mode), ms ==")
    print(f"{'mode':<10} {'node':<5} {'compute':>8} {'frc':>7} {'wait':>7} {'commit':>7} "
          f"{'optim':>7} {'step':>7} {'faults':>7} {'FRC in waits':>13}")
    nodes = {m: node_medians(events[m], args.warmup) for m in MODES}
    for mode in MODES:
        for r in nodes[mode]:
            print(f"{mode:<10} {r['node']:<5} " + " ".join(
                f"{1e3 * r[k]:>7.1f}" for k in ("compute_s", "frc_s", "wait_s", "reduce_s",
                                                 "optim_s", "step_s"))
                  + f" {r['page_faults']:>7.0f}"
                  + (f" {r['frc_in_waits']:>6g} of {r['frc_forwards']:g}" if r["frc_forwards"] else ""))

    costs, _numels = profile_costs(args)
    # the commit round as measured (median over nodes in the off runs): a barrier plus transfers
    costs = Costs(forward=costs.forward, backward=costs.backward, optim=costs.optim,
                  replica_optim=costs.replica_optim,
                  commit=statistics.median(r["reduce_s"] for r in nodes["off"]))
    print("\n== timeline model, costs profiled alone in this process (1 thread) ==")
    print("per micro-batch ms: forward " + " ".join(f"{1e3 * x:.2f}" for x in costs.forward)
          + " | backward " + " ".join(f"{1e3 * x:.2f}" for x in costs.backward)
          + " | optimizer/step " + " ".join(f"{1e3 * x:.2f}" for x in costs.optim)
          + f" | commit {1e3 * costs.commit:.2f}")
    predictions = {}
    for label, cores in (("one processor per node (GPU-like)", None),
                         (f"{args.cores} shared cores (this machine)", args.cores)):
        cmp = compare(P, M, costs, cores=cores)
        predictions[label] = cmp
        print(f"\n-- {label} --")
        print(render(cmp, show=args.ascii))
    _, _, ev_costs, _notes = costs_from_events(root / "eager-0" / "events.jsonl", skip=args.warmup)
    cmp_ev = compare(P, M, ev_costs)
    print("\n-- one processor per node, on the costs the eager run's own timers measured "
          "(wall times under core sharing) --")
    print(f"{'mode':<6} {'step ms':>8} {'overhead':>9}")
    for m, tl in cmp_ev.timelines.items():
        print(f"{m:<6} {1e3 * tl.step_s:>8.1f} {100 * cmp_ev.overhead(m):>8.1f}%")

    print("\n== summary: overhead vs off ==")
    print(f"{'':<44} {'lazy':>7} {'eager':>7} {'eager-slot':>10}")
    print(f"{'measured here, median of all steps':<44} "
          + " ".join(f"{100 * (statistics.median(walls[m]) / base - 1):>6.1f}%" for m in MODES[1:]))
    print(f"{'measured here, 10th percentile of steps':<44} "
          + " ".join(f"{100 * (q10[m] / q10['off'] - 1):>6.1f}%" for m in MODES[1:]))
    for label, cmp in predictions.items():
        print(f"{'model, FRC at slot, ' + label[:22]:<44} "
              + " ".join(f"{100 * cmp.overhead(m):>6.1f}%" for m in ("lazy", "eager")))
    waits = compare(P, M, costs, frc_policy="waits")
    print(f"{'model, GPU-like, FRC at waits (eager column)':<44} "
          + " ".join(f"{100 * waits.overhead(m):>6.1f}%" for m in ("lazy", "eager")))
    hid = predictions["one processor per node (GPU-like)"].frc_hidden()
    print("FRC work in bubbles (GPU-like model), per node: " + ", ".join(
        f"n{n} {100 * h / w:.0f}% of {1e3 * w:.1f} ms" for n, w, h in hid if w > 0))

    # -- memory: tensor accounting per node -------------------------------------------------
    outs = output_bytes(args)
    print("\n== peak memory per node, tensor accounting (bytes the engine holds; not process RSS,"
          " of which ~220 MB is the Python/torch runtime) ==")
    print("state = params + AdamW moments (replica included), grads = float64 gradient sum,"
          " act = 1F1B in-flight activations, outs = stage outputs kept all step,"
          " frc = FRC activations kept all step; MiB")
    print(f"{'node':<5} {'mode':<6} {'state':>7} {'grads':>7} {'act':>7} {'outs':>7} {'frc':>7} "
          f"{'total':>8} {'x off':>6}")
    totals: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(P):
        for mode in MODES:
            r = nodes[mode][i]
            s = r["stage"]
            # bytes_replica: own stage's gradient fed to the predecessor's replica, 4 B/param
            numel_primary = r["state_bytes"] / 12 if mode == "off" else r["bytes_replica"] / 4
            grads = 8 * numel_primary
            act = r["saved_bytes"] / M * min(P - s, M)
            kept = M * outs[s] if mode != "off" else 0
            frc = r["frc_saved_bytes"] if mode.startswith("eager") else 0
            total = r["state_bytes"] + grads + act + kept + frc
            totals[mode].append(total)
            ratio = total / totals["off"][i]
            print(f"n{i:<4} {mode:<10} {mb(r['state_bytes'])} {mb(grads)} {mb(act)} {mb(kept)} "
                  f"{mb(frc)} {mb(total):>8} {ratio:>5.2f}x")
    print("ratio to off, per node:  lazy " + " ".join(
        f"{a / b:.2f}x" for a, b in zip(totals["lazy"], totals["off"])) + "   eager " + " ".join(
        f"{a / b:.2f}x" for a, b in zip(totals["eager"], totals["off"])))
    print(f"max over nodes: off {mb(max(totals['off'])).strip()} MiB, lazy "
          f"{mb(max(totals['lazy'])).strip()} MiB, eager {mb(max(totals['eager'])).strip()} MiB "
          f"(eager/off {max(totals['eager']) / max(totals['off']):.2f}x)")
    print("note: off needs no stage outputs after their backward; the engine as written keeps them"
          " (saved_out) in every mode, so with --redundancy off it holds the 'outs' column too")
    print(f"load average (1/5/15 min) at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\nrun directories: {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
