"""Group ``data``: ``meshtrain data tokenizer`` and ``meshtrain data prepare`` on hostile input (issues
31 and 35): an --out that is the user's own text or a folder, a vocabulary far above what the text
can make, empty, blank, latin-1 or binary input, a long line without spaces, symbolic links matched
twice, a read-only folder, a full disk or file-size limit, Ctrl-C. Inputs are tiny (the memory
bound on a long line is tests/test_data_hardening.py's); every case runs in its own folder.
"""

from __future__ import annotations

import os
import random
from typing import List

from probe_bad_input import Case

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n"


def _write(path: str, data) -> None:
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def _tokenizer(tmp: str) -> str:
    """A small byte-level BPE tokenizer.json (through the library: no meshtrain import here)."""
    path = os.path.join(tmp, "probe-data-tokenizer.json")
    if not os.path.exists(path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator([TEXT] * 20, trainer=trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(path)
    return path


def _files(**named):
    """A ``prepare`` that writes ``name__ext: content`` files (content: text, bytes, or a function
    that makes it, called when the case runs)."""
    def prepare(work: str) -> None:
        for name, content in named.items():
            _write(os.path.join(work, name.replace("__", ".")), content() if callable(content) else content)
    return prepare


def _prose(chars: int):
    """Words and spaces, ``chars`` characters (made when the case runs)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
    return lambda: " ".join(random.Random(0).choices(words, k=chars // 6))[:chars] + "\n"


def _dna(chars: int):
    return lambda: "".join(random.Random(1).choices("ACGT", k=chars))


def _mounted(options: str, argv: List[str]) -> str:
    """A Python snippet: mount a tmpfs (``options``) at {work}/mnt, run meshtrain ``argv``, fail when
    anything is left on the mount (a .partial), unmount, exit with meshtrain's status."""
    return (
        "import os, subprocess, sys\n"
        "d = '{work}/mnt'\n"
        "os.makedirs(d, exist_ok=True)\n"
        f"subprocess.run(['mount', '-t', 'tmpfs', '-o', {options!r}, 'tmpfs', d], check=True, timeout=60)\n"
        "try:\n"
        f"    code = subprocess.run([sys.executable, '-m', 'meshtrain', *{argv!r}], timeout=280).returncode\n"
        "    left = sorted(os.listdir(d))\n"
        "finally:\n"
        "    subprocess.run(['umount', '-l', d], timeout=60)\n"
        "if left:\n"
        "    print(f'left behind on the mount: {left}', file=sys.stderr)\n"
        "    sys.exit(1)\n"
        "sys.exit(code)\n")


def cases(tmp: str) -> List[Case]:
    tok = _tokenizer(tmp)
    tokenize = ["data", "tokenizer", "--input"]
    prepare = ["data", "prepare", "--tokenizer", tok, "--input"]
    text = _files(notes__txt=TEXT)

    def links(work: str) -> None:
        os.makedirs(os.path.join(work, "docs"))
        _write(os.path.join(work, "docs", "a.txt"), TEXT)
        _write(os.path.join(work, "docs", "b.txt"), TEXT.upper())
        os.symlink("a.txt", os.path.join(work, "docs", "c-link.txt"))  # the same file under a second name

    return [
        # --out
        Case("tokenizer: --out is the input text itself (refused, text kept)",
             [*tokenize, "{work}/notes.txt", "--out", "{work}/notes.txt", "--vocab-size", "300"], "2",
             prepare=text, out="{work}/notes.txt", says="not a tokenizer.json"),
        Case("tokenizer: --out an existing folder (writes its tokenizer.json)",
             [*tokenize, "{work}/notes.txt", "--out", "{work}/tok", "--vocab-size", "260"], "0",
             prepare=lambda w: (text(w), os.makedirs(os.path.join(w, "tok"))), says="tok/tokenizer.json"),
        # vocabulary
        Case("tokenizer: --vocab-size 2^30 on 80 bytes of text (capped: says how many it made)",
             [*tokenize, "{work}/notes.txt", "--out", "{work}/o/t.json", "--vocab-size", str(1 << 30)], "warn",
             prepare=text),
        Case("tokenizer: --vocab-size above 2^32 (ids are uint32)",
             [*tokenize, "{work}/notes.txt", "--out", "{work}/o/t.json", "--vocab-size", str((1 << 32) + 1)], "2",
             prepare=text, out="{work}/o", says="at most"),
        # what is read
        Case("tokenizer: an empty file", [*tokenize, "{work}/empty.txt", "--out", "{work}/o/t.json"], "2",
             prepare=_files(empty__txt=b""), out="{work}/o", says="empty.txt"),
        Case("tokenizer: all-blank JSON lines", [*tokenize, "{work}/blank.jsonl", "--out", "{work}/o/t.json"], "2",
             prepare=_files(blank__jsonl="\n  \n\n"), out="{work}/o", says="blank.jsonl"),
        Case("tokenizer: latin-1 text (not UTF-8)", [*tokenize, "{work}/latin.txt", "--out", "{work}/o/t.json"], "2",
             prepare=_files(latin__txt="caf\xe9 cr\xe8me\n".encode("latin-1")), out="{work}/o",
             says="latin.txt"),
        Case("prepare: a binary file", [*prepare, "{work}/blob.txt", "--out", "{work}/o/p"], "2",
             prepare=_files(blob__txt=bytes(range(256)) * 8), out="{work}/o", says="blob.txt"),
        Case("prepare: latin-1 JSON lines", [*prepare, "{work}/latin.jsonl", "--out", "{work}/o/p"], "2",
             prepare=_files(latin__jsonl='{"text": "caf\xe9"}\n'.encode("latin-1")), out="{work}/o",
             says="line 1"),
        Case("tokenizer: a 300 kB line without a space (DNA-like) finishes",
             [*tokenize, "{work}/dna.txt", "--out", "{work}/o/t.json", "--vocab-size", "1000"], "0",
             prepare=_files(dna__txt=_dna(300_000))),
        Case("prepare: 'docs/*' with a symlink to a file already matched (read once)",
             [*prepare, "{work}/docs/*", "--out", "{work}/o/p", "--progress", "none"], "0",
             prepare=links, says="in 2 documents from 2 files"),
        # writing
        Case("tokenizer: read-only --out folder", [], "2", needs_root=True, prepare=text, says="mnt/t.json",
             python=_mounted("ro,size=1m", [*tokenize, "{work}/notes.txt", "--out", "{work}/mnt/t.json",
                                            "--vocab-size", "300"])),
        Case("prepare: read-only --out folder", [], "2", needs_root=True, prepare=text, says="mnt/p",
             python=_mounted("ro,size=1m", [*prepare, "{work}/notes.txt", "--out", "{work}/mnt/p"])),
        Case("tokenizer: full disk (4 KiB tmpfs)", [], "74", needs_root=True, prepare=text,
             python=_mounted("size=4k", [*tokenize, "{work}/notes.txt", "--out", "{work}/mnt/t.json",
                                         "--vocab-size", "300"])),
        Case("prepare: full disk (4 KiB tmpfs)", [], "74", needs_root=True, prepare=_files(big__txt=_prose(20_000)),
             python=_mounted("size=4k", [*prepare, "{work}/big.txt", "--out", "{work}/mnt/p"])),
        Case("tokenizer: file-size limit (ulimit -f 4)",
             [*tokenize, "{work}/notes.txt", "--out", "{work}/o/t.json", "--vocab-size", "300"], "74",
             shell="ulimit -f 4", prepare=text, out="{work}/o"),
        Case("prepare: file-size limit (ulimit -f 4)", [*prepare, "{work}/big.txt", "--out", "{work}/o/p"], "74",
             shell="ulimit -f 4", prepare=_files(big__txt=_prose(20_000)), out="{work}/o"),
        # Ctrl-C while working: exit 130, nothing left
        Case("tokenizer: Ctrl-C while learning",
             [*tokenize, "{work}/big.txt", "--out", "{work}/o/t.json", "--vocab-size", "2000"], "130",
             prepare=_files(big__txt=_prose(600_000)), out="{work}/o", interrupt_when="{work}/o/t.json.partial-*"),
        Case("prepare: Ctrl-C while tokenizing", [*prepare, "{work}/big.txt", "--out", "{work}/o/p"], "130",
             prepare=_files(big__txt=_prose(2_000_000)), out="{work}/o", interrupt_when="{work}/o/p.partial-*"),
    ]
