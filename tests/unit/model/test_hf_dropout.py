"""hf: models keep their configured dropout (transformers' default, or a directory's
config.json), drawn from the seeded generators like any layer's (`bamboo.model.run_layers`);
a name cannot set it, and the line that says so gives the real default.

The runs that train them against the single-process loop: tests/integration/test_hf_models_runs.py."""
from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, GPT2Config, LlamaConfig

from bamboo.config.presets import preset
from bamboo.data.datasets import make_task
from bamboo.model import build_layers, forward_seed, run_layers
from bamboo.model.hf import hf_config
from support.hf_models import HF_MODELS

DEFAULTS = {"gpt2": (GPT2Config(), ["attn_pdrop", "resid_pdrop", "embd_pdrop"]),
            "llama": (LlamaConfig(), ["attention_dropout"]),
            "bert": (BertConfig(), ["hidden_dropout_prob", "attention_probs_dropout_prob"])}


@pytest.mark.parametrize("kind", HF_MODELS)
def test_a_name_keeps_transformers_default_dropout_and_says_so(kind: str) -> None:
    name = HF_MODELS[kind][0]
    defaults, keys = DEFAULTS[kind]
    config = hf_config(preset(name).hf_config)
    for key in keys:
        assert getattr(config, key) == getattr(defaults, key)
        with pytest.raises(ValueError, match=f"dropout is fixed at {getattr(defaults, key)}, "
                                             f"transformers' default for hf:{kind}"):
            preset(f"{name},{key}=0.2")
    assert config.tie_word_embeddings is False


def test_a_directory_keeps_its_own_dropout(tmp_path) -> None:
    GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=256,
               attn_pdrop=0.25, resid_pdrop=0.0).to_json_file(tmp_path / "config.json")
    config = hf_config(preset(f"hf:{tmp_path}").hf_config)
    assert (config.attn_pdrop, config.resid_pdrop) == (0.25, 0.0)


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_hf_dropout_draws_from_the_seeded_generators(kind: str) -> None:
    """In train mode the layers drop (another micro-batch, another output); the same key
    gives the same output; in eval mode nothing is dropped."""
    p = preset(HF_MODELS[kind][0])
    layers = build_layers(p, range(p.layers), seed=0)
    x = make_task(p, seed=0, global_micro_batches=1, micro_batch_size=2).batch(0, 0).inputs

    def out(mb: int) -> torch.Tensor:
        with torch.no_grad():
            return run_layers(layers, range(p.layers), x, device="cpu",
                              seed_of=lambda i: forward_seed(0, 1, mb, i))
    assert torch.equal(out(0), out(0))
    assert not torch.equal(out(0), out(1))
    for layer in layers:
        layer.eval()
    assert torch.equal(out(0), out(1))
