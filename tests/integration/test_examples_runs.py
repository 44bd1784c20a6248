"""The scripts of examples/ run as a user runs them (`python examples/X.py --compare`, from
another directory): each trains with a node killed in flight, then without the kill, and
the two runs end with the same losses and parameters, bit for bit; the vision example's
killed run is compared with the single-process loop instead (one run fewer)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bamboo.config import JobConfig
from bamboo.data.sizing import SIZING
from support.reference import train_reference
from support.runs import REL, assert_close, param_l2
from support.strict import strict_loads

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, tmp_path: Path, steps: int) -> tuple[dict, dict, str]:
    """(killed run's summary, failure-free run's summary, stdout) of examples/`name`."""
    done = subprocess.run([sys.executable, str(EXAMPLES / name), "--steps", str(steps),
                           "--out", str(tmp_path / "run"), "--compare"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    killed, clean = (strict_loads((tmp_path / "run" / which / "summary.json").read_text(),
                                  "summary.json") for which in ("killed", "clean"))
    assert (killed["status"], clean["status"]) == ("completed", "completed")
    assert (killed["preemptions"], killed["failovers"], clean["failovers"]) == (1, 1, 0)
    assert (killed["redone_steps"], killed["checkpoint_restores"]) == (0, 0)
    assert len(killed["losses"]) == steps
    assert killed["losses"] == clean["losses"]
    assert killed["param_sha256"] == clean["param_sha256"]
    assert "the same losses and parameters" in done.stdout
    return killed, clean, done.stdout


@pytest.mark.timeout(300)
def test_sgd_with_momentum_under_one_cycle_survives_its_kill(tmp_path: Path) -> None:
    """The momentum OneCycleLR cycles reaches the shadow's replica too: the killed run
    is the failure-free run."""
    killed, _, _ = run_example("sgd_onecycle.py", tmp_path, steps=6)
    config = killed["config"]
    assert config["optimizer"] == "torch.optim.sgd:SGD(lr=0.05, momentum=0.9)"
    assert config["lr_schedule"] == \
        "torch.optim.lr_scheduler:OneCycleLR(max_lr=0.1, total_steps=6)"
    assert config["model"] == f"{EXAMPLES / 'sgd_onecycle.py'}:build"


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install 'bamboo-train[deepspeed]')")
def test_a_deepspeed_pipeline_script_survives_its_kill(tmp_path: Path) -> None:
    """A real PipelineModule built in every process; its LayerSpecs are the layers and its
    loss_fn the loss; DeepSpeed's config becomes the job's options. Its TiedLayerSpecs (the
    embedding and the head, on two stages) end as one weight, and the killed run is the
    single-process loop's, in which both uses share one parameter."""
    killed, _, _ = run_example("deepspeed_pipeline.py", tmp_path, steps=5)
    config = killed["config"]
    assert config["model"] == f"{EXAMPLES / 'deepspeed_pipeline.py'}:build"
    assert config["optimizer"] == "torch.optim.adamw:AdamW(lr=0.001)"
    assert (config["micro_batches"], config["micro_batch_size"], config["grad_clip"]) == \
        (2, 4, 1.0)
    saved = torch.load(tmp_path / "run" / "killed" / "model.pt", weights_only=True)
    assert torch.equal(saved["layers.0.weight"], saved["layers.4.module.weight"])
    losses, params = train_reference(JobConfig.of(
        model=config["model"], steps=5, seed=3, micro_batches=4, micro_batch_size=4,
        grad_clip=1.0, optimizer=config["optimizer"]).validate(SIZING))
    assert_close(killed["losses"], losses, rel=1e-5)
    assert_close(killed["param_l2"], param_l2(params), rel=1e-5)


@pytest.mark.timeout(300)
def test_a_bert_style_classifier_with_dropout_survives_its_kill(tmp_path: Path) -> None:
    """Encoder blocks with dropout hand on (hidden states, attention mask); a user's Dataset,
    cross-entropy and an accuracy metric: the killed run is the failure-free run, accuracy
    included, for every step and every held-out pass."""
    killed, clean, stdout = run_example("bert_classifier.py", tmp_path, steps=6)
    config = killed["config"]
    assert config["model"] == f"{EXAMPLES / 'bert_classifier.py'}:build"
    assert config["dataset"] == f"{EXAMPLES / 'bert_classifier.py'}:Reviews(n=512)"
    assert config["metrics"] == [f"accuracy={EXAMPLES / 'bert_classifier.py'}:accuracy()"]
    assert [list(m) for m in killed["metrics"]] == [["accuracy"]] * 6
    assert all(0 <= m["accuracy"] <= 1 for m in killed["metrics"])
    assert [step for step, _ in killed["eval_metrics"]] == [2, 4, 6]
    assert [list(m) for _, m in killed["eval_metrics"]] == [["accuracy"]] * 3
    assert (killed["metrics"], killed["eval_metrics"], killed["eval_losses"]) == \
        (clean["metrics"], clean["eval_metrics"], clean["eval_losses"])
    assert f"held out {killed['eval_metrics'][-1][1]['accuracy']:.3f} after step 6" in stdout


@pytest.mark.timeout(300)
def test_a_vision_transformer_on_an_image_dataset_survives_its_kill(tmp_path: Path) -> None:
    """Patch embedding and blocks with dropout on a user's image Dataset (float pixels), a
    label-smoothing loss and an accuracy metric; killed in flight (no `--compare`, to keep
    the suite short), it ends with the failure-free single-process loop's losses, metrics
    and parameters on the same Dataset, loss and metric."""
    example = EXAMPLES / "vision_classifier.py"
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(example), "--steps", "6", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    killed = strict_loads((out / "killed" / "summary.json").read_text(), "summary.json")
    assert (killed["status"], killed["preemptions"], killed["failovers"]) == ("completed", 1, 1)
    assert (killed["redone_steps"], killed["checkpoint_restores"]) == (0, 0)
    config = killed["config"]
    assert config["loss"] == "torch.nn.functional:cross_entropy(label_smoothing=0.1)"
    keys = ("model", "dataset", "eval_dataset", "loss", "metrics", "steps", "seed", "lr",
            "micro_batch_size", "eval_every", "eval_batches")
    cfg = JobConfig.of(**{k: config[k] for k in keys}, micro_batches=4)  # 2 pipelines x 2
    evals: list[list[float]] = []
    metrics: list[dict[str, float]] = []
    eval_metrics: list[list] = []
    losses, params = train_reference(cfg.validate(SIZING), evals, metrics, eval_metrics)
    assert_close(killed["losses"], losses, rel=REL)
    assert_close(killed["param_l2"], param_l2(params), rel=REL)
    assert_close([m["accuracy"] for m in killed["metrics"]],
                 [m["accuracy"] for m in metrics], rel=REL)
    assert [s for s, _ in killed["eval_losses"]] == [s for s, _ in evals] == [6]
    assert_close([v for _, v in killed["eval_losses"]], [v for _, v in evals], rel=REL)
    assert_close([m["accuracy"] for _, m in killed["eval_metrics"]],
                 [m["accuracy"] for _, m in eval_metrics], rel=REL)
