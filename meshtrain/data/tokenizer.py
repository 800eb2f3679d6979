"""Tokenizers: a HuggingFace ``tokenizer.json`` (through the ``tokenizers`` library), or the byte-level
one of the embedded corpus and of plain text files (ids 0..255, the UTF-8 bytes).

Pass :func:`load_tokenizer` a ``tokenizer.json`` file or a folder holding one (a HuggingFace model
folder, a prepared token folder, a run folder); :func:`train_bpe` builds a small byte-level BPE
tokenizer offline from text (``meshtrain data tokenizer``): nothing is written until it has learned,
then the file is written beside ``out`` and renamed (a full disk: a :class:`DiskError`, nothing left).
Example::

    tok = load_tokenizer("runs/small-fsdp")          # the tokenizer the run trained with
    ids = tok.encode("def main():")
    text = tok.decode(ids)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import warnings
from typing import Iterable, Iterator, List, Optional, Sequence

from meshtrain.errors import ConfigError, DiskError, MeshtrainError, disk_hint, is_disk_full

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # HuggingFace's: names the eos token, holds the chat template
#: transformers' file for a tokenizer's default chat template (it takes precedence over the config's)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: the legacy file some tokenizers name their special tokens in (the config's entries take precedence)
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
#: what travels with a tokenizer (a run, an import, an export, prepared data): :func:`copy_tokenizer_files`
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_FILE)
#: The end-of-document token of tokenizers built by :func:`train_bpe` (GPT-2's spelling).
EOS_TOKEN = "<|endoftext|>"
_KNOWN_EOS = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """Ids are UTF-8 bytes (vocabulary 256): the embedded corpus and plain text files train on these."""

    name: str = "bytes"
    fingerprint: str = "bytes"
    vocab_size: int = 256
    eos_id: Optional[int] = None

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # A cut inside a multi-byte character (a sampled continuation may end anywhere) shows as U+FFFD.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from ``path``; ``eos_id`` from ``tokenizer_config.json`` beside
    it, else the first known end-of-text token in the vocabulary (``None`` when there is none)."""

    tokenizer: object
    path: str
    fingerprint: str
    eos_id: Optional[int]

    @property
    def name(self) -> str:
        return self.path

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> List[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # The library tokenizes a batch on all cores (Rust threads).
        return [list(e.ids) for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_path(path: str) -> Optional[str]:
    """``path`` itself when it is a file, ``path/tokenizer.json`` when that exists, else ``None``."""
    if os.path.isfile(path):
        return path
    inside = os.path.join(path, TOKENIZER_FILE)
    return inside if os.path.isfile(inside) else None


def copy_tokenizer_files(source_dir: Optional[str], target_dir: str) -> Optional[str]:
    """Copy ``tokenizer.json`` (and ``tokenizer_config.json``, ``chat_template.jinja``,
    ``special_tokens_map.json``: :data:`TOKENIZER_FILES`) from folder ``source_dir`` to ``target_dir``
    when it has them; the first copied file's path, or ``None``. ``OSError`` propagates (the caller
    names the file and when)."""
    if source_dir is None or not os.path.isdir(source_dir):
        return None
    copied = None
    for name in TOKENIZER_FILES:
        source = os.path.join(source_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(target_dir, name))
            copied = copied or os.path.join(target_dir, name)
    return copied


def load_tokenizer(path: str) -> HFTokenizer:
    """The tokenizer in ``path`` (a ``tokenizer.json`` file, or a folder holding one)."""
    from tokenizers import Tokenizer  # lazy: only commands that tokenize text pay its import

    found = tokenizer_path(path)
    if found is None:
        what = "does not exist" if not os.path.exists(path) else f"holds no {TOKENIZER_FILE}"
        raise ConfigError(f"tokenizer {path!r} {what}; pass a {TOKENIZER_FILE} file or a folder holding one (a "
                          f"HuggingFace model folder, a prepared token folder or a run folder), or build one with "
                          f"`meshtrain data tokenizer --out tokenizer.json`")
    try:
        with open(found, "rb") as f:
            raw = f.read()
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read tokenizer {found!r}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - the library raises its own Exception type for a bad file
        raise ConfigError(f"tokenizer {found!r} is not a HuggingFace tokenizer.json ({str(exc)[:200]}); pass the "
                          f"file a `tokenizers` Tokenizer saved") from None
    fingerprint = "hf:" + hashlib.sha256(raw).hexdigest()[:16]
    return HFTokenizer(tokenizer, found, fingerprint, _eos_id(tokenizer, os.path.dirname(found)))


def _eos_id(tokenizer, folder: str) -> Optional[int]:
    config = os.path.join(folder, TOKENIZER_CONFIG_FILE)
    if os.path.isfile(config):
        try:
            with open(config) as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError):
            eos = None
        if isinstance(eos, dict):  # {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return int(tokenizer.token_to_id(eos))
    for token in _KNOWN_EOS:
        if tokenizer.token_to_id(token) is not None:
            return int(tokenizer.token_to_id(token))
    return None


#: The largest vocabulary :func:`train_bpe` builds: prepared ids are stored as uint32.
MAX_VOCAB = 1 << 32
#: Runs of non-space characters longer than this are learned from in slices of this length: the
#: trainer's work grows with (longest word x text), so one 40 MB "word" (a DNA sequence, base64)
#: would take hours. Only learning is affected: such a run still encodes whole.
LONGEST_WORD = 128
_LONG_RUN = re.compile(r"\S{%d,}" % (LONGEST_WORD + 1))


def write_error(path: str, exc: OSError) -> MeshtrainError:
    """The error for an output that could not be written: a :class:`DiskError` (exit 74) for a full
    disk or file-size limit, else a ``ConfigError`` (a read-only or missing folder) naming ``path``."""
    reason = exc.strerror or str(exc)
    if is_disk_full(exc):
        return DiskError(f"cannot write {path!r}: {reason}; {disk_hint(exc)} (nothing was written)")
    return ConfigError(f"cannot write {path!r}: {reason}; pass an --out in a folder you can write (nothing was "
                       f"written)")


def tokenizer_out(out: str) -> str:
    """Where ``meshtrain data tokenizer --out out`` writes: ``out/tokenizer.json`` for a folder (or a
    path ending in a separator), else ``out``. An existing file there is replaced only when it is a
    tokenizer.json (a retrain): any other file is refused, so a typo cannot overwrite a user's text."""
    if os.path.isdir(out) or out.endswith((os.sep, "/")):
        out = os.path.join(out, TOKENIZER_FILE)
    if os.path.isdir(out):
        raise ConfigError(f"--out {out!r} is a folder; pass a file path such as {os.path.join(out, 'new.json')!r}")
    if os.path.lexists(out) and not _is_tokenizer_file(out):
        raise ConfigError(f"--out {out!r} already exists and is not a tokenizer.json; pass a new path (an "
                          f"existing tokenizer.json is replaced, any other file is left alone)")
    return out


def _is_tokenizer_file(path: str) -> bool:
    from tokenizers import Tokenizer  # lazy: see load_tokenizer

    if not os.path.isfile(path) or os.path.getsize(path) > 1 << 30:
        return False
    try:
        Tokenizer.from_file(path)
    except Exception:  # noqa: BLE001 - the library raises its own Exception type for any bad file
        return False
    return True


def train_bpe(texts: Iterable[str], vocab_size: int, out: str, *, text_bytes: Optional[int] = None,
              source: str = "the text") -> HFTokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` ids (256 byte symbols, ``<|endoftext|>`` and the
    merges learned from ``texts``), written to ``out`` (a ``tokenizer.json``, or a folder to hold one;
    :func:`tokenizer_out`). Any text encodes (no unknown token) and decodes back exactly.

    ``text_bytes`` (an upper bound on the UTF-8 size of ``texts``) caps the vocabulary at what that
    text can make (each merge shortens the text by at least one byte; the trainer reserves memory
    for every id asked for); fewer ids than asked are learned with a warning. ``source`` names the
    text in errors and warnings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: see load_tokenizer

    if not isinstance(vocab_size, int) or vocab_size < 258:
        raise ConfigError(f"--vocab-size {vocab_size}: must be at least 258 (256 bytes, the end-of-text token "
                          f"and one merge)")
    if vocab_size > MAX_VOCAB:
        raise ConfigError(f"--vocab-size {vocab_size}: must be at most {MAX_VOCAB:,} (2^32: prepared ids are stored "
                          f"as uint32)")
    out = tokenizer_out(out)
    if text_bytes == 0:
        raise ConfigError(f"{source}: no text to learn from (empty files); pass files that hold text")
    asked = vocab_size
    if text_bytes is not None:  # each merge shortens the text by a byte: more ids cannot be made, and the
        vocab_size = min(vocab_size, 257 + text_bytes)  # trainer reserves memory for every id asked for
    with _reserved(out) as partial:  # before learning: a read-only folder fails now, not after minutes
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        seen = [False]
        tokenizer.train_from_iterator(_learnable(texts, seen), trainer=trainer)
        if not seen[0]:
            raise ConfigError(f"{source}: no text to learn from (empty files, blank lines or empty text fields); "
                              f"pass files that hold text")
        if tokenizer.get_vocab_size() < asked:
            warnings.warn(f"--vocab-size {asked:,}: {source} made only {tokenizer.get_vocab_size():,} ids (no pair of "
                          f"symbols left to merge); learn from more text for more")
        with open(partial, "w", encoding="utf-8") as f:
            f.write(tokenizer.to_str(pretty=True))
        os.replace(partial, out)  # never a half-written tokenizer.json at `out`
    return load_tokenizer(out)


def _learnable(texts: Iterable[str], seen: List[bool]) -> Iterator[str]:
    """``texts`` for the trainer, long non-space runs sliced (:data:`LONGEST_WORD`); ``seen[0]`` turns
    True at the first text that is not blank."""
    for text in texts:
        if not seen[0] and text and not text.isspace():
            seen[0] = True
        if not _LONG_RUN.search(text):
            yield text
            continue
        start = 0
        for run in _LONG_RUN.finditer(text):
            yield text[start:run.start()]
            yield from (text[i:i + LONGEST_WORD] for i in range(run.start(), run.end(), LONGEST_WORD))
            start = run.end()
        yield text[start:]


@contextlib.contextmanager
def _reserved(out: str) -> Iterator[str]:
    """An empty ``out.partial-<pid>`` (and any missing parent folders) for the block to fill and rename;
    removed, with the folders it made, on any error or Ctrl-C. Write errors name ``out``."""
    parent = os.path.dirname(os.path.abspath(out))
    made = missing_folders(out)
    partial = out + f".partial-{os.getpid()}"
    try:
        try:
            os.makedirs(parent, exist_ok=True)
            open(partial, "w").close()
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(f"--out {out!r}: a parent is a file, not a folder; pass a path in a folder") from None
        except OSError as exc:
            raise write_error(out, exc) from None
        try:
            yield partial
        except OSError as exc:
            raise write_error(out, exc) from None
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        remove_empty(made)
        raise


def missing_folders(path: str) -> List[str]:
    """The folders above ``path`` that do not exist yet, innermost first: what writing it makes, and
    what :func:`remove_empty` takes away again when the write fails."""
    made, folder = [], os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        made.append(folder)
        folder = os.path.dirname(folder)
    return made


def remove_empty(folders: Sequence[str]) -> None:
    """Remove ``folders`` (innermost first) while they are empty: nothing of anyone else's goes."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return
