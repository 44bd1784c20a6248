"""What makes a checkpoint trustworthy: the checks `bamboo.run.checkpoint` reads it with.

A chain of sha256 digests, written with the checkpoint and checked before it is used:

- each layer's `layer.json` (its sidecar) records every file of its DCP folder with its
  size and sha256 (`.metadata`, the data files), and every tensor's sha256;
- the manifest records the sha256 of each `layer.json` it names, and a `checksum`: the
  sha256 of its own canonical JSON without that field.

So an edited manifest (its step, its losses), a swapped or edited sidecar, and a flipped
byte in any file of any layer are each a checkpoint that is skipped with one line saying
why, never one that is loaded. The manifest's step must also be its folder's. Reading the
files to check them costs one pass over the checkpoint, paid only when a checkpoint is
chosen (a resume, a restore), never while training.
"""
from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Any

from bamboo.run.checkpoint_storage import FsspecStore, LocalStore, why_failed
from bamboo.util.json_shape import ListOf, MapOf, Record, Shape, problems

__all__ = ["CheckpointError", "FORMAT", "SIDECAR", "MANIFEST", "file_digest", "manifest_body",
           "read_manifest", "read_sidecar", "verify_files"]

FORMAT = 4
"""1: one torch.save file per stage, written by the coordinator. 2: one DCP folder per
layer, written by the layer's holder. 3: format 2 with sha256 digests of every file and a
checksum over the manifest. 4: format 3 with a layer's state as named tensors, its
parameters and its optimizer's own per-parameter state (`bamboo.engine.layer_state`),
where 2 and 3 held one float32 vector of parameters, two moments and a step count."""
SIDECAR = "layer.json"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_CHUNK = 1 << 20

Store = LocalStore | FsspecStore

MANIFEST_SHAPE = Record({"format": int, "step": int, "layers": ListOf(int),
                         "sidecars": MapOf(str), "checksum": str}, optional={"meta": dict})
"""What a manifest.json holds (`manifest_body` writes it)."""
SIDECAR_SHAPE = Record({"tensors": ListOf(Record({"key": str, "shape": ListOf(int), "dtype": str,
                                                   "sha256": str})),
                        "files": MapOf(int), "digests": MapOf(str)},
                       optional={"format": int, "layer": int})
"""What a layer.json holds (`bamboo.run.checkpoint._write_layer` writes it)."""
_SHOWN = 4
"""Problems of a damaged file named in its one line; the rest are counted."""


