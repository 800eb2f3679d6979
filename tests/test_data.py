"""Data: sources, packing with document boundaries, determinism, resumable and per-process loading."""

import hashlib
import json

import numpy as np
import pytest

import meshtrain as mt
from meshtrain.data import BatchIterator, load_source, pack_window, token_file_source
from meshtrain.data.sources import TokenSource
from meshtrain.errors import ConfigError

from helpers import mesh_for, tiny_abstract


def _source(docs):
    """Byte-level documents as a TokenSource, without files."""
    tokens = np.concatenate([np.frombuffer(d, np.uint8) for d in docs]).astype(np.uint16)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    return TokenSource("docs", tokens, np.array(starts, np.int64), 256, "test")


def test_default_corpus_is_python_stdlib():
    src = load_source(None)
    assert src.vocab_size == 256 and src.num_docs > 100 and len(src) > 1_000_000
    assert b"def " in bytes(np.asarray(src.tokens[:200_000], np.uint8))


def test_default_corpus_is_the_same_bytes_on_every_python():
    """The shipped archive, not the running interpreter's library: the same tokens (and the
    fingerprint earlier runs recorded on 3.11.7) whatever Python reads it."""
    src = load_source(None)
    assert (len(src), src.num_docs, src.fingerprint) == (11_002_708, 577, "stdlib:text:4e22418b64b4fd22")
    digest = hashlib.sha256(np.asarray(src.tokens, np.uint8).tobytes()).hexdigest()
    assert digest == "a5ff2876c2ba0bceeb2ccd9ee9b088d5760320f29e3df39367b15774d4b6a805"


def test_a_damaged_default_corpus_is_refused_by_name(tmp_path, monkeypatch):
    from meshtrain.data import corpus
    damaged = tmp_path / "python-stdlib.tar.xz"
    blob = bytearray(open(corpus.CORPUS_PATH, "rb").read())
    blob[len(blob) // 2] ^= 1
    damaged.write_bytes(bytes(blob))
    monkeypatch.setattr(corpus, "CORPUS_PATH", str(damaged))
    corpus.corpus_documents.cache_clear()
    try:
        with pytest.raises(ConfigError, match="python-stdlib.tar.xz.*not the pinned.*reinstall"):
            load_source(None)
    finally:
        corpus.corpus_documents.cache_clear()


def test_packing_keeps_documents_apart():
    src = _source([b"abcde", b"XYZ", b"0123456789"])
    w = pack_window(src, 0, 8)  # tokens abcdeXYZ0
    assert bytes(w["inputs"].astype(np.uint8)) == b"abcdeXYZ"
    assert list(w["segment_ids"]) == [0, 0, 0, 0, 0, 1, 1, 1]
    assert list(w["positions"]) == [0, 1, 2, 3, 4, 0, 1, 2]
    # 'e' -> 'X' crosses a document boundary: masked; 'Z' -> '0' too.
    assert w["targets"][4] == -1 and w["targets"][7] == -1
    assert w["targets"][0] == ord("b")
    w1 = pack_window(src, 1, 8)  # second window starts inside document 3: positions restart at 0
    assert list(w1["positions"][:2]) == [0, 1]


def test_split_cuts_at_a_document_boundary():
    src = _source([b"a" * 50, b"b" * 30, b"c" * 20])
    train, val = src.split(0.2)
    assert len(train) == 80 and len(val) == 20 and val.doc_starts[0] == 0
    assert train.fingerprint != val.fingerprint


def test_iterator_is_deterministic_and_resumable():
    src = load_source(None)
    a = BatchIterator(src, 4, 32, seed=3)
    batches = [next(a) for _ in range(3)]
    state = json.loads(json.dumps(a.state()))  # JSON-able
    fourth = next(a)
    b = BatchIterator(src, 4, 32, seed=3)
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(batches, [next(b) for _ in range(3)]))
    c = BatchIterator(src, 4, 32, seed=3)
    c.restore(state)
    assert np.array_equal(next(c)["inputs"], fourth["inputs"])
    # A different batch size resumes at the same sample: first 4 rows of the 8-row batch.
    d = BatchIterator(src, 8, 32, seed=3)
    d.restore(state)
    assert np.array_equal(next(d)["inputs"][:4], fourth["inputs"])
    e = BatchIterator(src, 4, 32, seed=4)
    with pytest.raises(mt.ConfigError, match="seed"):
        e.restore(state)


def test_iterator_builds_sharded_global_arrays_from_local_rows():
    recipe, mesh = mesh_for("fsdp")
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(16, 32))
    it = BatchIterator(load_source(None), 16, 32, seed=0, shardings=plan.batch_shardings)
    batch = next(it)
    assert batch["inputs"].sharding == plan.batch_shardings["inputs"]
    plain = BatchIterator(load_source(None), 16, 32, seed=0)
    assert np.array_equal(np.asarray(batch["inputs"]), next(plain)["inputs"])


def test_token_files(tmp_path):
    ids = np.array([5, 6, 7, 0, 8, 9, 0, 3, 4, 5, 6, 7], np.uint32)
    np.save(tmp_path / "ids.npy", ids)
    src = token_file_source(str(tmp_path / "ids.npy"), eos_id=0)
    assert list(src.doc_starts) == [0, 4, 7]
    ids.astype(np.uint16).tofile(tmp_path / "ids.bin")
    raw = load_source(str(tmp_path / "ids.bin"))
    assert np.array_equal(np.asarray(raw.tokens), ids)
    it = BatchIterator(src, 1, 4, seed=0, vocab_size=8)
    with pytest.raises(mt.ConfigError, match="outside the model's vocabulary"):
        for _ in range(3):
            next(it)


def test_bad_data_paths(tmp_path):
    with pytest.raises(mt.ConfigError, match="does not exist"):
        load_source(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(mt.ConfigError, match="holds no files"):
        load_source(str(tmp_path / "empty"))
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(mt.ConfigError, match="is empty"):
        load_source(str(tmp_path / "blank.txt"))
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(mt.ConfigError, match="fewer than one sequence"):
        BatchIterator(load_source(str(tmp_path / "short.txt")), 1, 8)
