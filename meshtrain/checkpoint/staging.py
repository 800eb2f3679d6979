"""One host copy of the saved shards, allocated once and refilled at every save (CPU backend).

On the CPU backend a save hands Orbax copies of the state's replica-0 shards, so that the next train
step can donate the originals (:func:`~meshtrain.checkpoint.donation.detach_from_donation` says why).
Copying into fresh buffers at every save made the kernel fault in every page of the copy again:
glibc returns the freed copies to the system after each write, so a 204.5 MB state's copy took
90–165 ms on most saves of a run (page faults) and 6–12 ms on the few that found the memory still
mapped. :class:`HostStaging` keeps one set of 64-byte aligned host buffers for the run instead, wraps
each in a jax array that aliases it (zero-copy), and at each save copies the shards into them with
``numpy.copyto``: a plain memory copy (~19 ms for 204.5 MB here), the same every time. The buffers are
allocated and touched in a background thread at the first :meth:`HostStaging.prepare` (the training
loop's first ``maybe_save`` call, usually long before the first save), so the first save does not
fault them in either.

Cost: one host copy of the replica-0 shards held for the whole run (the fresh copies were held only
from a save until its write ended; the peak is the same). Only for the CPU backend: on GPU and TPU
Orbax's device-to-host transfer is a copy already.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import List, Optional, Tuple

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

#: XLA:CPU wraps host memory without copying only when it is aligned to this many bytes.
ALIGN = 64


@dataclasses.dataclass
class _Slot:
    """The host buffer of one replica-0 shard and the jax array that aliases it (``None``: XLA copied
    instead of aliasing, e.g. another memory kind; such a slot is handed to Orbax through a fresh copy)."""

    host: np.ndarray
    array: Optional[jax.Array]


def _aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose data starts on an :data:`ALIGN`-byte boundary."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _replica_zero(tree) -> Tuple[list, list, list]:
    """``(leaves, treedef, picks)``: each pick is ``(leaf index, shard index, shard, target sharding)``
    for every replica-0 shard of every jax.Array leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    picks = []
    for j, x in enumerate(leaves):
        if not isinstance(x, jax.Array) or _is_key(x):
            continue
        for i, sh in enumerate(x.addressable_shards):
            if sh.replica_id == 0:
                picks.append((j, i, sh, SingleDeviceSharding(sh.device, memory_kind=x.sharding.memory_kind)))
    return leaves, treedef, picks


def _is_key(x) -> bool:
    """A typed PRNG key array (e.g. a dropout stream's key): no numpy view; copied by jax instead (a few bytes)."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _layout(picks) -> tuple:
    return tuple((j, i, sh.data.shape, str(sh.data.dtype), target) for j, i, sh, target in picks)


class HostStaging:
    """The run's host buffers for the saved shards (CPU backend); owned by one ``Saver``.

    Call :meth:`prepare` with the state on any ``maybe_save`` call (it returns at once; the first call
    starts allocating in the background) and :meth:`stage` at a save, after the previous save's write
    has finished (its Orbax worker reads these buffers until then). Example::

        staging = HostStaging()
        staging.prepare(state)              # step 1: buffers allocated in a background thread
        copy = staging.stage(state)         # a save: same tree, replica-0 shards now the host copies
    """

    def __init__(self):
        self._layout: Optional[tuple] = None
        self._slots: List[_Slot] = []
        self._building: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def prepare(self, tree) -> None:
        """Start allocating the buffers for ``tree``'s shards in a background thread (once)."""
        if self._layout is not None or self._building is not None:
            return
        layout = _layout(_replica_zero(tree)[2])
        self._building = threading.Thread(target=self._build, args=(layout,), name="meshtrain-ckpt-staging",
                                          daemon=True)
        self._building.start()

    def _build(self, layout: tuple) -> None:
        slots = []
        for _, _, shape, dtype, target in layout:
            host = _aligned_empty(shape, dtype)
            host.fill(0)   # fault the pages in now, not at the save
            array = jax.device_put(host, target, may_alias=True)
            aliased = array.unsafe_buffer_pointer() == host.ctypes.data
            slots.append(_Slot(host, array if aliased else None))
        with self._lock:
            self._layout, self._slots = layout, slots

    def _slots_for(self, layout: tuple) -> List[_Slot]:
        if self._building is not None:
            self._building.join()
            self._building = None
        with self._lock:
            if self._layout != layout:   # first save without prepare(), or the state's layout changed
                self._layout = None
        if self._layout is None:
            self._build(layout)
        return self._slots

    def release(self) -> None:
        """Free the buffers (the Checkpointer closes: no save follows)."""
        if self._building is not None:
            self._building.join()
            self._building = None
        with self._lock:
            self._layout, self._slots = None, []

    def stage(self, tree):
        """``tree`` with each leaf's replica-0 shards replaced by their host copies (other replicas
        referenced as they are: Orbax writes replica 0 only)."""
        leaves, treedef, picks = _replica_zero(tree)
        keys = [j for j, x in enumerate(leaves) if isinstance(x, jax.Array) and _is_key(x)]
        for j in keys:
            leaves[j] = jax.device_put(leaves[j], leaves[j].sharding, may_alias=False)
        if not picks:
            return jax.tree.unflatten(treedef, leaves) if keys else tree
        slots = self._slots_for(_layout(picks))
        shards_of = {}
        for (j, i, sh, target), slot in zip(picks, slots):
            np.copyto(slot.host, np.asarray(sh.data))
            arrays = shards_of.setdefault(j, [s.data for s in leaves[j].addressable_shards])
            arrays[i] = slot.array if slot.array is not None else jax.device_put(slot.host, target)
        for j, arrays in shards_of.items():
            leaves[j] = jax.make_array_from_single_device_arrays(leaves[j].shape, leaves[j].sharding, arrays)
        return jax.tree.unflatten(treedef, leaves)
