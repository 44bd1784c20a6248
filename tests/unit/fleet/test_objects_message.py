"""A job's objects sent by value reach an agent with its first `Job`: each signed with the
job's token, carried as a JSON frame, and kept on the agent's machine only when its
signature and hash hold (bamboo.fleet.remote.objects_message / install_objects)."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bamboo.config import JobConfig, objects
from bamboo.fleet.remote import Objects, install_objects, objects_message, register_wire_types
from bamboo.wire.frames import decode, to_bytes

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
    msg = objects_message(cfg, TOKEN, sent)
    assert msg is not None and list(msg.objects) == [ref] and sent == {ref}
    assert objects_message(cfg, TOKEN, sent) is None  # each agent gets it once
    received = _over_the_wire(msg)
    objects.forget(ref)
    (objects.machine_dir() / f"{objects.digest_of(ref)}.pkl").unlink()
    assert install_objects(received, TOKEN) == [ref]
    objects.forget(ref)
    assert objects.resolve(ref)(vocab_size=3) is None  # from the machine's directory


def test_an_object_signed_with_another_token_or_altered_is_refused() -> None:
    ref = objects.send(lambda vocab_size=256: 1, "model")
    msg = objects_message(JobConfig.of(nodes=2, stages=2).replace(model=ref), TOKEN, set())
    assert msg is not None
    with pytest.raises(objects.ObjectError, match="without a valid signature"):
        install_objects(msg, "b" * 32)
    encoded, mac = msg.objects[ref]
    altered = Objects(objects={ref: [encoded[:-4] + "AAA=", mac]})
    with pytest.raises(objects.ObjectError, match="without a valid signature"):
        install_objects(altered, TOKEN)
    with pytest.raises(objects.ObjectError, match="a malformed object"):
        install_objects(Objects(objects={ref: "not a pair"}), TOKEN)
