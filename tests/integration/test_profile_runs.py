"""`bamboo profile` measured here, then `bamboo simulate --costs` with what it wrote."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bamboo.cli.profile import main as profile_main
from bamboo.cli.simulate import main as simulate_main
from bamboo.sim.costs import load_costs
from support.procs import REPO

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.timeout(300)
def test_profile_then_simulate(tmp_path: Path, capsys) -> None:
    out = tmp_path / "costs.json"
    assert profile_main(["--stages", "3", "--micro-batches", "2", "--micro-batch-size", "4",
                         "--steps", "4", "--repeats", "1", "--out", str(out)]) == 0
    costs = load_costs(out)
    assert costs.stages == 3 and len(costs.forward_s) == 3 and all(f > 0 for f in costs.forward_s)
    assert all(b > 0 for b in costs.backward_s) and costs.rc_overhead >= 0
    assert costs.reconfiguration_s > 0  # a real peer restore was timed
    capsys.readouterr()
    trace = REPO / "traces" / "aws-p3-2xlarge.csv"
    assert simulate_main(["--trace", str(trace), "--costs", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["policies"]["bamboo"]["throughput"] > 0


@pytest.mark.timeout(300)
def test_a_model_of_image_inputs_is_profiled_on_its_dataset(tmp_path: Path) -> None:
    """Stage times and the engine's runs (a failover among them) on the --dataset's images."""
    from support.user_data import IMAGE_MODEL, IMAGES
    out = tmp_path / "costs.json"
    assert profile_main(["--model", IMAGE_MODEL, "--dataset", IMAGES, "--stages", "2",
                         "--micro-batches", "2", "--micro-batch-size", "4", "--steps", "4",
                         "--repeats", "1", "--out", str(out)]) == 0
    costs = load_costs(out)
    assert costs.stages == 2 and all(f > 0 for f in costs.forward_s + costs.backward_s)
    assert costs.failover_pause_s >= 0 and costs.allreduce_s > 0  # the engine ran
