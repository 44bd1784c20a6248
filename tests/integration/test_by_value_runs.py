"""Models made in Python and sent by value (bamboo.config.objects) trained by
`bamboo.train` with a node killed in flight: an `nn.Sequential` built here (its classes
defined in this function, so no worker can import them) ends bit-equal to its failure-free
run and equal to the single-process loop (and resuming it with another model object is
refused); a layer list of lambdas and closures too. The
same model reaches an agent on another machine (another temp directory) over the wire."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import bamboo
from bamboo.config import objects
from bamboo.model.forms import pipeline_model
from support.agents import stop, wait_for
from support.procs import BAMBOO, REPO, free_port
from support.reference import train_reference
from support.runs import REL, assert_close, param_l2

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

SHAPE = dict(nodes=4, stages=2, steps=4, micro_batches=2, micro_batch_size=2)
D, CONTEXT = 16, 16


def _mix_class() -> type[nn.Module]:
    class Mix(nn.Module):  # defined in a function: pickled by value, with its dropout
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln, self.fc, self.drop = nn.LayerNorm(d), nn.Linear(d, d), nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(torch.tanh(self.fc(self.ln(x))))

    return Mix


def _equals_the_single_process_loop(result: bamboo.RunResult, job: bamboo.Job) -> None:
    losses, params = train_reference(job.config)
    assert_close(result.losses, losses, rel=REL)
    assert_close(result.param_l2, param_l2(params), rel=REL)


@pytest.mark.timeout(300)
def test_models_sent_by_value_killed_in_flight_end_equal_to_their_failure_free_run(
        tmp_path: Path) -> None:
    mix = _mix_class()
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(256, D), mix(D), mix(D), nn.Linear(D, 256))
    model.context, model.vocab_size = CONTEXT, 256  # type: ignore[assignment]  # attributes Bamboo reads off a plain module
    clean = bamboo.train(bamboo.Job(model=model, **SHAPE), out=tmp_path / "clean")
    job = bamboo.Job(model=model, kill=["0:1@2"], **SHAPE)
    killed = bamboo.train(job, out=tmp_path / "killed")
    assert killed.failovers == 1 == killed.preemptions
    assert killed.losses == clean.losses and killed.param_sha256 == clean.param_sha256
    assert killed.config["model"] == clean.config["model"] == job.config.model.name
    _equals_the_single_process_loop(killed, job)
    other = nn.Sequential(nn.Embedding(256, D), mix(D), nn.Linear(D, 256))
    other.context, other.vocab_size = CONTEXT, 256  # type: ignore[assignment]  # attributes Bamboo reads off a plain module
    with pytest.raises(bamboo.JobError) as e:  # before any worker starts
        bamboo.train(bamboo.Job(model=other, resume=str(tmp_path / "killed"),
                                **(SHAPE | {"steps": 6})))
    assert str(e.value).startswith("bamboo.train: --resume ") and "\n" not in str(e.value)
    assert f"was made with the model {objects.short(job.config.model.name)}, this job gives " \
           f"by value (sha256 " in str(e.value)

    def block(width: int):  # a closure: each call a factory of its own layer
        return lambda: mix(width)

    layers = [lambda: nn.Embedding(256, D), block(D), block(D), lambda: nn.Linear(D, 256)]
    listed = bamboo.Job(model=pipeline_model(layers, context=CONTEXT, vocab_size=256),
                        kill=["1:0@1"], **SHAPE)
    result = bamboo.train(listed, out=tmp_path / "listed")
    assert result.failovers == 1
    _equals_the_single_process_loop(result, listed)


def _bamboo(args: list[str], tmpdir: Path) -> subprocess.Popen:
    """`bamboo ARGS` on a "machine" whose temp directory is `tmpdir`."""
    return subprocess.Popen(BAMBOO + args, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1"))


@pytest.mark.timeout(240)
def test_a_model_sent_by_value_reaches_an_agent_on_another_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator finds the model in its machine's directory; the agent, whose machine
    has no copy, gets it with the job, signed with the token, and its workers load it."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(here))
    torch.manual_seed(3)
    model = nn.Sequential(nn.Embedding(256, D), _mix_class()(D), nn.Linear(D, 256))
    model.context, model.vocab_size = CONTEXT, 256  # type: ignore[assignment]  # attributes Bamboo reads off a plain module
    job = bamboo.Job(model=model, nodes=2, stages=2, steps=3, micro_batches=2,
                     micro_batch_size=2)
    ref, out, port = job.config.model.name, tmp_path / "run", free_port()
    coord = _bamboo(["coordinator", "--bind", f"127.0.0.1:{port}", "--model", ref, "--nodes",
                     "2", "--stages", "2", "--steps", "3", "--micro-batches", "2",
                     "--micro-batch-size", "2", "--out", str(out), "--json", "--quiet",
                     "--no-report"], here)
    agent = None
    try:
        wait_for(out / "join-token")
        agent = _bamboo(["agent", "--join", f"127.0.0.1:{port}", "--token-file",
                         str(out / "join-token"), "--workers", "2"], there)
        stdout, stderr = coord.communicate(timeout=200)
        agent_out, agent_err = agent.communicate(timeout=60)
    finally:
        stop([p for p in (coord, agent) if p is not None])
    assert coord.returncode == 0, stderr
    assert "received 1 object(s) sent by value" in agent_out + agent_err
    digest = objects.digest_of(ref)
    assert [p.name for p in there.glob("bamboo-objects-*/*.pkl")] == [f"{digest}.pkl"]
    assert (out / "objects" / f"{digest}.pkl").is_file()
    summary = json.loads(stdout)
    assert summary["status"] == "completed" and summary["config"]["model"] == ref
    _equals_the_single_process_loop(bamboo.load_result(out), job)


@pytest.mark.timeout(240)
def test_the_command_resumes_a_by_value_run_where_the_machines_copy_is_gone(
        tmp_path: Path) -> None:
    """`bamboo train --model <reference> --resume DIR` on a machine that never held the
    object (another temp directory): the bytes come from DIR/objects, and the resumed run
    ends where an uninterrupted one does."""
    mix = _mix_class()
    torch.manual_seed(11)
    model = nn.Sequential(nn.Embedding(256, D), mix(D), nn.Linear(D, 256))
    model.context, model.vocab_size = CONTEXT, 256  # type: ignore[assignment]  # attributes Bamboo reads off a plain module
    shape = dict(SHAPE, nodes=2)
    first = bamboo.train(bamboo.Job(model=model, **shape), out=tmp_path / "run")
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    here = bamboo.train(bamboo.Job(model=model, resume=str(tmp_path / "copy"),
                                   **(shape | {"steps": 6})))  # resumed where it was made
    ref = first.config["model"]
    assert objects.is_reference(ref) and list((tmp_path / "run" / "objects").glob("*.pkl"))
    other_machine = tmp_path / "elsewhere"
    other_machine.mkdir()
    flags = ["--nodes", "2", "--stages", "2", "--micro-batches", "2", "--micro-batch-size", "2"]
    proc = _bamboo(["train", "--model", ref, *flags, "--steps", "6", "--resume",
                    str(tmp_path / "run"), "--json", "--quiet", "--no-report"], other_machine)
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["resumed_from_step"] == 4 and summary["steps_completed"] == 6
    assert summary["losses"][:4] == first.losses
    assert summary["losses"] == here.losses and summary["param_sha256"] == here.param_sha256
