"""Token sources: one flat token stream plus the offsets where documents start.

* :func:`default_corpus`: CPython 3.11.7's standard library ``.py`` files, shipped with meshtrain and
  checked against a pinned hash (:mod:`meshtrain.data.corpus`), byte-level (vocabulary 256).
* :func:`text_source`: byte-level tokens of any text files or folders.
* :func:`token_file_source`: pre-tokenized ids in a ``.npy`` (uint16/uint32) or raw ``.bin`` file,
  memory-mapped, for users with their own tokenizer; documents split at ``eos_id`` if given.
* :func:`prepared_source`: a folder written by ``meshtrain data prepare`` (:mod:`meshtrain.data.prepare`):
  memory-mapped ids, document starts, the tokenizer that made them, and (``--chat``,
  :mod:`meshtrain.data.chat_sft`) a loss mask.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from meshtrain.data.corpus import corpus_documents
from meshtrain.errors import ConfigError

BYTE_VOCAB = 256
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo"}


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSource:
    """A token stream (``tokens``, 1-D) and sorted document start offsets (``doc_starts``, first 0).

    ``vocab_size`` is an upper bound on token ids (256 for bytes; for token files, the model's).
    ``fingerprint`` identifies the data in checkpoints (a resumed run must read the same data).
    ``loss_mask``: ``None`` (every token is a target), or one uint8 per token, 1 where the token
    counts as a target (chat fine-tuning: the assistant's tokens); packing turns the others' targets
    into ``-1``, which every loss already ignores.
    """

    name: str
    tokens: np.ndarray
    doc_starts: np.ndarray
    vocab_size: Optional[int]
    fingerprint: str
    loss_mask: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_starts.shape[0])

    def split(self, val_fraction: float) -> Tuple["TokenSource", "TokenSource"]:
        """(train, validation), cut at the document boundary nearest ``1 - val_fraction`` of the tokens."""
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"validation fraction {val_fraction} must be between 0 and 1")
        target = int(len(self) * (1.0 - val_fraction))
        i = int(np.searchsorted(self.doc_starts, target))
        if i <= 0 or i >= self.num_docs:  # one document: cut inside it
            cut = target
            train_docs, val_docs = self.doc_starts[self.doc_starts < cut], np.array([0])
        else:
            cut = int(self.doc_starts[i])
            train_docs, val_docs = self.doc_starts[:i], self.doc_starts[i:] - cut
        mask = self.loss_mask
        return (TokenSource(self.name + ":train", self.tokens[:cut], train_docs, self.vocab_size,
                            self.fingerprint + ":train", None if mask is None else mask[:cut]),
                TokenSource(self.name + ":val", self.tokens[cut:], val_docs, self.vocab_size,
                            self.fingerprint + ":val", None if mask is None else mask[cut:]))


def _from_docs(name: str, docs: Iterable[bytes], fingerprint: str) -> TokenSource:
    chunks, starts, offset = [], [], 0
    for doc in docs:
        if not doc:
            continue
        starts.append(offset)
        chunks.append(np.frombuffer(doc, np.uint8))
        offset += len(doc)
    if not chunks:
        raise ConfigError(f"data {name!r} is empty: no non-empty files found")
    return TokenSource(name, np.concatenate(chunks).astype(np.uint16), np.array(starts, np.int64), BYTE_VOCAB,
                       fingerprint)


def _files_under(paths: Sequence[str], pattern: str = "*") -> List[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = glob.glob(os.path.join(path, "**", pattern), recursive=True)
            files += sorted(f for f in found if os.path.isfile(f) and not (
                set(os.path.relpath(f, path).split(os.sep)[:-1]) & _SKIP_DIRS))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ConfigError(f"data path {path!r} does not exist; pass a text file, a folder, or a .npy/.bin "
                              f"token file (or nothing for the embedded corpus)")
    return files


def text_source(paths: "str | Sequence[str]", *, pattern: str = "*", name: Optional[str] = None) -> TokenSource:
    """Byte-level tokens of text files; each file is one document. Folders are read recursively."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    files = _files_under(paths, pattern)
    if not files:
        raise ConfigError(f"data path {', '.join(paths)} holds no files matching {pattern!r}")
    digest = hashlib.sha256()
    docs = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read data file {f!r}: {exc.strerror or exc}; check its permissions or "
                              f"leave it out") from None
        digest.update(os.path.basename(f).encode() + len(data).to_bytes(8, "little"))
        docs.append(data)
    return _from_docs(name or ",".join(paths), docs, "text:" + digest.hexdigest()[:16])


def default_corpus() -> TokenSource:
    """The embedded default corpus (:mod:`meshtrain.data.corpus`: 580 files, 11.0 MB), byte-level.

    The same bytes on every Python and machine; its fingerprint (file names and lengths) is the one
    runs of earlier versions recorded on Python 3.11.7, so their checkpoints resume on it."""
    names, docs = corpus_documents()
    digest = hashlib.sha256()
    for name, data in zip(names, docs):
        digest.update(os.path.basename(name).encode() + len(data).to_bytes(8, "little"))
    source = _from_docs(f"python-stdlib ({len(names)} files)", docs, "text:" + digest.hexdigest()[:16])
    return dataclasses.replace(source, fingerprint="stdlib:" + source.fingerprint)


def token_file_source(path: str, *, dtype: Optional[str] = None, eos_id: Optional[int] = None,
                      vocab_size: Optional[int] = None) -> TokenSource:
    """Memory-mapped pre-tokenized ids: ``.npy`` (dtype inside) or raw ``.bin`` (``dtype``, default
    uint16). Documents end at ``eos_id`` when given (the eos token stays with its document)."""
    if not os.path.isfile(path):
        raise ConfigError(f"token file {path!r} does not exist")
    try:
        if path.endswith(".npy"):
            tokens = np.load(path, mmap_mode="r")
        else:
            itemsize = np.dtype(dtype or "uint16").itemsize
            size = os.path.getsize(path)
            if size < 2 * itemsize:
                raise ConfigError(f"token file {path!r} has {size} bytes, fewer than 2 tokens of {itemsize} bytes "
                                  f"({np.dtype(dtype or 'uint16')}); write at least 2 tokens (or pass the right dtype)")
            tokens = np.memmap(path, dtype=np.dtype(dtype or "uint16"), mode="r", shape=(size // itemsize,))
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path!r}: {exc.strerror or exc}; check the path and its "
                          f"permissions") from None
    except (ValueError, EOFError) as exc:
        raise ConfigError(f"token file {path!r} is not a valid .npy array ({exc}); write it with numpy.save of a "
                          f"1-D uint16/uint32 array") from None
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32, np.int32):
        raise ConfigError(f"token file {path!r} holds {tokens.dtype} of shape {tokens.shape}; expected a 1-D "
                          f"uint16/uint32 array")
    if tokens.shape[0] < 2:
        raise ConfigError(f"token file {path!r} is empty (fewer than 2 tokens)")
    starts = np.array([0], np.int64)
    if eos_id is not None:
        ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
        starts = np.concatenate([starts, ends[ends < tokens.shape[0]]]).astype(np.int64)
    stat = os.stat(path)
    return TokenSource(os.path.basename(path), tokens, starts, vocab_size,
                       f"tokens:{os.path.basename(path)}:{stat.st_size}")


