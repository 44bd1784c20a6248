"""Model presets as plain data, importable without torch: what a `--model` name is, in numbers.

The command line validates a layout (stages <= layers) before it pays for importing
torch, so the facts it needs about each preset live here, in the configuration's layer,
apart from the modules (`bamboo.model` builds them from these facts).
That includes `hf:` names (transformers' GPT-2, Llama and BERT, see docs/models.md): they are
parsed and sized here without importing torch or transformers. Your own model, named
`MODULE:FUNCTION` (bamboo.model.api), is sized by building it, which needs torch and the
model package: this package never imports them. Whoever asks for such a model's facts hands
the function that builds it as an argument (`CustomSizing`: `bamboo.data.sizing.SIZING`, from
a layer that may build models and read Datasets).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["ModelPreset", "PRESETS", "preset", "HF_PREFIX", "HF_SIZES", "HFName", "parse_hf_name",
           "CAUSAL_FAMILIES", "drop_special_tokens", "custom_preset", "with_vocab",
           "CustomModelSizer", "DatasetInputs", "CustomSizing", "is_custom_name"]

CAUSAL_FAMILIES = frozenset({"gpt2", "llama", "custom"})
"""Families trained on next-token prediction (bert is masked-LM, cnn classifies images)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelPreset:
    """What a preset is, in numbers."""

    name: str
    family: str
    """`gpt2`, `llama`, `bert` or `cnn`: which builder and which task it uses."""
    layers: int
    """Number of pipeline layers: the units a partition may cut between."""
    d_model: int = 0
    heads: int = 0
    context: int = 0
    vocab: int = 256
    image_size: int = 0
    channels: int = 0
    classes: int = 0
    kv_heads: int = 0
    """llama: key/value heads of grouped-query attention (0: as many as `heads`)."""
    ffn_dim: int = 0
    """llama: SwiGLU hidden width (0: 8/3 d rounded up to a multiple of 32)."""
    rope_theta: float = 10000.0
    """llama: base of the rotary position embedding's frequencies."""
    norm_eps: float = 1e-5
    """llama: RMSNorm epsilon."""
    description: str = ""
    hf_config: str = ""
    """For hf: models, the transformers config as JSON; bamboo's own builders when empty."""
    hf_weights: str = ""
    """For hf: models read from a directory, the weights file their layers start from."""
    inputs: str = ""
    """Your own model trained on a Dataset: what its layer 0 takes per sample, as the data's
    first sample shows it (JSON text, bamboo.model.spec_text); "" when the model says."""


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(name="gpt2-tiny", family="gpt2", layers=8, d_model=64, heads=4, context=64,
                    description="GPT-2 architecture, 8 blocks, d=64, 4 heads, context 64, byte vocab"),
        ModelPreset(name="gpt2-mini", family="gpt2", layers=12, d_model=128, heads=4, context=128,
                    description="GPT-2 architecture, 12 blocks, d=128, 4 heads, context 128"),
        ModelPreset(name="gpt2-small", family="gpt2", layers=12, d_model=768, heads=12,
                    context=1024, vocab=50257,
                    description="GPT-2 small sizes: 12 blocks, d=768 (163M parameters with the untied head)"),
        ModelPreset(name="gpt2-medium", family="gpt2", layers=24, d_model=1024, heads=16,
                    context=1024, vocab=50257,
                    description="GPT-2 medium sizes: 24 blocks, d=1024 (406M parameters with the untied head)"),
        ModelPreset(name="llama-tiny", family="llama", layers=8, d_model=64, heads=4,
                    kv_heads=2, ffn_dim=176, context=64,
                    description="Llama architecture (RMSNorm, RoPE, SwiGLU, grouped-query "
                                "attention), 8 blocks, d=64, 4 heads / 2 kv heads, context 64"),
        ModelPreset(name="llama-1b", family="llama", layers=16, d_model=2048, heads=32,
                    kv_heads=8, ffn_dim=8192, context=2048, vocab=128256, rope_theta=500000.0,
                    description="Llama-3.2-1B sizes: 16 blocks, d=2048, 32 heads / 8 kv heads, "
                                "context 2048 (1.50B parameters with the untied head)"),
        ModelPreset(name="bert-tiny", family="bert", layers=4, d_model=64, heads=4, context=64,
                    vocab=257,
                    description="BERT-style post-LN encoder, 4 blocks, d=64, masked-LM objective"),
        ModelPreset(name="bert-mini", family="bert", layers=8, d_model=128, heads=4, context=128,
                    vocab=257,
                    description="BERT-style post-LN encoder, 8 blocks, d=128, masked-LM objective"),
        ModelPreset(name="cnn-tiny", family="cnn", layers=6, channels=16, image_size=32,
                    classes=10,
                    description="Residual CNN, stem + 4 residual blocks + classifier, 32x32 images"),
    )
}


