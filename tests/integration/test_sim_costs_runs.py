"""`bamboo simulate --costs FILE` as a command, with a costs file `bamboo profile` wrote."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.costs import GOOD

pytestmark = pytest.mark.procs  # every test here starts processes


def test_simulate_with_costs_file(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps(GOOD))
    r = subprocess.run([sys.executable, "-m", "bamboo.sim", "--trace", "synthetic:p=0.1,nodes=12,hours=2",
                        "--costs", str(f), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"] == "gpt2-tiny" and d["policies"]["bamboo"]["steps"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    r = subprocess.run([sys.executable, "-m", "bamboo.sim", "--trace", "synthetic:p=0.1", "--costs", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and f"{bad}:1:" in r.stderr
