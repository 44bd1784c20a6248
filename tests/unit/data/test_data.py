"""Data: a pure function of (seed, sample index); layouts share micro-batches."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bamboo.config.presets import preset
from bamboo.data.datasets import SyntheticLanguage, make_task


def test_micro_batches_are_pure_functions_of_seed_step_and_index() -> None:
    p = preset("gpt2-tiny")
    a = make_task(p, seed=3, global_micro_batches=8, micro_batch_size=4)
    b = make_task(p, seed=3, global_micro_batches=8, micro_batch_size=4)
    assert torch.equal(a.batch(5, 6).inputs, b.batch(5, 6).inputs)
    assert not torch.equal(a.batch(5, 6).inputs, a.batch(5, 7).inputs)
    other = make_task(p, seed=4, global_micro_batches=8, micro_batch_size=4)
    assert not torch.equal(a.batch(5, 6).inputs, other.batch(5, 6).inputs)


def test_samples_are_addressed_globally() -> None:
    p = preset("gpt2-tiny")
    task = make_task(p, seed=0, global_micro_batches=4, micro_batch_size=2)
    assert task.sample_indices(3, 1) == [26, 27]
    batch = task.batch(0, 0)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])


def test_synthetic_language_is_low_entropy() -> None:
    source = SyntheticLanguage(0)
    seqs = source.sequences(list(range(64)), 65)
    assert set(np.unique(seqs)) <= set(source.alphabet.tolist())
    pairs = {}
    for s in seqs:
        for a, b in zip(s[:-1], s[1:]):
            pairs.setdefault(int(a), set()).add(int(b))
    assert max(len(v) for v in pairs.values()) <= 4


def test_text_file_windows(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_text("héllo wörld " * 50, encoding="utf-8")
    task = make_task(preset("gpt2-tiny"), seed=0, global_micro_batches=2, micro_batch_size=3,
                     data_file=str(path))
    batch = task.batch(0, 1)
    raw = path.read_bytes()
    for row in batch.inputs.tolist():
        assert bytes(row) in raw


def test_bert_masks_and_targets() -> None:
    p = preset("bert-tiny")
    batch = make_task(p, seed=0, global_micro_batches=1, micro_batch_size=8).batch(0, 0)
    masked = batch.targets != -100
    assert masked.any(dim=1).all()
    assert (batch.inputs[masked] == p.vocab - 1).all()
    assert 0.05 < masked.float().mean() < 0.3


def test_images_are_labelled() -> None:
    batch = make_task(preset("cnn-tiny"), seed=0, global_micro_batches=1,
                      micro_batch_size=16).batch(0, 0)
    assert batch.inputs.shape == (16, 3, 32, 32)
    assert batch.targets.min() >= 0 and batch.targets.max() < 10
