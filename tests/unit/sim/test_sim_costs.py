"""The costs file: schema validation, step-time model, and use by the simulator.
Its tests that start processes: tests/integration/test_sim_costs_runs.py."""

import json

import pytest

from bamboo.sim.cost_presets import get_preset, preset_from_costs
from bamboo.sim.costs import CostsError, StepCosts, load_costs, save_costs
from support.costs import GOOD


def test_round_trip_and_step_time(tmp_path):
    c = StepCosts(**{k: v for k, v in GOOD.items() if k != "schema"})
    f = tmp_path / "c.json"
    save_costs(c, f)
    back = load_costs(f)
    assert back == c
    # 1F1B: (ceil(8/D) + P - 1) x slowest stage (0.04 s)
    assert abs(back.step_time(1) - (8 + 3) * 0.04) < 1e-12
    assert abs(back.step_time(2) - (4 + 3) * 0.04) < 1e-12
    p = preset_from_costs(back, get_preset("gpt2"))
    assert p.stages == 4 and abs(p.step_time(2) - 7 * 0.04 * 1.2) < 1e-12 and p.rebalance_s == 2.5


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.pop("stages"), "'stages'"),
    (lambda d: d.update(forward_s=[0.1]), "forward_s"),
    (lambda d: d.update(rc_overhead=-1), "rc_overhead"),
    (lambda d: d.update(schema="other/2"), "schema"),
    (lambda d: d.update(extra_field=1), "extra_field"),
    (lambda d: d.update(micro_batches=2.5), "micro_batches"),
])
def test_invalid_costs_name_the_field(tmp_path, mutate, needle):
    d = dict(GOOD)
    mutate(d)
    f = tmp_path / "c.json"
    f.write_text(json.dumps(d))
    with pytest.raises(CostsError) as exc:
        load_costs(f)
    assert needle in str(exc.value) and str(f) in str(exc.value)


def test_simulate_takes_the_names_bamboo_train_takes(tmp_path, capsys):
    """One set of model names: a `bamboo train` model runs with its profiled costs, and
    without them the line says how to get them; --help lists every model and policy."""
    from bamboo.cli.simulate import build_parser, main
    from bamboo.config.presets import PRESETS as TRAIN_MODELS
    from bamboo.sim.cost_presets import SIM_MODELS
    from bamboo.sim.policies import POLICIES
    f = tmp_path / "c.json"
    f.write_text(json.dumps(GOOD))
    assert main(["--trace", "synthetic:p=0.1,nodes=12,hours=2", "--model", "gpt2-tiny",
                 "--costs", str(f), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "gpt2-tiny"
    for name in TRAIN_MODELS:
        if name.replace("-", "") in SIM_MODELS:  # a name both sides share (llama-1b) runs as is
            continue
        assert main(["--trace", "synthetic:p=0.1", "--model", name]) == 2
        err = capsys.readouterr().err
        assert err == (f"bamboo simulate: error: --model {name} needs its measured costs: run "
                       f"`bamboo profile --model {name} --out costs.json`, then add --costs "
                       f"costs.json\n"), err
    assert main(["--trace", "synthetic:p=0.1", "--model", "nonsense"]) == 2
    assert "is not a model: use one of gpt2, bert, llama-1b" in capsys.readouterr().err
    helptext = " ".join(build_parser().format_help().split())
    for name in [m.name for m in SIM_MODELS.values()] + list(POLICIES):
        assert name in helptext, name
