"""One-command check of the GPU path: a short pipelined job on CUDA, killed mid-run.

On a machine without a usable GPU it prints one line (why, and what it would have run)
and exits 0. With one it runs, through the project's own `bamboo train`:

  1. a failure-free job: gpt2-mini, --nodes N --stages N (N = 4 by default), --device
     cuda, --precision bf16, --comm strict (NCCL's rules), a few steps;
  2. the same job with `--kill 0:S@K` (SIGKILL of the node holding stage S inside step K;
     its predecessor takes over in flight);

and prints the median step time, the peak device memory per worker (summary.json's
`memory_per_node_bytes` when the run writes it, and the driver's view from nvidia-smi,
sampled while the job runs), the failover pause (summary.json `pause_s`), and whether the
killed run ended with the losses of the failure-free run (within --rtol, relative; and
whether the final parameters are bit-identical).

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected",
ncclInvalidUsage), so with fewer GPUs than workers the N workers share the GPUs over gloo
(BAMBOO_BACKEND=gloo: CUDA tensors staged through host memory, bamboo/engine/comm.py);
with two GPUs or more the check then also runs one worker per GPU over NCCL (as many
workers as GPUs, at most N). With N GPUs or more it runs N workers over NCCL only.
--shared always (only the gloo layout) / never (only NCCL, one worker per GPU) changes
that. Every layout run must pass.

    .venv/bin/python benchmarks/gpu_check.py            # about 2-4 minutes on a GPU machine
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NCCL_SHARED_NOTE = ("NCCL refuses two ranks of one communicator on one GPU "
                    "('Duplicate GPU detected')")


# -- pure parts (tests/test_devices.py) ------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """One layout the check runs."""

    nodes: int
    kill_stage: int | None
    """The stage whose node is killed in the second run (None: no kill run)."""
    note: str = ""
    backend: str = "nccl"
    """BAMBOO_BACKEND for the run's workers: nccl (one worker per GPU) or gloo."""


def plan_layouts(gpus: int, nodes: int, shared: str) -> list[Layout]:
    """The layouts to run, in order; the check passes when every one does.

    `shared`: auto (more workers than GPUs: the `nodes` workers sharing the GPUs over gloo,
    then, with two GPUs or more, one worker per GPU over NCCL; else `nodes` workers over
    NCCL), always (only the gloo layout) or never (only NCCL, one worker per GPU)."""
    def kill_stage(n: int) -> int | None:
        return None if n < 2 else min(2, n - 1)

    per_gpu = min(nodes, gpus)
    nccl = Layout(per_gpu, kill_stage(per_gpu),
                  "" if per_gpu == nodes else
                  f"{per_gpu} worker(s), one per GPU, over NCCL ({NCCL_SHARED_NOTE})"
                  + ("" if per_gpu >= 2 else "; one worker has no successor to take over, "
                     "so no kill run"), backend="nccl")
    gloo = Layout(nodes, kill_stage(nodes),
                  f"{nodes} workers sharing {gpus} GPU(s) over gloo, CUDA tensors staged "
                  f"through host memory ({NCCL_SHARED_NOTE})" if nodes > gpus else
                  f"{nodes} workers, one per GPU, over gloo", backend="gloo")
    if shared == "always":
        return [gloo]
    if shared == "never" or nodes <= gpus:
        return [nccl]
    return [gloo] + ([nccl] if gpus >= 2 else [])


def compare_losses(clean: list[float] | None, killed: list[float] | None,
                   rtol: float) -> tuple[bool, float | None, str]:
    """(equal within rtol, worst relative difference, why not) of two runs' step losses."""
    if not clean or not killed:
        return False, None, "a run has no losses"
    if len(clean) != len(killed):
        return False, None, f"{len(clean)} against {len(killed)} steps"
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(clean, killed))
    return worst <= rtol, worst, "" if worst <= rtol else f"worst relative difference {worst:.3g}"


