"""A preemption notice as a separate process receives it: SIGTERM, as Kubernetes sends it,
becomes a notice the process reports before it exits 0."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.timeout(30)
def test_sigterm_to_a_process_becomes_a_notice():
    """A separate process, as Kubernetes would signal it: it reports the notice and exits 0."""
    code = textwrap.dedent("""
        import sys, time
        from bamboo.node.notices import NoticeWatcher, SigtermNotice
        got = []
        with NoticeWatcher([SigtermNotice(grace_s=5)], got.append, interval_s=0.02):
            print("ready", flush=True)
            end = time.monotonic() + 15
            while not got and time.monotonic() < end:
                time.sleep(0.02)
        print(got[0].source if got else "none", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, proc.returncode
    assert out.strip() == "sigterm"
