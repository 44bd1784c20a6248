"""Durable checkpoints: the last resort, used only when every copy of some stage is gone.

Layout of a checkpoint directory:

    DIR/step-00000120/stage-0.pt      {"params": {name: tensor}, "optim": optimizer state}
    DIR/step-00000120/stage-1.pt
    DIR/step-00000120/manifest.json   {"format": 1, "step": 120, "stages": [0, 1],
                                       "files": {"stage-0.pt": {"sha256", "bytes"}}, "meta"}
    DIR/LATEST                        "step-00000120"

Guarantees: a checkpoint is built in a hidden `.tmp-*` directory (every file fsynced, the
manifest written last), then renamed into place in one step and the directory fsynced,
then LATEST is replaced atomically; older checkpoints are deleted only after that (the
newest `keep` stay). A failed save (a full disk) removes its partial files, keeps every
earlier checkpoint and raises CheckpointError naming the file it could not write; the
temporaries of a save that was interrupted (a killed process) are removed by the next save.
`load_latest` checks that the manifest lacks no layer, sizes and sha256 of every file,
loads with `torch.load(weights_only=True)` (no arbitrary code from a file), and falls back
to the newest whole checkpoint, saying which one it skipped and why.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bamboo.runlog import checkpoint_root, write_atomic

__all__ = ["CheckpointError", "Checkpoint", "save_checkpoint", "load_latest", "load_checkpoint",
           "list_checkpoints", "checkpoint_root"]

log = logging.getLogger(__name__)

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or none could be loaded; str() is one line."""


@dataclass(kw_only=True, slots=True)
class Checkpoint:
    """A whole checkpoint, loaded."""

    step: int
    stages: dict[int, dict[str, torch.Tensor]]
    optimizer_states: dict[int, dict]
    meta: dict
    path: Path
    warning: str | None = None
    """Set when a newer checkpoint was unusable and this older one was taken instead."""
    skipped: list[str] = field(default_factory=list)


