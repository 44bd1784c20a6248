"""Training on prepared BPE tokens (`bamboo data prepare`, then `--data DIR`) with real
processes: the same result in two layouts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from support.runs import assert_close, config, run_in_process
from support.tokens import docs_text, prepare

pytestmark = pytest.mark.procs  # every test here starts processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_training_on_bpe_tokens_is_the_same_in_two_layouts(tmp_path: Path, capsys) -> None:
    files = docs_text(tmp_path, size=8000)
    out = tmp_path / "bpe"
    assert prepare(capsys, *map(str, files), "--out", str(out), "--tokenizer", "bpe:300")[0] == 0
    job = dict(data=str(out), steps=3, micro_batch_size=4)  # the launcher here, kept warm
    one = run_in_process(config(job, nodes=2, stages=2, micro_batches=4), tmp_path / "one")
    two = run_in_process(config(job, nodes=4, stages=2, micro_batches=2), tmp_path / "two")
    assert one["status"] == two["status"] == "completed", (one["error"], two["error"])
    assert two["config"]["pipelines"] == 2
    assert_close(two["losses"], one["losses"], rel=1e-6)
    assert one["losses"][0] == pytest.approx(np.log(300), rel=0.1)  # not ln(256)
    params = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    ends = {name: tuple(t.shape) for name, t in params.items()
            if name.endswith(("embed.tokens.weight", "head.out.weight"))}
    assert sorted(ends.values()) == [(300, 64), (300, 64)], ends  # embedding and head
