"""Your model as it is, trained by processes with a node killed in flight: an
`nn.Sequential` tabular classifier and a conv net with no bamboo attribute (their shapes
come from the Dataset's first sample), a transformers GPT2LMHeadModel object and a built
DeepSpeed PipelineModule with loaded weights, each ending equal to its failure-free run;
with a learning rate of 0 each ends with its own parameters, bit for bit (an
`nn.Sequential`, a list of modules, the PipelineModule, the GPT-2), a model over 8 MiB
included, and one over a wire frame reaches an agent in parts."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import tempfile
from pathlib import Path

import cloudpickle
import pytest
import torch
from torch import nn

import bamboo
import support.your_model
from bamboo.config import objects
from support.agents import stop, wait_for
from support.procs import BAMBOO, REPO, free_port
from support.reference import train_reference
from support.runs import REL, assert_close, param_l2
from support.your_model import (
    IMAGES,
    TABULAR,
    TOKENS,
    built_pipeline_module,
    image_model,
    tabular_model,
)

pytestmark = [pytest.mark.procs, pytest.mark.slow]  # every test here starts processes

SHAPE = dict(nodes=2, stages=2, micro_batches=2, micro_batch_size=4, steps=4)
STILL = functools.partial(torch.optim.SGD, lr=0.0)
"""A learning rate of 0: the run ends with the parameters it started from."""
SGD = functools.partial(torch.optim.SGD, lr=0.1)
NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
NO_TRANSFORMERS = importlib.util.find_spec("transformers") is None

# the support module's functions (the tied head, the loss) travel by value with the model:
# a worker cannot import `support`
cloudpickle.register_pickle_by_value(support.your_model)


def _killed_equals_clean(model: object, tmp_path: Path, **job: object) -> bamboo.RunResult:
    clean = bamboo.train(bamboo.Job(model=model, **SHAPE, **job), out=tmp_path / "clean")
    killed = bamboo.train(bamboo.Job(model=model, kill=["0:1@2"], **SHAPE, **job),
                          out=tmp_path / "killed")
    assert killed.failovers == 1 == killed.preemptions
    assert killed.losses == clean.losses and killed.param_sha256 == clean.param_sha256
    start = [t for t in model.state_dict().values()] if isinstance(model, nn.Module) else []
    trained = list(killed.state_dict().values())
    assert not any(torch.equal(a, b) for a in start for b in trained if a.shape == b.shape
                   and a.shape[0] > 2)  # it trained: no tensor is the one it started as
    return killed


def _keeps_its_parameters(model: object, own: dict[str, torch.Tensor], out: Path,
                          key: object = lambda name: name, **job: object) -> None:
    """Trained with a learning rate of 0, the run's model.pt holds `own` (the object's
    state dict), bit for bit, under `layers.<index>.<name>`; `key` maps those names to
    `own`'s."""
    result = bamboo.train(bamboo.Job(model=model, optimizer=STILL, **SHAPE, **job), out=out)
    state = result.state_dict()
    assert state, "the run wrote no parameters"
    for name, tensor in state.items():
        mine = own[key(name.removeprefix("layers."))]
        assert torch.equal(tensor, mine), name


@pytest.mark.timeout(240)
def test_a_plain_sequential_on_a_tabular_dataset_killed_in_flight_ends_equal(
        tmp_path: Path) -> None:
    """No context, vocab_size or inputs: [20] float features and int labels give the
    shapes. Equal to the single-process loop too; an nn.Sequential and a list of its
    modules each keep their parameters at a learning rate of 0."""
    torch.manual_seed(1)
    model = tabular_model()
    loss = nn.functional.cross_entropy
    job = bamboo.Job(model=model, dataset=TABULAR, loss=loss, optimizer=SGD, **SHAPE)
    killed = _killed_equals_clean(model, tmp_path, dataset=TABULAR, loss=loss, optimizer=SGD)
    losses, params = train_reference(job.config)
    assert_close(killed.losses, losses, rel=REL)
    assert_close(killed.param_l2, param_l2(params), rel=REL)
    own = model.state_dict()
    _keeps_its_parameters(model, own, tmp_path / "still", dataset=TABULAR, loss=loss)
    _keeps_its_parameters(list(model), own, tmp_path / "listed", dataset=TABULAR, loss=loss)


