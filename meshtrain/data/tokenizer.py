"""Tokenizers: a HuggingFace ``tokenizer.json`` (through the ``tokenizers`` library), or the byte-level
one of the embedded corpus and of plain text files (ids 0..255, the UTF-8 bytes).

Pass :func:`load_tokenizer` a ``tokenizer.json`` file or a folder holding one (a HuggingFace model
folder, a prepared token folder, a run folder); :func:`train_bpe` builds a small byte-level BPE
tokenizer offline from text (``meshtrain data tokenizer``). Example::

    tok = load_tokenizer("runs/small-fsdp")          # the tokenizer the run trained with
    ids = tok.encode("def main():")
    text = tok.decode(ids)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Iterable, List, Optional, Sequence

from meshtrain.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # HuggingFace's: names the eos token
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
    """Copy ``tokenizer.json`` (and ``tokenizer_config.json``) from folder ``source_dir`` to
    ``target_dir`` when it has them; the copied ``tokenizer.json``'s path, or ``None``. ``OSError``
    propagates (the caller names the file and when)."""
    if source_dir is None or not os.path.isdir(source_dir):
        return None
    copied = None
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
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


def train_bpe(texts: Iterable[str], vocab_size: int, out: str) -> HFTokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` ids (256 byte symbols, ``<|endoftext|>`` and the
    merges learned from ``texts``), written to ``out`` (a ``tokenizer.json``). Any text encodes (no
    unknown token) and decodes back exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: see load_tokenizer

    if not isinstance(vocab_size, int) or vocab_size < 258:
        raise ConfigError(f"--vocab-size {vocab_size}: must be at least 258 (256 bytes, the end-of-text token "
                          f"and one merge)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    partial = out + f".partial-{os.getpid()}"
    tokenizer.save(partial)
    os.replace(partial, out)  # never a half-written tokenizer.json at `out`
    return load_tokenizer(out)
