"""A finished run's model as a Hugging Face directory: `export`, behind `bamboo export RUN_DIR
--hf DIR` (`bamboo.cli.export`).

    bamboo export runs/a --hf exported/a
    python -c "import transformers; transformers.AutoModelForCausalLM.from_pretrained('exported/a')"

The run directory's model.pt (`layers.<i>.<name>` -> tensor) and summary.json (the job's
config, which names the model) are turned into what `save_pretrained` writes: config.json
and one model.safetensors, with transformers' own parameter names, so that
`AutoModelForCausalLM.from_pretrained(DIR)` holds exactly the run's parameters:

- bamboo's gpt2 presets -> GPT2LMHeadModel (transformers' GPT-2 keeps its linear weights
  transposed, in Conv1D, and q, k, v in one c_attn; bamboo's tanh GELU is `gelu_new`);
- bamboo's llama presets -> LlamaForCausalLM (same names and numerics by construction);
- hf:gpt2, hf:llama and hf:DIR causal models -> their own class and config.

The head stays untied (tie_word_embeddings false), and the vocabulary is the embedding's in
model.pt (it follows the training data's tokenizer, not necessarily the preset's). When the
run trained on a prepared token directory with a tokenizer, its tokenizer files are copied
too. The directory is written beside DIR under a temporary name and renamed at the end.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bamboo.util import strict_json
from bamboo.util.logs import by

__all__ = ["export", "read_run", "EXPORTABLE"]

log = logging.getLogger(__name__)
_PROG = "bamboo export"
"""The interface whose words the warnings are in: this module is `bamboo export`'s library."""

EXPORTABLE = ("the gpt2 and llama presets, hf:gpt2, hf:llama and hf:DIR with model_type gpt2 "
              "or llama")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt",
                    "tokenizer.model", "chat_template.jinja")
_EMBEDDING = {"gpt2": ("embed.tokens.weight", "wte.weight"),
              "llama": ("embed.embed_tokens.weight", "embed_tokens.weight")}
"""Layer 0's token embedding, in bamboo's own model and in the hf: model."""


def read_run(run_dir: Path) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """The run's preset (sized to model.pt's vocabulary), its job config and every layer's
    parameters (name -> tensor); ValueError with one line for what is not a usable run."""
    from bamboo.config.presets import preset, with_vocab
    from bamboo.data.sizing import SIZING
    if not run_dir.is_dir():
        raise ValueError(f"run directory '{run_dir}' does not exist; give a directory "
                         f"bamboo train wrote (--out)")
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
        config = summary["config"]
        model = config["model"]
    except FileNotFoundError:
        raise ValueError(f"'{run_dir}' has no summary.json: not a run directory of bamboo "
                         f"train, or the run is still going") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the model's name from {run_dir / 'summary.json'}: "
                         f"{type(e).__name__}: {e}".splitlines()[0]) from None
    if ":" in model and not model.startswith("hf:"):  # MODULE:FUNCTION, not imported here
        raise ValueError(f"the run's model '{model}' is a custom model; export writes causal "
                         f"language models: {EXPORTABLE}")
    try:
        p = preset(model, SIZING)
    except ValueError as e:
        raise ValueError(f"the run's model cannot be set up again: {e}") from None
    if p.family not in _EMBEDDING:
        raise ValueError(f"the run's model '{model}' is a {p.family} model; export writes "
                         f"causal language models: {EXPORTABLE}")
    file = run_dir / "model.pt"
    if not file.is_file():
        raise ValueError(f"'{run_dir}' has no model.pt: the run did not finish with its final "
                         f"model; export a run that completed")
    import torch
    try:
        flat = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file: torch raises several types)
        raise ValueError(f"cannot read {file}: {type(e).__name__}: {e}".splitlines()[0]) from None
    layers: list[dict[str, Any]] = [{} for _ in range(p.layers)]
    for key, tensor in flat.items():
        _, index, name = (key.split(".", 2) + ["", ""])[:3]
        if not (key.startswith("layers.") and index.isdigit() and int(index) < p.layers
                and name):
            raise ValueError(f"{file} holds '{key}', not a parameter of {model}'s {p.layers} "
                             f"layers")
        layers[int(index)][name] = tensor
    embedding = _EMBEDDING[p.family][1 if p.hf_config else 0]
    if embedding not in layers[0] or not all(layers):
        raise ValueError(f"{file} does not hold every layer of {model}: was it written by "
                         f"this model's run?")
    vocab = layers[0][embedding].shape[0]
    return with_vocab(p, vocab, SIZING), config, layers


