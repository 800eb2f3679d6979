"""Tokenizers and prepared token folders: BPE built offline, text and JSON lines tokenized with
document boundaries, read memory-mapped by the Trainer, bad input refused with nothing written."""

import json
import os

import numpy as np
import pytest

from meshtrain.cli import main
from meshtrain.data import load_source
from meshtrain.data.prepare import prepare_tokens
from meshtrain.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from meshtrain.errors import ConfigError
from meshtrain.train import TrainConfig, Trainer

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n", "for i in range(10):\n    print(i)\n"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(TEXTS * 20, 300, str(path))


def test_bpe_round_trips_any_text(tokenizer):
    assert 258 < tokenizer.vocab_size <= 300 and tokenizer.eos_id == 0  # (fewer when merges run out)
    for text in TEXTS + ["ünïcödé ✓ and bytes never seen \x00\x7f"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode(TEXTS[0])) < len(TEXTS[0].encode())  # merges learned
    assert ByteTokenizer().decode(ByteTokenizer().encode("é")) == "é"


def test_prepare_keeps_documents_and_order(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text(TEXTS[0])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in TEXTS[1:]) + "\n")
    out = tmp_path / "prepared"
    meta = prepare_tokens(tokenizer, [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], str(out),
                          text_field="body", progress=False)
    expected = [tokenizer.encode(t) + [tokenizer.eos_id] for t in TEXTS]
    assert meta["num_docs"] == 3 and meta["num_tokens"] == sum(map(len, expected)) and meta["dtype"] == "uint16"
    source = load_source(str(out))
    assert isinstance(source.tokens, np.memmap) and source.vocab_size == tokenizer.vocab_size
    assert list(np.asarray(source.tokens)) == [i for ids in expected for i in ids]
    assert list(source.doc_starts) == list(np.cumsum([0] + [len(e) for e in expected[:-1]]))
    assert load_tokenizer(str(out)).fingerprint == tokenizer.fingerprint  # the tokenizer travels with the ids


@pytest.mark.parametrize("case, make, message", [
    ("missing input", lambda d: [str(d / "nope.txt")], "matches no file"),
    ("bad json", lambda d: [_write(d / "x.jsonl", '{"text": "a"}\n{oops\n')], "x.jsonl:2: not a JSON object"),
    ("no field", lambda d: [_write(d / "y.jsonl", '{"content": "a"}\n')], "y.jsonl:1: no string field 'text'"),
])
def test_bad_input_writes_nothing(tokenizer, tmp_path, case, make, message):
    inputs = make(tmp_path)
    with pytest.raises(ConfigError, match=message):
        prepare_tokens(tokenizer, inputs, str(tmp_path / "out"), progress=False)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")], case  # no folder, no partial one


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_cli_errors_name_the_fix(tokenizer, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    cases = [
        (["data", "prepare", "--tokenizer", str(tmp_path / "none"), "--input", "x", "--out", str(tmp_path / "o")],
         "does not exist"),
        (["data", "prepare", "--tokenizer", tokenizer.path, "--input", tokenizer.path, "--out",
          str(tmp_path / "full")], "already exists and is not an empty folder"),
        (["data", "tokenizer", "--out", str(tmp_path / "t.json"), "--vocab-size", "100"], "must be at least 258"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_trainer_reads_prepared_tokens(tokenizer, tmp_path):
    """A built-in decoder trains on tokenizer ids: its vocabulary grows to the tokenizer's, the run
    folder gets the tokenizer, the run header records the model config trained."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t * 8}) for t in TEXTS * 30) + "\n")
    prepare_tokens(tokenizer, [str(docs)], str(tmp_path / "data"), progress=False)
    run = tmp_path / "run"
    summary = Trainer(TrainConfig(model="tiny", recipe="fsdp", data=str(tmp_path / "data"), steps=2,
                                  batch_size=8, seq_len=32, eval_every=0, out=str(run), progress="none",
                                  val_fraction=0.1)).run()
    assert summary.steps == 2
    header = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert header["model_config"]["vocab_size"] == tokenizer.vocab_size and header["run_settings"]["data"] == str(tmp_path / "data")
    assert load_tokenizer(str(run)).fingerprint == tokenizer.fingerprint
