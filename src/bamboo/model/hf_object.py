"""A Hugging Face model object (`bamboo.Job(model=GPT2LMHeadModel(...))`) as pipeline layers
that start from its weights.

transformers' GPT-2, Llama and BERT with their language-model heads (`GPT2LMHeadModel`,
`LlamaForCausalLM`, `BertForMaskedLM`) are cut as bamboo.model.hf cuts an `hf:DIR` model:
layer 0 holds the embeddings and the first block, the last layer the last block and the
head. Each layer is built from the object's config and given the object's own tensors
(`Checkpoint.of_state_dict`), then travels by value. A head tied to the token embedding
(`tie_word_embeddings`, GPT-2's and BERT's default) stays tied: the two uses are one tie
(bamboo.model.ties), so the run trains what the object would. Other classes and families
are refused in one line that names `hf:DIR` and `model.save_pretrained(DIR)`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bamboo.config.presets import drop_special_tokens
from bamboo.model.forms_deepspeed import Copy, Ties
from bamboo.model.pipeline import ModelError

__all__ = ["is_hf_model", "HFLayers", "hf_object_layers"]

_HEADS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}
"""The transformers class bamboo trains of each family."""
_TIED = {"gpt2": ("wte.weight", "lm_head.weight"),
         "llama": ("embed_tokens.weight", "lm_head.weight"),
         "bert": ("embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")}
"""(the token embedding in layer 0, the head's weight in the last layer) of each family."""


def is_hf_model(obj: object) -> bool:
    """Whether `obj` is a transformers model (recognised without importing transformers)."""
    return (isinstance(obj, nn.Module) and type(obj).__module__.startswith("transformers.")
            and hasattr(obj, "config"))


@dataclass(frozen=True, slots=True)
class HFLayers:
    """A transformers model's layers, ties and sizes."""

    layers: list[Callable[[], nn.Module]]
    ties: Ties
    context: int
    vocab_size: int
    description: str


def _refuse(why: str) -> ModelError:
    return ModelError(f"{why}: save it with model.save_pretrained(DIR) and give "
                      f"model='hf:DIR', which bamboo trains as {', '.join(_HEADS.values())}")


def _config(obj: nn.Module) -> tuple[str, Any]:
    """(family, the config bamboo's layers are built from) of a supported object;
    ModelError naming hf:DIR for another."""
    from bamboo.model.hf import hf_config, load_transformers
    transformers = load_transformers()
    kind = getattr(obj.config, "model_type", None)
    name = type(obj).__name__
    if kind not in _HEADS:
        raise ModelError(f"{name} is a transformers model of type {kind!r}: bamboo cuts "
                         f"transformers' GPT-2, Llama and BERT into layers (as "
                         f"{', '.join(_HEADS.values())}, or from model='hf:DIR' of one)")
    if not isinstance(obj, getattr(transformers, _HEADS[kind])):
        raise _refuse(f"bamboo trains a {kind} model as {_HEADS[kind]}, not {name}")
    values = obj.config.to_dict()
    # transformers' defaults (GPT-2's 50256) outside a small vocabulary: unset, as hf: does
    drop_special_tokens(values, values.get("vocab_size", 0), {})
    if values.get("add_cross_attention") or (kind != "gpt2" and values.get("is_decoder")):
        raise ModelError(f"{name}: decoder and cross-attention configs are not supported")
    return kind, hf_config(json.dumps(values, sort_keys=True, default=str))


def _layer(kind: str, config: Any, index: int, ckpt: Any) -> nn.Module:
    """Layer `index`, its parameters the object's (`ckpt`, its state under bamboo's names)."""
    from bamboo.model.hf import HFBertLayer, HFGPT2Layer, HFLlamaLayer, layer_state_from
    layer_class = {"gpt2": HFGPT2Layer, "llama": HFLlamaLayer, "bert": HFBertLayer}[kind]
    layer: nn.Module = layer_class(config, index)
    if isinstance(layer, HFBertLayer):
        layer.untie_head_bias()
    params = dict(layer.named_parameters())
    state = layer_state_from(ckpt, kind, index, list(params))
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
    return layer


def hf_object_layers(obj: nn.Module) -> HFLayers:
    """The layers of transformers model `obj`, each a copy of its weights; ModelError (one
    line naming hf:DIR) for a class or family bamboo cannot cut."""
    from bamboo.model.hf import Checkpoint
    kind, config = _config(obj)
    if any(t.device.type not in ("cpu", "meta") for t in obj.parameters()):
        raise ModelError(f"it holds parameters on {next(obj.parameters()).device}: move it "
                         f"to the CPU (model.cpu()), the workers move each layer to their "
                         f"own device")
    ckpt = Checkpoint.of_state_dict(obj.state_dict(), kind)
    n = config.num_hidden_layers
    layers = [_layer(kind, config, i, ckpt) for i in range(n)]
    ties: Ties = {}
    if getattr(config, "tie_word_embeddings", False):
        first, head = _TIED[kind]
        if n == 1:  # one layer holds both: one parameter, as in the object
            _share(layers[0], head, first)
        else:
            ties = {"embedding": [(0, first), (n - 1, head)]}
    positions = config.max_position_embeddings
    return HFLayers(layers=[Copy(layer) for layer in layers], ties=ties, context=positions,
                    vocab_size=config.vocab_size,
                    description=f"transformers {type(obj).__name__} ({n} blocks, d="
                                f"{config.hidden_size}) sent by value")


def _share(layer: nn.Module, path: str, source: str) -> None:
    """Set parameter `path` of `layer` to its parameter `source` (one tensor, two uses)."""
    owner_path, _, attr = path.rpartition(".")
    owner = layer.get_submodule(owner_path)
    setattr(owner, attr, layer.get_parameter(source))
