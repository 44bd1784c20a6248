"""`bamboo profile` writes a costs file that `bamboo simulate --costs` reads.
Its tests that start processes: tests/integration/test_profile_runs.py."""
from __future__ import annotations

from pathlib import Path

from bamboo.cli.profile import main as profile_main


def test_profile_refuses_to_overwrite(tmp_path: Path, capsys) -> None:
    out = tmp_path / "costs.json"
    out.write_text("{}")
    assert profile_main(["--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == "{}"