def preset(name: str, sizing: CustomSizing | None = None) -> ModelPreset:
    """The preset called `name` (or an hf: model, or your own model sized by `sizing`);
    ValueError with one line otherwise."""
    if name.startswith(HF_PREFIX):
        return _hf_preset(name)
    if ":" in name:
        return custom_preset(name, sizer=sizing.model if sizing is not None else None)
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model '{name}'; choose one of: {known}, or hf:gpt2, hf:llama, "
                         f"hf:bert, hf:DIR (transformers models), or MODULE:FUNCTION (your own model; "
                         f"see docs/models.md)") from None


def drop_special_tokens(config: dict[str, Any], vocab: int, defaults: dict[str, Any]) -> None:
    """Set bos/eos/pad ids that lie outside a vocabulary of `vocab` ids (transformers' default
    when unset: GPT-2's 50256) to None; from a list (Llama 3's several end-of-sequence ids)
    keep the ones inside."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = config.get(key, defaults.get(key))
        if isinstance(token, int) and not isinstance(token, bool) and token >= vocab:
            config[key] = None
        elif isinstance(token, list):
            config[key] = [t for t in token if isinstance(t, int) and t < vocab] or None


def with_vocab(p: ModelPreset, vocab: int, sizing: CustomSizing | None = None) -> ModelPreset:
    """`p` sized for data of `vocab` token ids (a prepared --data directory's tokenizer; your
    own model built anew by `sizing`).

    bert's model vocabulary is one more: id `vocab` is its [MASK]. An hf: model with
    pretrained weights keeps its embedding: ValueError when the data's ids do not fit.
    """
    need = vocab + 1 if p.family == "bert" else vocab
    if p.family == "cnn" or need == p.vocab:
        return p
    if p.hf_weights:
        if p.family == "bert":
            raise ValueError(f"{p.name} is a pretrained BERT: it cannot train on a prepared "
                             f"directory yet (its [MASK] id comes from its own tokenizer); "
                             f"train it on --data FILE or give it no pretrained weights")
        if need > p.vocab:
            raise ValueError(f"the data's {vocab} token ids are a vocabulary the model cannot "
                             f"take: {p.name} has pretrained weights for {p.vocab}; prepare "
                             f"the data with its tokenizer (--tokenizer hf:DIR)")
        return p
    if p.hf_config:
        config = json.loads(p.hf_config)
        config["vocab_size"] = need
        drop_special_tokens(config, need, _SPECIAL_TOKENS.get(config.get("model_type", ""), {}))
        if config.get("model_type") == "bert":
            # bamboo never pads, and a BPE's end-of-text is id 0: as BERT's padding_idx its
            # embedding would never learn
            config["pad_token_id"] = None
        return replace(p, vocab=need, hf_config=json.dumps(config, sort_keys=True),
                       description=p.description.replace(f"vocab {p.vocab}", f"vocab {need}"))
    if p.family in ("gpt2", "llama", "bert"):
        return replace(p, vocab=need)
    if p.family == "custom":
        return custom_preset(p.name, need, p.inputs, sizing.model if sizing is not None else None)
    raise ValueError(f"model {p.name}: family '{p.family}' cannot follow the data's "
                     f"vocabulary; add it to bamboo.config.presets.with_vocab")


CustomModelSizer = Callable[[str, int | None, str], ModelPreset]
"""(`MODULE:FUNCTION`, vocab or None, inputs text or "") -> the facts of that model, built
for that vocabulary and, when given, for the inputs a Dataset's first sample shows."""

