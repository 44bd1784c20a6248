"""Objects sent by value: what no process can import by name, pickled once with
cloudpickle and found again by its SHA-256 in every process of a run.

    ref = send(obj, "model")   # 'bamboo.config.objects:sha256_<hex>', the bytes' digest
    obj = resolve(ref)         # in any process of the run

A model object (an `nn.Sequential`, a layer list, a `PipelineModel`), a lambda, a closure
or a notebook's function cannot be imported by the workers, so `bamboo.Job` sends it by
value: `send` pickles it (of any size; refusing in one line what cannot be pickled or
loaded back, and tensors on a GPU), and the reference, which names the bytes by their
hash, takes the place of the import path in the job (`--model`, a checkpoint's meta,
summary.json's config). A different object is another reference, so a resume with another
model is refused as any other model is. The digest (`digest`) is the SHA-256 of the pickle's
instructions with its memo taken out: pickle shares an equal string by object identity,
which a run in the same process can change (annotations made anew), so the same object
pickled twice may differ in bytes but never in digest. A reference is itself a `MODULE:NAME`: this module
answers the name (`__getattr__`), so whatever imports objects by name (`--model`,
`bamboo.model.api.import_object`) takes a by-value reference as it takes an import path.

Where a process finds the bytes of a reference (each checked against its hash before it is
unpickled):
- this process's memory (the process that sent them, or `install`ed them);
- the directories `add_dir` named (a run directory's `objects/`, written by `save`);
- this machine's directory (`machine_dir()`: per user, mode 0700, in the temp directory),
  where `send` and `install` put them for the workers this machine starts; an agent
  `install`s what its coordinator sent with the job (`bamboo.protocol.agent_wire.Objects`, in
  parts for a large one, signed with the job's token: `sign`, `verify`).

Torch-free: unpickling a model imports torch, importing this module does not.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bamboo.config.options import ConfigError

__all__ = ["PREFIX", "ObjectError", "is_reference", "send", "resolve", "data_of",
           "digest_of", "content_digest", "short", "references", "save", "install", "forget",
           "add_dir", "add_run_dirs", "machine_dir", "sign", "verify"]

PREFIX = "bamboo.config.objects:sha256_"
"""A reference is PREFIX followed by the 64 hex digits of its bytes' SHA-256."""

_REF = re.compile(r"bamboo\.config\.objects:sha256_([0-9a-f]{64})")
_NAME = re.compile(r"sha256_([0-9a-f]{64})")
_FIX = ("define it at module level in a .py file (the workers import it by name), or give "
        "a factory function that builds it")

_sent: dict[str, bytes] = {}
"""sha256 -> bytes: what this process sent or was given."""
_dirs: list[Path] = []
"""Directories searched for `<sha256>.pkl` (a run's objects/)."""


class ObjectError(ConfigError):
    """An object that cannot be sent by value, or a reference whose bytes are not here."""


def __getattr__(name: str) -> Any:
    """`sha256_<hex>`: the object sent by value under that hash (a reference is this
    module's name and that attribute)."""
    if _NAME.fullmatch(name) is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return resolve(f"{__name__}:{name}")


def short(ref: str) -> str:
    """A reference as messages show it: `by value (sha256 1a2b3c4d5e6f...)`."""
    return f"by value (sha256 {digest_of(ref)[:12]}...)"


def is_reference(text: object) -> bool:
    """Whether `text` is a by-value reference (`PREFIX` + a SHA-256)."""
    return isinstance(text, str) and _REF.fullmatch(text) is not None


def digest_of(ref: str) -> str:
    """The SHA-256 (hex) a reference names; ObjectError if `ref` is none."""
    match = _REF.fullmatch(ref) if isinstance(ref, str) else None
    if match is None:
        raise ObjectError(f"{str(ref)[:80]!r} is not a by-value reference ({PREFIX}<hex>)")
    return match.group(1)


def send(obj: Any, what: str) -> str:
    """The reference of `obj` pickled by value, its bytes kept in this process and this
    machine's directory. ObjectError (one line naming `what`) for an object that cannot be
    pickled or loaded back. Any size: the bytes go to a file in this machine's directory
    (and the run directory's objects/), and to an agent in parts."""
    import cloudpickle
    kind = type(obj).__name__
    try:
        data = _dumps(obj, cloudpickle)
        cloudpickle.loads(data)
    except ObjectError as e:
        raise ObjectError(f"{what}: {kind} cannot be sent by value: {e}; {_FIX}", what) from None
    except Exception as e:  # noqa: BLE001 - whatever pickle or a __reduce__ raises
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ObjectError(f"{what}: {kind} cannot be sent by value ({type(e).__name__}: "
                          f"{reason}): {_FIX}", what) from None
    digest = content_digest(data)
    _sent[digest] = data
    _store(machine_dir(), digest, data)
    return PREFIX + digest


def _dumps(obj: Any, cloudpickle: Any) -> bytes:
    """`obj` pickled by cloudpickle, refusing tensors that live on an accelerator (the
    workers may have another one, or none)."""
    import io

    class Pickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is passed in: Any
        def persistent_id(self, value: Any) -> None:
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(value, torch.Tensor) \
                    and value.device.type not in ("cpu", "meta"):
                raise ObjectError(f"it holds a tensor on {value.device} (shape "
                                  f"{list(value.shape)}): keep it on the CPU, the workers "
                                  f"move each layer to their own device")
            return None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


_TEXT = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
                   "BINUNICODE", "BINUNICODE8"})
