"""The installed package, not a folder that shares its name: a clone of the repository named
`bamboo` beside a user's script (the usual `git clone ... bamboo`, then a script in the
parent folder) does not shadow it, neither in the script nor in the workers it starts.
The src/ layout makes an editable install put src/ on sys.path, where the regular package
is found before the clone's folder can count as a namespace package."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # starts a script and its workers

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys
    import bamboo

    if __name__ == "__main__":
        job = bamboo.Job(model="gpt2-tiny", nodes=2, stages=2, steps=3, micro_batches=1,
                         micro_batch_size=2, kill=["0:1@1"])
        result = bamboo.train(job, out=sys.argv[1])
        print(json.dumps({"file": bamboo.__file__, "failovers": result.failovers,
                          "status": result.status}))
""")


@pytest.mark.timeout(180)
def test_a_clone_named_bamboo_beside_the_script_does_not_shadow_the_package(
        tmp_path: Path) -> None:
    (tmp_path / "bamboo").symlink_to(REPO, target_is_directory=True)  # the clone, by name
    (tmp_path / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "train.py", str(tmp_path / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).resolve() == (REPO / "src" / "bamboo" / "__init__.py").resolve()
    assert (got["status"], got["failovers"]) == ("completed", 1)  # the workers ran it too