DatasetInputs = Callable[[str, str | None], str]
"""(`--dataset` text, `--collate` text or None) -> what the Dataset's first sample hands
layer 0, per sample, as text (bamboo.model.spec_text)."""


@dataclass(frozen=True, slots=True)
class CustomSizing:
    """What sizes your own `MODULE:FUNCTION` model, which this package cannot build: given
    as an argument by the caller (`bamboo.data.sizing.SIZING`)."""

    model: CustomModelSizer
    dataset_inputs: DatasetInputs
    """What a Dataset's first sample hands layer 0 (the inputs a model on it is built for)."""


def is_custom_name(name: str) -> bool:
    """Whether `name` names your own model (`MODULE:FUNCTION`), not a preset or an hf: name."""
    return ":" in name and not name.startswith(HF_PREFIX)


@functools.cache
def custom_preset(name: str, vocab: int | None = None, inputs: str = "",
                  sizer: CustomModelSizer | None = None) -> ModelPreset:
    """Your own model, `pkg.module:function` or `path/to/file.py:function` (see
    bamboo.model.api), built by `sizer` for `vocab` tokens (the function's default when None)
    and for `inputs` (what a Dataset's first sample hands layer 0, as text; "" without a
    Dataset).

    The preset's name is the import path, so `custom_preset(p.name, vocab, p.inputs, sizer)`
    re-derives it for another vocabulary.
    """
    if sizer is None:
        raise ValueError(f"model '{name}': a MODULE:FUNCTION model is sized by building it, "
                         f"and no sizer was given here (bamboo.data.sizing.SIZING)")
    return sizer(name, vocab, inputs)


# -- hf: models, worked out without importing torch or transformers ---------------------

HF_PREFIX = "hf:"
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INSTALL_HF = "install the hf extra: pip install 'bamboo-train[hf]'"

_INT, _FLOAT = "a positive integer", "a positive number"
HF_OVERRIDES: dict[str, dict[str, str]] = {
    "gpt2": {"n_layer": _INT, "n_embd": _INT, "n_head": _INT, "n_positions": _INT,
             "n_inner": _INT, "vocab_size": _INT, "layer_norm_epsilon": _FLOAT,
             "initializer_range": _FLOAT, "context": _INT},
    "llama": {"num_hidden_layers": _INT, "hidden_size": _INT, "num_attention_heads": _INT,
              "num_key_value_heads": _INT, "intermediate_size": _INT,
              "max_position_embeddings": _INT, "vocab_size": _INT, "rms_norm_eps": _FLOAT,
              "rope_theta": _FLOAT, "initializer_range": _FLOAT, "context": _INT},
    "bert": {"num_hidden_layers": _INT, "hidden_size": _INT, "num_attention_heads": _INT,
             "intermediate_size": _INT, "max_position_embeddings": _INT, "vocab_size": _INT,
             "type_vocab_size": _INT, "layer_norm_eps": _FLOAT, "initializer_range": _FLOAT,
             "context": _INT},
}
"""The keys an hf:gpt2 / hf:llama / hf:bert name may set, and what each takes."""
HF_SIZES: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024, "vocab_size": 50257},
    "llama": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "max_position_embeddings": 2048, "vocab_size": 32000},
    "bert": {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
             "max_position_embeddings": 512, "vocab_size": 30522},
}
"""layers, width, heads, positions, vocab: transformers' GPT2Config() / LlamaConfig() /
BertConfig() defaults (GPT-2 small, Llama-2-7B, BERT-base), kept here so that no import is
needed; a test checks them."""
_ALIASES = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size",
            "n_head": "num_attention_heads", "n_positions": "max_position_embeddings"}
