"""Hugging Face GPT-2, Llama and BERT as lists of pipeline layers.

`hf:gpt2`, `hf:llama` and `hf:bert` build transformers' own modules (GPT2Block,
LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding, BertLayer, BertEmbeddings,
BertOnlyMLMHead) from a config, cut the same way as bamboo's own models: layer 0 holds
the embeddings and the first block, the last layer holds the last block and the head, so
every boundary is a float32 [B, T, d] tensor.

    hf:gpt2                     GPT2Config() defaults (GPT-2 small)
    hf:llama                    LlamaConfig() defaults (Llama-2-7B sizes)
    hf:bert                     BertConfig() defaults (BERT-base)
    hf:gpt2:n_layer=2,n_embd=64 the defaults with overrides
    hf:/path/to/dir             config.json of a local directory, and its weights
                                (model.safetensors or pytorch_model.bin) if present

Dropout is the config's (transformers' defaults, or a directory's config.json): every
layer's forward draws from generators seeded by (seed, step, micro-batch, layer)
(`bamboo.model.run_layers`), so a pipelined run and a single process draw the same masks.
Attention runs through SDPA (GPT-2 and Llama are causal through SDPA's `is_causal`; eager
with an explicit mask where a transformers release lacks SDPA), and the LM head is untied from the token embedding (tying would
couple the first and last stage every step). Every Llama layer holds its own rotary
module and computes the (cos, sin) position embeddings itself, so nothing but the hidden
state crosses a pipeline boundary. See docs/models.md.

Names are parsed, sized and checked in `bamboo.config.presets` without torch or
transformers; transformers (an optional dependency) is imported here, once an hf:
model's layers are built.
"""
from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bamboo.config.presets import INSTALL_HF, ModelPreset

__all__ = ["hf_layer", "hf_config", "load_transformers", "load_layer",
           "layer_state_from", "hf_state_key", "Checkpoint"]


def load_transformers() -> Any:
    """Import transformers and the modeling modules used here (ValueError if missing).

    Called before the meta-device shape pass too: transformers records torch's init
    functions when first imported, and must not record the no-op stand-ins.
    """
    try:
        import transformers
        from transformers.models.bert import modeling_bert  # noqa: F401 (imported to fail early when transformers is incomplete)
        from transformers.models.gpt2 import modeling_gpt2  # noqa: F401 (imported to fail early when transformers is incomplete)
        from transformers.models.llama import modeling_llama  # noqa: F401 (imported to fail early when transformers is incomplete)
    except ImportError:
        raise ValueError(f"hf: models need the transformers package: {INSTALL_HF}") from None
    return transformers


# -- layers ----------------------------------------------------------------------------


@functools.cache
def hf_config(config_json: str) -> Any:
    """The transformers config of a preset's `hf_config` values, with SDPA attention
    where this transformers has it for the model (eager otherwise)."""
    values = json.loads(config_json)
    config_class, model_class = _classes(values["model_type"])
    config = config_class.from_dict(values)
    sdpa = getattr(model_class, "_supports_sdpa", False)
    config._attn_implementation = "sdpa" if sdpa else "eager"
    return config


def _classes(kind: str) -> tuple[Any, Any]:
    """The config class and PreTrainedModel class of model_type `kind`."""
    transformers = load_transformers()
    name = {"gpt2": "GPT2", "llama": "Llama", "bert": "Bert"}[kind]
    return getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}PreTrainedModel")


def _config_of(p: ModelPreset) -> Any:
    config = hf_config(p.hf_config)
    sizes = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
             config.vocab_size)
    if sizes != (p.layers, p.d_model, p.heads, p.vocab):
        raise ValueError(f"model '{p.name}': transformers reads its config as layers, d, heads, "
                         f"vocab = {sizes}, not {(p.layers, p.d_model, p.heads, p.vocab)}")
    return config


@functools.cache
def _initialiser(config_json: str) -> Callable[[nn.Module], None]:
    """The `_init_weights` of the model's PreTrainedModel class (holds no parameters)."""
    config = hf_config(config_json)
    return _classes(config.model_type)[1](config)._init_weights