@pytest.mark.timeout(240)
def test_a_plain_conv_net_on_float_images_killed_in_flight_ends_equal(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = image_model()
    loss = nn.functional.cross_entropy
    job = bamboo.Job(model=model, dataset=IMAGES, loss=loss, optimizer=SGD, **SHAPE)
    killed = _killed_equals_clean(model, tmp_path, dataset=IMAGES, loss=loss, optimizer=SGD)
    losses, params = train_reference(job.config)
    assert_close(killed.losses, losses, rel=REL)
    assert_close(killed.param_l2, param_l2(params), rel=REL)


@pytest.mark.timeout(240)
@pytest.mark.skipif(NO_TRANSFORMERS, reason="transformers is not installed")
def test_a_gpt2_object_killed_in_flight_ends_equal_and_keeps_its_weights(
        tmp_path: Path) -> None:
    """transformers' GPT2LMHeadModel as it is (its tied head stays tied, its dropout
    seeded), on a token Dataset; at a learning rate of 0 the run ends with its weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from bamboo.model.hf import hf_state_key
    torch.manual_seed(3)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16,
                                      vocab_size=64))
    _killed_equals_clean(gpt2, tmp_path, dataset=TOKENS, optimizer=SGD)
    own = gpt2.state_dict()

    def key(name: str) -> str:
        index, _, rest = name.partition(".")
        return hf_state_key("gpt2", int(index), rest)

    _keeps_its_parameters(gpt2, own, tmp_path / "still", key, dataset=TOKENS)


@pytest.mark.timeout(240)
@pytest.mark.skipif(NO_DEEPSPEED, reason="deepspeed is not installed")
def test_a_built_pipeline_module_with_loaded_weights_ends_equal_and_keeps_them(
        tmp_path: Path) -> None:
    """A PipelineModule built (one stage), then given weights unlike any it would draw:
    the run starts from those, not from its LayerSpecs built anew."""
    built = built_pipeline_module()
    torch.manual_seed(4)
    loaded = {name: torch.randn_like(t) for name, t in built.state_dict().items()}
    module = built_pipeline_module(loaded)
    _killed_equals_clean(module, tmp_path, dataset=TOKENS, optimizer=SGD)

    def key(name: str) -> str:  # the tied embedding and head are DeepSpeed's one module
        index, _, rest = name.partition(".")
        return f"tied_modules.embed.{rest.removeprefix('module.')}" \
            if index in ("0", "3") else name

    _keeps_its_parameters(module, loaded, tmp_path / "still", key, dataset=TOKENS)


@pytest.mark.timeout(240)
def test_a_model_over_8_mib_is_sent_by_value_and_trains(tmp_path: Path) -> None:
    torch.manual_seed(5)
    big = nn.Sequential(nn.Linear(20, 1500), nn.Linear(1500, 1500), nn.Linear(1500, 2))
    assert sum(p.numel() for p in big.parameters()) * 4 > 8 << 20
    _keeps_its_parameters(big, big.state_dict(), tmp_path / "big", dataset=TABULAR,
                          loss=nn.functional.cross_entropy)


def _bamboo(args: list[str], tmpdir: Path) -> subprocess.Popen:
    """`bamboo ARGS` on a "machine" whose temp directory is `tmpdir`."""
    return subprocess.Popen(BAMBOO + args, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(tmpdir), PYTHONUNBUFFERED="1"))


@pytest.mark.timeout(240)
def test_a_model_over_a_frame_reaches_an_agent_in_parts(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """20 MiB pickled, over a wire frame (16 MiB): the agent, whose machine has no copy, gets
    it in parts, signed with the token, and its workers train it as a local run does."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir(), there.mkdir()
    torch.manual_seed(6)
    big = nn.Sequential(nn.Linear(20, 2200), nn.Linear(2200, 2200), nn.Linear(2200, 2))
    flags = dict(nodes=2, stages=2, steps=2, micro_batches=2, micro_batch_size=4)
    job = bamboo.Job(model=big, dataset=TABULAR, loss="torch.nn.functional:cross_entropy",
                     **flags)
    ref, out, port = job.config.model.name, tmp_path / "run", free_port()
    assert len(objects.data_of(ref)) > 16 << 20
    local = bamboo.train(job, out=tmp_path / "local")  # this machine's workers
    monkeypatch.setattr(tempfile, "tempdir", str(here))  # the coordinator's machine
    objects.save([ref], objects.machine_dir())
    cli = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    coord = _bamboo(["coordinator", "--bind", f"127.0.0.1:{port}", "--model", ref,
                     "--dataset", TABULAR, "--loss", "torch.nn.functional:cross_entropy", *cli,
                     "--out", str(out), "--json", "--quiet", "--no-report"], here)
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
    assert [p.name for p in there.glob("bamboo-objects-*/*.pkl")] == \
        [f"{objects.digest_of(ref)}.pkl"]
    summary = json.loads(stdout)
    assert summary["status"] == "completed"
    assert (summary["losses"], summary["param_sha256"]) == (local.losses, local.param_sha256)