_SPECIAL_TOKENS: dict[str, dict[str, Any]] = {"gpt2": {"bos_token_id": 50256, "eos_token_id": 50256},
                   "llama": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None},
                   "bert": {"pad_token_id": 0}}
_FIXED: dict[str, dict[str, Any]] = {
    "gpt2": {"tie_word_embeddings": False}, "llama": {"tie_word_embeddings": False},
    "bert": {"tie_word_embeddings": False},
}
"""An untied head. Dropout is the config's (transformers' default, or a directory's
config.json): every layer's draws are seeded by (seed, step, micro-batch, layer), so a
pipelined run draws what a single process draws (`bamboo.model.run_layers`)."""
_DROPOUT: dict[str, dict[str, float]] = {
    "gpt2": {"attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
             "summary_first_dropout": 0.1},
    "llama": {"attention_dropout": 0.0},
    "bert": {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1},
}
"""transformers' default dropout of each family (a test checks them): what a name's
dropout is, since a name does not set it."""
_MIN_VOCAB = {"gpt2": 256, "llama": 256, "bert": 257}
"""Training data are byte tokens 0..255; the masked-LM task also uses id vocab-1 as [MASK]."""
_EXAMPLE = {"gpt2": "n_layer=2,n_embd=64,n_head=4,n_positions=64,vocab_size=256",
            "llama": "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
                     "num_key_value_heads=2,intermediate_size=128,max_position_embeddings=64,"
                     "vocab_size=256",
            "bert": "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,"
                    "max_position_embeddings=64,vocab_size=257"}


@dataclass(frozen=True, slots=True)
class HFName:
    """An hf: model name taken apart: which architecture, from which config and weights."""

    name: str
    kind: str
    """`gpt2`, `llama` or `bert`."""
    config: dict[str, Any] = field(default_factory=dict)
    """config.json of a directory; empty for transformers' defaults."""
    overrides: dict[str, int | float] = field(default_factory=dict)
    """Config keys set by the name, plus `context` (the training sequence length)."""
    weights: str = ""


@functools.cache
def _hf_preset(name: str) -> ModelPreset:
    spec = parse_hf_name(name)
    kind = spec.kind
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"model '{name}' needs the transformers package: {INSTALL_HF}")
    values = {**spec.config, **spec.overrides}
    context = values.pop("context", None)
    layers, d, heads, positions, vocab = (_size(name, values, key, default)
                                          for key, default in HF_SIZES[kind].items())
    context = context or positions
    if d % heads:
        raise ValueError(f"model '{name}': hidden size {d} is not a multiple of the {heads} "
                         f"attention heads")
    kv_heads = _size(name, values, "num_key_value_heads", heads) if kind == "llama" else 0
    if kv_heads and heads % kv_heads:
        raise ValueError(f"model '{name}': the {heads} attention heads are not a multiple of "
                         f"the {kv_heads} key/value heads")
    if context > positions:
        raise ValueError(f"model '{name}': context={context} is more than the model's "
                         f"{positions} positions")
    if vocab < _MIN_VOCAB[kind]:
        raise ValueError(f"model '{name}': vocab_size={vocab} is too small: training data are "
                         f"byte tokens, so hf:{kind} needs vocab_size >= {_MIN_VOCAB[kind]}")
    if values.get("add_cross_attention") or values.get("is_decoder"):
        raise ValueError(f"model '{name}': decoder and cross-attention configs are not supported")
    drop_special_tokens(values, vocab, _SPECIAL_TOKENS[kind])
    values.update(_FIXED[kind], model_type=kind)
    source = f", weights from {spec.weights}" if spec.weights else ""
    return ModelPreset(
        name=name, family=kind, layers=layers, d_model=d, heads=heads, kv_heads=kv_heads,
        context=context, vocab=vocab, hf_config=json.dumps(values, sort_keys=True),
        hf_weights=spec.weights,
        description=f"transformers {kind}: {layers} blocks, d={d}, {heads} heads, context "
                    f"{context}, vocab {vocab}{source}")