def check_token_ids(source: TokenSource, vocab_size: int, chunk: int = 1 << 26) -> None:
    """Every token id of ``source`` is in ``[0, vocab_size)``, or a ``ConfigError`` names the source,
    the first offending id, its position and the vocabulary. Vectorised min/max over chunks of the
    (memory-mapped) stream: about a second per GB, once before step 1, so a bad id never reaches
    the embedding lookup (where it would be silently clamped)."""
    tokens = source.tokens
    signed = np.issubdtype(tokens.dtype, np.signedinteger)
    for start in range(0, tokens.shape[0], chunk):
        part = np.asarray(tokens[start:start + chunk])
        low, high = (int(part.min()) if signed else 0), int(part.max())
        if low >= 0 and high < vocab_size:
            continue
        bad = np.flatnonzero((part < 0) | (part >= vocab_size))[0]
        tid = int(part[bad])
        why = "is negative" if tid < 0 else f"is >= the model's vocabulary size {vocab_size}"
        raise ConfigError(f"data {source.name!r}: token id {tid} at position {start + int(bad):,} {why} (valid ids: "
                          f"0..{vocab_size - 1}); fix the tokenized file or use a model whose vocab_size covers "
                          f"the tokenizer")


#: The description file of a prepared token folder, and its format tag.
PREPARED_META = "tokens.json"
PREPARED_FORMAT = "meshtrain-tokens/1"
#: A prepared folder's loss mask (``data prepare --chat``): one uint8 per token, 1 = a target.
LOSS_MASK_FILE = "loss_mask.bin"


def is_prepared(path: Optional[str]) -> bool:
    """Whether ``path`` is a folder written by ``meshtrain data prepare``."""
    return path is not None and os.path.isfile(os.path.join(path, PREPARED_META))


def prepared_meta(path: str) -> dict:
    """The description (``tokens.json``) of prepared token folder ``path``, the whole folder checked
    (its fields, the size of ``tokens.bin``, ``doc_starts.npy``): called before a run starts, so a
    damaged folder is refused before anything is made."""
    return _checked_folder(path)[0]


