"""The embedded default corpus: CPython 3.11.7's standard library ``.py`` sources (580 files,
11.0 MB, byte-level), shipped with meshtrain as ``corpus/python-stdlib.tar.xz`` (1.8 MB).

It ships, rather than being read from the running interpreter, so that every Python and every
machine trains on the same bytes and the README's figures reproduce (the 3.10, 3.11 and 3.12
standard libraries differ). The archive's sha256 is pinned here and checked on every load: a
damaged or edited archive is an error, never a silently different corpus. ``tools/make_default_corpus.py``
wrote it; the standard library's licence (PSF) travels inside as ``LICENSE.txt``.

    from meshtrain.data.corpus import corpus_documents
    names, docs = corpus_documents()          # 580 names and their bytes, sorted by path
"""

from __future__ import annotations

import functools
import hashlib
import io
import lzma
import os
import tarfile
from typing import List, Tuple

from meshtrain.errors import ConfigError

CORPUS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "python-stdlib.tar.xz")
#: sha256 of the archive's bytes; change it only together with the archive (tools/make_default_corpus.py)
CORPUS_SHA256 = "7d5b8515b3953b3dd62383bfdfac8199a1ae3dabeb4a508fe10711f3a2883628"
#: the archive's licence member, not a training document
_LICENSE = "LICENSE.txt"


def _damaged(why: str) -> ConfigError:
    return ConfigError(f"the embedded default corpus {CORPUS_PATH!r} {why}; reinstall meshtrain (`pip install -e .` "
                       f"from a fresh clone), or train on your own text with --data")


@functools.lru_cache(maxsize=1)
def corpus_documents() -> Tuple[Tuple[str, ...], Tuple[bytes, ...]]:
    """``(names, documents)``: the corpus's files (paths relative to the standard library, sorted)
    and their bytes, after checking the archive against :data:`CORPUS_SHA256`."""
    try:
        with open(CORPUS_PATH, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise _damaged(f"cannot be read ({exc.strerror or exc})") from None
    digest = hashlib.sha256(blob).hexdigest()
    if digest != CORPUS_SHA256:
        raise _damaged(f"has sha256 {digest[:16]}…, not the pinned {CORPUS_SHA256[:16]}…")
    names: List[str] = []
    docs: List[bytes] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:xz") as tar:
            for member in tar:
                if member.isfile() and member.name != _LICENSE:
                    names.append(member.name)
                    docs.append(tar.extractfile(member).read())
    except (tarfile.TarError, lzma.LZMAError, EOFError) as exc:  # unreachable with the pinned hash
        raise _damaged(f"cannot be unpacked ({exc})") from None
    return tuple(names), tuple(docs)


def corpus_texts() -> List[str]:
    """The corpus's documents as text (every file is UTF-8), e.g. to learn a tokenizer from."""
    return [d.decode("utf-8") for d in corpus_documents()[1]]
