"""Your own model (bamboo.model.api): loaded by import path, checked before anything starts,
and trained through the real command line like bamboo's own presets, failover included.

Its tests that start processes: tests/integration/test_custom_model_runs.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bamboo.config.presets import custom_preset, preset, with_vocab
from bamboo.data.sizing import SIZING
from bamboo.model import boundary_shapes, build_layer, build_layers, layer_param_counts, loss_fn
from bamboo.model.api import PipelineModel, TensorSpec
from support.models import EXAMPLE, HEADER, TINY, write_module
from support.procs import REPO


def tiny_model(context: str = "16", boundary: str = "TensorSpec((CONTEXT, D))",
               layers: str = "[lambda: nn.Sequential(nn.Embedding(vocab_size, D), nn.Linear(D, D)),"
                             " lambda: nn.Linear(D, vocab_size)]",
               extra: str = "", signature: str = "vocab_size: int = 256",
               body: str = "") -> str:
    return HEADER + f"""
CONTEXT, D = {context}, 8


def build({signature}) -> PipelineModel:
    {body or "pass"}
    return PipelineModel(layers={layers}, boundary={boundary}, context=CONTEXT,
                         vocab_size={'vocab_size' if 'vocab_size' in signature else 256}{extra})
"""


# What is wrong -> (module source or None for the example, function, what the one line says).
BAD = {
    "no module": (None, "no_such_module_for_bamboo:build", "no module 'no_such_module_for_bamboo'"),
    "no function": ("TINY", "nope", "has no function 'nope'"),
    "not MODULE:FUNCTION": (None, "examples/custom model:build", "is not MODULE:FUNCTION"),
    "import fails": ("import no_such_dependency_for_bamboo\n", "build",
                     "ModuleNotFoundError: No module named 'no_such_dependency_for_bamboo'"),
    "not a function": ("build = 3\n", "build", "is int, not a function"),
    "build raises": (tiny_model(body="raise RuntimeError('no GPU here')"), "build",
                     "build() raised RuntimeError: no GPU here"),
    "not a PipelineModel": ("def build(vocab_size=256):\n    return {'layers': []}\n", "build",
                            "build() returned dict, not a bamboo.model.api.PipelineModel"),
    "uses a vocab_size it does not take": (tiny_model(signature=""), "build",
                                           "layer 0's factory raised NameError: name "
                                           "'vocab_size' is not defined"),
    "vocab_size without a default": (tiny_model(signature="vocab_size: int"), "build",
                                     "has a parameter without a default"),
    "zero layers": (tiny_model(layers="[]"), "build", "PipelineModel has no layers"),
    "layers not callables": (tiny_model(layers="[nn.Linear(8, 8)]"), "build",
                             "layers[0] is Linear, not a zero-argument callable"),
    "bad spec shape": (tiny_model(boundary="TensorSpec((CONTEXT, 0))"), "build",
                       "TensorSpec shape (16, 0) is not a tuple of positive integers"),
    "integer boundary": (tiny_model(boundary="TensorSpec((CONTEXT, D), torch.int64)"), "build",
                         "is not a floating torch dtype"),
    "wrong number of specs": (tiny_model(boundary="[TensorSpec((CONTEXT, D))] * 2"), "build",
                              "boundary lists 2 specs but its 2 layers need 1"),
    "spec does not hold": (tiny_model(boundary="TensorSpec((CONTEXT, 2 * D))"), "build",
                           "layer 0 outputs [B, 16, 8] torch.float32 but the model "
                           "declares its boundary 0 as [B, 16, 16] torch.float32"),
    "factory raises": (tiny_model(layers="[lambda: nn.Linear(D, D, bias='x' + 1)]"), "build",
                       "layer 0's factory raised TypeError"),
    "factory returns no module": (tiny_model(layers="[lambda: 3]"), "build",
                                  "layer 0's factory returned int, not an nn.Module"),
    "byte vocabulary too small": (tiny_model(signature="vocab_size: int = 100"), "build",
                                  "vocab_size=100 is too small for byte tokens"),
}


def train_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """The one line `bamboo train ARGV` prints, run in this process (exit code != 0)."""
    from bamboo.cli import main
    try:
        code = main(["train", *argv])
    except SystemExit as e:
        code = e.code
    assert code not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("bamboo train: error: --model"), err
    return lines[0]


@pytest.mark.parametrize("case", BAD)
def test_a_bad_model_is_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    source, function, expected = BAD[case]
    name = function
    if source is not None:
        file = write_module(tmp_path, "model_" + case.replace(" ", "_").replace("-", "_"),
                            TINY if source == "TINY" else source)
        name = f"{file}:{function}"
    out = tmp_path / "run"
    line = train_error(["--model", name, "--nodes", "1", "--stages", "1", "--steps", "1",
                        "--out", str(out)], capsys)
    assert expected in line, line
    assert not out.exists()


def test_the_preset_comes_from_the_build_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    p = preset(EXAMPLE, SIZING)
    assert (p.name, p.family, p.layers, p.context, p.vocab, p.d_model) == \
        (EXAMPLE, "custom", 4, 64, 256, 64)
    assert "example transformer" in p.description
    assert preset("examples/custom_model.py:build", SIZING).layers == 4
    try:  # an hf: name has a colon too
        assert preset("hf:gpt2", SIZING).family == "gpt2"
    except ValueError as e:  # without transformers installed
        assert "transformers" in str(e), e


def test_another_vocabulary_rebuilds_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    p = with_vocab(preset(EXAMPLE, SIZING), 300, SIZING)
    assert p == custom_preset(EXAMPLE, 300, sizer=SIZING.model)
    assert (p.name, p.vocab) == (EXAMPLE, 300)
    assert boundary_shapes(p, 2)[-1].shape == (2, 64, 300)
    first, last = build_layers(p, [0, 3], seed=1)
    assert first[0].tokens.weight.shape == (300, 64)
    assert last[-1].out.weight.shape == (300, 64)


def test_a_build_function_must_pass_the_vocabulary_on(tmp_path: Path) -> None:
    file = write_module(tmp_path, "fixed_vocab", tiny_model().replace(
        "vocab_size=vocab_size", "vocab_size=256").replace("nn.Embedding(vocab_size, D)",
                                                           "nn.Embedding(256, D)").replace(
        "nn.Linear(D, vocab_size)", "nn.Linear(D, 256)"))
    assert preset(f"{file}:build", SIZING).vocab == 256
    with pytest.raises(ValueError, match=r"build\(vocab_size=300\) returned a model with "
                                         r"vocab_size=256: pass vocab_size on"):
        custom_preset(f"{file}:build", 300, sizer=SIZING.model)


def test_boundaries_may_differ_and_hold_in_a_real_forward(tmp_path: Path) -> None:
    """One spec per boundary; the declared specs are what real layers give, and every layer
    is drawn from its own (seed, index) stream, whoever builds it."""
    source = tiny_model(
        boundary="[TensorSpec((CONTEXT, D)), TensorSpec((CONTEXT, 2 * D))]",
        layers="[lambda: nn.Embedding(vocab_size, D), lambda: nn.Linear(D, 2 * D), "
               "lambda: nn.Linear(2 * D, vocab_size)]",
        extra=", loss=lambda out, y: torch.nn.functional.cross_entropy("
              "out.reshape(-1, out.shape[-1]), y.reshape(-1)),"
              " output=TensorSpec((CONTEXT, vocab_size))")
    p = preset(f"{write_module(tmp_path, 'widths', source)}:build", SIZING)
    assert (p.layers, p.d_model) == (3, 0)
    specs = boundary_shapes(p, 2)
    assert [(s.shape, s.dtype) for s in specs] == [
        ((2, 16, 8), torch.float32), ((2, 16, 16), torch.float32), ((2, 16, 256), torch.float32)]
    layers = build_layers(p, range(3), seed=7)
    x = torch.randint(0, 256, (2, 16))
    for layer, spec in zip(layers, specs):
        x = layer(x)
        assert (x.shape, x.dtype) == (spec.shape, spec.dtype)
    assert loss_fn(p)(x.float(), torch.randint(0, 256, (2, 16))).dim() == 0
    assert layer_param_counts(p) == [sum(t.numel() for t in m.parameters()) for m in layers]
    alone = build_layer(p, 1, seed=7)
    for a, b in zip(alone.parameters(), layers[1].parameters()):
        assert torch.equal(a, b)


def test_the_api_checks_its_fields_itself() -> None:
    with pytest.raises(ValueError, match="no layers"):
        PipelineModel(layers=[], boundary=TensorSpec((4, 4)), context=4, vocab_size=8)
    with pytest.raises(ValueError, match="context=0 is not a positive integer"):
        PipelineModel(layers=[torch.nn.Identity], context=0, vocab_size=8)
    with pytest.raises(ValueError, match="must be a TensorSpec"):
        PipelineModel(layers=[torch.nn.Identity] * 2, boundary=(4, 4), context=4, vocab_size=8)
    model = PipelineModel(layers=[torch.nn.Identity], context=4, vocab_size=8)
    assert model.boundaries == (TensorSpec((4, 8)),)


# -- through the real command line, with real worker processes -----------------------------


def test_a_job_file_names_a_model_by_import_path(tmp_path: Path) -> None:
    from bamboo.config.jobfile import load_job_config
    job = tmp_path / "job.yaml"
    job.write_text("model: examples.custom_model:build\nlayout:\n  nodes: 2\n  stages: 2\n")
    assert load_job_config(str(job), {}, SIZING).model.name == "examples.custom_model:build"
