"""`DeviceFeed`: any iterable of numpy batches → global ``jax.Array`` batches laid out by the plan.

The iterable yields *this process's rows* of each global batch (with one process: the whole batch),
as a pytree of numpy arrays whose structure, shapes (the ``batch`` dimension divided by the
process count) and dtypes match the plan's :class:`~meshtrain.BatchLayout`. Each leaf becomes a
global array with ``jax.make_array_from_process_local_data``; a mismatch raises naming the leaf.

Resuming: when the iterable has ``state() -> dict`` and ``restore(dict)`` (meshtrain's iterators),
or ``get_state()`` / ``set_state()`` (a ``grain`` ``DatasetIterator``), its position is saved with
each checkpoint and restored on ``--resume``. Otherwise the position cannot be saved: a resumed run
starts the iterable again from its beginning (the Trainer warns once).

Example::

    feed = DeviceFeed(my_numpy_batches(), plan.batch, plan.batch_shardings)
    batch = next(feed)            # pytree of global jax.Arrays
"""

from __future__ import annotations

import time
from typing import Any, Dict, Iterable, Optional

import jax
import numpy as np

from meshtrain.errors import ConfigError


class DataExhausted(ConfigError):
    """The data source ended before the run's last step."""


def local_shape(global_shape, batch_dim: Optional[int], process_count: int):
    shape = list(global_shape)
    if batch_dim is not None and process_count > 1:
        shape[batch_dim] //= process_count
    return tuple(shape)


class DeviceFeed:
    """Global device batches from an iterable of this process's numpy batches (see module doc).

    Args:
      source: an iterable (or iterator) of numpy batch pytrees; ``first`` is a batch already taken
        from it (e.g. to build the layout), yielded before the rest.
      layout: the plan's :class:`~meshtrain.BatchLayout` (``plan.batch``).
      shardings: ``plan.batch_shardings``.
      name: how errors call the source.
      seq_order: when given, every leaf with a ``seq`` axis is taken in this order along it
        (:func:`meshtrain.parallel.context.sequence_permutation`: zig-zag context parallelism).
    """

    def __init__(self, source: Iterable, layout, shardings, *, first: Any = None, name: str = "data",
                 seq_order: Optional[np.ndarray] = None):
        self.name = name
        self.seq_order = seq_order
        self._iter = iter(source)
        self._source = source
        self.layout, self.shardings = layout, shardings
        self._first = first
        self._count = 0
        self.wait_s = 0.0

    # -- position -------------------------------------------------------------------------------
    @property
    def resumable(self) -> bool:
        it = self._iter
        return (hasattr(it, "state") and hasattr(it, "restore")) or (hasattr(it, "get_state") and
                                                                     hasattr(it, "set_state"))

    def state(self) -> Dict[str, Any]:
        """The source's position after the batches handed out so far (``{}``: not resumable)."""
        it = self._iter
        if hasattr(it, "state") and hasattr(it, "restore"):
            return {"kind": "meshtrain", "state": it.state(), "batches": self._count}
        if hasattr(it, "get_state") and hasattr(it, "set_state"):
            return {"kind": "grain", "state": it.get_state(), "batches": self._count}
        return {"kind": "none", "batches": self._count}

    def restore(self, state: Dict[str, Any]) -> bool:
        """Continue from :meth:`state`; False when the source cannot resume (it starts over)."""
        self._first = None
        kind = state.get("kind")
        it = self._iter
        if kind == "meshtrain" and hasattr(it, "restore"):
            it.restore(state["state"])
        elif kind == "grain" and hasattr(it, "set_state"):
            it.set_state(state["state"])
        else:
            return False
        self._count = int(state.get("batches", 0))
        return True

    # -- batches --------------------------------------------------------------------------------
    def _read(self):
        if self._first is not None:
            batch, self._first = self._first, None
            return batch
        try:
            return next(self._iter)
        except StopIteration:
            raise DataExhausted(f"{self.name} ended after {self._count} batches; give an iterable that repeats "
                                f"(e.g. itertools.cycle, or an infinite generator), or lower --steps") from None

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        local = self._read()
        self.wait_s += time.perf_counter() - t0
        self._count += 1
        return self.globalize(local)

    def globalize(self, local):
        """One local numpy batch → global arrays (raises naming the leaf on a mismatch)."""
        try:
            same = jax.tree.structure(local) == self.layout.treedef
        except Exception:  # noqa: BLE001
            same = False
        if not same:
            raise ConfigError(f"{self.name}: a batch has structure {jax.tree.structure(local)} where the plan "
                              f"expects {self.layout.treedef}; yield the same keys every time")
        if self.seq_order is not None:
            local = self.layout.permute_seq(local, self.seq_order)
        return jax.tree.map(self._leaf, self.shardings, local, self.layout.map(lambda _, leaf: leaf))

    def _leaf(self, sharding, value, leaf):
        arr = np.asarray(value)
        want = local_shape(leaf.shape, leaf.batch_dim, jax.process_count())
        if arr.shape != want or arr.dtype != leaf.dtype:
            if arr.shape == want and np.can_cast(arr.dtype, leaf.dtype, "same_kind"):
                arr = arr.astype(leaf.dtype)
            else:
                raise ConfigError(f"{self.name}: a batch leaf has shape {arr.shape} {arr.dtype} where the plan expects "
                                  f"{want} {leaf.dtype} (global {leaf.shape}, logical axes {leaf.axes}); every batch "
                                  f"must have the first batch's structure, shapes and dtypes (drop the last partial "
                                  f"batch)")
        return jax.make_array_from_process_local_data(sharding, arr, leaf.shape)

    def close(self):
        """Nothing to release: the source belongs to the caller (a generator handed in as
        ``eval_data`` is read again at the next evaluation, so it is not closed here)."""
