"""`bamboo simulate` of a trace, run as a command."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.procs  # every test here starts processes


def test_cli_warns_once_about_unsorted_rows_and_errors_on_bad_line(tmp_path):
    good = tmp_path / "t.csv"
    good.write_text("0,add,a\n" + "".join(f"0,add,n{i}\n" for i in range(12)) + "9000000,remove,a\n60000,add,z\n")
    r = subprocess.run([sys.executable, "-m", "bamboo.sim", "--trace", str(good), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    warn = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(warn) == 1 and "1 row(s) out of time order" in warn[0]
    bad = tmp_path / "b.csv"
    bad.write_text("0,add,a\nnot a row\n")
    r = subprocess.run([sys.executable, "-m", "bamboo.sim", "--trace", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and f"{bad}:2:" in r.stderr and "Traceback" not in r.stderr
