"""Durable checkpoints, written by the nodes that hold the state: the last resort, used only
when every copy of some layer is gone.

Layout under a checkpoint root: a local directory, or an fsspec URL (file:///mnt/ckpt,
s3://bucket/run/checkpoints, ...) that every machine reaches at the same address:

    ROOT/step-00000120/layer-0003/       one torch.distributed.checkpoint (DCP) folder per
        .metadata  __0_0.distcp          layer, one key per entry of the layer's state
        layer.json                       (`bamboo.engine.layer_state`), each in its own
                                         shape and dtype, exact bits:
                                           layer.3.param.<name>       each parameter
                                           layer.3.held.<name>        uint8 0/1: the
                                             optimizer holds state for it (0 before a step)
                                           layer.3.optim.<name>.<key> each entry of that
                                             state: a tensor (AdamW's exp_avg, exp_avg_sq,
                                             step; amsgrad's max_exp_avg_sq; Adafactor's
                                             row_var and col_var), or a Python number as a
                                             float64, int64 or bool tensor of no dimension
                                         (a layer without parameters: no key at all); and
                                         layer.json: the keys in order with shape, dtype
                                         and sha256, the size and sha256 of every file
    ROOT/step-00000120/manifest.json     {"format": 4, "step": 120, "layers": [0, .., 11],
                                          "meta": {...}, "sidecars": {layer: sha256},
                                          "checksum": sha256 of the rest}, written last, by
                                          the coordinator (`bamboo.run.checkpoint_integrity`)
    ROOT/LATEST                          "step-00000120"
    ROOT/final-00000200/layer-0003/      the trained model after the last step, keys
                                         `layer.3.param.<name>` (none for a layer without
                                         parameters): model.pt is built from these

A checkpoint of an earlier format (3: one float32 vector of parameters, two moments and a
step count a layer) is refused in one line naming its format.

Who writes what: each stage's first live holder writes its own layers (`write_layers`, in
the worker, on a background thread, from a copy of the state) and reports them durable;
when every layer of a step is reported, the coordinator checks that it sees them, writes
the manifest and LATEST (`publish`) and prunes to the newest `keep` whole checkpoints. No
tensor passes through the coordinator. Each layer being its own folder, a later layout
with another partition loads any subset (`load_layers`).

Guarantees: a layer is written into a hidden `.tmp-layer-NNNN-PID-HOST` folder (files
fsynced) and renamed into place in one step (replacing a same-step copy); the manifest and
LATEST are replaced atomically; a step folder without its manifest is never whole. The
temporaries of writes that never finished (a process of this machine that was killed) are
removed by the next write into the same folder. `load_latest` takes the newest whole
checkpoint (manifest readable, its checksum right, its step its folder's, every layer of the
model listed, present, and every file at its recorded size and digest), falls back past
broken ones saying in one line which it skipped and why, and needs no torch. `load_layers` checks every tensor's sha256 and unpickles nothing but DCP's own
metadata classes (tensors load with `weights_only`): no code runs from a file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bamboo.run.checkpoint_integrity import (
    FORMAT,
    MANIFEST,
    SIDECAR,
    CheckpointError,
    file_digest,
    manifest_body,
    read_manifest,
    read_sidecar,
    verify_files,
)
from bamboo.run.checkpoint_storage import (
    FsspecStore,
    LocalStore,
    is_failure,
    is_url,
    remove_stale_temporaries,
    single_process,
    storage_for,
    why_failed,
    writer_tag,
)
from bamboo.run.runlog import checkpoint_root

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointError", "Checkpoint", "FORMAT", "write_layers", "publish", "load_latest",
           "load_checkpoint", "load_layers", "load_layer_tensors", "list_checkpoints",
           "has_whole_checkpoint", "checkpoint_root", "checkpoint_location", "step_dir",
           "final_dir", "discard_unpublished"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SIDECAR, _MANIFEST = SIDECAR, MANIFEST


@dataclass(kw_only=True, slots=True)
class Checkpoint:
    """A whole checkpoint, verified; its tensors stay on storage (`load_layers(path, ...)`)."""

    step: int
    layers: list[int]
    meta: dict
    path: Path | str
    """Its step folder: a Path under a local root, a URL under a URL root."""
    warning: str | None = None
    """Set when a newer checkpoint was unusable and this older one was taken instead."""
    skipped: list[str] = field(default_factory=list)


# -- where ----------------------------------------------------------------------------------


def _located(root: str | Path, text: str) -> Path | str:
    """A location under `root` as the caller gave it: a Path for a folder, a str for a URL."""
    return text if is_url(root) else Path(text)


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def _layer_name(layer: int) -> str:
    return f"layer-{layer:04d}"


def step_dir(root: str | Path, step: int) -> Path | str:
    """The folder of step `step`'s checkpoint under `root`."""
    return _located(root, storage_for(root).join(str(root), _step_name(step)))


