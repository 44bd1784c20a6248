"""transformers' GPT-2, Llama and BERT as pipeline layers (`--model hf:...`).

The split must be faithful (the layers compose to transformers' own model), pipelined
training must equal the plain single-process loop as for bamboo's own models, local
weights must arrive unchanged, and bad names must fail with one line.

Its tests that start processes: tests/integration/test_hf_models_runs.py."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from bamboo.config.presets import HF_SIZES, preset
from bamboo.data.datasets import make_task
from bamboo.model import boundary_shapes, build_layer, build_layers, layer_param_counts, loss_fn
from bamboo.model.hf import Checkpoint, hf_config, hf_state_key, load_layer
from support.hf_models import BERT, GPT2, HF_MODELS, LLAMA


def _compose(layers: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The layers in eval mode (no dropout, as the transformers model compared with)."""
    for layer in layers:
        x = layer.eval()(x)
    return x


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", HF_MODELS)
def test_the_layers_compose_to_the_transformers_model(kind: str) -> None:
    name, model_class = HF_MODELS[kind]
    p = preset(name)
    config = copy.deepcopy(hf_config(p.hf_config))
    config._attn_implementation = "eager"  # an independent attention path, with explicit masks
    torch.manual_seed(0)
    model = model_class(config).eval()
    layers = [layer.eval() for layer in build_layers(p, range(p.layers), seed=0)]  # no dropout
    ckpt = Checkpoint.of_state_dict(model.state_dict(), kind)
    for index, layer in enumerate(layers):
        load_layer(layer, p, index, ckpt)
    assert sum(layer_param_counts(p)) == sum(t.numel() for layer in layers for t in layer.parameters())
    batch = make_task(p, seed=0, global_micro_batches=1, micro_batch_size=3).batch(0, 0)
    x = batch.inputs
    for layer, spec in zip(layers, boundary_shapes(p, 3)):
        x = layer(x)
        assert tuple(x.shape) == spec.shape and x.dtype == spec.dtype
    with torch.no_grad():
        expected = model(input_ids=batch.inputs).logits
    torch.testing.assert_close(x.detach(), expected, rtol=1e-4, atol=1e-5)
    if kind != "bert":  # causal: a later token changes no earlier logit
        changed = batch.inputs.clone()
        changed[:, -1] = (changed[:, -1] + 1) % 256
        torch.testing.assert_close(_compose(layers, changed)[:, :-1], x[:, :-1])
    loss = loss_fn(p)(x, batch.targets)
    assert 4.0 < float(loss.detach()) < 7.0  # about ln(vocab) at random init


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", HF_MODELS)
def test_each_hf_layer_is_a_pure_function_of_seed_and_index(kind: str) -> None:
    p = preset(HF_MODELS[kind][0])
    whole = build_layers(p, range(p.layers), seed=3)
    alone = build_layer(p, 1, seed=3)
    for a, b in zip(whole[1].parameters(), alone.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(t.requires_grad for layer in whole for t in layer.parameters())


def test_default_names_have_the_real_sizes() -> None:
    for kind, config in (("gpt2", GPT2Config()), ("llama", LlamaConfig()), ("bert", BertConfig())):
        assert HF_SIZES[kind] == {key: getattr(config, key) for key in HF_SIZES[kind]}
    llama = preset("hf:llama")
    assert (llama.layers, llama.d_model, llama.heads, llama.context, llama.vocab) == \
        (32, 4096, 32, 2048, 32000)
    assert llama.family == "llama"
    gpt2, bert = preset("hf:gpt2"), preset("hf:bert")
    assert (gpt2.layers, gpt2.d_model, gpt2.heads, gpt2.context) == (12, 768, 12, 1024)
    assert (bert.layers, bert.d_model, bert.heads, bert.context) == (12, 768, 12, 512)
    assert (gpt2.vocab, bert.vocab) == (50257, 30522)
    assert sum(layer_param_counts(gpt2)) == 163_037_184  # GPT-2 small with the untied head
    assert (gpt2.family, bert.family) == ("gpt2", "bert")
    assert preset(GPT2 + ",context=16").context == 16


def _gpt2_file_key(index: int, name: str) -> str:
    """Where parameter `name` of layer `index` lives in a (tied) GPT2LMHeadModel file."""
    part, rest = name.split(".", 1)
    if part == "block":
        return f"transformer.h.{index}.{rest}"
    return "transformer.wte.weight" if part == "lm_head" else f"transformer.{name}"


@pytest.mark.timeout(60)
def test_a_directory_with_safetensors_starts_from_its_weights(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=32,
                                       vocab_size=256))
    model.save_pretrained(tmp_path)  # tied: the file holds the head once, as wte
    p = preset(f"hf:{tmp_path}:context=16")
    assert p.hf_weights == str(tmp_path / "model.safetensors") and p.context == 16
    state = model.state_dict()
    layers = build_layers(p, range(p.layers), seed=5)
    names = [n for layer in layers for n, _ in layer.named_parameters()]
    assert "lm_head.weight" in names and "wte.weight" in names
    for index, layer in enumerate(layers):
        for name, tensor in layer.named_parameters():
            assert torch.equal(tensor, state[_gpt2_file_key(index, name)]), (index, name)