def _first(output: Any) -> torch.Tensor:
    # Blocks return a tensor in transformers 5 and a tuple (hidden, ...) before.
    return output[0] if isinstance(output, tuple) else output


def _with_layer_idx(cls: type[nn.Module], config: Any, index: int) -> nn.Module:
    # Older BertLayer takes no layer_idx.
    if "layer_idx" in inspect.signature(cls.__init__).parameters:
        return cls(config, layer_idx=index)
    return cls(config)


def _causal_mask(x: torch.Tensor) -> torch.Tensor:
    """Additive [1, 1, T, T] mask: eager attention is causal only through a mask."""
    t = x.shape[1]
    blocked = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
    return torch.zeros(1, 1, t, t, dtype=x.dtype, device=x.device).masked_fill(
        blocked, torch.finfo(x.dtype).min)


class HFGPT2Layer(nn.Module):
    """A GPT2Block, with token + position embedding before it or ln_f + LM head after it."""

    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        first, last = index == 0, index == config.num_hidden_layers - 1
        d = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, d) if first else None
        self.wpe = nn.Embedding(config.max_position_embeddings, d) if first else None
        self.block = GPT2Block(config, layer_idx=index)
        self.eager = config._attn_implementation == "eager"
        self.ln_f = nn.LayerNorm(d, eps=config.layer_norm_epsilon) if last else None
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = self.wte(x) + self.wpe(positions)
        # SDPA is causal without a mask (is_causal), which keeps its fast kernels.
        x = _first(self.block(x, attention_mask=_causal_mask(x) if self.eager else None))
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


class HFLlamaLayer(nn.Module):
    """A LlamaDecoderLayer with its own rotary embedding, with the token embedding before it
    or the final RMSNorm + LM head after it."""

    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )
        first, last = index == 0, index == config.num_hidden_layers - 1
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d) if first else None
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.block = LlamaDecoderLayer(config, layer_idx=index)
        self.eager = config._attn_implementation == "eager"
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps) if last else None
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        cos_sin = self.rotary_emb(x, positions)
        x = _first(self.block(x, attention_mask=_causal_mask(x) if self.eager else None,
                              position_ids=positions, position_embeddings=cos_sin))
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


class HFBertLayer(nn.Module):
    """A BertLayer, with BertEmbeddings before it or the masked-LM head after it."""

    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        from transformers.models.bert.modeling_bert import (
            BertEmbeddings,
            BertLayer,
            BertOnlyMLMHead,
        )
        first, last = index == 0, index == config.num_hidden_layers - 1
        self.embeddings = BertEmbeddings(config) if first else None
        self.block = _with_layer_idx(BertLayer, config, index)
        self.cls = BertOnlyMLMHead(config) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embeddings is not None:
            x = self.embeddings(input_ids=x)
        x = _first(self.block(x))
        if self.cls is not None:
            x = self.cls(x)
        return x

    def untie_head_bias(self) -> None:
        """Keep one bias for the decoder: transformers 5 holds an unused second one."""
        if self.cls is None:
            return
        predictions = self.cls.predictions
        if predictions.decoder.bias is None:  # transformers 4: decoder.bias is predictions.bias
            predictions.decoder.bias = predictions.bias
        del predictions.bias


def hf_layer(p: ModelPreset, index: int, *, init: bool = True) -> nn.Module:
    """Layer `index` of hf preset `p`: random from the current RNG, or the file's weights."""
    config = _config_of(p)
    layer_class = {"gpt2": HFGPT2Layer, "llama": HFLlamaLayer, "bert": HFBertLayer}[p.family]
    layer: nn.Module = layer_class(config, index)
    if init and not p.hf_weights:
        layer.apply(_initialiser(p.hf_config))
    if isinstance(layer, HFBertLayer):
        layer.untie_head_bias()
    if init and p.hf_weights:
        load_layer(layer, p, index, Checkpoint.open(p.hf_weights, p.family))
    return layer


# -- weights ---------------------------------------------------------------------------


