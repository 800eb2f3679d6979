"""Chat fine-tuning data: ``meshtrain data prepare --chat``.

Each line of a JSON lines input is one conversation, ``{"messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}``. It is rendered with the tokenizer's chat template by
the renderer generation uses (:class:`~meshtrain.data.chat.ChatTemplate`), tokenized without adding
special tokens (the template writes them), and stored as one document of a prepared folder
(:mod:`meshtrain.data.prepare`'s format) with a loss mask beside the ids::

    loss_mask.bin     one uint8 per token: 1 where the token is the assistant's (a target), else 0

Packing keeps the mask (:func:`meshtrain.data.packing.pack_window` sets the other targets to ``-1``),
so ``train --data`` computes the loss, and its gradient, on the assistant's tokens only.

Where the assistant's text is: a template with ``{% generation %}`` blocks says so itself
(:meth:`~meshtrain.data.chat.ChatTemplate.render_spans`); for the rest (most published templates)
assistant turn ``i`` is the text that rendering turns ``0..i`` adds to the rendering of turns
``0..i-1`` with the generation prompt: the reply and its end-of-turn token (trailing whitespace left
out). A token counts when its characters (the tokenizer's offsets) overlap that text. Example::

    meta = prepare_chat(load_tokenizer("runs/base"), load_chat_template("runs/base"), ["chats.jsonl"], "data/chat")
    # then: meshtrain train --model runs/base --init-from runs/base --data data/chat
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator, List, Sequence, Tuple

import numpy as np

from meshtrain.data.chat import ChatTemplate, check_messages
from meshtrain.data.prepare import input_files
from meshtrain.data.sources import LOSS_MASK_FILE, PREPARED_FORMAT, PREPARED_META
from meshtrain.data.tokenizer import (TOKENIZER_FILE, copy_tokenizer_files, missing_folders, remove_empty,
                                       write_error)
from meshtrain.errors import ConfigError
from meshtrain.folders import new_folder

#: The key of a JSON line that holds the conversation (``--text-field`` names another).
MESSAGES_FIELD = "messages"
#: Conversations tokenized together (``encode_batch`` uses every core).
BATCH_CONVERSATIONS = 256
Span = Tuple[int, int]


def conversations(path: str, field: str = MESSAGES_FIELD) -> Iterator[Tuple[int, list]]:
    """``(line number, messages)`` for each non-blank line of the JSON lines file ``path``; a line that
    is not UTF-8, not a JSON object, or has no list under ``field`` is a ``ConfigError`` naming the
    file and line."""
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                where = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                      f"{exc.start + 1}); convert the file to UTF-8") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ConfigError(f"{where}: not a JSON object ({exc}); write one JSON object per line, "
                                      f"{{\"{field}\": [{{\"role\": \"user\", \"content\": ...}}, ...]}}") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), list):
                    found = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ConfigError(f"{where}: no list of messages under {field!r} (found {found}); give "
                                      f"{{\"{field}\": [{{\"role\": ..., \"content\": ...}}, ...]}}, or pass "
                                      f"--text-field with the key that holds the messages")
                yield number, record[field]
    except OSError as exc:
        raise ConfigError(f"cannot read {path!r}: {exc.strerror or exc}") from None


def assistant_spans(template: ChatTemplate, messages: Sequence[dict]) -> Tuple[str, List[Span]]:
    """``(text, spans)``: the rendered conversation and the ``(start, end)`` character ranges of the
    assistant's turns in it (see the module docstring). A ``ConfigError`` when the conversation has no
    assistant turn or the template renders its turns inconsistently."""
    check_messages(messages, template.where)
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ConfigError(f"the conversation has no assistant turn (roles: {', '.join(roles)}); chat fine-tuning "
                          f"learns the assistant's replies: add one, or leave the conversation out")
    text, spans = template.render_spans(messages)
    if spans:  # the template marks them itself ({% generation %})
        return text, spans
    for i, role in enumerate(roles):
        if role != "assistant":
            continue
        upto = template.render(messages[:i + 1])
        if i == 0:  # nothing before it to render with the generation prompt: find the reply itself
            content = messages[0]["content"]
            if not (isinstance(content, str) and content.strip()):
                raise ConfigError("the conversation opens with an assistant turn without text; start it with "
                                  "a user (or system) turn")
            start = upto.find(content)
        else:
            before = template.render(messages[:i], add_generation_prompt=True)
            start = len(before) if upto.startswith(before) else -1
        if start < 0 or not text.startswith(upto):
            raise ConfigError(f"{template.where} renders the conversation cut after turn {i} differently from "
                              f"the whole, so the assistant's text cannot be found; use a template that wraps "
                              f"each assistant reply in {{% generation %}}...{{% endgeneration %}}")
        spans.append((start, max(start, len(upto.rstrip()))))
    return text, spans


def token_mask(offsets: Sequence[Tuple[int, int]], spans: Sequence[Span]) -> np.ndarray:
    """One uint8 per token: 1 when the token's characters ``offsets[t] = (start, end)`` overlap a span
    (a token with no characters counts when it sits inside one)."""
    o = np.asarray(offsets, np.int64).reshape(-1, 2)
    starts, ends = o[:, 0], o[:, 1]
    mask = np.zeros(o.shape[0], bool)
    for a, b in spans:
        mask |= (np.maximum(starts, a) < np.minimum(ends, b)) | ((starts == ends) & (a <= starts) & (starts < b))
    return mask.astype(np.uint8)


def prepare_chat(tokenizer, template: ChatTemplate, inputs: Sequence[str], out: str, *,
                 field: str = MESSAGES_FIELD) -> dict:
    """Render, tokenize and mask every conversation of ``inputs`` (JSON lines files, folders or globs)
    into the folder ``out`` (must not exist, or be empty); the description written (``tokens.json``)."""
    files = input_files(inputs)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    made = missing_folders(out)
    try:
        with new_folder(out) as partial:
            counts, starts = _write_conversations(tokenizer, template, files, field, partial, dtype)
            num_tokens, targets = counts
            if num_tokens < 2:
                raise ConfigError(f"--input {' '.join(inputs)}: no conversation to tokenize (empty files)")
            if targets == 0:
                raise ConfigError(f"--input {' '.join(inputs)}: the assistant's turns hold no tokens; nothing "
                                  f"would be learned")
            np.save(os.path.join(partial, "doc_starts.npy"), np.asarray(starts, np.int64))
            copy_tokenizer_files(os.path.dirname(tokenizer.path), partial)  # the template comes along
            shutil.copyfile(tokenizer.path, os.path.join(partial, TOKENIZER_FILE))
            meta = {"format": PREPARED_FORMAT, "tokenizer": tokenizer.fingerprint,
                    "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id, "dtype": dtype.name,
                    "num_tokens": num_tokens, "num_docs": len(starts), "text_field": field, "inputs": files,
                    "loss_mask": LOSS_MASK_FILE, "target_tokens": targets, "chat_template": template.where}
            with open(os.path.join(partial, PREPARED_META), "w") as f:
                json.dump(meta, f, indent=1)
    except BaseException as exc:
        remove_empty(made)
        if isinstance(exc, OSError):
            raise write_error(out, exc) from None
        raise
    return meta


def _write_conversations(tokenizer, template: ChatTemplate, files: List[str], field: str, folder: str,
                         dtype: np.dtype) -> Tuple[Tuple[int, int], List[int]]:
    """Stream ids to ``tokens.bin`` and the mask to ``loss_mask.bin``; ``((tokens, targets), starts)``."""
    starts: List[int] = []
    total = targets = 0
    with open(os.path.join(folder, "tokens.bin"), "wb") as ids_out, \
            open(os.path.join(folder, LOSS_MASK_FILE), "wb") as mask_out:

        def flush(batch: List[Tuple[str, List[Span]]]) -> None:
            nonlocal total, targets
            encodings = tokenizer.tokenizer.encode_batch([text for text, _ in batch], add_special_tokens=False)
            for (_, spans), encoding in zip(batch, encodings):
                if not encoding.ids:
                    continue
                mask = token_mask(encoding.offsets, spans)
                starts.append(total)
                ids_out.write(np.asarray(encoding.ids, dtype).tobytes())
                mask_out.write(mask.tobytes())
                total += len(encoding.ids)
                targets += int(mask.sum())
            batch.clear()

        batch: List[Tuple[str, List[Span]]] = []
        for path in files:
            for number, messages in conversations(path, field):
                try:
                    batch.append(assistant_spans(template, messages))
                except ConfigError as exc:
                    raise ConfigError(f"{path}:{number}: {exc}") from None
                if len(batch) >= BATCH_CONVERSATIONS:
                    flush(batch)
        flush(batch)
    return (total, targets), starts