@pytest.mark.timeout(60)
def test_a_directory_with_an_old_style_bert_bin_starts_from_its_weights(tmp_path: Path) -> None:
    config = hf_config(preset(BERT).hf_config)
    torch.manual_seed(2)
    model = BertForMaskedLM(config).eval()
    config.to_json_file(tmp_path / "config.json")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma")
                .replace("LayerNorm.bias", "LayerNorm.beta"): v
               for k, v in model.state_dict().items()}
    torch.save(renamed, tmp_path / "pytorch_model.bin")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    got = _compose(build_layers(preset(f"hf:{tmp_path}"), range(3), seed=5), x)
    with torch.no_grad():
        expected = model(input_ids=x).logits
    torch.testing.assert_close(got.detach(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,expected", [
    (GPT2 + ",context=64", "context=64 is more than the model's 32 positions"),
    (GPT2.replace("vocab_size=256", "vocab_size=200"), "needs vocab_size >= 256"),
    (BERT.replace("vocab_size=257", "vocab_size=256"), "needs vocab_size >= 257"),
    (GPT2.replace("n_head=4", "n_head=5"), "not a multiple of the 5 attention heads"),
    (LLAMA.replace("num_key_value_heads=2", "num_key_value_heads=3"),
     "the 4 attention heads are not a multiple of the 3 key/value heads"),
    (LLAMA.replace("vocab_size=256", "vocab_size=255"), "needs vocab_size >= 256"),
])
def test_unusable_configs_are_refused(name: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        preset(name)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    # a name no other test asks for, so no preset of it was kept from a run with transformers
    with pytest.raises(ValueError, match=r"pip install 'bamboo-train\[hf\]'"):
        preset("hf:gpt2:n_layer=1,n_embd=24")


def test_a_directory_needs_a_gpt2_llama_or_bert_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        preset(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text('{"model_type": "mistral"}')
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        preset(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="only context=N may follow a directory"):
        preset(f"hf:{tmp_path}:n_layer=2")


@pytest.mark.timeout(60)
def test_a_llama_directory_with_tied_safetensors_gives_the_models_logits(tmp_path: Path) -> None:
    """As Llama 3.2 ships: safetensors, head tied to the embedding, several eos ids."""
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                         num_key_value_heads=1, intermediate_size=48, max_position_embeddings=64,
                         vocab_size=300, rope_theta=500000.0, tie_word_embeddings=True,
                         bos_token_id=128000, eos_token_id=[128001, 7])
    torch.manual_seed(4)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    p = preset(f"hf:{tmp_path}:context=16")
    assert (p.family, p.layers, p.kv_heads, p.context, p.vocab) == ("llama", 2, 1, 16, 300)
    layers = build_layers(p, range(p.layers), seed=9)
    assert torch.equal(layers[-1].lm_head.weight, model.model.embed_tokens.weight)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=x).logits
    torch.testing.assert_close(_compose(layers, x).detach(), expected, rtol=1e-4, atol=1e-5)


def _llama_key(index: int, name: str, last: int) -> str:
    """Where parameter `name` of bamboo's llama layer `index` lives in a LlamaForCausalLM."""
    part, rest = name.split(".", 1)
    if part == "block":
        return f"model.layers.{index}.{rest}"
    return rest if rest.startswith("lm_head") else f"model.{rest}"


@pytest.mark.timeout(60)
def test_in_house_llama_weights_give_llama_for_causal_lm_the_same_logits() -> None:
    """bamboo's own llama-tiny, its weights loaded into transformers' LlamaForCausalLM under
    transformers' names, gives the same logits: what `bamboo export` relies on."""
    p = preset("llama-tiny")
    layers = build_layers(p, range(p.layers), seed=11)
    config = LlamaConfig(num_hidden_layers=p.layers, hidden_size=p.d_model,
                         num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                         intermediate_size=p.ffn_dim, max_position_embeddings=p.context,
                         vocab_size=p.vocab, rms_norm_eps=p.norm_eps, rope_theta=p.rope_theta,
                         tie_word_embeddings=False)
    config._attn_implementation = "eager"  # an independent attention path: explicit mask, repeat_kv
    model = LlamaForCausalLM(config).eval()
    state = {_llama_key(i, name, p.layers - 1): t
             for i, layer in enumerate(layers) for name, t in layer.named_parameters()}
    assert state.keys() == model.state_dict().keys()
    model.load_state_dict(state, strict=True)
    for i, layer in enumerate(layers):  # the names export writes are these
        for name, _ in layer.named_parameters():
            bare = name.removeprefix("embed.").removeprefix("head.")
            assert hf_state_key("llama", i, bare) == _llama_key(i, name, p.layers - 1)
    x = make_task(p, seed=0, global_micro_batches=1, micro_batch_size=3).batch(0, 0).inputs
    with torch.no_grad():
        expected = model(input_ids=x).logits
        got = _compose(layers, x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", HF_MODELS)
def test_a_transformers_object_gives_layers_that_compose_to_its_own_logits(kind: str) -> None:
    """`bamboo.Job(model=<a transformers object>)`: the layers cut from the object (each a
    copy of its weights, `bamboo.model.hf_object`) give the object's own logits; a head
    tied in the object (as GPT-2's and BERT's are by default) is tied across the layers."""
    from bamboo.model.hf_object import hf_object_layers
    name, model_class = HF_MODELS[kind]
    config = copy.deepcopy(hf_config(preset(name).hf_config))
    config._attn_implementation = "eager"
    config.tie_word_embeddings = True
    torch.manual_seed(6)
    model = model_class(config).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.no_grad():  # weights unlike any a layer draws (biases too): each must arrive
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    cut = hf_object_layers(model)
    layers = [make() for make in cut.layers]
    assert len(layers) == config.num_hidden_layers
    (first, source), (last, head) = cut.ties["embedding"]
    assert (first, last) == (0, len(layers) - 1)
    assert torch.equal(layers[0].get_parameter(source), layers[-1].get_parameter(head))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=x).logits
    torch.testing.assert_close(_compose(layers, x).detach(), expected, rtol=1e-4, atol=1e-5)