def _damaged(name: str, value: object, shape: Shape) -> CheckpointError | None:
    """The one-line error for a file `name` whose JSON `value` is not `shape`: every
    missing or mistyped key (the first few named, the rest counted); None when it fits."""
    found = problems(value, shape)
    if not found:
        return None
    more = len(found) - _SHOWN
    text = "; ".join(found[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")
    return CheckpointError(f"{name} is damaged: {text}")


def _parsed(raw: bytes, name: str) -> object:
    """The JSON in `raw` (the file `name`); CheckpointError saying where it stops parsing."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{name} is damaged: it is not UTF-8 text") from None
    except ValueError as e:
        raise CheckpointError(f"{name} is damaged: not JSON ({e})") from None


_OLDER = {3: " (format 3 kept a layer's state as one float32 vector: start afresh, or finish "
              "that run with the version of bamboo that wrote it)"}
"""What a manifest of an older format adds to its refusal."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or none could be loaded; str() is one line."""


def _layer_name(layer: int) -> str:
    return f"layer-{layer:04d}"


def file_digest(store: Store, path: str) -> str:
    """sha256 of one stored file, read in chunks."""
    h = hashlib.sha256()
    if isinstance(store, LocalStore):
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    else:
        h.update(store.read_bytes(path))
    return h.hexdigest()


def _checksum(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def manifest_body(store: Store, d: str, step: int, layers: list[int], meta: dict) -> dict:
    """The manifest of step `step`'s checkpoint in folder `d`: its layers' sidecar digests
    read from storage, and its checksum."""
    sidecars = {_layer_name(i): file_digest(store, store.join(d, _layer_name(i), SIDECAR))
                for i in layers}
    body = {"format": FORMAT, "step": step, "layers": layers, "meta": meta,
            "sidecars": sidecars}
    return body | {"checksum": _checksum(body)}


def _expected_layers(meta: dict) -> int | None:
    """How many layers a checkpoint of whole layers (meta "unit" "layer") must hold: those
    of the model it names, when that model is known here."""
    if not isinstance(meta, dict) or meta.get("unit") != "layer" or "model" not in meta:
        return None
    from bamboo.config.presets import preset
    from bamboo.data.sizing import SIZING
    try:
        return preset(str(meta["model"]), SIZING).layers
    except (ValueError, OSError, KeyError, TypeError):  # a model this version cannot read
        return None


def read_manifest(store: Store, d: str) -> dict:
    """The manifest of folder `d`, whole (every layer of the model listed), its step that
    of the folder, its checksum right; CheckpointError says what is wrong."""
    try:
        raw = store.read_bytes(store.join(d, MANIFEST))
    except FileNotFoundError:
        raise CheckpointError("manifest.json is missing (the save did not finish)") from None
    except OSError as e:
        raise CheckpointError(f"manifest.json cannot be read ({why_failed(e)})") from None
    manifest: Any = _parsed(raw, MANIFEST)
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if isinstance(fmt, int) and fmt != FORMAT:
        raise CheckpointError(f"manifest.json is of format {fmt}; this version of bamboo "
                              f"reads format {FORMAT}" + _OLDER.get(fmt, ""))
    if (error := _damaged(MANIFEST, manifest, MANIFEST_SHAPE)) is not None:
        raise error
    step, layers, sidecars = manifest["step"], manifest["layers"], manifest["sidecars"]
    checksum = manifest["checksum"]
    meta = manifest.get("meta") or {}
    expected = set(range(max(layers, default=-1) + 1))
    count = _expected_layers(meta)
    if count is not None:
        expected |= set(range(count))
    missing = sorted(expected - set(layers))
    if missing:
        of = f" of the {count} of {meta['model']}" if count is not None else ""
        raise CheckpointError(f"manifest.json lacks layer{'s' if len(missing) > 1 else ''} "
                              f"{', '.join(map(str, missing))}{of}: the checkpoint is incomplete")
    if not layers:
        raise CheckpointError("manifest.json lists no layer")
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    if _checksum(body) != checksum:
        raise CheckpointError("manifest.json does not match its checksum (edited or damaged)")
    folder = _STEP_DIR.match(posixpath.basename(str(d).rstrip("/")))
    if folder is not None and int(folder[1]) != step:
        raise CheckpointError(f"manifest.json names step {step}, its folder step "
                              f"{int(folder[1])}")
    return {"step": step, "layers": sorted(layers), "meta": meta, "sidecars": sidecars}


def read_sidecar(store: Store, d: str, layer: int) -> dict:
    """A layer folder's layer.json, with every file it lists present at its size."""
    name = _layer_name(layer)
    ld = store.join(d, name)
    try:
        raw = store.read_bytes(store.join(ld, SIDECAR))
    except FileNotFoundError:
        what = name if not store.exists(ld) else f"{name}/{SIDECAR}"
        raise CheckpointError(f"{what} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{name}/{SIDECAR} cannot be read ({why_failed(e)})") from None
    sidecar: Any = _parsed(raw, f"{name}/{SIDECAR}")
    if (error := _damaged(f"{name}/{SIDECAR}", sidecar, SIDECAR_SHAPE)) is not None:
        raise error
    files = sidecar["files"]
    for f, size in files.items():
        try:
            actual = store.size(store.join(ld, f))
        except FileNotFoundError:
            raise CheckpointError(f"{name}/{f} is missing") from None
        except OSError as e:
            raise CheckpointError(f"{name}/{f} cannot be read ({why_failed(e)})") from None
        if actual != size:
            raise CheckpointError(f"{name}/{f} is truncated ({actual} of {size} bytes)"
                                  if actual < size else
                                  f"{name}/{f} has {actual} bytes, {size} were written")
    return sidecar


def verify_files(store: Store, d: str, layer: int, sidecar_sha: str | None) -> None:
    """Layer `layer`'s sidecar against the manifest's digest of it, and every file the
    sidecar lists against its own digest (CheckpointError names the first that differs)."""
    name = _layer_name(layer)
    ld = store.join(d, name)
    try:
        raw = store.read_bytes(store.join(ld, SIDECAR))
        if hashlib.sha256(raw).hexdigest() != sidecar_sha:
            raise CheckpointError(f"{name}/{SIDECAR} does not match the manifest's digest")
        sidecar: Any = _parsed(raw, f"{name}/{SIDECAR}")
        if (error := _damaged(f"{name}/{SIDECAR}", sidecar, SIDECAR_SHAPE)) is not None:
            raise error
        digests: dict[str, str] = sidecar["digests"]
        for f in sidecar["files"]:
            if file_digest(store, store.join(ld, f)) != digests.get(f):
                raise CheckpointError(f"{name}/{f} is corrupt (sha256 mismatch)")
    except OSError as e:
        raise CheckpointError(f"{name} cannot be read ({why_failed(e)})") from None
