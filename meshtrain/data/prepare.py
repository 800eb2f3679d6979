"""``meshtrain data prepare``: text → token ids, once, into a folder the Trainer memory-maps.

Inputs are plain text files (one document each) and JSON lines (``.jsonl`` / ``.json``: one document
per line, its text under ``text_field``), given as files, folders or glob patterns. Each document's
ids are followed by the tokenizer's end-of-text id, so packing keeps document boundaries (the
``segment_ids`` of a batch restart at every document, :mod:`meshtrain.data.packing`). The folder holds::

    tokens.bin        every id, uint16 (vocabulary <= 65,536) or uint32, in input order
    doc_starts.npy    where each document starts (int64)
    tokenizer.json    the tokenizer that wrote them (and tokenizer_config.json when it had one)
    tokens.json       format, tokenizer fingerprint, vocabulary, eos id, dtype, counts, inputs

It is written beside ``out`` and renamed into place at the end: on any error nothing is left at
``out``. Example::

    meta = prepare_tokens(load_tokenizer("tokenizer.json"), ["notes/*.txt", "chat.jsonl"], "data/tok")
    # then: meshtrain train --data data/tok
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from typing import Iterator, List, Sequence, Tuple

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn

from meshtrain.data.sources import PREPARED_FORMAT, PREPARED_META
from meshtrain.data.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from meshtrain.errors import ConfigError
from meshtrain.folders import new_folder

_JSON_SUFFIXES = (".jsonl", ".json")


def input_files(inputs: Sequence[str]) -> List[str]:
    """Files named by ``inputs`` (files, folders read recursively, glob patterns), in the order given,
    each folder's and pattern's files sorted."""
    files: List[str] = []
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
        files += found
    return files


def documents(path: str, text_field: str) -> Iterator[str]:
    """The documents of one input file: the file's text, or one per JSON line (``text_field``)."""
    try:
        if not path.endswith(_JSON_SUFFIXES):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
            return
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
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
                yield record[text_field]
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path!r} is not UTF-8 JSON lines ({exc.reason}); convert it to UTF-8") from None


def prepare_tokens(tokenizer, inputs: Sequence[str], out: str, *, text_field: str = "text",
                   batch_docs: int = 512, progress: bool = True) -> dict:
    """Tokenize ``inputs`` with ``tokenizer`` (:func:`~meshtrain.data.tokenizer.load_tokenizer`) into
    the folder ``out`` (which must not exist, or be empty); the description written, as a dict."""
    if tokenizer.eos_id is None:
        raise ConfigError(f"tokenizer {tokenizer.name!r} has no end-of-text token (none of its "
                          f"tokenizer_config.json eos_token, <|endoftext|>, </s>, <eos>); documents could not be "
                          f"told apart: use a tokenizer with one")
    files = input_files(inputs)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
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
        meta = {"format": PREPARED_FORMAT, "tokenizer": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
                "eos_id": tokenizer.eos_id, "dtype": dtype.name, "num_tokens": num_tokens, "num_docs": len(starts),
                "text_field": text_field, "inputs": files}
        with open(os.path.join(partial, PREPARED_META), "w") as f:
            json.dump(meta, f, indent=1)
    return meta


def _write_tokens(tokenizer, files: List[str], text_field: str, path: str, dtype: np.dtype, batch_docs: int,
                  progress: bool) -> Tuple[int, List[int]]:
    """Stream the ids to ``path`` (never the whole corpus in memory); the count and document starts."""
    starts: List[int] = []
    total = 0
    console = Console(file=sys.stderr)
    with open(path, "wb") as sink, Progress(TextColumn("tokenizing"), BarColumn(), TransferSpeedColumn(),
                                            TextColumn("{task.fields[tokens]:,} tokens"), console=console,
                                            disable=not progress, transient=True) as bar:
        task = bar.add_task("tokenizing", total=sum(os.path.getsize(f) for f in files), tokens=0)

        def flush(batch: List[str]) -> None:
            nonlocal total
            for ids in tokenizer.encode_batch(batch):
                starts.append(total)
                ids.append(tokenizer.eos_id)
                sink.write(np.asarray(ids, dtype).tobytes())
                total += len(ids)
            batch.clear()

        batch: List[str] = []
        for f in files:
            for doc in documents(f, text_field):
                if doc:
                    batch.append(doc)
                if len(batch) >= batch_docs:
                    flush(batch)
            flush(batch)
            bar.update(task, advance=os.path.getsize(f), tokens=total)
    return total, starts
