"""What an agent and its coordinator exchange besides the messages: the objects a job sent
by value (`Objects`, signed with the job's token, in parts when large), the classes that may
travel on an agent's connection (`register_wire_types`), and the one-line `JoinError`.
Torch-free: both the agent's process and the coordinator's import it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bamboo.protocol.frames import register
from bamboo.protocol.messages import AGENT_MESSAGES, WORKER_MESSAGES

__all__ = ["JoinError", "Objects", "CHUNK_BYTES", "objects_messages", "install_objects",
           "register_wire_types"]


class JoinError(RuntimeError):
    """An agent could not join; str() is the one line for the user."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Objects:
    """The objects a job sent by value (bamboo.config.objects), sent to an agent before the
    first `Job` that names them: {reference: [base64 of the bytes, HMAC-SHA256 of the
    reference and the whole bytes under the job's token]}. The agent checks both before it
    keeps them (`install_objects`): it unpickles only what the holder of its token sent.
    An object over `CHUNK_BYTES` travels in `parts` messages of one reference each, part
    `part` holding that slice of its bytes; the agent keeps it once the last part is in."""

    objects: dict[str, list[str]]
    part: int = 0
    parts: int = 1


CHUNK_BYTES = 6 << 20
"""The most bytes of objects one message carries: base64 makes them 8 MiB, within a frame
(bamboo.protocol.frames.MAX_FRAME). A larger object is cut into chunks of this size."""

def objects_messages(config: Any, token: str, sent: set[str]) -> list[Objects]:
    """The `Objects` messages of `config`'s by-value references not in `sent` (which gains
    them): small ones together, up to `CHUNK_BYTES` a message; each larger one in parts."""
    import base64

    from bamboo.config import objects
    refs = [r for r in objects.references(config.to_dict()) if r not in sent]
    messages: list[Objects] = []
    batch: dict[str, list[str]] = {}
    size = 0
    for ref in refs:
        data = objects.data_of(ref)
        mac = objects.sign(token, ref, data)
        if len(data) > CHUNK_BYTES:
            parts = -(-len(data) // CHUNK_BYTES)
            messages += [Objects(objects={ref: [base64.b64encode(
                data[k * CHUNK_BYTES:(k + 1) * CHUNK_BYTES]).decode(), mac]}, part=k,
                parts=parts) for k in range(parts)]
            continue
        if batch and size + len(data) > CHUNK_BYTES:
            messages.append(Objects(objects=batch))
            batch, size = {}, 0
        batch[ref] = [base64.b64encode(data).decode(), mac]
        size += len(data)
    if batch:
        messages.append(Objects(objects=batch))
    sent.update(refs)
    return messages


def install_objects(msg: Objects, token: str, pending: dict[str, list[bytes]] | None = None
                    ) -> list[str]:
    """An agent's side: each object checked (signature, hash) and kept on this machine for
    its workers; the references kept. A part of a larger object waits in `pending` (the
    agent's, across messages) until its last part arrives. ObjectError (one line) for one
    that fails a check."""
    import base64
    import binascii

    from bamboo.config import objects
    kept = []
    for ref, entry in msg.objects.items():
        try:
            encoded, mac = entry
            data = base64.b64decode(encoded, validate=True)
        except (TypeError, ValueError, binascii.Error):
            raise objects.ObjectError(f"a malformed object {str(ref)[:80]!r}") from None
        if msg.parts > 1:
            whole = _joined(ref, data, msg, {} if pending is None else pending)
            if whole is None:
                continue
            data = whole
        objects.verify(token, ref, data, mac)
        objects.install(ref, data)
        kept.append(ref)
    return kept


def _joined(ref: str, data: bytes, msg: Objects, pending: dict[str, list[bytes]]
            ) -> bytes | None:
    """The whole bytes of `ref` once part `msg.part` (the last) is in, else None (kept in
    `pending`); ObjectError for a part out of order."""
    from bamboo.config import objects
    parts = pending.setdefault(ref, [])
    if msg.part != len(parts) or len(msg.objects) != 1:
        pending.pop(ref, None)
        raise objects.ObjectError(f"part {msg.part} of the object {str(ref)[:80]!r} came out of "
                                  f"order")
    parts.append(data)
    if msg.part < msg.parts - 1:
        return None
    return b"".join(pending.pop(ref))


def register_wire_types() -> None:
    """Every class that may travel between an agent and the coordinator."""
    from bamboo.config import SECTION_CLASSES, JobConfig, KillSpec
    from bamboo.plan.faults import Fault
    from bamboo.protocol.launch import WorkerSpec
    register(*AGENT_MESSAGES, *WORKER_MESSAGES, WorkerSpec, JobConfig, *SECTION_CLASSES,
             KillSpec, Fault, Objects)
