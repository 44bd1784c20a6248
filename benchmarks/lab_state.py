"""State movement between lab hosts, against a raw socket copy between the same hosts.

One lab (bamboo.chaos.lab: hosts in network namespaces on a bridge; needs root): a coordinator
host and three agent hosts of one worker each (the third a standby). In one run:

1. raw TCP copy a1 -> a2 (plain sockets, no bamboo code): the bridge's MB/s;
2. a job of 1 pipeline x 2 stages with a checkpoint every 2 steps: each holder's checkpoint
   write (`checkpoint_part` events: bytes / seconds on its writer thread);
3. `--kill 0:1@2`: the shadow takes over, and the next generation moves the lost stage's
   state (and the replica) to the standby on another host (`state_loaded`, source peers);
4. the coordinator host is SIGKILLed and the same command started again (`--resume auto`):
   every worker reads its layers from the newest checkpoint (`state_loaded`, source
   checkpoint), and the seconds from the kill to the next committed step are timed.

The run directory (and so the checkpoints) is a local directory every host sees, as a
shared filesystem would be: checkpoint MB/s are this machine's disk, not the network.

    sudo .venv/bin/python benchmarks/lab_state.py                      # gpt2-mini, ~1 min
    sudo .venv/bin/python benchmarks/lab_state.py --model gpt2-small   # ~1 GB a stage
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from lab_transfer import SEND, SINK  # noqa: E402 (after sys.path is set)

from bamboo.chaos.lab import Lab, unsupported_reason  # noqa: E402 (after sys.path is set)

JOIN, SINK_PORT = 29400, 29556
ENV = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
BAMBOO = [sys.executable, "-m", "bamboo"]


def events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    if not path.exists():
        return []
    # only whole lines: the coordinator may be writing the last one right now
    return [json.loads(x) for x in path.read_text().split("\n")[:-1] if x.strip()]


def raw_copy(lab: Lab, size: int, repeats: int) -> float:
    """Median MB/s of `size`-byte copies a1 -> a2."""
    sink = lab.run("a2", [sys.executable, "-c", SINK, str(SINK_PORT)], stdout=subprocess.PIPE,
                   text=True)
    try:
        assert sink.stdout.readline().strip() == "ready"
        times = []
        for _ in range(repeats):
            r = lab.call("a1", [sys.executable, "-c", SEND, lab["a2"].address, str(SINK_PORT),
                                str(size)], timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"raw copy failed: {r.stderr.strip()}")
            times.append(float(r.stdout))
        return size / statistics.median(times) / 1e6
    finally:
        sink.kill()
        sink.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-mini")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--raw-mb", type=float, default=256.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    reason = unsupported_reason()
    if reason is not None:
        print(f"lab_state: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bamboo-lab-state-") as tmp, Lab(4) as lab:
        out, token = Path(tmp) / "run", Path(tmp) / "token"
        token.write_text("5" * 64 + "\n")
        raw = raw_copy(lab, int(args.raw_mb * 1e6), 3)
        job = ["--model", args.model, "--nodes", "2", "--stages", "2", "--pipelines", "1",
               "--max-nodes", "3", "--micro-batches", "2", "--micro-batch-size", "2",
               "--steps", str(args.steps), "--checkpoint-every", "2", "--kill", "0:1@2",
               "--lease", "6", "--comm-timeout", "300"]
        coord_argv = [*BAMBOO, "coordinator", "--bind", f"0.0.0.0:{JOIN}", "--token-file",
                      str(token), "--out", str(out), "--resume", "auto", "--quiet", "--json",
                      "--no-report", *job]

        def coordinator() -> subprocess.Popen:
            return lab.run("coord", coord_argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)

        coord = coordinator()
        agents = [lab.run(h, [*BAMBOO, "agent", "--join", f"{lab['coord'].address}:{JOIN}",
                              "--token-file", str(token), "--quiet", "--rejoin-s", "300"],
                          cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                  for h in ("a1", "a2", "a3")]
        deadline = time.monotonic() + 1800
        # wait for the peer transfer's generation and a checkpoint after it
        while not (any(e["event"] == "state_loaded" and e["source"] == "peers"
                       for e in events(out))
                   and any(e["event"] == "checkpoint" and e["step"] >= 4 for e in events(out))):
            if coord.poll() is not None or time.monotonic() > deadline:
                print(coord.stderr.read()[-2000:], file=sys.stderr)
                return 1
            time.sleep(0.5)
        lab.kill_host("coord")
        killed = time.monotonic()
        seen = len(events(out))
        coord = coordinator()
        while not any(e["event"] == "step_done" for e in events(out)[seen:]):
            if coord.poll() is not None or time.monotonic() > deadline:
                print(coord.stderr.read()[-2000:], file=sys.stderr)
                return 1
            time.sleep(0.2)
        kill_to_step = time.monotonic() - killed
        stdout, stderr = coord.communicate(timeout=1800)
        if coord.returncode != 0:
            print(stderr[-2000:], file=sys.stderr)
            return 1
        for a in agents:
            a.wait(60)
        ev = events(out)
    saves = [e for e in ev if e["event"] == "checkpoint_part"]
    peers = [e for e in ev if e["event"] == "state_loaded" and e["source"] == "peers"]
    loads = [e for e in ev if e["event"] == "state_loaded" and e["source"] == "checkpoint"]

    def rate(rows: list[dict]) -> tuple[float, float, float]:
        b, s = sum(r["bytes"] for r in rows), sum(r["seconds"] for r in rows)
        return b / 1e6, s, b / 1e6 / s if s else float("nan")

    rows = {"raw socket copy a1 -> a2": (args.raw_mb, args.raw_mb / raw, raw),
            "reconfiguration transfer (peer -> standby host)": rate(peers),
            "checkpoint save (holders' writer threads)": rate(saves),
            "checkpoint load (restart, every worker)": rate(loads)}
    print(f"model {args.model}; lab of 4 hosts on one machine ({os.cpu_count()} cores)")
    print(f"{'what':<50} {'MB':>9} {'s':>8} {'MB/s':>9} {'of raw':>7}")
    for what, (mb, s, r) in rows.items():
        print(f"{what:<50} {mb:>9.1f} {s:>8.3f} {r:>9.1f} {r / raw:>7.0%}")
    print(f"coordinator SIGKILL -> next committed step: {kill_to_step:.1f} s "
          f"(restart, rejoin, checkpoint load, one step)")
    if args.json:
        print(json.dumps({"rows": rows, "kill_to_step_s": kill_to_step}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
