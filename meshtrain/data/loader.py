"""`BatchIterator`: deterministic by (seed, sample index), resumable from a small JSON state, and
per-process: each process packs only the rows its devices hold, and the global batch is assembled
with ``jax.make_array_from_process_local_data``.

Order: sample ``k`` of the run is sequence ``perm_e[k mod n]`` where ``e = k // n`` is the epoch
and ``perm_e`` a permutation seeded by ``(seed, e)``. The state stores ``samples_seen``, so a run
can resume with another batch size or another number of processes.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Dict, Optional

import jax
import numpy as np

from meshtrain.data.packing import num_sequences, pack_window
from meshtrain.data.sources import TokenSource
from meshtrain.errors import ConfigError

KEYS = ("inputs", "targets", "positions", "segment_ids")


class BatchIterator:
    """Global batches of ``batch_size`` packed sequences of ``seq_len`` tokens.

    Args:
      source: a :class:`TokenSource`.
      shardings: ``{key: NamedSharding}`` (``plan.batch_shardings``); ``None`` yields numpy arrays.
      vocab_size: the model's vocabulary; a token id at or above it raises a ``ConfigError``.
      prefetch: batches prepared ahead in a background thread.
    """

    def __init__(self, source: TokenSource, batch_size: int, seq_len: int, seed: int = 0, *,
                 shardings: Optional[Dict[str, Any]] = None, vocab_size: Optional[int] = None, prefetch: int = 2):
        self.source, self.batch_size, self.seq_len, self.seed = source, batch_size, seq_len, seed
        self.shardings, self.vocab_size = shardings, vocab_size
        self.num_sequences = num_sequences(source, seq_len)
        if self.num_sequences < 1:
            raise ConfigError(f"data {source.name!r} has {len(source)} tokens, fewer than one sequence of "
                              f"{seq_len + 1}; use a shorter --seq-len or more data")
        self.samples_seen = 0
        self._perm_cache: Dict[int, np.ndarray] = {}
        self._rows = self._local_rows()
        self._pool = concurrent.futures.ThreadPoolExecutor(1) if prefetch else None
        self._prefetch = prefetch
        self._pending: Dict[int, concurrent.futures.Future] = {}
        self.wait_s = 0.0  # time next() spent waiting for data (goodput accounting)

    # -- which rows this process builds --------------------------------------------------------
    def _local_rows(self) -> np.ndarray:
        if self.shardings is None:
            return np.arange(self.batch_size)
        sharding = self.shardings["inputs"]
        rows = set()
        for index in sharding.addressable_devices_indices_map((self.batch_size, self.seq_len)).values():
            rows.update(range(self.batch_size)[index[0]])
        return np.array(sorted(rows))

    def _sequence(self, sample: int) -> int:
        epoch, k = divmod(sample, self.num_sequences)
        perm = self._perm_cache.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
            self._perm_cache = {epoch: perm}
        return int(perm[k])

    def local_batch(self, first_sample: int) -> Dict[str, np.ndarray]:
        """This process's rows of the global batch that starts at sample ``first_sample`` (numpy)."""
        windows = [pack_window(self.source, self._sequence(first_sample + int(r)), self.seq_len) for r in self._rows]
        batch = {k: np.stack([w[k] for w in windows]) for k in KEYS}
        if self.vocab_size is not None:
            top = int(batch["inputs"].max())
            if top >= self.vocab_size:
                raise ConfigError(f"token id {top} in {self.source.name!r} is outside the model's vocabulary "
                                  f"({self.vocab_size}); use a model whose vocab_size covers the tokenizer")
        return batch

    def _globalize(self, local: Dict[str, np.ndarray]):
        if self.shardings is None:
            return local
        shape = (self.batch_size, self.seq_len)
        return {k: jax.make_array_from_process_local_data(self.shardings[k], v, shape) for k, v in local.items()}

    def _submit(self, first: int):
        if self._pool is not None and first not in self._pending:
            self._pending[first] = self._pool.submit(self.local_batch, first)

    def __iter__(self):
        return self

    def __next__(self):
        first = self.samples_seen
        t0 = time.perf_counter()
        if self._pool is None:
            local = self.local_batch(first)
        else:
            self._submit(first)
            local = self._pending.pop(first).result()
            for ahead in range(1, self._prefetch + 1):
                self._submit(first + ahead * self.batch_size)
        self.wait_s += time.perf_counter() - t0
        self.samples_seen = first + self.batch_size
        return self._globalize(local)

    # -- resumable position --------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        return {"samples_seen": self.samples_seen, "seed": self.seed, "seq_len": self.seq_len,
                "source": self.source.fingerprint}

    def restore(self, state: Dict[str, Any]) -> None:
        """Continue from a :meth:`state` (batch size and process count may differ from the saver's)."""
        mine = {"seed": self.seed, "seq_len": self.seq_len, "source": self.source.fingerprint}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ConfigError(f"cannot resume the data position: the checkpoint has {key}={state.get(key)!r}, "
                                  f"this run has {value!r}; resume with the same --seed, --seq-len and --data")
        self._pending.clear()
        self.samples_seen = int(state["samples_seen"])

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
