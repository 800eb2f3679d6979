"""Shared by the numpy batch iterators (:mod:`meshtrain.data.images`, :mod:`meshtrain.data.mlm`):
which rows of a global batch this process builds, and the sample → example order.

Order: sample ``k`` of a run is example ``perm_e[k mod n]`` where ``e = k // n`` is the epoch and
``perm_e`` a permutation seeded by ``(seed, e)`` (the identity when not shuffling). Global batch
``b`` holds samples ``b * batch_size + r`` for rows ``r = 0 .. batch_size - 1``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np

from meshtrain.errors import ConfigError


def process_rows(batch_size: int, process_index: int = 0, process_count: int = 1,
                 rows: Optional[Sequence[int]] = None) -> np.ndarray:
    """The global-batch rows this process builds: ``rows`` if given (e.g. read off a batch
    sharding), else the contiguous block ``[i * B/P, (i + 1) * B/P)`` for process ``i`` of ``P``
    (what a batch dimension sharded over all devices in process order gives each process)."""
    if batch_size < 1:
        raise ConfigError(f"batch size {batch_size} must be at least 1")
    if rows is not None:
        rows = np.asarray(rows, np.int64)
        if rows.ndim != 1 or rows.size == 0 or rows.min() < 0 or rows.max() >= batch_size:
            raise ConfigError(f"rows {rows.tolist()} must be a non-empty list of indices below the batch size "
                              f"{batch_size}")
        return rows
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index {process_index} must be in [0, process_count={process_count})")
    if batch_size % process_count:
        raise ConfigError(f"global batch size {batch_size} is not divisible by {process_count} processes; "
                          f"use a multiple of {process_count}")
    per = batch_size // process_count
    return np.arange(process_index * per, (process_index + 1) * per)


class EpochOrder:
    """``example(sample)``: the example index of sample ``sample`` (see the module docstring)."""

    def __init__(self, num_examples: int, seed: int, shuffle: bool = True):
        if num_examples < 1:
            raise ConfigError("no examples to iterate over")
        self.n, self.seed, self.shuffle = num_examples, seed, shuffle
        self._cache: Dict[int, np.ndarray] = {}

    def example(self, sample: int) -> int:
        epoch, k = divmod(int(sample), self.n)
        if not self.shuffle:
            return k
        perm = self._cache.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._cache = {epoch: perm}
        return int(perm[k])


def check_state(state: Dict, mine: Dict, what: str) -> None:
    """Raise a ``ConfigError`` naming the first field where a saved position does not match."""
    for key, value in mine.items():
        if state.get(key) != value:
            raise ConfigError(f"cannot resume the {what} position: the checkpoint has {key}={state.get(key)!r}, "
                              f"this run has {value!r}; resume with the same settings")