def _size(name: str, values: dict[str, Any], key: str, default: int) -> int:
    value = values.get(key, values.get(_ALIASES.get(key, ""), default))
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model '{name}': {key}={value!r} in its config is not a positive integer")
    return value


def parse_hf_name(name: str) -> HFName:
    """Parse `hf:gpt2[:K=V,...]`, `hf:llama[:K=V,...]`, `hf:bert[:K=V,...]` or
    `hf:DIR[:context=N]` strictly."""
    rest = name[len(HF_PREFIX):]
    kind = next((k for k in HF_OVERRIDES if rest == k or rest.startswith(k + ":")), "")
    if kind:
        text = rest[len(kind) + 1:]
        if len(rest) > len(kind) and not text:
            raise ValueError(f"model '{name}': nothing after '{kind}:'; write hf:{kind} or "
                             f"hf:{kind}:{_EXAMPLE[kind]}")
        return HFName(name, kind, overrides=_parse_overrides(name, kind, text) if text else {})
    if not rest:
        raise ValueError(f"model '{name}': write hf:gpt2, hf:llama, hf:bert or hf:DIR (a "
                         f"directory with a config.json)")
    path, text = rest, ""
    head, sep, tail = rest.rpartition(":")
    if sep and "=" in tail:
        path, text = head, tail
    overrides = _parse_overrides(name, None, text) if text else {}
    directory = Path(path)
    kind, config = _read_config_json(name, directory)
    return HFName(name, kind, config, overrides, _weights_in(name, directory))


def _dropout_why(kind: str | None, key: str) -> str:
    """Why a dropout key cannot follow a name: its dropout is transformers' default."""
    default = _DROPOUT.get(kind or "", {}).get(key)
    if default is None:
        return "dropout is fixed at the config's: transformers' default, or a directory's"
    return (f"dropout is fixed at {default}, transformers' default for hf:{kind}; a "
            f"directory's config.json sets its own")


def _parse_overrides(name: str, kind: str | None, text: str) -> dict[str, int | float]:
    allowed = HF_OVERRIDES[kind] if kind else {"context": _INT}
    form = (f"write hf:{kind}:KEY=VALUE,... e.g. hf:{kind}:{_EXAMPLE[kind]}" if kind else
            "only context=N may follow a directory, e.g. hf:DIR:context=128")
    out: dict[str, int | float] = {}
    for item in text.split(","):
        key, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or not key or not raw:
            raise ValueError(f"model '{name}': '{item}' is not KEY=VALUE; {form}")
        if key not in allowed:
            why = _dropout_why(kind, key) if "drop" in key else f"keys: {', '.join(allowed)}"
            raise ValueError(f"model '{name}': unknown key '{key}' ({why}); {form}")
        if key in out:
            raise ValueError(f"model '{name}': key '{key}' is given twice")
        try:
            value: int | float = int(raw) if allowed[key] == _INT else float(raw)
        except ValueError:
            value = -1
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"model '{name}': {key}={raw} is not {allowed[key]}; {form}")
        out[key] = value
    return out


def _read_config_json(name: str, directory: Path) -> tuple[str, dict[str, Any]]:
    if not directory.is_dir():
        raise ValueError(f"model '{name}': directory '{directory}' does not exist; give "
                         f"hf:gpt2, hf:llama, hf:bert or hf:DIR with a config.json")
    file = directory / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"model '{name}': directory '{directory}' has no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"model '{name}': cannot read {file}: {e}".splitlines()[0]) from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in HF_OVERRIDES:
        raise ValueError(f"model '{name}': {file} has model_type {kind!r}; hf: models are "
                         f"'gpt2', 'llama' or 'bert'")
    return kind, config


def _weights_in(name: str, directory: Path) -> str:
    for file in HF_WEIGHT_FILES:
        if (directory / file).is_file():
            return str(directory / file)
    if any((directory / f"{file}.index.json").is_file() for file in HF_WEIGHT_FILES):
        raise ValueError(f"model '{name}': '{directory}' holds a sharded checkpoint; save it as "
                         f"one file (save_pretrained(..., max_shard_size='100GB'))")
    return ""
