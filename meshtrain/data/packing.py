"""Packing: the token stream cut into fixed windows of ``seq_len + 1`` tokens (stride ``seq_len``),
documents kept apart inside a window by ``segment_ids`` (attention stays within a document),
``positions`` restarting at each document (and at the window start), and the target that would cross into the next
document masked (``-1``). A source with a ``loss_mask`` (chat fine-tuning: only the assistant's
tokens count) also has ``-1`` for every target its mask leaves out, so the losses, which ignore
negative targets, weigh those tokens zero and the step divides by the assistant tokens alone."""

from __future__ import annotations

from typing import Dict

import numpy as np

from meshtrain.data.sources import TokenSource


def num_sequences(source: TokenSource, seq_len: int) -> int:
    return max((len(source) - 1) // seq_len, 0)


def pack_window(source: TokenSource, index: int, seq_len: int) -> Dict[str, np.ndarray]:
    """Sequence ``index``: ``inputs``, ``targets``, ``positions``, ``segment_ids`` (int32, ``(seq_len,)``)."""
    start = index * seq_len
    window = np.asarray(source.tokens[start:start + seq_len + 1], dtype=np.int64)
    pos = np.arange(start, start + seq_len + 1)
    doc = np.searchsorted(source.doc_starts, pos, side="right") - 1
    inputs, targets = window[:-1], window[1:].copy()
    targets[doc[1:] != doc[:-1]] = -1  # the next document's first token is not predictable
    if source.loss_mask is not None:  # token t is the target of position t - 1
        targets[np.asarray(source.loss_mask[start + 1:start + seq_len + 1]) == 0] = -1
    # Positions count from the document's start, or from the window's start for a document that
    # began in an earlier window: always < seq_len, like every packed sequence the model sees.
    positions = pos[:-1] - np.maximum(source.doc_starts[doc[:-1]], start)
    segments = doc[:-1] - doc[0]
    return {"inputs": inputs.astype(np.int32), "targets": targets.astype(np.int32),
            "positions": positions.astype(np.int32), "segment_ids": segments.astype(np.int32)}