def memory_lines(summary: dict | None) -> list[str]:
    """summary.json's memory figures, whatever shape they come in (absent: said so)."""
    if not summary:
        return ["summary.json: none"]
    lines = []
    names = summary.get("memory_nodes")  # the nodes the per-node lists are in the order of
    for key, value in summary.items():  # memory_per_node_bytes, host_memory_per_node_bytes, ...
        if "memory" not in key or key == "memory_nodes":
            continue
        if isinstance(value, dict):
            for name, v in value.items():
                lines.append(f"{key} {name}: {_mib(v)}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                name = names[i] if isinstance(names, list) and i < len(names) else f"[{i}]"
                lines.append(f"{key} {name}: {_mib(v)}")
        else:
            lines.append(f"{key}: {_mib(value)}")
    return lines or ["summary.json has no memory figures (memory_per_node_bytes missing)"]


def _mib(value: Any) -> str:
    if isinstance(value, (int, float)):
        return f"{value / 2**20:.1f} MiB"
    if isinstance(value, dict):  # e.g. {"allocated": ..., "reserved": ...}
        return ", ".join(f"{k} {_mib(v)}" for k, v in value.items())
    return repr(value)


def no_gpu_reason(torch: Any) -> str | None:
    """Why this process cannot use a GPU (None: it can)."""
    if getattr(torch.version, "cuda", None) is None:
        why = f"torch {torch.__version__} is a CPU-only build"
        if shutil.which("nvidia-smi"):
            why += " (nvidia-smi is here: install a CUDA build of torch)"
        return why
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no CUDA device is visible" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                              if visible is not None else "")
    return None


# -- running jobs ------------------------------------------------------------------------------

def train_cmd(args: argparse.Namespace, nodes: int, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bamboo", "train", "--model", args.model,
            "--nodes", str(nodes), "--stages", str(nodes), "--micro-batches",
            str(args.micro_batches), "--steps", str(args.steps), "--device", args.device,
            "--precision", args.precision, "--comm", "strict", "--json", "--quiet",
            "--no-report", "--out", str(out), *extra]


class _SmiSampler:
    """Peak device memory per process as nvidia-smi sees it (context included)."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.peak_by_pid: dict[int, float] = {}
        self.peak_total = 0.0
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _SmiSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                       "--format=csv,noheader,nounits"], capture_output=True,
                                      text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                return
            total = 0.0
            for line in text.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) != 2 or not parts[0].isdigit():
                    continue
                try:
                    mib = float(parts[1])
                except ValueError:
                    continue
                pid = int(parts[0])
                total += mib
                self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0.0), mib)
            self.peak_total = max(self.peak_total, total)


@dataclass
class JobResult:
    rc: int | None
    wall_s: float
    out: Path
    summary: dict | None
    events: list[dict] = field(default_factory=list)
    stderr_tail: str = ""
    smi_by_node: dict[str, float] = field(default_factory=dict)
    smi_total_mib: float = 0.0
    smi_unmatched: bool = False

    @property
    def ok(self) -> bool:
        return self.rc == 0 and bool(self.summary) and \
            self.summary.get("status", "completed") == "completed"


def run_job(cmd: list[str], out: Path, timeout_s: float,
            env: dict[str, str] | None = None) -> JobResult:
    """Run `cmd` (a `bamboo train`) in its own session, with `env` (None: this process's);
    past `timeout_s` its whole process group is killed."""
    t0 = time.monotonic()
    with _SmiSampler() as smi:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, env=env)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, stderr = proc.communicate()
            rc = None
            stderr += f"\n(killed after {timeout_s:.0f} s)"
    summary = None
    for text in (_read(out / "summary.json"), stdout):
        try:
            summary = json.loads(text) if text else None
        except json.JSONDecodeError:
            summary = None
        if summary:
            break
    events = [json.loads(line) for line in _read(out / "events.jsonl").splitlines()
              if line.strip().startswith("{")]
    pids = {e.get("pid"): e.get("node") for e in events if e.get("event") == "node_up"}
    by_node = {str(pids[pid]): mib for pid, mib in smi.peak_by_pid.items() if pid in pids}
    return JobResult(rc, time.monotonic() - t0, out, summary, events, stderr[-1500:], by_node,
                     smi.peak_total, smi.available and bool(smi.peak_by_pid) and not by_node)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def median_step_s(job: JobResult) -> float | None:
    if job.summary and isinstance(job.summary.get("median_step_s"), (int, float)):
        return float(job.summary["median_step_s"])
    walls = [e["wall_s"] for e in job.events if e.get("event") == "step_done" and "wall_s" in e]
    return statistics.median(walls[1:] or walls) if walls else None


def describe(name: str, job: JobResult) -> list[str]:
    lines = [f"[{name}] exit {job.rc if job.rc is not None else 'timeout'}, "
             f"{job.wall_s:.1f} s wall, run directory {job.out}"]
    if not job.ok:
        tail = " | ".join(line for line in job.stderr_tail.splitlines()[-6:] if line.strip())
        error = (job.summary or {}).get("error")
        lines.append(f"  FAILED: {error or tail or 'no output'}")
        if "Duplicate GPU" in job.stderr_tail or "Duplicate GPU" in str(error):
            lines.append(f"  ({NCCL_SHARED_NOTE})")
    step = median_step_s(job)
    lines.append(f"  median step time: {f'{1e3 * step:.1f} ms' if step is not None else 'n/a'}")
    lines += [f"  {line}" for line in memory_lines(job.summary)]
    if job.smi_by_node:
        lines += [f"  nvidia-smi peak, {node}: {mib:.0f} MiB (CUDA context included)"
                  for node, mib in sorted(job.smi_by_node.items())]
    elif job.smi_total_mib:
        lines.append(f"  nvidia-smi peak, all processes on the GPU(s): {job.smi_total_mib:.0f} MiB"
                     + (" (its pids are not the workers' pids here: another PID namespace)"
                        if job.smi_unmatched else ""))
    if job.summary and "pause_s" in job.summary:
        lines.append(f"  failover pause_s: {job.summary['pause_s']}")
    return lines


def header(torch: Any) -> str:
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - informative only
        nccl = "?"
    return (f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; "
            f"{len(names)} visible GPU(s): {', '.join(names)}; "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--nodes", type=int, default=4, help="workers = stages (default 4)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=6)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--shared", default="auto", choices=("auto", "always", "never"),
                    help="auto: more workers than GPUs share them over gloo, then (2+ GPUs) "
                         "one per GPU over NCCL; always: only gloo; never: only NCCL")
    ap.add_argument("--rtol", type=float, default=1e-2)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per job")
    ap.add_argument("--out", help="keep run directories here (default: a temporary one)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: run the same check on the CPU (tests the harness; its figures "
                         "say nothing about a GPU)")
    args = ap.parse_args(argv)

    import torch

    plan = (f"`bamboo train --model {args.model} --nodes {args.nodes} --stages {args.nodes} "
            f"--device cuda --precision {args.precision} --comm strict --steps {args.steps}` "
            f"failure-free and with `--kill 0:{min(2, args.nodes - 1)}@{args.kill_step}` "
            f"(BAMBOO_BACKEND=gloo where workers share a GPU, NCCL with one per GPU), "
            f"reporting median step time, peak device memory per worker, the failover pause "
            f"and whether both runs end with the same losses")
    reason = no_gpu_reason(torch) if args.device == "cuda" else None
    if reason is not None:
        print(f"gpu_check: no GPU present ({reason}); on a GPU it would run {plan}")
        return 0
    if not 1 <= args.kill_step < args.steps:
        raise SystemExit("need 1 <= --kill-step < --steps")

    if args.device == "cuda":
        print(header(torch), flush=True)
        gpus = torch.cuda.device_count()
    else:
        print("gpu_check: on the CPU (--device cpu: a check of this script, not of a GPU)")
        gpus = args.nodes
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    for i, layout in enumerate(plan_layouts(gpus, args.nodes, args.shared)):
        backend = layout.backend if args.device == "cuda" else "gloo"  # nccl needs CUDA
        where = f"{gpus} GPU(s)" if args.device == "cuda" else "the CPU"
        print(f"\n== {layout.nodes} worker(s) on {where}, BAMBOO_BACKEND={backend}"
              + (f": {layout.note}" if layout.note else ""), flush=True)
        env = dict(os.environ, BAMBOO_BACKEND=backend)
        results.append((layout, backend, *check_layout(args, layout, root / str(i), env)))
    ok = all(r[2] for r in results)
    print(f"\ngpu_check: {'ok' if ok else 'FAILED'} (run directories in {root})")
    for layout, backend, layout_ok, failover in results:
        print(f"  {layout.nodes} worker(s), {backend}: {'ok' if layout_ok else 'FAILED'}"
              + ("" if failover or not layout_ok else " (the failover was not checked)"))
    return 0 if ok else 1


def check_layout(args: argparse.Namespace, layout: Layout, out: Path,
                 env: dict[str, str]) -> tuple[bool, bool]:
    """Run one layout: failure-free, then killed (where it has a kill stage) and compared;
    (passed, failover checked)."""
    clean = run_job(train_cmd(args, layout.nodes, out / "clean"), out / "clean", args.timeout, env)
    print("\n".join(describe("failure-free", clean)), flush=True)
    if not clean.ok:
        return False, False
    if layout.kill_stage is None:
        print("  no kill run in this layout")
        return True, False
    spec = f"0:{layout.kill_stage}@{args.kill_step}"
    killed = run_job(train_cmd(args, layout.nodes, out / "kill", "--kill", spec), out / "kill",
                     args.timeout, env)
    print("\n".join(describe(f"--kill {spec}", killed)), flush=True)
    if not killed.ok:
        return False, False
    same, worst, why = compare_losses(clean.summary.get("losses"),
                                      killed.summary.get("losses"), args.rtol)
    bits = (clean.summary.get("param_sha256") is not None and
            clean.summary.get("param_sha256") == killed.summary.get("param_sha256"))
    failovers = killed.summary.get("failovers")
    print(f"  ended equal to the failure-free run: {'yes' if same else 'NO'} "
          f"(losses within {args.rtol:g} relative"
          + (f", worst {worst:.2e}" if worst is not None else "") + (f"; {why}" if why else "")
          + f"; final parameters {'bit-identical' if bits else 'differ'}"
          + (f"; failovers {failovers}" if failovers is not None else "") + ")", flush=True)
    return same, True

if __name__ == "__main__":
    sys.exit(main())
