"""The checks of a job that read files: --data (a token directory or a text file) and
--layer-costs, each against the model it is for."""
from __future__ import annotations

import codecs
from pathlib import Path
from typing import TYPE_CHECKING

from bamboo.config.options import ConfigError

if TYPE_CHECKING:
    from bamboo.config.presets import CustomSizing
    from bamboo.config.sections import JobView

__all__ = ["check_data", "check_layer_costs"]


def check_data(job: JobView, family: str, sizing: CustomSizing | None = None) -> None:
    data, model = job.data.path, job.model.name
    if data is None:
        return
    if family == "cnn":
        raise ConfigError(f"--data is for token models; {model} trains on synthetic images", "data")
    path = Path(data)
    if path.is_dir():
        _check_token_dir(job, sizing)
        return
    if not path.is_file():
        raise ConfigError(f"--data file '{data}' does not exist: give a directory written "
                          f"by `bamboo data prepare` or a path to a UTF-8 text file", "data")
    _check_text(path)
    need = job.model_preset(sizing).context + 1
    size = path.stat().st_size
    if size < need:
        raise ConfigError(f"--data file '{data}' has {size} bytes; {model} needs at least "
                          f"{need}", "data")
    if size < 2 * need:
        raise ConfigError(f"--data file '{data}' has {size} bytes; {model} needs at least "
                          f"{2 * need}: {need} to train on and {need} held out", "data")


def _check_text(path: Path, sample: int = 1 << 20) -> None:
    """A --data file is trained on as UTF-8 text: refuse one that is not (its first MiB is
    read; a NUL byte or an invalid sequence there is binary data)."""
    with path.open("rb") as f:
        head = f.read(sample)
    problem = None
    if b"\x00" in head:
        problem = f"a NUL byte at offset {head.index(bytes(1))}"
    else:
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < sample)
        except UnicodeDecodeError as e:
            problem = f"bytes that are not UTF-8 at offset {e.start}"
    if problem:
        raise ConfigError(f"--data file '{path}' is not UTF-8 text ({problem}): give a UTF-8 "
                          f"text file, or tokenize your data with `bamboo data prepare`", "data")


def _check_token_dir(job: JobView, sizing: CustomSizing | None) -> None:
    from bamboo.config.token_dir import largest_token_id, open_split, read_header
    data = job.data.path
    assert data is not None, "checked only where --data names a token directory"
    try:
        header = read_header(data)
        p = job.model_preset(sizing)
    except ValueError as e:  # read_header's lines start with the directory's name
        raise ConfigError(f"--data {e}" if str(e).startswith("'") else f"--data {data}: {e}",
                          "data") from None
    need = p.context + 1
    for split, count in header.tokens.items():
        if count < need:
            raise ConfigError(f"--data {data}: its {split} split has {count} tokens; "
                              f"{job.model.name} needs at least {need} (context + 1): prepare "
                              f"more text" + (" or a larger --val-fraction"
                                              if split == "val" else ""), "data")
        try:
            open_split(data, header, split)
        except ValueError as e:
            raise ConfigError(f"--data {data}: {e}", "data") from None
    largest = largest_token_id(data, header)
    if largest >= p.vocab:
        raise ConfigError(f"--data {data}: its tokens reach id {largest}, but the vocabulary "
                          f"is {p.vocab} (its header says vocab_size {header.vocab_size}): "
                          f"prepare the directory again with `bamboo data prepare`", "data")


def check_layer_costs(job: JobView, layers: int) -> None:
    path, model = job.layout.layer_costs, job.model.name
    if path is None:
        return
    from bamboo.config.layer_costs import load_layer_costs
    try:
        costs = load_layer_costs(path)
    except ValueError as e:
        raise ConfigError(f"--layer-costs: {e}", "layer_costs") from None
    if costs.model != model:
        raise ConfigError(f"--layer-costs {path} was measured for {costs.model}, not {model}: "
                          f"profile this model", "layer_costs", "model")
    if len(costs.layer_s) != layers:
        raise ConfigError(f"--layer-costs {path} has {len(costs.layer_s)} layers; {model} has "
                          f"{layers}: profile this model", "layer_costs", "model")