def final_dir(root: str | Path, steps: int) -> Path | str:
    """The folder the trained model's layers are written to after the run's last step."""
    return _located(root, storage_for(root).join(str(root), f"final-{steps:08d}"))


def checkpoint_location(cfg: Any) -> Path | str:
    """Where a job's checkpoints go: its --checkpoint-dir (a path or a URL), else the
    checkpoints/ folder of its run directory (`cfg.logging.out`, made absolute by the coordinator
    before any worker starts)."""
    if cfg.checkpoints.dir:
        return cfg.checkpoints.dir if is_url(cfg.checkpoints.dir) else Path(cfg.checkpoints.dir)
    if cfg.logging.out is None:
        raise CheckpointError("the job names no run directory (--out) and no --checkpoint-dir: "
                              "nowhere to write checkpoints")
    return checkpoint_root(cfg.logging.out)


# -- writing (the holders) ----------------------------------------------------------------


def _sha256(t: torch.Tensor) -> str:
    import torch
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def write_layers(directory: str | Path, layers: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    """Write each layer's tensors (name -> tensor, stored as `layer.{i}.{name}`) as its own
    DCP folder `directory/layer-NNNN`, atomically per layer (a same-step copy there is
    replaced). Returns the layers written; CheckpointError names the layer and why."""
    store, d = storage_for(directory), str(directory)
    try:
        store.makedirs(d)
        remove_stale_temporaries(store, d)  # of writes interrupted earlier
    except OSError as e:
        raise CheckpointError(f"could not write checkpoint folder {d}: {why_failed(e, d)}") from None
    for i in sorted(layers):
        _write_layer(store, d, i, layers[i])
    return sorted(layers)


def _write_layer(store: LocalStore | FsspecStore, d: str, i: int, tensors: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp
    name = _layer_name(i)
    tmp = store.join(d, f".tmp-{name}-{writer_tag()}")
    try:
        state = {f"layer.{i}.{k}": t.detach().to("cpu").contiguous() for k, t in tensors.items()}
        entries = [{"key": k, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                    "sha256": _sha256(t)} for k, t in state.items()]
        with single_process():
            dcp.save(state, storage_writer=store.writer(tmp), no_dist=True)
        files = {f: store.size(store.join(tmp, f)) for f in sorted(store.ls(tmp))}
        digests = {f: file_digest(store, store.join(tmp, f)) for f in files}
        sidecar = {"format": FORMAT, "layer": i, "tensors": entries, "files": files,
                   "digests": digests}
        store.write_file(store.join(tmp, _SIDECAR), json.dumps(sidecar, indent=1).encode())
        store.sync_dir(tmp)
        _replace_dir(store, d, tmp, name)
    except BaseException as e:
        why = why_failed(e, None if store.url else d)  # the room left before it is freed
        store.rmtree(tmp)
        if is_failure(e):
            raise CheckpointError(f"could not write layer {i} to {d}: {why}") from None
        raise


def _replace_dir(store: LocalStore | FsspecStore, d: str, tmp: str, name: str) -> None:
    """Rename the finished folder into place, replacing a same-named one."""
    final, old = store.join(d, name), None
    if store.exists(final):
        old = store.join(d, f".old-{name}-{writer_tag()}")
        store.rename(final, old)
    try:
        store.rename(tmp, final)
    except BaseException:
        if old is not None:  # put the earlier copy back
            store.rename(old, final)
        raise
    if old is not None:
        store.rmtree(old)


def remove_unfinished_writes(root: str | Path) -> list[str]:
    """After a run's workers are stopped: the temporaries their interrupted writes left in
    the checkpoint root, its step folders and its final folders (a writer of another
    machine, whose processes cannot be seen from here, keeps its own), and every step
    folder without a manifest (a save whose other parts were still being written, or had
    failed, when the run stopped: no one is left to make it whole)."""
    store, r = storage_for(root), str(root)
    removed = remove_stale_temporaries(store, r)
    for name in store.ls(r):
        if _STEP_DIR.match(name) or name.startswith("final-"):
            removed += remove_stale_temporaries(store, store.join(r, name))
    for step, name in _steps(store, r):
        if discard_unpublished(root, step):
            removed.append(name)
    return removed


# -- publishing (the coordinator) ---------------------------------------------------------


def discard_unpublished(root: str | Path, step: int) -> bool:
    """Remove step `step`'s folder unless it holds a manifest (a save that failed, or one
    that will never be whole, leaves nothing behind); whether it removed one."""
    store, r = storage_for(root), str(root)
    d = store.join(r, _step_name(step))
    if not store.isdir(d) or store.exists(store.join(d, _MANIFEST)):
        return False
    store.rmtree(d)
    return True


def _steps(store: LocalStore | FsspecStore, root: str) -> list[tuple[int, str]]:
    """(step, folder name) of every step folder under `root`, newest first."""
    found = [(int(m[1]), n) for n in store.ls(root) if (m := _STEP_DIR.match(n))]
    return sorted(found, reverse=True)


def publish(root: str | Path, step: int, layers: Iterable[int], meta: dict | None = None,
            *, keep: int = 2) -> Path | str:
    """Make step `step`'s checkpoint whole: check that every one of `layers` is in place,
    write its manifest (last) and LATEST, and prune to the newest `keep` whole checkpoints.
    Returns its folder; CheckpointError when it could not be made whole (earlier ones are
    kept)."""
    store, r = storage_for(root), str(root)
    name = _step_name(step)
    d = store.join(r, name)
    layers = sorted(set(layers))
    writing = f"{name}/{_MANIFEST}"
    try:
        missing = [i for i in layers
                   if not store.exists(store.join(d, _layer_name(i), _SIDECAR))]
        if missing:
            raise CheckpointError(
                f"checkpoint of step {step} not published: layer{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} reported written but not found in {d} (every "
                f"machine must reach the checkpoint directory at the same path: give a shared "
                f"--checkpoint-dir)")
        remove_stale_temporaries(store, r)
        manifest = manifest_body(store, d, step, layers, meta or {})
        store.write_atomic(store.join(d, _MANIFEST),
                           json.dumps(manifest, indent=1, sort_keys=True).encode())
    except OSError as e:
        kept = next((n for s, n in _steps(store, r)
                     if s != step and store.exists(store.join(r, n, _MANIFEST))), None)
        raise CheckpointError(f"checkpoint of step {step} not published in {root}: could not "
                              f"write {writing}: {why_failed(e, None if store.url else d)}; "
                              + (f"{kept} is kept" if kept else "no earlier checkpoint")) from None
    try:  # the checkpoint is whole: LATEST only names it for people
        store.write_atomic(store.join(r, "LATEST"), (name + "\n").encode())
    except OSError as e:
        log.warning("checkpoint %s saved but %s/LATEST not updated: %s", name, r, why_failed(e))
    _prune(store, r, keep, step)
    return _located(root, d)


def _prune(store: LocalStore | FsspecStore, root: str, keep: int, newest: int) -> None:
    """Delete every step folder up to `newest` but the newest `keep` whole ones (later
    folders may still be being written)."""
    kept = 0
    for step, name in _steps(store, root):
        if step > newest:
            continue
        if kept < max(1, keep) and store.exists(store.join(root, name, _MANIFEST)):
            kept += 1
            continue
        store.rmtree(store.join(root, name))


# -- finding and checking -----------------------------------------------------------------


def list_checkpoints(root: str | Path) -> list[Path | str]:
    """Checkpoint folders under `root`, newest step first (whole or not)."""
    store, r = storage_for(root), str(root)
    if not store.isdir(r):
        return []
    return [_located(root, store.join(r, n)) for _, n in _steps(store, r)
            if store.isdir(store.join(r, n))]


def _check(store: LocalStore | FsspecStore, d: str, *, verify_data: bool) -> dict:
    """The manifest of folder `d`, after checking it and every file of every layer it
    names against their digests (`bamboo.run.checkpoint_integrity`)."""
    manifest = read_manifest(store, d)
    for i in manifest["layers"]:
        read_sidecar(store, d, i)
        verify_files(store, d, i, manifest["sidecars"].get(_layer_name(i)))
        if verify_data:
            _load_layer(store, d, i)
    return manifest


def load_checkpoint(path: str | Path, *, verify_data: bool = False) -> Checkpoint:
    """One checkpoint folder, verified (CheckpointError says what is wrong); with
    `verify_data`, every tensor is read and its sha256 checked too."""
    manifest = _check(storage_for(path), str(path), verify_data=verify_data)
    return Checkpoint(step=manifest["step"], layers=manifest["layers"], meta=manifest["meta"],
                      path=path)


def _newest_whole(root: str | Path, verify_data: bool) -> Checkpoint:
    candidates = list_checkpoints(root)
    if not candidates:
        raise CheckpointError(f"no checkpoint in {root}: pass the --out directory of an "
                              f"earlier run (runs save checkpoints unless --checkpoint-every 0)")
    skipped = []
    for path in candidates:
        name = posixpath.basename(str(path).rstrip("/"))
        try:
            ckpt = load_checkpoint(path, verify_data=verify_data)
        except CheckpointError as e:
            skipped.append(f"{name}: {e}")
            continue
        if skipped:
            ckpt.skipped = skipped
            ckpt.warning = f"checkpoint {'; '.join(skipped)}; resuming from {name} instead"
        return ckpt
    raise CheckpointError(f"no whole checkpoint in {root}: {'; '.join(skipped)}")


def load_latest(root: str | Path, *, verify_data: bool = False, quiet: bool = False) -> Checkpoint:
    """The newest whole checkpoint under `root`; falls back past broken ones, saying so (a
    logged warning; with `quiet` only in `.warning`, for a caller that reports it itself).
    Reads manifests, sizes and digests (no torch); with `verify_data` loads every tensor."""
    ckpt = _newest_whole(root, verify_data)
    if ckpt.warning and not quiet:
        log.warning("%s", ckpt.warning)
    return ckpt


def has_whole_checkpoint(root: str | Path) -> bool:
    """Whether `root` holds a whole checkpoint (as `load_latest` judges it, without torch
    and without a word)."""
    try:
        _newest_whole(root, verify_data=False)
    except CheckpointError:
        return False
    return True


# -- reading layers (the nodes) -----------------------------------------------------------


def _load_layer(store: LocalStore | FsspecStore, d: str, layer: int) -> list[tuple[str, torch.Tensor]]:
    import torch
    import torch.distributed.checkpoint as dcp
    name = _layer_name(layer)
    sidecar = read_sidecar(store, d, layer)
    state = {}
    for e in sidecar["tensors"]:
        dtype = getattr(torch, e["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{name}/{_SIDECAR} names an unknown dtype {e['dtype']!r}")
        state[e["key"]] = torch.empty([int(x) for x in e["shape"]], dtype=dtype)
    try:
        reader = store.reader(store.join(d, name))
        # Read first here: DCP logs a failed read with its traceback (on the root logger)
        # before it raises.
        reader.read_metadata()
        with single_process():
            dcp.load(state, storage_reader=reader, no_dist=True)
    except BaseException as e:  # a damaged folder, whatever DCP makes of it
        if not is_failure(e):
            raise
        raise CheckpointError(f"{name} cannot be read ({why_failed(e)})") from None
    prefix = f"layer.{layer}."
    out = []
    for e in sidecar["tensors"]:
        if _sha256(state[e["key"]]) != e["sha256"]:
            raise CheckpointError(f"{name}: {e['key']} is corrupt (sha256 mismatch)")
        key = e["key"]
        out.append((key[len(prefix):] if key.startswith(prefix) else key, state[key]))
    return out


def load_layer_tensors(path: str | Path, layer: int) -> list[tuple[str, torch.Tensor]]:
    """Layer `layer`'s tensors from the checkpoint (or final) folder `path`, as (name,
    tensor) in the order they were written, names without the `layer.{i}.` prefix."""
    store = storage_for(path)
    try:
        return _load_layer(store, str(path), layer)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_layers(path: str | Path, layers: Iterable[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The named tensors (a layer's state: `bamboo.engine.layer_state`) of only `layers`
    from the checkpoint folder `path` (any subset: each layer is its own folder)."""
    return {i: dict(load_layer_tensors(path, i)) for i in sorted(set(layers))}