def _gpt2_state(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """bamboo's GPT-2 under GPT2LMHeadModel's names (Conv1D weights are [in, out])."""
    places = {"embed.tokens.": "transformer.wte.", "embed.positions.": "transformer.wpe.",
              "block.ln1.": "transformer.h.{i}.ln_1.", "block.ln2.": "transformer.h.{i}.ln_2.",
              "block.attn.qkv.": "transformer.h.{i}.attn.c_attn.",
              "block.attn.proj.": "transformer.h.{i}.attn.c_proj.",
              "block.mlp.fc.": "transformer.h.{i}.mlp.c_fc.",
              "block.mlp.proj.": "transformer.h.{i}.mlp.c_proj.",
              "head.ln.": "transformer.ln_f.", "head.out.": "lm_head."}
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for i, params in enumerate(layers):
        for name, tensor in params.items():
            prefix = next(p for p in places if name.startswith(p))
            key = places[prefix].format(i=i) + name[len(prefix):]
            state[key] = tensor.t() if key.endswith(conv1d) else tensor
    return state


def _hf_model(p: Any, layers: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    """The transformers config and state dict of the run's model."""
    import transformers

    from bamboo.config.presets import drop_special_tokens
    from bamboo.model.hf import hf_state_key
    from bamboo.model.llama import ffn_dim
    vocab = layers[0][_EMBEDDING[p.family][1 if p.hf_config else 0]].shape[0]
    no_tokens = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if p.hf_config:
        values = json.loads(p.hf_config)
        values["vocab_size"] = vocab
        drop_special_tokens(values, vocab, {})
        for key in ("torch_dtype", "dtype"):  # a bf16 checkpoint's: the run's weights are fp32
            values.pop(key, None)
        config_class = transformers.GPT2Config if p.family == "gpt2" else transformers.LlamaConfig
        config = config_class.from_dict(values)
        state = {hf_state_key(p.family, i, name): t
                 for i, params in enumerate(layers) for name, t in params.items()}
    elif p.family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=p.layers, n_embd=p.d_model, n_head=p.heads, n_positions=p.context,
            n_inner=4 * p.d_model, vocab_size=vocab, activation_function="gelu_new",
            layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            summary_first_dropout=0.0, tie_word_embeddings=False, **no_tokens)
        state = _gpt2_state(layers)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=p.layers, hidden_size=p.d_model, num_attention_heads=p.heads,
            num_key_value_heads=p.kv_heads or p.heads, head_dim=p.d_model // p.heads,
            intermediate_size=ffn_dim(p), max_position_embeddings=p.context, vocab_size=vocab,
            rms_norm_eps=p.norm_eps, rope_theta=p.rope_theta, hidden_act="silu",
            attention_bias=False, mlp_bias=False, attention_dropout=0.0,
            tie_word_embeddings=False, **no_tokens)
        state = {hf_state_key("llama", i, name.removeprefix("embed.").removeprefix("head.")): t
                 for i, params in enumerate(layers) for name, t in params.items()}
    config.architectures = ["GPT2LMHeadModel" if p.family == "gpt2" else "LlamaForCausalLM"]
    config.dtype = "float32"  # what model.safetensors holds; `dtype="auto"` loads that
    return config, state


def _check_names(config: Any, state: dict[str, Any]) -> None:
    """The state dict is exactly the model class's (names and shapes), checked on meta."""
    import torch
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if expected != got:
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        shapes = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])[:3]
        raise ValueError(f"model.pt does not map onto {type(model).__name__}: missing "
                         f"{missing}, unexpected {extra}, other shapes {shapes}")


def _tokenizer_files(config: dict[str, Any], vocab: int) -> tuple[Path | None, list[str]]:
    """The prepared data directory's tokenizer files, if the run trained on one (its path as
    the run's summary recorded it) and it is that data's (as many ids as the model takes)."""
    data = config.get("data")
    if not isinstance(data, str) or not (Path(data) / "tokenizer.json").is_file():
        return None, []
    try:
        ids = json.loads((Path(data) / "header.json").read_text(encoding="utf-8"))["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        ids = None
    if ids != vocab:
        log.warning("the tokenizer in %s has %s ids, the model %s: not copied", data, ids, vocab,
                    extra=by(_PROG))
        return None, []
    return Path(data), [n for n in _TOKENIZER_FILES if (Path(data) / n).is_file()]


def _check_out(out: Path) -> None:
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--hf '{out}' is not empty; give a new or empty directory (export "
                         f"never overwrites files)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--hf '{out}' exists and is not a directory; give a new or empty "
                         f"directory")


def export(run_dir: Path, out: Path) -> str:
    """Write the run's model to `out` as a save_pretrained directory; one line saying what."""
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("bamboo export needs the transformers package: pip install "
                         "'bamboo-train[hf]'")
    _check_out(out)
    p, config, layers = read_run(run_dir)
    hf_config, state = _hf_model(p, layers)
    _check_names(hf_config, state)
    source, names = _tokenizer_files(config, hf_config.vocab_size)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".export", dir=out.parent))
    except OSError as e:
        raise ValueError(f"cannot write beside --hf '{out}': {e.strerror or e}") from None
    try:
        from safetensors.torch import save_file
        save_file({k: t.contiguous() for k, t in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        hf_config.save_pretrained(str(tmp))
        copied = _copy_tokenizer(source, names, tmp)
        for file in tmp.iterdir():  # mkdtemp and safetensors make them private
            file.chmod(0o644)
        tmp.chmod(0o755)
        _check_out(out)
        if out.is_dir():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    count = sum(t.numel() for t in state.values())
    vocab = layers[0][_EMBEDDING[p.family][1 if p.hf_config else 0]].shape[0]
    tokenizer = f", tokenizer from {source}" if copied else ""
    return (f"wrote {out}: {hf_config.architectures[0]}, {count:,} parameters, vocab {vocab}"
            f"{tokenizer}; load it with transformers.AutoModelForCausalLM.from_pretrained")


def _copy_tokenizer(source: Path | None, names: list[str], tmp: Path) -> bool:
    """Copy the tokenizer files, best effort: a failure is a warning, not a failed export."""
    if source is None:
        return False
    try:
        for name in names:
            shutil.copyfile(source / name, tmp / name)
        if "tokenizer_config.json" not in names:  # AutoTokenizer then takes tokenizer.json as is
            (tmp / "tokenizer_config.json").write_text(
                strict_json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n",
                encoding="utf-8")
    except OSError as e:
        log.warning("the tokenizer of %s was not copied (%s)", source, e.strerror or e,
                    extra=by(_PROG))
        for name in [*names, "tokenizer_config.json"]:
            (tmp / name).unlink(missing_ok=True)
        return False
    return True
