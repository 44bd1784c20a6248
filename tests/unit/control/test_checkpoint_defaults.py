"""Checkpoints a newcomer gets without asking, and checkpoints that cannot be trusted.

On by default (the interval chosen by the run, Young/Daly within bounds, the first one early,
the finished run's final state a resume point); a rerun into its own --out names
`--resume auto`; a manifest or layer that was edited or damaged is skipped with one line,
never loaded; a save that fails leaves no folder; a summary that cannot be written is said.

Without processes here; the real runs (the default checkpoint restored, `--resume auto`,
a full disk) are in tests/integration/test_checkpoint_defaults_runs.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bamboo.config import JobConfig
from bamboo.control.interval import FIRST_AFTER, MAX_UNPROTECTED_S, MAX_WRITE_SHARE, choose_interval
from bamboo.run.checkpoint import (
    CheckpointError,
    discard_unpublished,
    load_latest,
    load_layer_tensors,
    publish,
    step_dir,
    write_layers,
)
from support.decisions import kill_stages, run

META = {"unit": "layer", "model": "gpt2-tiny", "seed": 0, "losses": [5.0, 4.0]}


def save(root: Path, step: int, seed: int) -> dict[int, torch.Tensor]:
    torch.manual_seed(seed)
    vectors = {i: torch.randn(7) for i in range(8)}
    write_layers(step_dir(root, step), {i: {"state": v} for i, v in vectors.items()})
    publish(root, step, range(8), META, keep=5)
    return vectors


# -- the interval -----------------------------------------------------------------------------


def test_the_interval_is_young_daly_within_its_bounds() -> None:
    # 0.1 s to write, 0.2 s a step, the prior rate (one uncovered loss an hour): T =
    # sqrt(2 x 0.1 x 3600) = 26.8 s = 134 steps; writing costs 0.1 / 26.8 = 0.4% < 1%.
    every, why = choose_interval(0.1, 0.2, 0.0)
    assert every == 134 and why["bound"] == "young_daly" and why["mtbf_s"] == 3600.0
    # A rate seen far above the prior shortens it, down to where writing costs 1%.
    every, why = choose_interval(0.1, 0.2, 3600.0)
    assert every == math.ceil(0.1 / (MAX_WRITE_SHARE * 0.2)) == 50 and why["bound"] == "write_share"
    # A slow write is never allowed to leave more than MAX_UNPROTECTED_S unprotected.
    every, why = choose_interval(30.0, 0.5, 0.0)
    assert every == MAX_UNPROTECTED_S / 0.5 and why["bound"] == "unprotected"
    assert choose_interval(0.0, 0.2, 0.0)[0] == 1  # free writes: every step


def test_without_the_flag_a_run_checkpoints_early_and_restores_the_newest(tmp_path: Path) -> None:
    """Two adjacent stages of the only pipeline lost in step 6: no redundancy covers it, and
    the run goes back to its newest checkpoint, not to step 0. (The simulated writes cost
    nothing, so the interval chosen here is every step.)"""
    cfg = JobConfig.of(nodes=4, stages=4, steps=10, micro_batches=4).validate()
    assert cfg.checkpoints.every is None  # chosen by the run
    sim = run(tmp_path, cfg, {6: kill_stages((0, 1), (0, 2))})
    assert sim.stopped is None, sim.stopped
    published = [e["step"] for e in sim.events.of("checkpoint")]
    assert published[0] == FIRST_AFTER and published[-1] == 10  # early, and the final state
    chosen = sim.events.of("checkpoint_interval")[0]
    assert chosen["after_step"] == FIRST_AFTER
    assert chosen["every"] == choose_interval(chosen["write_s"], chosen["step_s"], 0.0)[0]
    restores = sim.events.of("checkpoint_restore")
    newest = max(s for s in published if s <= 6)
    assert [(Path(e["checkpoint"]).name, e["step"]) for e in restores] == [
        (f"step-{newest:08d}", newest)]
    config = sim.core.summary("completed", None)["config"]
    assert config["checkpoint_every_by"] == "run" and config["checkpoint_every"] == chosen["every"]


def test_checkpoint_every_0_turns_them_off(tmp_path: Path) -> None:
    cfg = JobConfig.of(nodes=4, stages=4, steps=6, micro_batches=4, checkpoint_every=0).validate()
    sim = run(tmp_path, cfg, {3: kill_stages((0, 1), (0, 2))})
    assert sim.events.of("checkpoint") == []
    assert [e["checkpoint"] for e in sim.events.of("checkpoint_restore")] == [None]
    assert sim.core.summary("completed", None)["config"]["checkpoint_every"] == 0


# -- a manifest is checked, not trusted ---------------------------------------------------------


@pytest.mark.parametrize("edit", ["step", "losses", "layer_digest"])
def test_an_edited_manifest_is_skipped_with_one_line(tmp_path: Path, edit: str) -> None:
    save(tmp_path, 10, 1)
    save(tmp_path, 15, 2)
    path = tmp_path / "step-00000015" / "manifest.json"
    manifest = json.loads(path.read_text())
    if edit == "step":
        manifest["step"] = 14
    elif edit == "losses":
        manifest["meta"]["losses"][0] = 1.0
    else:
        manifest["sidecars"]["layer-0003"] = "0" * 64
    path.write_text(json.dumps(manifest))
    got = load_latest(tmp_path, quiet=True)
    assert got.step == 10 and got.meta["losses"] == [5.0, 4.0]
    assert got.warning == ("checkpoint step-00000015: manifest.json does not match its checksum "
                           "(edited or damaged); resuming from step-00000010 instead")


def test_a_manifest_of_another_folder_is_skipped(tmp_path: Path) -> None:
    """A whole checkpoint copied under another step's name is not that step."""
    import shutil
    save(tmp_path, 10, 1)
    save(tmp_path, 12, 2)
    shutil.copytree(tmp_path / "step-00000012", tmp_path / "step-00000020")
    got = load_latest(tmp_path, quiet=True)
    assert got.step == 12 and "step-00000020: manifest.json names step 12, its folder step 20" \
        in got.warning


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp", "layer.json"])
def test_a_same_size_byte_flip_falls_back_without_a_traceback(tmp_path: Path, victim: str,
                                                               capfd: pytest.CaptureFixture) -> None:
    old = save(tmp_path, 10, 1)
    save(tmp_path, 20, 2)
    path = tmp_path / "step-00000020" / "layer-0003" / victim
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x20  # a flipped bit keeps every size
    path.write_bytes(bytes(raw))
    got = load_latest(tmp_path, quiet=True)
    assert got.step == 10 and "\n" not in got.warning
    assert "step-00000020: layer-0003/" in got.warning
    assert torch.equal(dict(load_layer_tensors(got.path, 3))["state"], old[3])
    if victim == ".metadata":  # read directly: one error, and nothing of torch's on stderr
        capfd.readouterr()
        with pytest.raises(CheckpointError, match="layer-0003 cannot be read"):
            load_layer_tensors(tmp_path / "step-00000020", 3)
        assert "Traceback" not in capfd.readouterr().err


def test_a_failed_save_leaves_no_folder_but_a_published_one_stays(tmp_path: Path) -> None:
    save(tmp_path, 10, 1)
    write_layers(step_dir(tmp_path, 20), {0: {"state": torch.ones(3)}})  # never whole
    assert discard_unpublished(tmp_path, 20) and not (tmp_path / "step-00000020").exists()
    assert not discard_unpublished(tmp_path, 10) and load_latest(tmp_path).step == 10
    assert not discard_unpublished(tmp_path, 30)  # nothing there
