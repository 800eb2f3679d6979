"""The CPU donation worker: how an async save on the CPU backend leaves the caller's buffers donatable.

On CPU, Orbax's "device-to-host transfer" is a zero-copy view of the device buffers, which would pin
them until the background write ends (the next donating train step would then silently keep a
second copy of the state: measured, 0 of 38 buffers donated on that step, 38 of 38 on every other).
So a save hands Orbax host copies of the replica-0 shards instead
(:class:`~meshtrain.checkpoint.staging.HostStaging`, refilled in place at each save), and with
``background_start`` a :class:`StartWorker` runs Orbax's own blocking part in one worker thread, so
that :meth:`~meshtrain.checkpoint.Checkpointer.maybe_save` only copies the shards and returns.
``tests/test_checkpoint_safety.py`` checks that the step after each async save donates every buffer.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import jax
import numpy as np
import orbax.checkpoint as ocp


def replica_zero_registry():
    """Orbax's default type handlers, except that jax.Arrays are written from their replica-0 shards
    only (no replica-parallel slicing).

    With ``background_start`` Orbax reads the arrays in a worker thread after :meth:`maybe_save`
    returned, when the caller may already have donated its buffers: it must read nothing but the
    copies :func:`detach_from_donation` enqueued, which are the replica-0 shards. Its default
    replica-parallel mode writes a slice of every replica's shard instead (on one host the same
    bytes, split into smaller chunks; restore reads either layout)."""
    th = ocp.type_handlers
    default = th.get_type_handler(jax.Array)
    array = th.ArrayHandler(use_replica_parallel=False,
                            array_metadata_store=getattr(default, "_array_metadata_store", None))
    scalar = th.ScalarHandler()
    return th.create_type_handler_registry(
        (int, scalar), (float, scalar), (bytes, scalar), (np.number, scalar), (np.ndarray, th.NumpyHandler()),
        (jax.Array, array), (str, th.StringHandler()))



class StartWorker:
    """One worker thread that runs Orbax's blocking ``save()`` and then its wait for the commit
    (``background_start``), so that a Ctrl-C in the training loop lands in a future's ``result()``,
    never inside Orbax (whose wait logs a KeyboardInterrupt traceback and forgets the step while its
    threads still write it).

    The hand-off's future exists before the job is queued: a Ctrl-C at any point of :meth:`start`
    finds the step either claimed by the worker (in flight: wait for it) or cancellable (never
    started): :meth:`cancel` says which."""

    def __init__(self, manager: ocp.CheckpointManager):
        self._manager = manager
        self._pool: Optional[ThreadPoolExecutor] = None
        self._started: Optional[Future] = None     # Orbax's save() for the step in flight
        self._finalized: Optional[Future] = None   # Orbax's wait for it, on the same worker

    def start(self, step: int, args) -> None:
        """Queue Orbax's save() of ``step`` and return at once (its error surfaces in :meth:`wait`)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-ckpt-start")
        self._started = Future()
        self._pool.submit(self._hand_off, self._started, step, args)

    def cancel(self) -> bool:
        """After an interrupted :meth:`start`: True when the worker will not save the step (forget
        it), False when it already claimed it (the step is in flight)."""
        if self._started is not None and not self._started.cancel():
            return False
        self._started = None
        return True

    def save(self, step: int, args) -> None:
        """Orbax's save() on the worker thread."""
        self._manager.save(step, args=args, force=True)

    def _hand_off(self, started: Future, step: int, args) -> None:
        """Claim ``started`` (skip the step when :meth:`cancel` came first), run :meth:`save`, and
        always complete ``started`` (a wait on it must never hang)."""
        if not started.set_running_or_notify_cancel():
            return
        try:
            self.save(step, args)
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            started.set_exception(exc)
        except BaseException as exc:   # e.g. SystemExit inside Orbax: a failed save like any other
            started.set_exception(RuntimeError(f"the save was interrupted: {exc!r}"))
        else:
            started.set_result(None)

    @property
    def starting(self) -> bool:
        """True while Orbax's save() of the step in flight has not returned."""
        started = self._started
        return started is not None and not started.done()

    def wait(self) -> None:
        """Block until the step in flight is started, written and committed; raises its error."""
        if self._started is not None:
            self._started.result()
        if self._pool is None:   # nothing was started on the worker
            self._manager.wait_until_finished()
            return
        if self._finalized is None:
            self._finalized = self._pool.submit(self._manager.wait_until_finished)
        self._finalized.result()

    def forget(self) -> None:
        """The step in flight was collected (committed or failed)."""
        self._started = self._finalized = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
