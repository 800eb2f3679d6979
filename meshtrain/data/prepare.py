"""``meshtrain data prepare``: text → token ids, once, into a folder the Trainer memory-maps.

Inputs are plain text files (one document each) and JSON lines (``.jsonl`` / ``.json``: one document
per line, its text under ``text_field``), given as files, folders or glob patterns; each real file
is read once, however many names, links or patterns reach it. Inputs must be UTF-8: a file that is
not (binary, latin-1) is refused, naming the file and the offset of its first bad byte. Each
document's ids are followed by the tokenizer's end-of-text id, so packing keeps document boundaries
(the ``segment_ids`` of a batch restart at every document, :mod:`meshtrain.data.packing`). The
folder holds::

    tokens.bin        every id, uint16 (vocabulary <= 65,536) or uint32, in input order
    doc_starts.npy    where each document starts (int64)
    tokenizer.json    the tokenizer that wrote them (and tokenizer_config.json when it had one)
    tokens.json       format, tokenizer fingerprint, vocabulary, eos id, dtype, counts, inputs

Memory follows a piece of text, not a line: a document longer than :data:`PIECE_CHARS` characters
is read and encoded in pieces cut before a space (a byte-level BPE such as ``meshtrain data
tokenizer``'s gives the same ids as for the whole document). A JSON line is parsed whole.

It is written beside ``out`` and renamed into place at the end: on any error (a full disk: a
:class:`~meshtrain.errors.DiskError`) or Ctrl-C nothing is left at ``out``. Example::

    meta = prepare_tokens(load_tokenizer("tokenizer.json"), ["notes/*.txt", "chat.jsonl"], "data/tok")
    # then: meshtrain train --data data/tok
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import io
import json
import os
import re
import shutil
import sys
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn

from meshtrain.data.sources import PREPARED_FORMAT, PREPARED_META
from meshtrain.data.tokenizer import (TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, missing_folders, remove_empty,
                                       write_error)
from meshtrain.errors import ConfigError
from meshtrain.folders import new_folder

_JSON_SUFFIXES = (".jsonl", ".json")
#: The longest piece of text handed to the tokenizer at once (characters). A 100 MB line as one
#: string costs the ``tokenizers`` library gigabytes (its Encoding keeps offsets and token strings).
PIECE_CHARS = 1 << 18
#: ``encode_batch`` gets about this many characters at a time (several pieces: all cores work).
BATCH_CHARS = 1 << 21
# Where a piece may end: after a non-space character that a space (else any whitespace) follows.
# Pre-tokenizers split there anyway (GPT-2's byte-level regex, Metaspace), so the ids do not change.
_CUTS = (re.compile(r".*\S(?= )", re.S), re.compile(r".*\S(?=\s)", re.S))


@dataclasses.dataclass(frozen=True)
class InputFiles:
    """The files ``--input`` reaches, each real file once (:func:`gather_inputs`), and how many names
    were skipped because they reach a file already listed (a symbolic link, a hard link, a folder
    linked into another, a repeated pattern)."""

    files: List[str]
    skipped: int

    def skipped_text(self) -> str:
        """``"; 3 names skipped (links or repeats of files already read)"``, or nothing."""
        if not self.skipped:
            return ""
        return (f"; {self.skipped:,} name{'s' if self.skipped > 1 else ''} skipped (links or repeats of files "
                f"already read)")


def gather_inputs(inputs: Sequence[str]) -> InputFiles:
    """Files named by ``inputs`` (files, folders read recursively, glob patterns), in the order given,
    each folder's and pattern's files sorted. A file reached twice (a symbolic or hard link to a file
    already listed, a linked folder, a repeated pattern) is listed once, under the first name that
    reached it, and counted in ``skipped``."""
    files: List[str] = []
    seen = set()
    skipped = 0
    for spec in inputs:
        if os.path.isdir(spec):
            found = sorted(f for f in glob.glob(os.path.join(spec, "**", "*"), recursive=True) if os.path.isfile(f))
        elif os.path.isfile(spec):
            found = [spec]
        else:
            found = sorted(f for f in glob.glob(spec, recursive=True) if os.path.isfile(f))
        if not found:
            raise ConfigError(f"--input {spec!r} matches no file; pass text or .jsonl files, folders or a glob "
                              f"pattern such as 'data/*.txt'")
        for f in found:
            info = os.stat(f)  # follows links: the real file's device and inode (hard links share them too)
            real = (info.st_dev, info.st_ino)
            if real in seen:
                skipped += 1
                continue
            seen.add(real)
            files.append(f)
    return InputFiles(files, skipped)


def input_files(inputs: Sequence[str]) -> List[str]:
    """The files of :func:`gather_inputs`, each real file once."""
    return gather_inputs(inputs).files


def pieces(path: str, text_field: str = "text", limit: Optional[int] = None) -> Iterator[Tuple[str, bool]]:
    """The text of one input file as ``(piece, ends_document)``: a plain file is one document, a JSON
    lines file one per line (its ``text_field``); pieces hold at most :data:`PIECE_CHARS` characters.
    ``limit``: read at most this many bytes of the file, and yield at most as many bytes of text (a
    sample; its last piece or line is cut). Unreadable or non-UTF-8
    files raise a ``ConfigError`` naming the file."""
    try:
        if path.endswith(_JSON_SUFFIXES):
            for text in _json_texts(path, text_field, limit):
                yield from _mark_last(_split(text))
        else:
            yield from _mark_last(_text_pieces(path, limit))
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc.strerror or exc}") from None


def _mark_last(items: Iterable[str]) -> Iterator[Tuple[str, bool]]:
    previous = None
    for item in items:
        if previous is not None:
            yield previous, False
        previous = item
    yield ("" if previous is None else previous), True


def _split(text: str) -> Iterator[str]:
    """``text`` in pieces of at most :data:`PIECE_CHARS` characters, each but the last cut before
    whitespace where the window has some (slices: no copy of the rest)."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        for cut in _CUTS:
            found = cut.match(text, start, end + 1)
            if found:
                end = found.end()
                break
        yield text[start:end]
        start = end
    yield text[start:]


