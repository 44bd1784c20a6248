"""The adaptive policy decides with bamboo.plan.redundancy_choice (the function ``--redundancy auto`` uses)."""

from pathlib import Path

import pytest

from bamboo.plan.redundancy_choice import choose_mode
from bamboo.sim.core import SimConfig
from bamboo.sim.cost_presets import get_preset
from bamboo.sim.policies import AdaptivePolicy
from bamboo.traces.trace import generate_synthetic, load_trace, parse_synthetic_spec

P3 = Path(__file__).resolve().parents[3] / "traces" / "aws-p3-2xlarge.csv"


class Recording(AdaptivePolicy):
    """Adaptive, noting every decision: (rate, nodes ready, pipelines chosen, mode chosen)."""

    def _reset(self) -> None:
        super()._reset()
        self.decisions: list[tuple[float, int, int, str]] = []

    def choose_layout(self, n_ready: int) -> int:
        D = super().choose_layout(n_ready)
        self.decisions.append((self.rate(), n_ready, D, self.rc_mode))
        return D


@pytest.mark.parametrize("model", ["gpt2", "vgg"])
def test_every_generation_is_choose_modes_argmax(model):
    preset = get_preset(model)
    traces = [load_trace(P3), generate_synthetic(parse_synthetic_spec("synthetic:p=0.5,hours=6"), 3)]
    for trace in traces:
        pol = Recording(preset, SimConfig())
        pol.run(trace)
        assert len(pol.decisions) > 20
        modes = set()
        for lam, n_ready, D, mode in pol.decisions:
            d_max = min(n_ready // preset.stages, preset.max_pipelines)
            best = (0, "eager", -1.0)
            for d in range(1, d_max + 1):
                ch = choose_mode(pol.mode_costs(d), lam)
                if ch.expected[ch.mode] > best[2]:
                    best = (d, ch.mode, ch.expected[ch.mode])
            assert (D, mode) == best[:2]
            modes.add(mode)
        assert len(modes) >= 2  # the rate moves the decision


def test_adaptive_figures_unchanged_by_the_shared_decision():
    """Pinned before the decision moved to bamboo.plan.redundancy_choice (same results to the step)."""
    trace = load_trace(P3)
    want = {"gpt2": (34419, 2, 73, 18328.843, 19243.628), "vgg": (13144, 5, 84, 37000.0, 2910.0)}
    for model, (steps, fatal, reconf, lazy_s, off_s) in want.items():
        r = AdaptivePolicy(get_preset(model), SimConfig()).run(trace)
        assert (r.steps, r.fatal_failures, r.reconfigurations) == (steps, fatal, reconf), model
        assert r.extra["seconds_eager"] == 0.0
        assert r.extra["seconds_lazy"] == pytest.approx(lazy_s, abs=1e-3)
        assert r.extra["seconds_off"] == pytest.approx(off_s, abs=1e-3)