def _checked_folder(path: str):
    """``(meta, starts)`` of a prepared folder, or a ``ConfigError`` naming the damaged file and field."""
    meta_path = os.path.join(path, PREPARED_META)
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ConfigError(f"cannot read {meta_path!r} ({exc}); prepare the folder again with `meshtrain data "
                          f"prepare`") from None
    if not isinstance(meta, dict) or meta.get("format") != PREPARED_FORMAT:
        raise ConfigError(f"{meta_path!r} is not a {PREPARED_FORMAT} description; prepare the folder again with "
                          f"`meshtrain data prepare`")
    for field, ok, want in _META_FIELDS:
        value = meta.get(field)
        if field not in meta or not ok(value):
            found = "is missing" if field not in meta else f"is {value!r}"
            raise ConfigError(f"{meta_path!r}: field {field!r} {found}, expected {want}; the folder is damaged: "
                              f"prepare it again with `meshtrain data prepare`")
    dtype, count = np.dtype(meta["dtype"]), meta["num_tokens"]
    tokens_path = os.path.join(path, "tokens.bin")
    if not os.path.isfile(tokens_path) or os.path.getsize(tokens_path) != count * dtype.itemsize:
        raise ConfigError(f"{tokens_path!r} is missing or not {count} {dtype} tokens as {PREPARED_META} says; "
                          f"prepare the folder again with `meshtrain data prepare`")
    mask_path = os.path.join(path, LOSS_MASK_FILE)
    if meta.get("loss_mask") and not (os.path.isfile(mask_path) and os.path.getsize(mask_path) == count):
        raise ConfigError(f"{mask_path!r} is missing or not {count} bytes (one per token) as "
                          f"{PREPARED_META} says; prepare the folder again with `meshtrain data prepare --chat`")
    return meta, _doc_starts(os.path.join(path, "doc_starts.npy"), count)


def _count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


#: The fields of ``tokens.json`` the reader needs: (name, check, what it must be). The dtypes are
#: those ``meshtrain data prepare`` writes.
_META_FIELDS = (
    ("dtype", lambda v: v in ("uint16", "uint32"), "'uint16' or 'uint32'"),
    ("num_tokens", lambda v: _count(v, 2), "an integer >= 2"),
    ("vocab_size", lambda v: _count(v, 1), "an integer >= 1"),
    ("tokenizer", lambda v: isinstance(v, str) and bool(v), "the tokenizer's fingerprint (a string)"),
)


def prepared_source(path: str) -> TokenSource:
    """The token stream of a prepared folder: ``tokens.bin`` memory-mapped (nothing is read until a
    batch needs it), ``doc_starts.npy``, the vocabulary of the tokenizer that wrote them. A damaged
    folder (a field of ``tokens.json``, a missing or malformed file) is a ``ConfigError`` naming it."""
    meta, starts = _checked_folder(path)
    count = meta["num_tokens"]
    tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=np.dtype(meta["dtype"]), mode="r", shape=(count,))
    fingerprint = f"prepared:{meta['tokenizer']}:{count}:{int(starts.shape[0])}"
    mask = None
    if meta.get("loss_mask"):  # chat fine-tuning data: only the assistant's tokens are targets
        mask = np.memmap(os.path.join(path, LOSS_MASK_FILE), dtype=np.uint8, mode="r", shape=(count,))
        fingerprint += ":masked"
    return TokenSource(os.path.basename(os.path.normpath(path)), tokens, starts, meta["vocab_size"], fingerprint,
                       mask)


def _doc_starts(starts_path: str, count: int) -> np.ndarray:
    """``doc_starts.npy`` of a prepared folder of ``count`` tokens: a 1-D integer array starting at 0,
    strictly increasing, below ``count`` (packing looks documents up by binary search: an unsorted or
    out-of-range start would silently mislabel segments). Never unpickles (``allow_pickle=False``)."""
    again = "prepare the folder again with `meshtrain data prepare`"
    try:
        starts = np.load(starts_path, allow_pickle=False)
    except FileNotFoundError:
        raise ConfigError(f"{starts_path!r} is missing (where each document starts); {again}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {starts_path!r}: {exc.strerror or exc}; {again}") from None
    except (ValueError, EOFError) as exc:  # a pickled (object) array, a truncated or foreign file
        raise ConfigError(f"{starts_path!r} is not a .npy array of integers ({exc}); {again}") from None
    if not isinstance(starts, np.ndarray) or starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer):
        what = (f"{starts.dtype} of shape {starts.shape}" if isinstance(starts, np.ndarray)
                else type(starts).__name__)
        raise ConfigError(f"{starts_path!r} holds {what}, not a 1-D integer array of document starts; {again}")
    starts = starts.astype(np.int64)  # (an unsigned array's differences would wrap around)
    if starts.shape[0] == 0 or starts[0] != 0:
        raise ConfigError(f"{starts_path!r}: the first document must start at 0 (it holds "
                          f"{starts[:3].tolist()}...); {again}")
    steps = np.diff(starts)
    if steps.size and steps.min() <= 0:
        i = int(np.argmax(steps <= 0)) + 1
        raise ConfigError(f"{starts_path!r}: document starts are not strictly increasing (entry {i} is "
                          f"{int(starts[i])} after {int(starts[i - 1])}); {again}")
    if int(starts[-1]) >= count:
        raise ConfigError(f"{starts_path!r}: document start {int(starts[-1])} is past the end of the {count} tokens "
                          f"of tokens.bin; {again}")
    return starts


def load_source(path: Optional[str] = None, **kwargs) -> TokenSource:
    """``None`` → the default corpus; a prepared folder (``meshtrain data prepare``) → its tokens;
    ``.npy`` / ``.bin`` → token file; anything else → byte-level text."""
    if path is None:
        return default_corpus()
    if is_prepared(path):
        return prepared_source(path)
    if path.endswith((".npy", ".bin")):
        return token_file_source(path, **kwargs)
    return text_source(path)
