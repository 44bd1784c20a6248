"""A run's result as a user compares and loads it: `bamboo.same` (and `RunResult.matches`)
judges two runs by the contract's rule, the one `bamboo soak` uses, and says why;
`RunResult.state_dict()` has the user's model's own names, so it loads into their
`nn.Sequential` with strict=True."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import bamboo
from bamboo.control.results import Results
from bamboo.run.bits import COUNTERS, differs

KEPT = [{"from_step": 0, "pipelines": 2, "stages": 2, "rerouted": False}]
SMALLER = KEPT + [{"from_step": 2, "pipelines": 1, "stages": 2, "rerouted": False}]
REROUTED = KEPT + [{"from_step": 2, "pipelines": 2, "stages": 2, "rerouted": True}]
CONFIG = {"model": "gpt2-tiny", "seed": 3, "steps": 3, "global_batch_size": 32,
          "micro_batch_size": 8, "exact": False}
CLEAN = {"status": "completed", "error": None, "losses": [5.0, 4.5, 4.0], "param_l2": 10.0,
         "param_sha256": "abc", "preemptions": 0, "layouts": KEPT, "config": CONFIG,
         "eval_losses": [[3, 4.2]], "metrics": [{"accuracy": 0.25}] * 3,
         **{k: 0 for k in COUNTERS}}


def run(**changes: object) -> dict:
    return {**CLEAN, **changes}


def test_equal_runs_are_bit_equal() -> None:
    failover = run(preemptions=1, failovers=1)
    verdict = bamboo.same(CLEAN, failover)
    assert verdict and verdict.equal and verdict.bits_equal
    assert verdict.reason == "bit-equal: the same losses and parameter bits"
    assert str(verdict) == "same: bit-equal: the same losses and parameter bits"


def test_a_changed_layout_is_judged_by_the_tolerances_and_says_so() -> None:
    near = [5.0 * (1 + 3e-7), 4.5, 4.0]
    for layouts, why in ((SMALLER, "the layout changed"), (REROUTED, "a slot was re-routed")):
        other = run(losses=near, param_l2=10.0 * (1 + 2e-7), param_sha256="abd",
                    layouts=layouts, preemptions=1, drains=1)
        verdict = bamboo.same(CLEAN, other)
        assert verdict and verdict.bits_equal is False
        assert verdict.reason == (f"losses within 1e-05 and param_l2 within 1e-06 ({why}: the "
                                  f"bits may differ); measured 3.0e-07 and 2.0e-07")
    exact = {**CONFIG, "exact": True}
    verdict = bamboo.same(run(config=exact), run(config=exact, layouts=SMALLER, losses=near))
    assert verdict.reason.startswith("parameters bit-equal, losses within 3.0e-07 relative")


def test_what_differs_is_said_with_how_much() -> None:
    cases = [
        (run(param_sha256="abd", preemptions=1, failovers=1),
         "param_sha256 differs although both kept one layout (2 pipelines x 2 stages) and the "
         "order of their sums, which keeps the bits (losses within 0.0e+00 relative)"),
        (run(losses=[5.0, 4.6, 4.0]),
         "the loss of step 1: 4.5 against 4.6 (2.2e-02 relative), more than 1e-05"),
        (run(losses=[5.0, float("nan"), 4.0]), "the loss of step 1: 4.5 against nan"),
        (run(losses=[5.0, 4.5]), "3 losses against 2"),
        (run(param_l2=10.1, param_sha256="abd", layouts=SMALLER),
         "param_l2 10.0 against 10.1 (1.0e-02 relative), more than 1e-06"),
        (run(config={**CONFIG, "seed": 4}),
         "not the same job (seed 3 and 4): the rule compares runs of one model, data, seed"),
        (run(status="failed", error="stopped by SIGINT"),
         "the second run did not complete (status 'failed': stopped by SIGINT)"),
        (run(preemptions=2, failovers=1),
         "the second run counts 2 preemptions but its counters sum to 1"),
        (run(eval_losses=[[3, 4.3]]), "the held-out loss after step 3: 4.2 against 4.3"),
        (run(metrics=[{"accuracy": 0.25}, {"accuracy": 0.5}, {"accuracy": 0.25}]),
         "metric accuracy of step 1: 0.25 against 0.5"),
    ]
    for other, reason in cases:
        verdict = bamboo.same(CLEAN, other)
        assert not verdict and verdict.reason.startswith(reason), (verdict.reason, reason)
        assert str(verdict).startswith("different: ")


def test_the_rule_is_the_soaks() -> None:
    """`bamboo.same` agrees with the soak's `differs` on every case where a failure-free run
    is compared with a trial (the soak's own question)."""
    trials = [run(preemptions=1, failovers=1), run(param_sha256="abd", preemptions=1, failovers=1),
              run(param_sha256="abd", layouts=SMALLER, preemptions=1, drains=1),
              run(losses=[5.0, 4.5, 4.01]), run(param_l2=10.001), run(preemptions=1)]
    for trial in trials:
        assert bool(bamboo.same(CLEAN, trial)) == (differs(CLEAN, trial) == "")


def test_runs_are_given_as_results_directories_or_summaries(tmp_path: Path) -> None:
    for name, summary in (("a", CLEAN), ("b", run(preemptions=1, failovers=1))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    a, b = bamboo.load_result(tmp_path / "a"), bamboo.load_result(tmp_path / "b")
    assert a.matches(b) and bamboo.same(a, str(tmp_path / "b")) and bamboo.same(tmp_path / "a", b)
    assert not a.matches(run(losses=[1.0, 1.0, 1.0]))
    with pytest.raises(bamboo.JobError, match="bamboo.same: b= takes a RunResult, a summary "
                                              "dict or a run directory"):
        bamboo.same(a, 42)


class Mix(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


def layers() -> list[nn.Module]:
    return [nn.Embedding(64, 8), Mix(8), nn.Sequential(Mix(8), nn.Linear(8, 64))]


def test_state_dict_has_the_users_names_and_loads_strictly(tmp_path: Path) -> None:
    """model.pt as the coordinator writes it (`Results.model_bytes`, from every layer's named
    parameters) keeps `layers.<i>.` for `bamboo export`; `state_dict()` gives the user's own
    names, which an `nn.Sequential` of the layers (the user's model, or their list wrapped
    in one) takes with strict=True, every tensor the trained one."""
    torch.manual_seed(0)
    trained = nn.Sequential(*layers())
    writer = Results.__new__(Results)  # only its model writer: no run around it
    writer.params = {i: [(n, p.detach().clone()) for n, p in layer.named_parameters()]
                     for i, layer in enumerate(trained)}
    (tmp_path / "model.pt").write_bytes(writer.model_bytes())
    (tmp_path / "summary.json").write_text(json.dumps(CLEAN))
    result = bamboo.load_result(tmp_path)
    saved = torch.load(result.model_path, weights_only=True)
    assert all(key.startswith("layers.") for key in saved)
    params = result.state_dict()
    assert list(params) == list(trained.state_dict())  # "0.weight", "1.ln.weight", ...
    torch.manual_seed(1)
    fresh = nn.Sequential(*layers())  # other initial parameters
    assert not torch.equal(fresh[0].weight, trained[0].weight)
    missing, unexpected = fresh.load_state_dict(params, strict=True)
    assert (missing, unexpected) == ([], [])
    for key, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], tensor), key
