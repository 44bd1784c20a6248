"""Models as layer lists: real structure, per-layer determinism, declared shapes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from bamboo.config.presets import PRESETS, preset
from bamboo.data.datasets import make_task
from bamboo.model import boundary_shapes, build_layer, build_layers, layer_param_counts, loss_fn
from bamboo.model.gpt2 import GPTBlock
from bamboo.model.layer import PipelineLayer

SMALL = ["gpt2-tiny", "llama-tiny", "bert-tiny", "cnn-tiny"]


@pytest.mark.parametrize("name", SMALL)
def test_declared_boundary_shapes_match_a_real_forward(name: str) -> None:
    p = preset(name)
    task = make_task(p, seed=0, global_micro_batches=1, micro_batch_size=3)
    x = task.batch(0, 0).inputs
    for layer, spec in zip(build_layers(p, range(p.layers), seed=0), boundary_shapes(p, 3)):
        x = layer(x)
        assert tuple(x.shape) == spec.shape and x.dtype == spec.dtype


@pytest.mark.parametrize("name", SMALL)
def test_each_layer_is_a_pure_function_of_seed_and_index(name: str) -> None:
    p = preset(name)
    whole = build_layers(p, range(p.layers), seed=7)
    alone = build_layer(p, p.layers - 1, seed=7)
    for a, b in zip(whole[-1].parameters(), alone.parameters()):
        assert torch.equal(a, b)
    other_seed = build_layer(p, p.layers - 1, seed=8)
    assert not all(torch.equal(a, b) for a, b in zip(alone.parameters(), other_seed.parameters()))


def test_param_counts_match_built_layers() -> None:
    p = preset("gpt2-tiny")
    built = [sum(t.numel() for t in layer.parameters()) for layer in build_layers(p, range(8), 0)]
    assert layer_param_counts(p) == built
    assert 400_000 < sum(built) < 450_000


def test_gpt2_small_has_gpt2_small_sizes() -> None:
    # 124M with a tied head; ours is untied, which adds vocab x d = 38.6M.
    total = sum(layer_param_counts(preset("gpt2-small")))
    assert total == 124_439_808 + 50257 * 768


def test_llama_1b_has_llama_3_2_1b_sizes() -> None:
    # 1,235,814,400 with the head tied to the embedding; ours is untied: + vocab x d.
    p = preset("llama-1b")
    counts = layer_param_counts(p)  # on the meta device: no memory, no init
    assert len(counts) == 16 and counts[1] == counts[-2]
    assert sum(counts) == 1_235_814_400 + 128256 * 2048
    assert boundary_shapes(p, 1)[-1].shape == (1, 2048, 128256)


def test_llama_is_causal_with_grouped_query_attention() -> None:
    p = preset("llama-tiny")
    layer = build_layer(p, 1, seed=0)
    attn = layer.block.self_attn
    assert attn.k_proj.weight.shape == (2 * 16, 64) and attn.q_proj.weight.shape == (64, 64)
    x = torch.randn(2, 10, p.d_model)
    y = x.clone()
    y[:, 7:] += 1.0  # change only the future of position 6
    assert torch.allclose(layer(x)[:, :7], layer(y)[:, :7], atol=1e-6)
    assert not torch.allclose(layer(x)[:, 7:], layer(y)[:, 7:])


def test_gpt2_is_causal() -> None:
    torch.manual_seed(0)
    block = GPTBlock(32, 4, 2)
    x = torch.randn(1, 10, 32)
    y = x.clone()
    y[:, 7:] += 1.0  # change only the future of position 6
    assert torch.allclose(block(x)[:, :7], block(y)[:, :7], atol=1e-6)
    assert not torch.allclose(block(x)[:, 7:], block(y)[:, 7:])


def test_bert_is_bidirectional() -> None:
    p = preset("bert-tiny")
    layer = build_layer(p, 1, seed=0)
    x = torch.randn(1, p.context, p.d_model)
    y = x.clone()
    y[:, -1] += 1.0
    assert not torch.allclose(layer(x)[:, 0], layer(y)[:, 0])


@pytest.mark.parametrize("name", SMALL)
def test_a_few_steps_of_plain_training_reduce_loss(name: str) -> None:
    p = preset(name)
    torch.manual_seed(0)
    model = nn.Sequential(*build_layers(p, range(p.layers), seed=0))
    task = make_task(p, seed=0, global_micro_batches=1, micro_batch_size=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = task.batch(0, 0)
    first = None
    for _ in range(30 if p.family == "cnn" else 12):
        loss = loss_fn(p)(model(batch.inputs), batch.targets)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.8 * first


def test_every_preset_is_described() -> None:
    for p in PRESETS.values():
        assert p.description and p.layers >= 2


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_transformers_share_one_layer_wrapper_with_the_same_parameter_names(name: str) -> None:
    """GPT-2 and BERT layers are both `PipelineLayer`: embed (layer 0), block, head (last
    layer), the names model.pt and checkpoints hold."""
    p = preset(name)
    layers = build_layers(p, range(p.layers), seed=0)
    assert all(type(layer) is PipelineLayer for layer in layers)

    def parts(layer: nn.Module) -> list[str]:
        return list(dict.fromkeys(n.split(".")[0] for n, _ in layer.named_parameters()))
    assert parts(layers[0]) == ["embed", "block"]
    assert all(parts(layer) == ["block"] for layer in layers[1:-1])
    assert parts(layers[-1]) == ["block", "head"]
    x = torch.randint(0, p.vocab - 1, (2, p.context))
    out = layers[0](x)  # the wrapper runs embed, then block: the same as by hand
    assert torch.equal(out, layers[0].block(layers[0].embed(x)))
