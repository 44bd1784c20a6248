"""A real gloo error, from a peer killed with SIGKILL in another process, reaches the user in
the project's words (the texts themselves: tests/unit/control/test_backend_errors.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bamboo.node.backend_errors import describe, is_backend_text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK = textwrap.dedent("""
    import json, os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    if rank == 1:
        print("joined", flush=True)
        time.sleep(60)
    else:
        store.set("ready", "1")
        try:
            dist.recv(torch.zeros(4), src=1)
            print(json.dumps({"error": None}), flush=True)
        except RuntimeError as e:
            print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}),
                  flush=True)
        os._exit(0)
""")


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_a_real_gloo_error_from_a_killed_peer_is_worded(tmp_path: Path) -> None:
    """The text gloo itself gives when the peer of a receive is killed with SIGKILL."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    receiver = subprocess.Popen([sys.executable, str(script), "0", str(port)],
                                stdout=subprocess.PIPE, text=True, env=env)
    peer = subprocess.Popen([sys.executable, str(script), "1", str(port)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert peer.stdout.readline().strip() == "joined"
        peer.send_signal(signal.SIGKILL)
        out, _ = receiver.communicate(timeout=60)
    finally:
        for p in (receiver, peer):
            p.kill()
            p.wait()
    raw = json.loads(out.strip().splitlines()[-1])["error"]
    assert raw is not None and is_backend_text(raw), raw
    worded = describe(raw)
    assert worded.startswith("the connection to a peer broke") and "events.jsonl" in worded
    assert "pair.cc" not in worded and "gloo" not in worded
