"""Where checkpoints live: a local folder or an fsspec URL, behind one small interface
(`storage_for`), and DCP's readers with their metadata unpickled safely (only DCP's own
classes may be named in it); the temporaries an interrupted write leaves there, and what
a failed write or read says. Used by `bamboo.run.checkpoint`."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import posixpath
import re
import shutil
import socket
from pathlib import Path
from typing import Any

from bamboo.run.runlog import write_atomic

__all__ = ["LocalStore", "FsspecStore", "storage_for", "safe_reader", "single_process",
           "writer_tag", "fsync_dir", "MetadataUnpickler", "is_url", "HOST",
           "remove_stale_temporaries", "os_error_in", "is_failure", "why_failed", "free_space",
           "size_text"]


def is_url(location: str | Path) -> bool:
    """A location with a scheme (file://, s3://, ...): reached through fsspec (a Path never
    is one)."""
    return isinstance(location, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", location) is not None


# -- storage: a local folder or an fsspec URL -----------------------------------------------

log = logging.getLogger(__name__)

HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def writer_tag() -> str:
    """Who writes a temporary: this process on this machine."""
    return f"{os.getpid()}-{HOST}"


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A local (or mounted) folder: os calls, fsynced renames."""

    url = False

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def ls(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def write_file(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def write_atomic(self, path: str, data: bytes) -> None:
        write_atomic(Path(path), data)  # its temporary is `.NAME.tmp-PID`
        fsync_dir(os.path.dirname(path) or ".")

    def sync_dir(self, path: str) -> None:
        fsync_dir(path)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)
        fsync_dir(os.path.dirname(dst) or ".")

    def rmtree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def writer(self, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemWriter
        return FileSystemWriter(path, sync_files=True)

    def reader(self, path: str) -> Any:
        from torch.distributed.checkpoint import FileSystemReader
        return safe_reader(FileSystemReader)(path)


class FsspecStore:
    """A URL: fsspec calls (an object store renames by copying: the manifest, written
    last, is what makes a checkpoint whole)."""

    url = True

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs
        self.fs, _ = url_to_fs(url)

    def join(self, base: str, *names: str) -> str:
        return posixpath.join(base.rstrip("/"), *names)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def isdir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def ls(self, path: str) -> list[str]:
        try:
            return [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(path, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def write_file(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def write_atomic(self, path: str, data: bytes) -> None:
        head, name = posixpath.split(path.rstrip("/"))
        tmp = posixpath.join(head, f".{name}.tmp-{writer_tag()}")
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(tmp)
            raise

    def sync_dir(self, path: str) -> None:
        pass

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst, recursive=True)

    def rmtree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def writer(self, path: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(path, sync_files=True)

    def reader(self, path: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return safe_reader(FsspecReader)(path)


def storage_for(location: str | Path) -> LocalStore | FsspecStore:
    return FsspecStore(str(location)) if is_url(location) else LocalStore()


# -- safe reading of DCP metadata ---------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("collections", "OrderedDict")}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; only DCP's metadata classes, torch sizes and dtypes
    may be named in it (anything else could run code)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch
        allowed = (module, name) in _ALLOWED or module in _DCP_MODULES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        return super().find_class(module, name)


_safe_readers: dict[type, type] = {}


def safe_reader(base: type) -> type:
    """`base` (a DCP reader) with its metadata read by `MetadataUnpickler`."""
    if base not in _safe_readers:
        def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
        _safe_readers[base] = type(f"Safe{base.__name__}", (base,), {"read_metadata": read_metadata})
    return _safe_readers[base]


@contextlib.contextmanager
def single_process() -> Any:
    """DCP without a process group warns that it assumes one process: that is the intent.
    (A filter added once, not `catch_warnings`, which is not thread-safe: writes run on a
    background thread.)"""
    import warnings
    if not any(f[1] is not None and f[1].pattern.startswith("torch.distributed is disabled")
               for f in warnings.filters if f[0] == "ignore"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
    yield


# -- temporaries --------------------------------------------------------------------------

_TEMPORARY = re.compile(r"^\.(?:tmp-layer-\d+|old-layer-\d+|tmp-step-\d+|old-step-\d+|"
                        r"LATEST\.tmp|manifest\.json\.tmp)-(\d+)(?:-(.+))?$")
"""What a write leaves behind when it is interrupted (killed, power cut) mid-way: the pid
of the writer, and its host when the name says (a name without one is this machine's)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


def remove_stale_temporaries(store: LocalStore | FsspecStore, folder: str) -> list[str]:
    """Delete the temporaries in `folder` of earlier writes that never finished (this
    process's, or a process of this machine that is gone); a write in progress elsewhere,
    or one of another machine (whose processes cannot be seen from here), is left alone."""
    removed = []
    for name in store.ls(folder):
        m = _TEMPORARY.match(name)
        if m is None or (m[2] is not None and m[2] != HOST):
            continue
        if int(m[1]) != os.getpid() and _pid_alive(int(m[1])):
            continue
        store.rmtree(store.join(folder, name))
        removed.append(name)
    if removed:
        log.debug("removed %d unfinished checkpoint temporaries in %s: %s", len(removed), folder,
                  ", ".join(sorted(removed)))  # housekeeping: shown under --debug only
    return removed


# -- errors -------------------------------------------------------------------------------


def os_error_in(error: BaseException | None) -> OSError | None:
    """The OSError (e.g. ENOSPC) somewhere in an exception's chain (or in a DCP
    CheckpointException's failures), if any."""
    seen, todo = 0, [error]
    while todo and seen < 20:
        e = todo.pop(0)
        seen += 1
        if e is None:
            continue
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's wrapped ones
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def is_failure(e: BaseException) -> bool:
    """A failure to report (an Exception, or DCP's CheckpointException, which is a
    BaseException), not an interrupt."""
    return isinstance(e, Exception) or type(e).__name__ == "CheckpointException"


def unwrap_failure(e: BaseException) -> BaseException:
    """The first exception a DCP CheckpointException wraps (else `e`)."""
    for failure in (getattr(e, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


def why_failed(e: BaseException, where: str | Path | None = None) -> str:
    """A failed write or read in one line, as the OS says it ("No space left on device");
    a full disk under the local folder `where` also says how much room is left there."""
    cause = os_error_in(e)
    if cause is not None:
        text = cause.strerror or str(cause) or type(cause).__name__
        if cause.errno in (errno.ENOSPC, errno.EDQUOT) and where is not None:
            free = free_space(where)
            text += f" ({free} free there)" if free else ""
        return text
    e = unwrap_failure(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def free_space(where: str | Path) -> str:
    """The room left on the file system of the local folder `where` (or of its nearest
    existing parent), e.g. "12 kB"; '' for a URL or where it cannot be asked."""
    if is_url(where):
        return ""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return size_text(free)


def size_text(count: int | float) -> str:
    """A byte count for people: "12 kB", "3.4 MB", "1.2 GB"."""
    if count >= 1e9:
        return f"{count / 1e9:.1f} GB"
    if count >= 1e6:
        return f"{count / 1e6:.1f} MB"
    return f"{count / 1e3:.0f} kB"
