"""Masked-LM batches (BERT pre-training) from a token source, as numpy batches for ``bert-*``.

Each example is one packed window of ``seq_len`` tokens (:func:`meshtrain.data.packing.pack_window`:
documents kept apart by ``segment_ids``, ``positions`` restarting per document). BERT masking:
``round(mask_rate * seq_len)`` positions (at least 1) are chosen without replacement; of those 80 %
become ``mask_id``, 10 % a random token below ``random_vocab`` and 10 % stay unchanged; ``targets``
holds the original token there and ``-1`` everywhere else. The choice is a function of
``(seed, sample index)`` only.

Special ids for the byte-level corpus (vocabulary 256): ``PAD_ID`` 256, ``CLS_ID`` 257, ``SEP_ID``
258, ``MASK_ID`` 259: ``MLM_VOCAB`` = 260 ids (``bert-tiny`` / ``bert-small`` pad it to 264). Batches
need no padding (windows are full); [PAD]/[CLS]/[SEP] are for classification inputs.

Example::

    it = MLMBatches(default_corpus(), batch_size=16, seq_len=128, seed=0)
    batch = next(it)  # {"input_ids", "targets", "positions", "segment_ids"}: (16, 128) int32
    it.state()        # JSON, for checkpoints; it.restore(state) continues identically

Processes: ``batch_size`` is the *global* batch; process ``i`` of ``P`` gets the contiguous rows
``[i * B/P, (i + 1) * B/P)`` (or the explicit ``rows``); see :mod:`meshtrain.data.rows`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from meshtrain.data.packing import num_sequences, pack_window
from meshtrain.data.rows import EpochOrder, check_state, process_rows
from meshtrain.data.sources import BYTE_VOCAB, TokenSource
from meshtrain.errors import ConfigError

PAD_ID, CLS_ID, SEP_ID, MASK_ID = BYTE_VOCAB, BYTE_VOCAB + 1, BYTE_VOCAB + 2, BYTE_VOCAB + 3
MLM_VOCAB = BYTE_VOCAB + 4
KEYS = ("input_ids", "targets", "positions", "segment_ids")


def mask_tokens(tokens: np.ndarray, rng: np.random.Generator, *, mask_rate: float = 0.15, mask_id: int = MASK_ID,
                random_vocab: int = BYTE_VOCAB):
    """BERT masking of one sequence: ``(input_ids, targets)`` (int32; targets ``-1`` where unmasked)."""
    n = tokens.shape[0]
    count = min(n, max(1, int(round(mask_rate * n))))
    picked = rng.choice(n, size=count, replace=False)
    action = rng.random(count)
    inputs = tokens.astype(np.int32).copy()
    targets = np.full(n, -1, np.int32)
    targets[picked] = inputs[picked]
    to_mask = picked[action < 0.8]
    to_random = picked[(action >= 0.8) & (action < 0.9)]
    inputs[to_mask] = mask_id
    inputs[to_random] = rng.integers(0, random_vocab, size=to_random.shape[0])
    return inputs, targets


class MLMBatches:
    """Infinite, deterministic, resumable masked-LM batches over a :class:`TokenSource`.

    Args:
      source: token source (e.g. ``meshtrain.data.default_corpus()``), read only.
      batch_size: the global batch size (a multiple of ``process_count``).
      seq_len: tokens per example.
      seed: shuffle and masking seed (global batch ``b`` is a function of ``(seed, b)`` only).
      mask_rate / mask_id / random_vocab: masking (``random_vocab`` defaults to the source's
        vocabulary, 256 for bytes).
      process_index / process_count / rows: which rows of each global batch this process yields.
    """

    def __init__(self, source: TokenSource, batch_size: int, seq_len: int, seed: int = 0, *,
                 mask_rate: float = 0.15, mask_id: int = MASK_ID, random_vocab: Optional[int] = None,
                 process_index: int = 0, process_count: int = 1, rows: Optional[Sequence[int]] = None):
        if not 0.0 < mask_rate < 1.0:
            raise ConfigError(f"mask rate {mask_rate} must be between 0 and 1")
        self.source, self.batch_size, self.seq_len, self.seed = source, batch_size, seq_len, seed
        self.mask_rate, self.mask_id = mask_rate, mask_id
        self.random_vocab = int(random_vocab or source.vocab_size or BYTE_VOCAB)
        if self.random_vocab > mask_id:
            raise ConfigError(f"mask id {mask_id} lies inside the source's vocabulary ({self.random_vocab}); "
                              f"pass a mask_id at or above it")
        n = num_sequences(source, seq_len)
        if n < 1:
            raise ConfigError(f"data {source.name!r} has {len(source)} tokens, fewer than one sequence of "
                              f"{seq_len + 1}; use a shorter seq_len or more data")
        self.rows = process_rows(batch_size, process_index, process_count, rows)
        self.order = EpochOrder(n, seed)
        self.samples_seen = 0

    def example(self, sample: int) -> Dict[str, np.ndarray]:
        """Sample ``sample`` of the run (one row, unbatched)."""
        window = pack_window(self.source, self.order.example(sample), self.seq_len)
        rng = np.random.default_rng([self.seed, int(sample), 1])  # independent of the shuffle stream
        input_ids, targets = mask_tokens(window["inputs"], rng, mask_rate=self.mask_rate, mask_id=self.mask_id,
                                         random_vocab=self.random_vocab)
        return {"input_ids": input_ids, "targets": targets, "positions": window["positions"],
                "segment_ids": window["segment_ids"]}

    def local_batch(self, first_sample: int) -> Dict[str, np.ndarray]:
        """This process's rows of the global batch starting at sample ``first_sample``."""
        rows = [self.example(first_sample + int(r)) for r in self.rows]
        return {k: np.stack([r[k] for r in rows]) for k in KEYS}

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        batch = self.local_batch(self.samples_seen)
        self.samples_seen += self.batch_size
        return batch

    def _identity(self) -> Dict[str, Any]:
        return {"seed": self.seed, "seq_len": self.seq_len, "mask_rate": self.mask_rate, "mask_id": self.mask_id,
                "source": self.source.fingerprint}

    def state(self) -> Dict[str, Any]:
        return {"samples_seen": self.samples_seen, **self._identity()}

    def restore(self, state: Dict[str, Any]) -> None:
        """Continue from a :meth:`state` (the batch size and process count may differ)."""
        check_state(state, self._identity(), "masked-LM data")
        self.samples_seen = int(state["samples_seen"])
