"""`meshtrain data` on long lines, odd bytes, links and outputs: pieces cut before spaces give the
ids of the whole document, UTF-8 is required (the message names the byte), each real file is read
once, an --out that is not a tokenizer is never overwritten, and a 12 MB single line stays within a
memory bound in both commands (issues 31, 35)."""

import json
import os
import random
import sys

import numpy as np
import pytest

import processes
from meshtrain.data import prepare as prep
from meshtrain.data.prepare import input_files, pieces, prepare_tokens
from meshtrain.data.tokenizer import load_tokenizer, tokenizer_out, train_bpe
from meshtrain.errors import ConfigError

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0  # ünïcödé ✓\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_bpe([TEXT] * 30, 300, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _long_text(chars: int, seed: int = 0) -> str:
    """Prose-like text on one line: pseudo-words, single and double spaces, tabs, accents."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyzéü") for _ in range(rng.randint(1, 9)))
             for _ in range(3000)]
    seps = [" "] * 12 + ["  ", "\t", ", ", ". "]
    out, size = [], 0
    while size < chars:
        out.append(rng.choice(words) + rng.choice(seps))
        size += len(out[-1])
    return "".join(out)


def test_pieces_cut_before_spaces_give_the_ids_of_the_whole_document(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "PIECE_CHARS", 500)
    monkeypatch.setattr(prep, "BATCH_CHARS", 1200)
    text = _long_text(20_000)
    (tmp_path / "one.txt").write_text(text)
    (tmp_path / "two.jsonl").write_text(json.dumps({"text": text[:7000]}) + "\n" + json.dumps({"text": "x"}) + "\n")
    got = list(pieces(str(tmp_path / "one.txt")))
    assert "".join(p for p, _ in got) == text and max(len(p) for p, _ in got) <= 500 and len(got) > 40
    assert [end for _, end in got] == [False] * (len(got) - 1) + [True]
    meta = prepare_tokens(tokenizer, [str(tmp_path / "one.txt"), str(tmp_path / "two.jsonl")], str(tmp_path / "out"),
                          progress=False)
    ids = np.fromfile(tmp_path / "out" / "tokens.bin", np.uint16).tolist()
    eos = tokenizer.eos_id
    expected = [tokenizer.encode(t) + [eos] for t in (text, text[:7000], "x")]
    assert ids == [i for doc in expected for i in doc] and meta["num_docs"] == 3
    assert np.load(tmp_path / "out" / "doc_starts.npy").tolist() == [0, len(expected[0]), len(expected[0]) +
                                                                    len(expected[1])]


def test_a_line_without_spaces_is_cut_anywhere_and_decodes_back(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "PIECE_CHARS", 64)
    text = "".join(random.Random(1).choice("ACGTé✓") for _ in range(5000)) + "\r\nend\r\n"
    (tmp_path / "dna.txt").write_bytes(text.encode())
    parts = [p for p, _ in pieces(str(tmp_path / "dna.txt"))]
    assert "".join(parts) == text.replace("\r\n", "\n") and max(map(len, parts)) <= 64  # newlines as \n, as before
    prepare_tokens(tokenizer, [str(tmp_path / "dna.txt")], str(tmp_path / "out"), progress=False)
    ids = np.fromfile(tmp_path / "out" / "tokens.bin", np.uint16).tolist()
    assert tokenizer.decode(ids[:-1]) == text.replace("\r\n", "\n") and ids[-1] == tokenizer.eos_id


@pytest.mark.parametrize("name, data, message", [
    ("latin.txt", "caf\xe9".encode("latin-1"), "byte 0xe9 at offset 3"),
    ("late.txt", b"a" * 5000 + b"\xff tail", "byte 0xff at offset 5,000"),
    ("cut.txt", "é".encode()[:1], "byte 0xc3 at offset 0"),                    # a character cut at the end
    ("rows.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "line 2, byte 0xe9 at offset 28"),
])
def test_non_utf8_input_is_refused_naming_file_and_byte(tokenizer, tmp_path, monkeypatch, name, data, message):
    monkeypatch.setattr(prep, "PIECE_CHARS", 100)  # the bad byte lies beyond the first read
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ConfigError, match=f"{name}.*not UTF-8 text.*{message}"):
        prepare_tokens(tokenizer, [str(tmp_path / name)], str(tmp_path / "out"), progress=False)
    assert sorted(os.listdir(tmp_path)) == [name]


def test_each_real_file_is_read_once(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        (docs / name).write_text(name)
    (docs / "link-a.txt").symlink_to("a.txt")
    (docs / "sub" / "link-b.txt").symlink_to(docs / "b.txt")
    (docs / "linked-dir").symlink_to(docs / "sub", target_is_directory=True)
    files = input_files([str(docs / "*"), str(docs), str(docs / "a.txt")])
    assert [os.path.relpath(f, docs) for f in files] == ["a.txt", "b.txt", "linked-dir/c.txt"]  # the first name


def test_prepare_counts_the_names_it_skipped(tokenizer, tmp_path, capsys):
    """Issue 31: `data prepare --input 'dir/*'` read 3 of 17 documents twice through links; each real file
    is read once (symbolic and hard links, linked folders) and the command says how many names it skipped."""
    from meshtrain.cli import main

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    for i in range(4):
        (docs / f"doc{i}.txt").write_text(f"document {i}: " + TEXT)
    (docs / "sub" / "own.txt").write_text("its own text " + TEXT)
    (docs / "link0.txt").symlink_to("doc0.txt")                # a symbolic link
    os.link(docs / "doc1.txt", docs / "hard1.txt")              # a hard link: the same inode
    (docs / "sub" / "up2.txt").symlink_to(docs / "doc2.txt")
    (docs / "again").symlink_to(docs / "sub", target_is_directory=True)   # a linked folder
    inputs = [str(docs / "*"), str(docs / "again")]   # link0, hard1 and again/up2.txt reach files already read
    gathered = prep.gather_inputs(inputs)
    assert [os.path.relpath(f, docs) for f in gathered.files] == \
        ["doc0.txt", "doc1.txt", "doc2.txt", "doc3.txt", "again/own.txt"] and gathered.skipped == 3
    assert main(["data", "prepare", "--tokenizer", tokenizer.path, "--input", *inputs, "--out", str(tmp_path / "tok"),
                 "--progress", "none"]) == 0
    assert "from 5 files; 3 names skipped (links or repeats of files already read)" in capsys.readouterr().out
    meta = json.load(open(tmp_path / "tok" / "tokens.json"))
    assert meta["num_docs"] == 5 and meta["skipped_inputs"] == 3


def test_tokenizer_out_replaces_only_a_tokenizer(tokenizer, tmp_path):
    (tmp_path / "notes.txt").write_text(TEXT)
    with pytest.raises(ConfigError, match="not a tokenizer.json"):
        train_bpe([TEXT], 300, str(tmp_path / "notes.txt"))
    assert (tmp_path / "notes.txt").read_text() == TEXT
    assert tokenizer_out(str(tmp_path)) == str(tmp_path / "tokenizer.json")     # a folder: its tokenizer.json
    again = train_bpe([TEXT], 300, str(tmp_path))                                 # written, then replaced
    assert train_bpe([TEXT * 2], 300, again.path).path == again.path == str(tmp_path / "tokenizer.json")
    (tmp_path / "sub" / "tokenizer.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match="is a folder"):
        train_bpe([TEXT], 300, str(tmp_path / "sub"))


def test_vocabulary_is_bounded_by_the_text_and_the_id_dtype(tmp_path):
    with pytest.warns(UserWarning, match="made only"):
        tok = train_bpe([TEXT], 1 << 31, str(tmp_path / "t.json"), text_bytes=len(TEXT.encode()))
    assert tok.vocab_size <= 257 + len(TEXT.encode())
    with pytest.raises(ConfigError, match="at most 4,294,967,296"):
        train_bpe([TEXT], (1 << 32) + 1, str(tmp_path / "u.json"))


def test_nothing_learned_leaves_nothing(tmp_path):
    with pytest.raises(ConfigError, match="blank.jsonl: no text to learn from"):
        train_bpe(["", " \n", "\t"], 300, str(tmp_path / "new" / "deeper" / "t.json"), source="blank.jsonl")
    assert os.listdir(tmp_path) == []  # neither the partial file nor the folders made for it


def test_sample_reads_at_most_its_bytes(tmp_path):
    (tmp_path / "a.txt").write_text("é" * 1000)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "word " * 100}, ensure_ascii=False) + "\n" +
                                      json.dumps({"text": "more"}) + "\n")
    a = "".join(p for p, _ in pieces(str(tmp_path / "a.txt"), limit=101))
    b = "".join(p for p, _ in pieces(str(tmp_path / "b.jsonl"), limit=50))
    assert a == "é" * 50 and 0 < len(b.encode()) <= 50 and "more" not in b


def _peak_rss_mb(argv, timeout=900) -> float:
    """Peak RSS of `meshtrain argv`, read by a small wrapper process as its children's maximum.

    Not the command's own RUSAGE_SELF: Linux carries a process's peak RSS across fork and exec, so a
    command started from this pytest worker (often 2 GB) would report the worker's peak. The wrapper
    is small, so what its child inherits is too."""
    script = ("import resource, subprocess, sys\n"
              "code = subprocess.call([sys.executable, '-m', 'meshtrain', *sys.argv[1:]])\n"
              "print('peak-rss-kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
              "sys.exit(code)\n")
    out = processes.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stderr.split("peak-rss-kb")[-1].split()[0]) / 1024


@pytest.mark.slow
def test_a_12_mb_single_line_stays_within_a_memory_bound(tmp_path):
    """Before: the whole line was one string to the trainer and to encode (a 30 MB line took > 7 GiB
    in `prepare`, a 40 MB line did not finish `tokenizer` in 300 s). Now pieces of 256 Ki chars."""
    line = tmp_path / "line.txt"
    line.write_text(_long_text(12_000_000, seed=2))
    tok = tmp_path / "tok.json"
    learn = _peak_rss_mb(["data", "tokenizer", "--input", str(line), "--out", str(tok), "--vocab-size", "2000"])
    encode = _peak_rss_mb(["data", "prepare", "--tokenizer", str(tok), "--input", str(line), "--out",
                           str(tmp_path / "data"), "--progress", "none"])
    assert learn < 1024 and encode < 1024, (learn, encode)
    assert json.load(open(tmp_path / "data" / "tokens.json"))["num_docs"] == 1
    assert load_tokenizer(str(tok)).vocab_size == 2000