def _text_pieces(path: str, limit: Optional[int]) -> Iterator[str]:
    """A plain text file's text, decoded (strict UTF-8, newlines as ``\\n``) and cut as it is read."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines = io.IncrementalNewlineDecoder(decoder, translate=True)
    buffer, offset = "", 0
    with open(path, "rb") as f:
        while True:
            want = PIECE_CHARS if limit is None else min(PIECE_CHARS, limit - offset)
            raw = f.read(want) if want > 0 else None
            pending = len(decoder.getstate()[0])
            try:
                buffer += lines.decode(raw or b"", final=raw == b"")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, offset - pending + exc.start, exc.object[exc.start]) from None
            if not raw:  # the end of the file, or of the sample (a cut character is dropped)
                yield buffer
                return
            offset += len(raw)
            *done, buffer = _split(buffer)
            yield from done


def _json_texts(path: str, text_field: str, limit: Optional[int]) -> Iterator[str]:
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            room = None if limit is None else limit - offset
            if room is not None and room <= 0:
                return
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, offset + exc.start, raw[exc.start], number) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: not a JSON object ({exc}); write one JSON object per "
                                  f"line") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path}:{number}: no string field {text_field!r} (found {keys}); pass "
                                  f"--text-field with the key that holds the text")
            text = record[text_field]
            if room is not None and len(raw) > room:  # the sample ends inside this line: its first bytes
                text = text.encode("utf-8")[:room].decode("utf-8", errors="ignore")
            yield text


def _not_utf8(path: str, offset: int, byte: int, line: Optional[int] = None) -> ConfigError:
    where = f"line {line}, " if line else ""
    return ConfigError(f"{path!r} is not UTF-8 text ({where}byte 0x{byte:02x} at offset {offset:,}); convert it "
                       f"(e.g. `iconv -f latin1 -t utf-8`) or leave it out of --input")


def prepare_tokens(tokenizer, inputs: Sequence[str], out: str, *, text_field: str = "text",
                   batch_docs: int = 512, progress: bool = True) -> dict:
    """Tokenize ``inputs`` with ``tokenizer`` (:func:`~meshtrain.data.tokenizer.load_tokenizer`) into
    the folder ``out`` (which must not exist, or be empty); the description written, as a dict."""
    if tokenizer.eos_id is None:
        raise ConfigError(f"tokenizer {tokenizer.name!r} has no end-of-text token (none of its "
                          f"tokenizer_config.json eos_token, <|endoftext|>, </s>, <eos>); documents could not be "
                          f"told apart: use a tokenizer with one")
    gathered = gather_inputs(inputs)
    files = gathered.files
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    made = missing_folders(out)
    try:
        with new_folder(out) as partial:
            num_tokens, starts = _write_tokens(tokenizer, files, text_field, os.path.join(partial, "tokens.bin"),
                                               dtype, batch_docs, progress)
            if num_tokens < 2:
                raise ConfigError(f"--input {' '.join(inputs)}: no text to tokenize (empty files)")
            np.save(os.path.join(partial, "doc_starts.npy"), np.asarray(starts, np.int64))
            shutil.copyfile(tokenizer.path, os.path.join(partial, TOKENIZER_FILE))
            config = os.path.join(os.path.dirname(tokenizer.path), TOKENIZER_CONFIG_FILE)
            if os.path.isfile(config):
                shutil.copyfile(config, os.path.join(partial, TOKENIZER_CONFIG_FILE))
            meta = {"format": PREPARED_FORMAT, "tokenizer": tokenizer.fingerprint,
                    "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "dtype": dtype.name,
                    "num_tokens": num_tokens, "num_docs": len(starts), "text_field": text_field, "inputs": files,
                    "skipped_inputs": gathered.skipped}
            with open(os.path.join(partial, PREPARED_META), "w") as f:
                json.dump(meta, f, indent=1)
    except BaseException as exc:
        remove_empty(made)  # new_folder removed its partial folder; these are the ones above it
        if isinstance(exc, OSError):  # the inputs' errors are ConfigErrors already: this is --out's
            raise write_error(out, exc) from None
        raise
    return meta


def _write_tokens(tokenizer, files: List[str], text_field: str, path: str, dtype: np.dtype, batch_docs: int,
                  progress: bool) -> Tuple[int, List[int]]:
    """Stream the ids to ``path`` (never a whole file or line in memory); the count and document starts."""
    starts: List[int] = []
    total, in_doc = 0, False
    eos = np.asarray([tokenizer.eos_id], dtype).tobytes()
    console = Console(file=sys.stderr)
    with open(path, "wb") as sink, Progress(TextColumn("tokenizing"), BarColumn(), TransferSpeedColumn(),
                                            TextColumn("{task.fields[tokens]:,} tokens"), console=console,
                                            disable=not progress, transient=True) as bar:
        task = bar.add_task("tokenizing", total=sum(os.path.getsize(f) for f in files), tokens=0)

        def flush(batch: List[Tuple[str, bool]]) -> None:
            nonlocal total, in_doc
            for (text, ends), ids in zip(batch, tokenizer.encode_batch([text for text, _ in batch])):
                if text and not in_doc:  # a document's first text (empty documents are left out)
                    starts.append(total)
                    in_doc = True
                sink.write(np.asarray(ids, dtype).tobytes())
                total += len(ids)
                if ends and in_doc:
                    sink.write(eos)
                    total += 1
                    in_doc = False
            batch.clear()

        batch: List[Tuple[str, bool]] = []
        chars = 0
        for f in files:
            for text, ends in pieces(f, text_field):
                batch.append((text, ends))
                chars += len(text)
                if len(batch) >= batch_docs or chars >= BATCH_CHARS:
                    flush(batch)
                    chars = 0
            flush(batch)
            chars = 0
            bar.update(task, advance=os.path.getsize(f), tokens=total)
    return total, starts