_PREFIX = {"gpt2": "transformer.", "llama": "model.", "bert": "bert."}
"""The base model's prefix in a head model's file (GPT2LMHeadModel, LlamaForCausalLM, ...)."""


class Checkpoint:
    """Tensors of a weights file under normalised names (no `transformer.`/`model.`/`bert.`
    prefix, LayerNorm gamma/beta as weight/bias); safetensors read per tensor."""

    def __init__(self, tensors: Callable[[str], torch.Tensor], names: list[str], kind: str) -> None:
        prefix = _PREFIX[kind]
        self._raw: dict[str, str] = {}
        for raw in names:
            key = raw.removeprefix(prefix)
            if key.endswith("LayerNorm.gamma"):
                key = key.removesuffix("gamma") + "weight"
            elif key.endswith("LayerNorm.beta"):
                key = key.removesuffix("beta") + "bias"
            self._raw[key] = raw
        self._tensors = tensors

    @staticmethod
    @functools.cache
    def open(path: str, kind: str) -> Checkpoint:
        if path.endswith(".safetensors"):
            from safetensors import safe_open
            handle = safe_open(path, framework="pt")
            return Checkpoint(handle.get_tensor, list(handle.keys()), kind)
        try:  # mmap: a node touches only its own layers' pages
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (pre-zip) format cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
        return Checkpoint(state.__getitem__, list(state), kind)

    @staticmethod
    def of_state_dict(state: dict[str, torch.Tensor], kind: str) -> Checkpoint:
        return Checkpoint(state.__getitem__, list(state), kind)

    def get(self, key: str) -> torch.Tensor | None:
        raw = self._raw.get(key)
        return None if raw is None else self._tensors(raw)


_PLACES = {"gpt2": {"wte.": "wte.", "wpe.": "wpe.", "block.": "h.{i}.", "ln_f.": "ln_f.",
                    "lm_head.": "lm_head."},
           "llama": {"embed_tokens.": "embed_tokens.", "block.": "layers.{i}.",
                     "norm.": "norm.", "lm_head.": "lm_head."},
           "bert": {"embeddings.": "embeddings.", "block.": "encoder.layer.{i}.", "cls.": "cls."}}
# Tied checkpoints store the head once, as the embedding (and BERT's bias as predictions.bias).
_FALLBACKS = {"gpt2": {"lm_head.weight": "wte.weight"},
              "llama": {"lm_head.weight": "embed_tokens.weight"},
              "bert": {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight",
                       "cls.predictions.decoder.bias": "cls.predictions.bias"}}


def _normalised_key(kind: str, index: int, name: str) -> str:
    prefix = next(p for p in _PLACES[kind] if name.startswith(p))
    return _PLACES[kind][prefix].format(i=index) + name[len(prefix):]


def hf_state_key(kind: str, index: int, name: str) -> str:
    """The name parameter `name` of layer `index` has in transformers' own head model
    (GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM) of an untied checkpoint."""
    key = _normalised_key(kind, index, name)
    return key if key.startswith(("lm_head.", "cls.")) else _PREFIX[kind] + key


def layer_state_from(ckpt: Checkpoint, kind: str, index: int,
                     names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of layer `index`'s parameters `names` (ValueError if missing)."""
    out = {}
    for name in names:
        key = _normalised_key(kind, index, name)
        tensor = ckpt.get(key)
        if tensor is None and name in _FALLBACKS[kind]:
            tensor = ckpt.get(_FALLBACKS[kind][name])
        if tensor is None:
            raise ValueError(f"the weights file has no tensor '{key}' for layer {index}")
        out[name] = tensor
    return out


def load_layer(layer: nn.Module, p: ModelPreset, index: int, ckpt: Checkpoint) -> None:
    """Copy layer `index`'s parameters from `ckpt` into `layer` (cast to its dtype)."""
    params = dict(layer.named_parameters())
    state = layer_state_from(ckpt, p.family, index, list(params))
    with torch.no_grad():
        for name, tensor in state.items():
            if tensor.shape != params[name].shape:
                raise ValueError(f"weights for layer {index} '{name}' have shape "
                                 f"{tuple(tensor.shape)}, the config says "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(tensor)
