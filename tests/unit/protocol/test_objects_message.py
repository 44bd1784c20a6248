"""A job's objects sent by value reach an agent with its first `Job`: each signed with the
job's token, carried as a JSON frame, and kept on the agent's machine only when its
signature and hash hold (bamboo.protocol.agent_wire.objects_messages / install_objects; a large one in parts)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bamboo.config import JobConfig, objects
from bamboo.protocol.agent_wire import (
    CHUNK_BYTES,
    Objects,
    install_objects,
    objects_messages,
    register_wire_types,
)
from bamboo.protocol.frames import decode, to_bytes

TOKEN = "a" * 32


@pytest.fixture(autouse=True)
def _machine_dir_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def _over_the_wire(msg: Objects) -> Objects:
    import json
    register_wire_types()
    body = to_bytes(msg)[4:]
    return decode(json.loads(body))


def test_an_agent_keeps_what_the_holder_of_its_token_sent_once() -> None:
    ref = objects.send(lambda vocab_size=256: None, "model")
    cfg = JobConfig.of(nodes=2, stages=2).replace(model=ref)
    sent: set[str] = set()
    [msg] = objects_messages(cfg, TOKEN, sent)
    assert list(msg.objects) == [ref] and sent == {ref} and msg.parts == 1
    assert objects_messages(cfg, TOKEN, sent) == []  # each agent gets it once
    received = _over_the_wire(msg)
    objects.forget(ref)
    (objects.machine_dir() / f"{objects.digest_of(ref)}.pkl").unlink()
    assert install_objects(received, TOKEN) == [ref]
    objects.forget(ref)
    assert objects.resolve(ref)(vocab_size=3) is None  # from the machine's directory


def test_an_object_signed_with_another_token_or_altered_is_refused() -> None:
    ref = objects.send(lambda vocab_size=256: 1, "model")
    [msg] = objects_messages(JobConfig.of(nodes=2, stages=2).replace(model=ref), TOKEN, set())
    with pytest.raises(objects.ObjectError, match="without a valid signature"):
        install_objects(msg, "b" * 32)
    encoded, mac = msg.objects[ref]
    altered = Objects(objects={ref: [encoded[:-4] + "AAA=", mac]})
    with pytest.raises(objects.ObjectError, match="without a valid signature"):
        install_objects(altered, TOKEN)
    with pytest.raises(objects.ObjectError, match="a malformed object"):
        install_objects(Objects(objects={ref: "not a pair"}), TOKEN)


def test_an_object_over_a_frame_travels_in_parts_kept_once_the_last_is_in() -> None:
    """14 MiB (a frame holds 16 MiB of base64 text): three parts, each within a frame; the
    agent keeps nothing until the last part, then the whole bytes, checked; a part out of
    order is refused."""
    big = bytes(range(256)) * (56 << 10)
    ref = objects.send(big, "model")
    cfg = JobConfig.of(nodes=2, stages=2).replace(model=ref)
    parts = [_over_the_wire(m) for m in objects_messages(cfg, TOKEN, set())]
    assert [(m.part, m.parts) for m in parts] == [(0, 3), (1, 3), (2, 3)]
    assert all(len(to_bytes(m)) < 16 << 20 for m in parts) and CHUNK_BYTES < len(big)
    objects.forget(ref)
    (objects.machine_dir() / f"{objects.digest_of(ref)}.pkl").unlink()
    pending: dict[str, list[bytes]] = {}
    assert install_objects(parts[0], TOKEN, pending) == []
    assert install_objects(parts[1], TOKEN, pending) == []
    assert install_objects(parts[2], TOKEN, pending) == [ref] and pending == {}
    objects.forget(ref)
    assert objects.resolve(ref) == big
    with pytest.raises(objects.ObjectError, match="part 1 of the object .* came out of order"):
        install_objects(parts[1], TOKEN, {})
