"""Tokenized datasets: `bamboo data prepare`, the memory-mapped reader and `--data DIR`.
Its tests that start processes: tests/integration/test_tokendata_runs.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bamboo import cli
from bamboo.config import ConfigError, JobConfig
from bamboo.config.presets import preset, with_vocab
from bamboo.config.token_dir import SPLITS, open_split, read_header
from bamboo.data.datasets import TextFile, TokenFile, make_task
from bamboo.data.tokens import EOT
from support.tokens import docs_text, prepare

TEXT = "Grüße aus Bamboo — preemptible instances, pipelines and shadows.\n"


def split_parts(path: Path, fraction: float = 0.05) -> tuple[str, str]:
    """The train and val text of one input file, as prepare cuts it (on a character)."""
    raw = path.read_bytes()
    cut = len(raw) - int(np.ceil(len(raw) * fraction))
    while cut < len(raw) and raw[cut] & 0xC0 == 0x80:
        cut += 1
    return raw[:cut].decode(), raw[cut:].decode()


def tokens(out: Path, split: str) -> np.ndarray:
    h = read_header(out)
    return np.fromfile(out / f"{split}.bin", dtype=h.dtype)


def test_bytes_header_and_round_trip(tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(TEXT * 40, encoding="utf-8")
    b.write_text(TEXT.upper() * 30, encoding="utf-8")
    out = tmp_path / "data"
    assert prepare(capsys, str(a), str(b), "--out", str(out)) == (0, "")
    header = json.loads((out / "header.json").read_text())
    assert header["format"] == "bamboo-tokens" and header["version"] == 1
    assert header["tokenizer"]["kind"] == "bytes" and header["vocab_size"] == 256
    assert header["dtype"] == "uint16" and header["eot_id"] is None
    assert [s["path"] for s in header["sources"]] == [str(a.resolve()), str(b.resolve())]
    (a_train, a_val), (b_train, b_val) = split_parts(a), split_parts(b)
    for split, want in (("train", a_train + b_train), ("val", a_val + b_val)):
        got = tokens(out, split)
        assert header["tokens"][split] == len(got) == len(want.encode())
        assert bytes(got.astype(np.uint8)) == want.encode()


def test_bpe_vocab_files_and_windows_decode_to_the_text(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer
    files = docs_text(tmp_path)
    out = tmp_path / "bpe"
    assert prepare(capsys, *map(str, files), "--out", str(out), "--tokenizer", "bpe:300")[0] == 0
    h = read_header(out)
    assert h.vocab_size == 300 and h.tokenizer == {"kind": "bpe", "spec": "bpe:300",
                                                    "files": ["tokenizer.json"]}
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 300 and h.eot_id == tok.token_to_id(EOT)
    train = tokens(out, "train")
    assert len(train) < sum(len(f.read_bytes()) for f in files) * 0.8  # merges compress
    assert (train == h.eot_id).sum() == len(files) - 1  # files separated by end-of-text
    parts = [split_parts(f) for f in files]
    assert tok.decode(train.tolist(), skip_special_tokens=True) == "".join(p[0] for p in parts)
    assert tok.decode(tokens(out, "val").tolist(), skip_special_tokens=True) == \
        "".join(p[1] for p in parts)
    # a window the reader draws decodes to a piece of the text (cut only at its edges)
    source = TokenFile(out, seed=3, length=65)
    full = "".join(f.read_text() for f in files)
    for row in source.sequences([0, 1, 2], 65):
        ids = [t for t in row.tolist() if t != h.eot_id]
        text = tok.decode(ids).strip("\ufffd")
        assert len(text) > 40
        assert text[1:-1] in full


def test_hf_tokenizer_directory(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    files = docs_text(tmp_path, ("deploy",))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([files[0].read_text()], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(
        tmp_path / "tok")
    out = tmp_path / "hf"
    text = tmp_path / "other.txt"
    text.write_text(TEXT * 30, encoding="utf-8")
    code, err = prepare(capsys, str(files[0]), str(text), "--out", str(out), "--tokenizer",
                        f"hf:{tmp_path / 'tok'}")
    assert code == 0, err
    h = read_header(out)
    assert h.tokenizer["kind"] == "hf" and "tokenizer.json" in h.tokenizer["files"]
    copied = (out / "tokenizer.json").read_bytes()
    assert copied == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    assert h.vocab_size == tok.get_vocab_size() and h.eot_id == tok.token_to_id("</s>")
    # the copied files are a tokenizer transformers loads, and it decodes the data back
    loaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    val = loaded.decode(tokens(out, "val").tolist(), skip_special_tokens=True)
    assert val == split_parts(files[0])[1] + split_parts(text)[1]


def test_windows_are_pure_functions_of_seed_and_index(tmp_path: Path, capsys) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text("".join(f"line {i}: {TEXT}" for i in range(400)), encoding="utf-8")
    out = tmp_path / "d"
    assert prepare(capsys, str(src), "--out", str(out))[0] == 0
    a, b = TokenFile(out, seed=7, length=65), TokenFile(out, seed=7, length=65)
    assert isinstance(a.splits["train"], np.memmap) and isinstance(a.splits["val"], np.memmap)
    np.testing.assert_array_equal(a.sequences([5, 9], 65), b.sequences([5, 9], 65))
    np.testing.assert_array_equal(a.sequences([9], 65)[0], b.sequences([5, 9], 65)[1])
    np.testing.assert_array_equal(a.sequences([3], 65, val=True), b.sequences([3], 65, val=True))
    assert not np.array_equal(a.sequences([5], 65), a.sequences([6], 65))
    assert not np.array_equal(a.sequences([5], 65), TokenFile(out, 8, 65).sequences([5], 65))
    train_text, val_text = split_parts(src)
    for row in a.sequences(list(range(20)), 65, val=True):
        assert bytes(row.astype(np.uint8)) in val_text.encode()
    for row in a.sequences(list(range(20)), 65):
        assert bytes(row.astype(np.uint8)) in train_text.encode()
    # a Task: train and held-out micro-batches differ, both pure functions of their index
    task = make_task(preset("gpt2-tiny"), seed=7, global_micro_batches=2, micro_batch_size=4,
                     data_file=str(out))
    assert isinstance(task.source, TokenFile)
    assert torch.equal(task.eval_batch(1).inputs, task.eval_batch(1).inputs)
    assert not torch.equal(task.eval_batch(0).inputs, task.batch(0, 0).inputs)


def test_text_file_holds_out_its_last_bytes(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"a" * 1900 + b"b" * 100)
    source = TextFile(path, seed=0, length=65)
    assert set(source.sequences(list(range(30)), 65, val=True).ravel()) == {ord("b")}
    assert ord("a") in source.sequences(list(range(30)), 65)
    assert (source.sequences(list(range(30)), 65) == ord("a")).mean() > 0.9
    with pytest.raises(ValueError, match="has 2000 bytes; it needs at least 2002"):
        TextFile(path, seed=0, length=1001)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _files(tmp_path: Path) -> dict[str, str]:
    good = tmp_path / "good.txt"
    good.write_text(TEXT * 50, encoding="utf-8")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (tmp_path / "nul.bin").write_bytes(b"text\0" * 100)
    (tmp_path / "tiny.txt").write_text("hi\n", encoding="utf-8")
    return {"good": str(good), "tmp": str(tmp_path)}


PREPARE_ERRORS = {
    "empty file": (["{tmp}/empty.txt"], "is empty"),
    "not UTF-8": (["{tmp}/latin1.txt"], "is not UTF-8 text"),
    "binary": (["{tmp}/nul.bin"], "looks binary"),
    "missing file": (["{tmp}/nope.txt"], "does not exist"),
    "a directory": (["{tmp}"], "is a directory"),
    "bad tokenizer": (["{good}", "--tokenizer", "sentencepiece"], "is not a tokenizer"),
    "bpe without a number": (["{good}", "--tokenizer", "bpe:lots"], "is not an integer"),
    "bpe too small": (["{good}", "--tokenizer", "bpe:100"], "must be between 257"),
    "hf missing dir": (["{good}", "--tokenizer", "hf:{tmp}/none"], "does not exist"),
    "hf no tokenizer.json": (["{good}", "--tokenizer", "hf:{tmp}"], "has no tokenizer.json"),
    "fraction 0": (["{good}", "--val-fraction", "0"], "--val-fraction must be between 0 and 1"),
    "fraction nan": (["{good}", "--val-fraction", "nan"], "must be between 0 and 1"),
    "fraction text": (["{good}", "--val-fraction", "most"], "invalid float value"),
    "split too small": (["{tmp}/tiny.txt"], "the val split has 1 token(s): give more text"),
}


@pytest.mark.parametrize("name", PREPARE_ERRORS)
def test_prepare_errors_are_one_line(name: str, tmp_path: Path, capsys) -> None:
    args, expected = PREPARE_ERRORS[name]
    where = _files(tmp_path)
    out = tmp_path / "out"
    try:
        code, err = prepare(capsys, *(a.format(**where) for a in args), "--out", str(out))
    except SystemExit as e:  # argparse's own errors
        code, err = e.code, capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    assert lines[0].startswith("bamboo data")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_a_non_empty_out_is_never_clobbered(tmp_path: Path, capsys) -> None:
    where = _files(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, err = prepare(capsys, where["good"], "--out", str(out))
    assert code == 2 and "is not empty" in err and len(err.strip().splitlines()) == 1
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    assert prepare(capsys, where["good"], "--out", str(empty))[0] == 0  # an empty one is fine
    assert (empty / "header.json").is_file()


def test_train_rejects_bad_data_directories_in_one_line(tmp_path: Path, capsys) -> None:
    short = tmp_path / "short.txt"
    short.write_text(TEXT * 25, encoding="utf-8")
    small = tmp_path / "small"
    assert prepare(capsys, str(short), "--out", str(small))[0] == 0
    val = read_header(small).tokens["val"]
    assert 65 <= val < 129  # enough for gpt2-tiny's context, too few for gpt2-mini's
    with pytest.raises(ConfigError, match=f"its val split has {val} tokens; gpt2-mini needs "
                       f"at least 129 \\(context \\+ 1\\)"):
        JobConfig.of(data=str(small), model="gpt2-mini").validate()
    bare = tmp_path / "bare"
    bare.mkdir()
    cases = [(["--data", str(bare)], "is a directory without header.json"),
             (["--data", str(small), "--model", "cnn-tiny", "--stages", "2"],
              "is for token models")]
    for args, expected in cases:
        assert cli.main(["train", *args, "--out", str(tmp_path / "run")]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], lines
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="has 100 bytes; gpt2-tiny needs at least 130: 65 to "
                       "train on and 65 held out"):
        JobConfig.of(data=str(_write(tmp_path / "100.txt", "x" * 100))).validate()
    noise = tmp_path / "noise.txt"  # random bytes, as a user may point --data at by mistake
    noise.write_bytes(bytes(range(128, 256)) * 32)
    with pytest.raises(ConfigError, match="noise.txt' is not UTF-8 text \\(bytes that are not "
                       "UTF-8 at offset 0\\): give a UTF-8 text file"):
        JobConfig.of(data=str(noise)).validate()
    (tmp_path / "nul.txt").write_bytes(b"abc\0" * 100)
    with pytest.raises(ConfigError, match="a NUL byte at offset 3"):
        JobConfig.of(data=str(tmp_path / "nul.txt")).validate()
    header = json.loads((small / "header.json").read_text())
    largest = header["max_token_id"]
    assert largest == max(int(open_split(small, read_header(small), s).max()) for s in SPLITS)
    for recorded in (True, False):  # a header of today, and one written before the record
        wrong = tmp_path / f"wrong-vocab-{recorded}"
        shutil.copytree(small, wrong)
        bad = header | {"vocab_size": 100}
        if not recorded:
            bad.pop("max_token_id")
        (wrong / "header.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"its tokens reach id {largest}, but the "
                           f"vocabulary is 100 \\(its header says vocab_size 100\\)"):
            JobConfig.of(data=str(wrong)).validate()
    (small / "val.bin").write_bytes(b"\0\0")  # truncated after it was prepared
    with pytest.raises(ConfigError, match=f"its header says {val} uint16 tokens"):
        JobConfig.of(data=str(small)).validate()


def test_the_model_vocabulary_follows_the_data(tmp_path: Path, capsys) -> None:
    files = docs_text(tmp_path, ("architecture",), size=20000)
    out = tmp_path / "bpe"
    assert prepare(capsys, str(files[0]), "--out", str(out), "--tokenizer", "bpe:300")[0] == 0
    assert JobConfig.of(data=str(out)).validate().model_preset().vocab == 300
    assert JobConfig.of(data=str(out), model="bert-tiny").validate().model_preset().vocab == 301
    assert JobConfig.of(data=str(files[0])).validate().model_preset().vocab == 256  # bytes
    assert JobConfig.of(model="gpt2-small").model_preset().vocab == 50257
    hf = with_vocab(preset("hf:gpt2:n_layer=2,n_embd=32,n_head=2,n_positions=64"), 300)
    config = json.loads(hf.hf_config)
    assert hf.vocab == config["vocab_size"] == 300 and config["eos_token_id"] is None
    bert = with_vocab(preset("hf:bert:num_hidden_layers=2,hidden_size=32,num_attention_heads=2,"
                             "max_position_embeddings=64"), 300)
    assert bert.vocab == json.loads(bert.hf_config)["vocab_size"] == 301
    with pytest.raises(ValueError, match="model bert-tiny has 257 token ids"):
        make_task(preset("bert-tiny"), seed=0, global_micro_batches=1, micro_batch_size=1,
                  data_file=str(out))


def test_pretrained_hf_weights_keep_their_vocabulary(tmp_path: Path, capsys) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel
    model_dir = tmp_path / "model"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                               vocab_size=280)).save_pretrained(model_dir)
    files = docs_text(tmp_path, ("architecture",), size=20000)
    big, small = tmp_path / "bpe", tmp_path / "bytes"
    assert prepare(capsys, str(files[0]), "--out", str(big), "--tokenizer", "bpe:300")[0] == 0
    assert prepare(capsys, str(files[0]), "--out", str(small))[0] == 0
    name = f"hf:{model_dir}"
    assert JobConfig.of(model=name, stages=2, data=str(small)).validate().model_preset().vocab == 280
    assert cli.main(["train", "--model", name, "--stages", "2", "--data", str(big)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "a vocabulary the model cannot take" in lines[0], lines


def test_with_vocab_drops_special_ids_outside_the_vocabulary() -> None:
    """Llama 3 lists several end-of-sequence ids; BERT's pad id (0, a BPE's end-of-text)
    would never learn as padding_idx, and bamboo never pads."""
    import dataclasses
    import json as _json

    from bamboo.config.presets import preset, with_vocab
    p = preset("hf:llama:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,"
               "num_key_value_heads=2,intermediate_size=64,max_position_embeddings=32,"
               "vocab_size=1000")
    config = _json.loads(p.hf_config) | {"bos_token_id": 900, "eos_token_id": [250, 901, 902]}
    sized = with_vocab(dataclasses.replace(p, hf_config=_json.dumps(config)), 300)
    values = _json.loads(sized.hf_config)
    assert (values["vocab_size"], values["bos_token_id"], values["eos_token_id"]) == \
        (300, None, [250])
    bert = with_vocab(preset("hf:bert:num_hidden_layers=2,hidden_size=32,num_attention_heads=4,"
                             "max_position_embeddings=32,vocab_size=400"), 300)
    assert _json.loads(bert.hf_config)["pad_token_id"] is None and bert.vocab == 301


def test_a_pretrained_bert_refuses_a_prepared_directory() -> None:
    import dataclasses

    from bamboo.config.presets import preset, with_vocab
    p = dataclasses.replace(preset("hf:bert:num_hidden_layers=2,hidden_size=32,"
                                   "num_attention_heads=4,vocab_size=400"), hf_weights="w")
    with pytest.raises(ValueError, match="its \\[MASK\\] id comes from its own tokenizer"):
        with_vocab(p, 300)