class _HashingWriter:
    """A binary file that hashes and counts what is written through it."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        n = self.f.write(data)
        self.sha.update(memoryview(data)[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError (e.g. ENOSPC) somewhere in an exception's chain, if any."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _write_stage(path: Path, obj: dict) -> dict:
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError as e:  # torch's zip writer hides a failed write behind its own
            cause = _os_error_in(e)
            if cause is None:
                raise
            raise cause from None
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": writer.sha.hexdigest(), "bytes": writer.size}


def _write_text(path: Path, text: str) -> None:
    write_atomic(path, text.encode("utf-8"))  # its temporary is `.NAME.tmp-PID`
    _fsync_dir(path.parent)


_TEMPORARY = re.compile(r"^\.(?:tmp-step-\d{8,}|old-step-\d{8,}|LATEST\.tmp)-(\d+)$")
"""What a save leaves behind when it is interrupted (killed, power cut) mid-way."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def _remove_stale_temporaries(root: Path) -> list[str]:
    """Delete the temporary files and folders of earlier saves that never finished (this
    process's, or a process that is gone); a save in progress elsewhere is left alone."""
    removed = []
    for path in root.iterdir():
        m = _TEMPORARY.match(path.name)
        if m is None or (int(m[1]) != os.getpid() and _alive(int(m[1]))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    if removed:
        log.info("removed %d unfinished checkpoint temporaries in %s: %s", len(removed), root,
                 ", ".join(sorted(removed)))
    return removed


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under `root`, newest step first (whole or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def save_checkpoint(root: str | Path, step: int, stages: dict[int, dict[str, torch.Tensor]],
                    optimizer_states: dict[int, dict], meta: dict | None = None,
                    *, keep: int = 2) -> Path:
    """Write step `step`'s checkpoint under `root`; returns its directory."""
    root = Path(root)
    name = f"step-{step:08d}"
    tmp = root / f".tmp-{name}-{os.getpid()}"
    writing = str(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)  # of saves interrupted earlier (this one's included)
        writing = name
        tmp.mkdir()
        files = {}
        for s in sorted(stages):
            obj = {"params": stages[s], "optim": optimizer_states.get(s, {})}
            writing = f"{name}/stage-{s}.pt"
            files[f"stage-{s}.pt"] = _write_stage(tmp / f"stage-{s}.pt", obj)
        manifest = {"format": FORMAT, "step": step, "stages": sorted(stages),
                    "files": files, "meta": meta or {}}
        writing = f"{name}/manifest.json"
        _write_text(tmp / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
        writing = name
        _publish(root, tmp, root / name)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        kept = next((p.name for p in list_checkpoints(root)), None)
        raise CheckpointError(f"checkpoint of step {step} not saved in {root}: could not write "
                              f"{writing}: {why}; "
                              + (f"{kept} is kept" if kept else "no earlier checkpoint")) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:  # the checkpoint is whole and in place: LATEST only names it for people
        _write_text(root / "LATEST", name + "\n")
    except OSError as e:
        log.warning("checkpoint %s saved but %s/LATEST not updated: %s", name, root,
                    e.strerror or e)
    _prune(root, keep)
    return root / name


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished directory into place (replacing a same-step one) and fsync."""
    old = None
    if final.exists():
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:  # put the earlier same-step checkpoint back
            os.replace(old, final)
        raise
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[max(1, keep):]:
        shutil.rmtree(old, ignore_errors=True)


def _expected_layers(meta: dict) -> int | None:
    """How many layers a checkpoint of whole layers (meta "unit" "layer") must hold: those
    of the model it names, when that model is known here."""
    if not isinstance(meta, dict) or meta.get("unit") != "layer" or "model" not in meta:
        return None
    from bamboo.presets import preset
    try:
        return preset(str(meta["model"])).layers
    except (ValueError, OSError, KeyError, TypeError):  # a model this version cannot read
        return None


def _check_complete(manifest: dict) -> None:
    """CheckpointError naming every layer (or stage) the manifest lacks: one its files
    list, one below the highest it holds, or one of the model it names."""
    try:
        held = {int(s) for s in manifest.get("stages", [])}
        listed = {int(m[1]) for f in manifest["files"]
                  if (m := re.match(r"^stage-(\d+)\.pt$", str(f)))}
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"manifest.json is unreadable ({e})") from None
    meta = manifest.get("meta") or {}
    unit = "layer" if isinstance(meta, dict) and meta.get("unit") == "layer" else "stage"
    expected = listed | set(range(max(held | listed, default=-1) + 1))
    count = _expected_layers(meta)
    if count is not None:
        expected |= set(range(count))
    missing = sorted(expected - held)
    if missing:
        of = f" of the {count} of {meta['model']}" if count is not None else ""
        raise CheckpointError(f"manifest.json lacks {unit}{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))}{of}: the checkpoint is incomplete")


def _load_one(path: Path) -> Checkpoint:
    """Load and verify one checkpoint directory; CheckpointError says what is wrong."""
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
        files, step = manifest["files"], int(manifest["step"])
    except FileNotFoundError:
        raise CheckpointError("manifest.json is missing (the save did not finish)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"manifest.json is unreadable ({e})") from None
    _check_complete(manifest)
    stages, optim = {}, {}
    for s in manifest.get("stages", []):
        fname = f"stage-{s}.pt"
        entry = files.get(fname)
        if entry is None:
            raise CheckpointError(f"{fname} is not in the manifest")
        try:
            data = (path / fname).read_bytes()
        except OSError as e:
            raise CheckpointError(f"{fname} cannot be read ({e.strerror or e})") from None
        if len(data) != entry["bytes"]:
            raise CheckpointError(f"{fname} is truncated ({len(data)} of {entry['bytes']} bytes)")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"{fname} is corrupt (sha256 mismatch)")
        try:
            obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - refuse anything weights_only refuses
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{fname} does not load safely ({first[:160]})") from None
        stages[int(s)], optim[int(s)] = obj["params"], obj["optim"]
    return Checkpoint(step=step, stages=stages, optimizer_states=optim,
                      meta=manifest.get("meta", {}), path=path)


def load_checkpoint(path: str | Path) -> Checkpoint:
    """One checkpoint directory, verified (CheckpointError says what is wrong)."""
    return _load_one(Path(path))


def load_latest(root: str | Path) -> Checkpoint:
    """The newest whole checkpoint under `root`; falls back past broken ones, saying so."""
    root = Path(root)
    candidates = list_checkpoints(root)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {root}: pass the --out directory of an "
                              f"earlier run that saved checkpoints (--checkpoint-every)")
    skipped = []
    for path in candidates:
        try:
            ckpt = _load_one(path)
        except CheckpointError as e:
            skipped.append(f"{path.name}: {e}")
            continue
        if skipped:
            ckpt.skipped = skipped
            ckpt.warning = (f"checkpoint {'; '.join(skipped)}; "
                            f"resuming from {path.name} instead")
            log.warning("%s", ckpt.warning)
        return ckpt
    raise CheckpointError(f"no whole checkpoint in {root}: {'; '.join(skipped)}")