_BYTES = frozenset({"BINBYTES", "SHORT_BINBYTES", "BINBYTES8"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def content_digest(data: bytes) -> str:
    """The SHA-256 of pickle `data`'s instructions, a string or bytes written out wherever
    the memo refers to one and frames left out: the same for every pickling of one object.
    "" for bytes that are not one whole pickle."""
    try:
        return _digest(data)
    except (ValueError, TypeError, IndexError):
        return ""


def _digest(data: bytes) -> str:
    import pickletools
    h = hashlib.sha256()
    memo: dict[int, bytes] = {}
    objects_memoized, last = 0, b""

    def emit(token: bytes) -> None:
        h.update(len(token).to_bytes(8, "little"))
        h.update(token)

    end: int | None = -1
    for op, op_arg, end in pickletools.genops(data):  # noqa: B007 (end: read after the loop)
        arg: Any = op_arg  # of the op's own type, checked by the op's name
        name = op.name
        if name == "FRAME":
            continue
        if name in _PUTS:
            index = len(memo) if name == "MEMOIZE" else int(arg)
            if last[:1] in (b"S", b"B"):
                memo[index] = last
            else:
                memo[index] = b"R%d" % objects_memoized
                objects_memoized += 1
            continue
        if name in _GETS:
            token = memo.get(int(arg), b"?")
            token = token if token[:1] in (b"S", b"B") else b"G" + token
        elif name in _TEXT:
            token = b"S" + str(arg).encode("utf-8", "surrogatepass")
        elif name in _BYTES:
            token = b"B" + bytes(arg)
        else:
            token = b"O" + f"{name} {arg!r}".encode("utf-8", "surrogatepass")
        emit(token)
        last = token
    if end != len(data) - 1:  # bytes after the pickle's STOP
        return ""
    return h.hexdigest()


def data_of(ref: str) -> bytes:
    """The bytes of `ref`, from this process, a run's objects/ or this machine's directory;
    ObjectError (one line) when none holds them."""
    digest = digest_of(ref)
    if digest in _sent:
        return _sent[digest]
    for directory in (*_dirs, machine_dir()):
        path = directory / f"{digest}.pkl"
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if content_digest(data) == digest:
            _sent[digest] = data
            return data
    raise ObjectError(f"the object sent {short(ref)} is not on this "
                      f"machine: run the job from the Python process that made it (bamboo.train), "
                      f"which sends it to every worker")


def resolve(ref: str) -> Any:
    """The object `ref` names, unpickled (each call a fresh copy)."""
    import cloudpickle
    return cloudpickle.loads(data_of(ref))


def references(value: Any) -> list[str]:
    """Every by-value reference in `value` (a config's dict, its lists and strings, also
    inside a call's text: `--optimizer bamboo.config.objects:sha256_...(lr=0.1)`), once."""
    found: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            for match in _REF.finditer(v):
                if match.group(0) not in found:
                    found.append(match.group(0))
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    walk(value)
    return found


def save(refs: Iterable[str], directory: Path) -> list[Path]:
    """Each reference's bytes written to `directory`/<sha256>.pkl (whole or not at all),
    and `directory` searched from now on; the paths written."""
    directory = Path(directory)
    paths = []
    for ref in refs:
        data = data_of(ref)
        paths.append(_store(directory, digest_of(ref), data))
    add_dir(directory)
    return paths


def install(ref: str, data: bytes) -> None:
    """Bytes received for `ref` (an agent's, from its coordinator) kept in this process and
    this machine's directory; ObjectError when they are not the bytes `ref` names."""
    digest = digest_of(ref)
    if content_digest(data) != digest:
        raise ObjectError(f"the bytes received for the object {short(ref)} do not match "
                          f"its SHA-256")
    _sent[digest] = data
    _store(machine_dir(), digest, data)


def forget(ref: str) -> None:
    """Drop this process's copy of `ref`'s bytes (they stay on disk, found again there)."""
    _sent.pop(digest_of(ref), None)


def add_dir(directory: Path) -> None:
    """Search `directory` for the bytes of references too (a run's objects/)."""
    directory = Path(directory)
    if directory not in _dirs:
        _dirs.append(directory)


def add_run_dirs(*run_dirs: str | Path | None) -> None:
    """Search the objects/ of each run directory given (None and "auto" skipped) that has
    one: a resume finds its objects there on a machine whose own copy is gone."""
    for d in run_dirs:
        if d is not None and d != "auto" and (Path(d) / "objects").is_dir():
            add_dir(Path(d) / "objects")


def machine_dir() -> Path:
    """This machine's directory of objects sent by value, for the workers it starts: one
    per user in the temp directory, mode 0700 (files are checked against their hash)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = Path(tempfile.gettempdir()) / f"bamboo-objects-{uid}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not path.is_dir() or path.is_symlink() or (hasattr(os, "getuid") and st.st_uid != uid):
        raise ObjectError(f"{path} is not a directory of this user's: remove it, bamboo "
                          f"keeps objects sent by value there")
    return path


def _store(directory: Path, digest: str, data: bytes) -> Path:
    """`data` as `directory`/<digest>.pkl, written to a temporary file and renamed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{digest}.pkl"
    if path.is_file() and path.stat().st_size == len(data):
        return path
    tmp = directory / f".{digest}.tmp-{os.getpid()}"
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def sign(token: str, ref: str, data: bytes) -> str:
    """The HMAC-SHA256 of `ref` and its bytes under the job's token: an agent unpickles
    only what the holder of its token sent."""
    return hmac.new(token.encode(), ref.encode() + b"\0" + data, hashlib.sha256).hexdigest()


def verify(token: str, ref: str, data: bytes, mac: str) -> None:
    """ObjectError unless `mac` is `sign(token, ref, data)`."""
    if not isinstance(mac, str) or not hmac.compare_digest(mac, sign(token, ref, data)):
        raise ObjectError(f"the object sent {short(ref)} came without a valid "
                          f"signature of the job's token: refused")
