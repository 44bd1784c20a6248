"""Store connections that stall on a reverse DNS lookup: torch's own server against ours.

torch's TCPStore server listens on `[::]`, so each peer it accepts is an IPv4-mapped IPv6
address; naming it (`getnameinfo`) goes to the DNS server, and a lost reply costs the
resolver's 5 s timeout while the whole store waits. `bamboo.wire.store.serve_store` listens
on an IPv4 socket of the bind address, whose loopback peers /etc/hosts names at once.

In one invocation, side by side: 3 client processes each open `--connects` store
connections (a `set` on each) to (a) torch's server and (b) ours; printed: the connections
that took over 1 s, and the slowest. Then `--runs` training runs of each (`bamboo.train`,
4 nodes x 2 stages, 3 steps, node 1 killed in step 1; the coordinator's store swapped for
torch's in (a)), interleaved: the runs with a step over 2 s, and the failovers' `pause_s`.

    .venv/bin/python benchmarks/store_stalls.py --connects 30 --runs 10
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from bamboo.wire.store import serve_store

TIMEOUT = timedelta(seconds=30)


def _client(rank: int, port: int, connects: int, out: mp.Queue) -> None:
    times = []
    for i in range(connects):
        start = time.perf_counter()
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        store.set(f"{rank}/{i}", "x")
        times.append(time.perf_counter() - start)
        del store
    out.put(times)


def _measure(port: int, clients: int, connects: int) -> list[float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(r, port, connects, out)) for r in range(clients)]
    for p in procs:
        p.start()
    times = [t for _ in procs for t in out.get(timeout=600)]
    for p in procs:
        p.join()
    return times


def _torch_server(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def _killed_runs(runs: int) -> None:
    import bamboo
    import bamboo.control.loop as loop
    job = bamboo.Job(nodes=4, stages=2, steps=3, kill=["0:1@1"], checkpoint_every=0)
    found: dict[str, list[tuple[float, float]]] = {"torch's server": [], "serve_store": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs + 1):  # the first pair warms the fork server up, uncounted
            for name, server in (("torch's server", _torch_server), ("serve_store", serve_store)):
                loop.serve_store = server
                out = Path(tmp) / f"{name[:5]}-{i}"
                bamboo.train(job, out)
                events = [json.loads(line) for line in (out / "events.jsonl").open()]
                slowest = max(e["wall_s"] for e in events if e["event"] == "step_done")
                pause = next(e["pause_s"] for e in events if e["event"] == "node_lost")
                if i:
                    found[name].append((slowest, pause))
    for name, rows in found.items():
        pauses = [p for _, p in rows]
        print(f"{name}: {len(rows)} killed runs, {sum(s > 2 for s, _ in rows)} with a step "
              f"over 2 s; failover pause_s median {statistics.median(pauses):.2f}, "
              f"max {max(pauses):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connects", type=int, default=30)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--runs", type=int, default=0)
    args = ap.parse_args()
    servers = {"torch's server ([::])": lambda: dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT),
        "serve_store (127.0.0.1)": lambda: serve_store("127.0.0.1", 0, TIMEOUT)}
    for name, make in servers.items():
        server = make()
        times = _measure(server.port, args.clients, args.connects)
        slow = [t for t in times if t > 1.0]
        print(f"{name}: {len(times)} connections, {len(slow)} over 1 s "
              f"({sum(slow):.1f} s in all), slowest {max(times):.2f} s")
        del server
    if args.runs:
        _killed_runs(args.runs)


if __name__ == "__main__":
    main()
