"""`bamboo export` of real runs: the trained model as a single-process checkpoint that
loads and computes as the pipeline did."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bamboo import cli
from bamboo.model import build_layers
from bamboo.run.export import read_run
from support.procs import REPO

pytestmark = pytest.mark.procs  # every test here starts processes


def _train(tmp_path: Path, name: str, *args: str) -> Path:
    out = tmp_path / name
    code = cli.main(["train", "--nodes", "2", "--stages", "2", "--steps", "2",
                     "--micro-batches", "2", "--micro-batch-size", "4", "--quiet",
                     "--no-report", "--out", str(out), *args])
    assert code == 0
    return out


def _export(run: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code = cli.main(["export", str(run), "--hf", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def _bamboo_logits(run: Path, x: torch.Tensor) -> torch.Tensor:
    """The logits of bamboo's own model, its layers built and loaded from model.pt."""
    p, _, states = read_run(run)
    layers = build_layers(p, range(p.layers), seed=1)
    for layer, state in zip(layers, states, strict=True):
        layer.load_state_dict(state, strict=True)
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x


def _check_same_model(run: Path, out: Path, architecture: str, vocab: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == architecture
    assert model.config.vocab_size == vocab and not model.config.tie_word_embeddings
    # The same parameters: every tensor once (GPT-2's transposed), so count and norm agree.
    run_params = torch.load(run / "model.pt", weights_only=True)
    hf_params = dict(model.named_parameters())
    assert len(hf_params) == len(run_params)
    assert sum(t.numel() for t in hf_params.values()) == sum(t.numel() for t in run_params.values())
    norm = math.fsum(float(t.double().square().sum()) for t in run_params.values())
    hf_norm = math.fsum(float(t.detach().double().square().sum()) for t in hf_params.values())
    assert math.isclose(hf_norm, norm, rel_tol=1e-12)
    summary = json.loads((run / "summary.json").read_text())
    assert math.isclose(math.sqrt(norm), summary["param_l2"], rel_tol=1e-9)
    context = model.config.max_position_embeddings
    x = torch.randint(0, vocab, (3, context), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=x).logits
    torch.testing.assert_close(_bamboo_logits(run, x), expected, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_gpt2_run_exports_to_gpt2_lm_head_model(tmp_path: Path, capsys) -> None:
    run = _train(tmp_path, "run", "--model", "gpt2-tiny")
    out = tmp_path / "hf"
    assert "GPT2LMHeadModel" in _export(run, out, capsys)
    assert {"config.json", "model.safetensors"} <= {f.name for f in out.iterdir()}
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temporary left
    _check_same_model(run, out, "GPT2LMHeadModel", 256)
    config = json.loads((out / "config.json").read_text())
    assert config["activation_function"] == "gelu_new" and config["n_positions"] == 64


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_llama_run_on_a_bpe_data_directory_exports_with_its_tokenizer(tmp_path: Path,
                                                                           capsys) -> None:
    text = tmp_path / "docs.txt"
    text.write_text((REPO / "docs" / "architecture.md").read_text(encoding="utf-8")[:20000],
                    encoding="utf-8")
    data = tmp_path / "data"
    assert cli.main(["data", "prepare", str(text), "--out", str(data), "--tokenizer", "bpe:300",
                     "--quiet"]) == 0
    run = _train(tmp_path, "run", "--model", "llama-tiny", "--data", str(data))
    out = tmp_path / "hf"
    err = _export(run, out, capsys)
    assert "LlamaForCausalLM" in err and "vocab 300" in err and "tokenizer" in err
    _check_same_model(run, out, "LlamaForCausalLM", 300)  # the data's vocabulary, not 256
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("pipelines and shadows")["input_ids"]) == \
        "pipelines and shadows"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_hf_llama_run_exports_under_its_own_names(tmp_path: Path, capsys) -> None:
    name = ("hf:llama:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,"
            "num_key_value_heads=2,intermediate_size=64,max_position_embeddings=32,"
            "vocab_size=256")
    run = _train(tmp_path, "run", "--model", name)
    out = tmp_path / "hf"
    _export(run, out, capsys)
    _check_same_model(run, out, "LlamaForCausalLM", 256)
    # The exported directory is an hf:DIR model: it trains on from the run's parameters.
    # Its config says bf16, as released Llama checkpoints do: the run's weights are fp32, and
    # so must its export say, or transformers would load them rounded to bf16.
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    again = _train(tmp_path, "again", "--model", f"hf:{out}", "--steps", "1", "--lr", "1e-30")
    _export(again, tmp_path / "hf-again", capsys)
    _check_same_model(again, tmp_path / "hf-again", "LlamaForCausalLM", 256)
    assert json.loads((tmp_path / "hf-again" / "config.json").read_text())["dtype"] == "float32"
    before, after = (torch.load(r / "model.pt", weights_only=True) for r in (run, again))
    assert before.keys() == after.keys()
    for key, tensor in before.items():  # a step of lr 1e-30 moves nothing measurable
        torch.testing.assert_close(after[key], tensor, rtol=1e-6, atol=1e-12)
