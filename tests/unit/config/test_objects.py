"""Objects sent by value (bamboo.config.objects): pickled once, named by the SHA-256 of
their bytes, found again from memory, a run's objects/ or the machine's directory (each
checked against its hash), and what cannot be sent refused in one line."""
from __future__ import annotations

import hashlib
import tempfile
import threading
from pathlib import Path

import pytest

from bamboo.config import ConfigError, objects
from bamboo.model.api import import_object


@pytest.fixture(autouse=True)
def _machine_dir_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's directory under the test's own temp directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


def _closure(scale: float):
    return lambda x: x * scale


def test_a_closure_round_trips_named_by_the_sha256_of_its_bytes() -> None:
    ref = objects.send(_closure(3.0), "loss")
    assert objects.is_reference(ref) and ref.startswith(objects.PREFIX)
    data = objects.data_of(ref)
    assert objects.digest_of(ref) == objects.content_digest(data)
    assert objects.resolve(ref)(2.0) == 6.0
    assert objects.send(_closure(3.0), "loss") == ref  # the same bytes, the same name
    assert objects.send(_closure(4.0), "loss") != ref
    assert objects.short(ref) == f"by value (sha256 {objects.digest_of(ref)[:12]}...)"


def test_the_digest_is_the_same_however_pickle_shared_equal_strings() -> None:
    """Pickle refers back to a string it wrote when the same object comes again, and writes
    an equal but distinct one anew: the bytes differ, the digest does not."""
    import pickle
    name = "weight" * 3
    shared, distinct = [name, name], [name, "".join(["weight"] * 3)]
    a, b = pickle.dumps(shared, protocol=5), pickle.dumps(distinct, protocol=5)
    assert a != b and hashlib.sha256(a).digest() != hashlib.sha256(b).digest()
    assert objects.content_digest(a) == objects.content_digest(b)
    assert objects.content_digest(pickle.dumps([name, name + "!"], protocol=5)) != \
        objects.content_digest(a)
    assert objects.content_digest(pickle.dumps([b"x", "x"], protocol=5)) != \
        objects.content_digest(pickle.dumps(["x", "x"], protocol=5))


def test_a_reference_is_an_import_path_every_importer_takes() -> None:
    ref = objects.send(_closure(5.0), "metric")
    assert import_object(ref)(2.0) == 10.0
    with pytest.raises(AttributeError):
        objects.sha512_00  # noqa: B018 - only sha256_<hex> names are answered


def test_the_bytes_are_found_on_disk_when_this_process_has_forgotten_them(
        tmp_path: Path) -> None:
    ref = objects.send(_closure(2.0), "model")
    digest = objects.digest_of(ref)
    on_machine = objects.machine_dir() / f"{digest}.pkl"
    assert on_machine.read_bytes() == objects.data_of(ref)
    assert (objects.machine_dir().stat().st_mode & 0o777) == 0o700
    [saved] = objects.save([ref], tmp_path / "run" / "objects")
    assert saved == tmp_path / "run" / "objects" / f"{digest}.pkl"
    assert not [p for p in saved.parent.iterdir() if p.name.startswith(".")]  # no temp left
    objects.forget(ref)
    on_machine.unlink()
    assert objects.resolve(ref)(1.5) == 3.0  # from the run's objects/
    objects.forget(ref)
    saved.write_bytes(b"not the bytes")  # a file that does not hash to its name is not read
    with pytest.raises(objects.ObjectError, match="is not on this machine: run the job from "
                       "the Python process that made it"):
        objects.data_of(ref)


def _generator_closure():
    numbers = (i for i in range(3))
    return lambda: next(numbers)


@pytest.mark.parametrize("make, expected", [
    (_generator_closure, "cannot be sent by value (TypeError: cannot pickle 'generator' object)"),
    (lambda: (lambda lock=threading.Lock(): lock),  # noqa: B008 (the lock is the point)
     "cannot pickle '_thread.lock' object"),
])
def test_what_cannot_be_pickled_is_refused_in_one_line_saying_what_to_do(make, expected) -> None:
    with pytest.raises(objects.ObjectError) as e:
        objects.send(make(), "model")
    text = str(e.value)
    assert text.startswith("model: ") and expected in text and "\n" not in text, text
    assert "define it at module level in a .py file" in text
    assert isinstance(e.value, ConfigError)


def test_a_file_open_for_writing_is_refused(tmp_path: Path) -> None:
    with open(tmp_path / "log.txt", "w") as log:
        with pytest.raises(objects.ObjectError, match="PicklingError: Cannot pickle files that "
                           "are not opened for reading"):
            objects.send(lambda text: log.write(text), "loss")


def test_an_object_of_any_size_is_sent_and_found_again_on_disk() -> None:
    """No cap: 20 MiB of bytes go to this machine's directory and come back whole."""
    big = bytes(range(256)) * (80 << 10)
    ref = objects.send(big, "model")
    objects.forget(ref)
    assert objects.resolve(ref) == big and len(big) == 20 << 20


@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
def test_a_tensor_on_a_gpu_is_refused() -> None:
    import torch
    weights = torch.ones(2, device="cuda")
    with pytest.raises(objects.ObjectError, match="holds a tensor on cuda:0 .* keep it on the CPU"):
        objects.send(lambda: weights, "model")


def test_references_are_found_in_a_config_once_and_signed_with_the_token() -> None:
    ref = objects.send(_closure(1.0), "model")
    config = {"model": ref, "metrics": [ref, "acc=pkg:acc"], "seed": 3, "loss": None}
    assert objects.references(config) == [ref]
    data = objects.data_of(ref)
    mac = objects.sign("t" * 32, ref, data)
    objects.verify("t" * 32, ref, data, mac)
    for token, payload in (("u" * 32, data), ("t" * 32, data + b"!")):
        with pytest.raises(objects.ObjectError, match="without a valid signature"):
            objects.verify(token, ref, payload, mac)
    with pytest.raises(objects.ObjectError, match="do not match its SHA-256"):
        objects.install(ref, data + b"!")
    for bad in ("pkg:fn", objects.PREFIX + "abc", None):
        assert not objects.is_reference(bad)
