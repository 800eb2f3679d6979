"""`Checkpointer`: async sharded saves through Orbax, integrity manifests, retention, resharding restore.

Typical use in a training loop (the :class:`~meshtrain.train.Trainer` does exactly this)::

    ckpt = Checkpointer(run_dir / "checkpoints", save_every=100, keep_last=3, keep_every=1000)
    if ckpt.require_resumable() is not None:       # raises NoValidCheckpoint if no step folder is valid
        r = ckpt.restore(plan)                     # reshards onto this plan's mesh
        state, data_state = r.state, r.data_state
    for step in range(start, steps + 1):
        state, metrics = train_step(state, batch)
        res = ckpt.maybe_save(step, state, data_state=it.state(), metadata=meta)
        stalled += res.blocking_s                  # seconds the loop was blocked by checkpointing
    ckpt.close()                                   # waits for the last async save; raises its error

Errors are :class:`CheckpointError` (a ``MeshtrainError``): the CLI prints them without a traceback.

Nothing is lost: a step folder is deleted only by retention, and only once it passed the quick check
and a newer valid step exists; a damaged step whose number is saved again is renamed
``<step>.corrupt`` (never deleted); damaged steps are otherwise left in place and reported.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding

from meshtrain.checkpoint import integrity
from meshtrain.checkpoint.housekeeping import Janitor, WriterLock
from meshtrain.checkpoint.inspection import META_FILE, META_FORMAT, read_meta
from meshtrain.checkpoint.layout import (describe_tree, from_nested, key_name, mismatch_error, mismatches, state_bytes,
                                        to_nested)
from meshtrain.checkpoint.types import (CheckpointDiskError, CheckpointError, CheckpointWarning, Compression,
                                        NoValidCheckpoint, Restored, SaveResult, StepCheck, StepStatus, Verify)
from meshtrain.errors import disk_hint, is_disk_full, is_file_size_limit
from meshtrain.plan import fmt_bytes as plan_fmt_bytes
from meshtrain.precision import MasterWeightsState, has_master_weights
from meshtrain.state import TrainState, abstract_train_state

log = logging.getLogger("meshtrain.checkpoint")

#: The one Orbax item; the JSON (metadata, data position, tree) is written by process 0 with the manifest.
ITEMS = ("state",)
#: Bytes required beyond the state's size before a save starts (JSON items, OCDBT indices, manifest).
FREE_MARGIN = 256 << 10


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (a module function so that tests can replace it)."""
    return shutil.disk_usage(path).free


def fmt_bytes(n: float) -> str:
    return plan_fmt_bytes(n, ".1f")  # checkpoint messages keep one decimal


def _json_problem(obj, where: str) -> Optional[str]:
    """The path of the first value that JSON cannot encode, or None."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{where} has a non-string key {k!r}"
            p = _json_problem(v, f"{where}[{k!r}]")
            if p:
                return p
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            p = _json_problem(v, f"{where}[{i}]")
            if p:
                return p
        return None
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return None
    return (f"{where} is a {type(obj).__name__} ({obj!r:.60}), which JSON cannot store; "
            f"convert it (int(), float(), str())")


def _detach_from_donation(tree):
    """On the CPU backend: the same tree, with each leaf's replica-0 shards replaced by fresh copies.

    Orbax's blocking "device-to-host transfer" is ``np.asarray(shard)``, which on CPU is a zero-copy
    view of the device buffer, kept until the background write finishes. A buffer with such an
    external reference cannot be donated: the train step right after every async save silently
    allocated a second copy of the whole state instead of updating it in place (measured: 0 of 38
    buffers donated on that step, 38 of 38 on every other step). Orbax writes the replica-0 shards
    of each array (its replica-parallel mode slices shards with a jax op, a copy already), so those
    are copied here (whole arrays where nothing is replicated), in one batched ``device_put``, before
    ``save()`` returns (the copy is counted in ``SaveResult.blocking_s``; with ``background_start``
    it is only enqueued: XLA runs it before any later computation that donates the originals, and
    Orbax waits for it in the worker); Orbax's views then pin the copies, never the caller's
    buffers. Other replicas are referenced as they are (a reference does not prevent donation; with
    ``background_start`` Orbax does not read them: see :func:`_replica_zero_registry`). Orbax's own
    ``enable_pinned_host_transfer`` does the same per slice but costs ~3x more dispatch time. On GPU
    and TPU the transfer is a real copy: the tree is returned unchanged.
    ``tests/test_checkpoint_safety.py`` checks that the step after each async save donates every
    buffer (``tests/test_checkpoint_speed.py`` with ``background_start``)."""
    if jax.default_backend() != "cpu":
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    sources, targets, slots = [], [], []   # slot: (leaf, None) for a whole array, (leaf, shard list, i)
    for j, x in enumerate(leaves):
        if not isinstance(x, jax.Array):
            continue
        shards = x.addressable_shards
        if x.is_fully_addressable and all(sh.replica_id == 0 for sh in shards):   # no replicas: one copy
            sources.append(x)
            targets.append(x.sharding)
            slots.append((j, None, 0))
            continue
        arrays = [sh.data for sh in shards]
        for i, sh in enumerate(shards):
            if sh.replica_id == 0:
                sources.append(arrays[i])
                # in the array's own memory kind (pinned_host for an offloaded optimizer state)
                targets.append(SingleDeviceSharding(sh.device, memory_kind=x.sharding.memory_kind))
                slots.append((j, arrays, i))
    if not sources:
        return tree
    rebuilt = {}
    for (j, arrays, i), copy in zip(slots, jax.device_put(sources, targets, may_alias=False)):
        if arrays is None:
            leaves[j] = copy
        else:
            arrays[i] = copy
            rebuilt[j] = arrays
    for j, arrays in rebuilt.items():
        leaves[j] = jax.make_array_from_single_device_arrays(leaves[j].shape, leaves[j].sharding, arrays)
    return jax.tree.unflatten(treedef, leaves)


def _replica_zero_registry():
    """Orbax's default type handlers, except that jax.Arrays are written from their replica-0 shards
    only (no replica-parallel slicing).

    With ``background_start`` Orbax reads the arrays in a worker thread after :meth:`maybe_save`
    returned, when the caller may already have donated its buffers: it must read nothing but the
    copies :func:`_detach_from_donation` enqueued, which are the replica-0 shards. Its default
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


def _join_orbax_threads(timeout_s: float) -> None:
    """Wait (bounded) for Orbax's background writer threads other than this one to end."""
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t is threading.current_thread() or not type(t).__module__.startswith("orbax."):
            continue
        t.join(max(0.0, deadline - time.monotonic()))


def _disk_reason(exc: BaseException) -> str:
    return "a file reached the file-size limit (ulimit -f)" if is_file_size_limit(exc) else "the disk is full"


class _DropWaitNotice(logging.Filter):
    """Orbax logs "Waiting for previous save to complete took N seconds" and counts our own explicit
    waits (every synchronous save); meshtrain reports the real stall in ``SaveResult.blocking_s``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Waiting for previous save to complete" not in str(record.msg)


class _DropDiskFullTracebacks(logging.Filter):
    """Orbax logs each failed writer thread with a traceback (several per save) before the error
    reaches :meth:`Checkpointer.wait`; a full disk or file-size limit is then reported once, in one
    line naming the step (:class:`CheckpointDiskError`). Other failures keep Orbax's tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.levelno >= logging.ERROR and (exc is not None and is_disk_full(exc)
                                                         or is_disk_full(Exception(record.getMessage()))))


logging.getLogger("absl").addFilter(_DropWaitNotice())
logging.getLogger("absl").addFilter(_DropDiskFullTracebacks())


def _ignore_closed_loop_callbacks(previous):
    """After one array write of a save fails, Orbax closes that save's asyncio loop while TensorStore
    still completes the other writes; each completion's callback into the closed loop is reported
    as an unraisable ``RuntimeError('Event loop is closed')`` (measured: ~50-230 tracebacks after
    one full-disk save). The save's error itself is raised by :meth:`Checkpointer.wait`; these say
    nothing more, so they are dropped and every other unraisable goes to the previous hook."""
    def hook(unraisable):
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)
    hook.meshtrain_closed_loop_filter = True
    return hook


if not getattr(sys.unraisablehook, "meshtrain_closed_loop_filter", False):
    sys.unraisablehook = _ignore_closed_loop_callbacks(sys.unraisablehook)


def _warn(message: str) -> None:
    log.warning(message)
    warnings.warn(CheckpointWarning(message), stacklevel=3)


class Checkpointer:
    """Sharded, asynchronous, verified checkpoints of a :class:`~meshtrain.TrainState` in one folder.

    Args:
      directory: the run's ``checkpoints/`` folder (created if missing).
      save_every: :meth:`maybe_save` writes when ``step % save_every == 0`` (or ``force=True``).
      keep_last: keep the newest ``keep_last`` good steps...
      keep_every: ...plus every step that is a multiple of ``keep_every`` (``None``: none extra).
      async_save: write in a background thread (default); the loop blocks only to copy arrays to host.
        ``False`` blocks until the step is committed and verified (and takes no extra host copy: the
        caller's buffers are free again when it returns).
      compression: :class:`Compression` of the array chunks (default ``none``: see
        :class:`Compression` for why; ``zstd`` is Orbax's default and restores the same way).
      background_start: with ``async_save`` on the CPU backend, run Orbax's own blocking part too
        (host transfer, folders, metadata: 40-400 ms per save on a busy 2-core host) in a worker
        thread. :meth:`maybe_save` then only enqueues a copy of the saved buffers, which XLA runs
        before any later computation that donates them, and returns (~10 ms). An error of that part
        surfaces at the next call, like a write error, and a Ctrl-C cannot land inside Orbax. The
        :class:`~meshtrain.train.Trainer` turns it on. Ignored on GPU/TPU, where Orbax's
        device-to-host copy must finish before the next donating step, and with several processes
        (Orbax's save synchronizes them; not tested from a worker thread).

    Next: :meth:`require_resumable` (or :meth:`inventory`) and :meth:`restore` on start,
    :meth:`maybe_save` each step, :meth:`close` at the end.
    """

    def __init__(self, directory, *, save_every: int, keep_last: int = 3, keep_every: Optional[int] = None,
                 async_save: bool = True, compression: Compression = Compression.NONE,
                 background_start: bool = False):
        for name, value, low in (("save_every", save_every, 1), ("keep_last", keep_last, 1)):
            if not isinstance(value, int) or value < low:
                raise CheckpointError(f"{name}={value!r}: give an integer >= {low}")
        if keep_every is not None and (not isinstance(keep_every, int) or keep_every < 1):
            raise CheckpointError(f"keep_every={keep_every!r}: give an integer >= 1 or None")
        self.directory = Path(directory).expanduser().absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} is a file; pass a folder")
        self.save_every, self.keep_last, self.keep_every = save_every, keep_last, keep_every
        self.async_save = bool(async_save)
        self.background_start = bool(background_start)
        try:
            self.compression = Compression(compression)
        except ValueError:
            raise CheckpointError(f"compression={compression!r}: use one of "
                                  f"{[c.value for c in Compression]}") from None
        self._primary = jax.process_index() == 0
        self._inflight: Optional[int] = None
        self._inflight_meta: Optional[Dict[str, Any]] = None
        self._session_steps: set = set()
        self._verified: Dict[int, Tuple[tuple, StepCheck]] = {}
        self._skip_warned: set = set()   # (step, status, reason) already reported by this Checkpointer
        self._kept_warned: set = set()   # (step, status, reason) that retention reported and left in place
        self._janitor: Optional[Janitor] = None
        self._closed = False
        self._starter: Optional[ThreadPoolExecutor] = None   # runs Orbax's save() (background_start)
        self._started: Optional[Future] = None                # that call for the step in flight
        self._finalized: Optional[Future] = None              # Orbax's wait for it, on the same worker
        # How a save is carried out, not what it writes (tools/bench_checkpoint.py --compare sets the
        # earlier behaviour on one instance to measure both in one run): hash the new files from the
        # page cache (integrity.sha256_range), and copy the arrays before a *synchronous* save too.
        self._mapped_hashing = True
        self._copy_before_sync_save = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {self.directory}: {exc}") from exc
        # process 0 writes manifests, cleans and deletes; it must be the folder's only writer
        self._lock = WriterLock(self.directory) if self._primary else None
        self._owner = self._lock is None or self._lock.acquired
        if self._lock is not None and not self._owner:
            _warn(f"{self.directory} is being written by {self._lock.holder()}; this Checkpointer can restore "
                  f"but not save, clean or delete there")
        if self._primary and self._owner:
            self._clean_tmp("left by an earlier run that did not finish it")
            for p in integrity.trash_dirs(self.directory):   # retention deletes interrupted by a crash
                integrity.remove_tree(p)
            self._janitor = Janitor()
        self._manager = self._new_manager()

    # -- setup --------------------------------------------------------------------------------------

    def _new_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, save_interval_steps=1, create=True, cleanup_tmp_directories=False,
            enable_async_checkpointing=True,  # a synchronous save is an async save plus wait()
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest))
        extra = {}
        if self._starts_in_background():
            extra["type_handler_registry"] = _replica_zero_registry()
        handler = ocp.PyTreeCheckpointHandler(use_compression=self.compression is Compression.ZSTD, **extra)
        return ocp.CheckpointManager(self.directory, item_names=ITEMS, item_handlers={"state": handler},
                                     options=options)

    def _clean_tmp(self, why: str, step: Optional[int] = None) -> List[Path]:
        """Remove temporary step folders (all, or those of ``step``) on process 0."""
        removed = []
        if not (self._primary and self._owner):
            return removed
        for p in integrity.tmp_dirs(self.directory):
            if step is not None and integrity.tmp_step(p) != step:
                continue
            size = integrity.folder_bytes(p)
            integrity.remove_tree(p)
            removed.append(p)
            _warn(f"removed temporary checkpoint folder {p} ({fmt_bytes(size)}) {why}")
        return removed

    def _write_manifest(self) -> None:
        """Orbax's post-finalization hook: runs on process 0 in the save thread, after every process
        wrote its shards and before the rename that commits the step."""
        step = self._inflight
        if step is None:
            raise CheckpointError("internal: a save finished but no step is in flight")
        candidates = [p for p in integrity.tmp_dirs(self.directory) if integrity.tmp_step(p) == step]
        final = self.directory / str(step)
        target = candidates[0] if len(candidates) == 1 else (final if not candidates and final.is_dir() else None)
        if target is None:
            raise CheckpointError(f"cannot find the folder being written for step {step} in {self.directory} "
                                  f"(found {[p.name for p in candidates]})")
        integrity.write_json_atomic(target / META_FILE, self._inflight_meta, sort_keys=False)  # tree order
        if self._mapped_hashing:
            integrity.write_manifest(target, step)              # hashed from the page cache
        else:                                                   # 8 MiB reads (bench_checkpoint --compare)
            integrity.write_manifest(target, step, mapped=False)

    # -- saving -------------------------------------------------------------------------------------

    def maybe_save(self, step: int, state, *, data_state: Dict[str, Any], metadata: Dict[str, Any],
                   force: bool = False) -> SaveResult:
        """Save ``state`` at ``step`` when ``step % save_every == 0`` or ``force``; call it every step.

        It also reports (as :class:`CheckpointError`) a background save that failed since the last
        call, e.g. a full disk: the failed temporary folder is removed and older steps stay intact;
        the next due step tries again. ``data_state`` (iterator position) and ``metadata`` (recipe,
        plan summary, seed, model) must be JSON-able dicts. Example::

            res = ckpt.maybe_save(step, state, data_state={"epoch": 0, "index": 4096},
                                  metadata={"recipe": plan.recipe.to_dict(), "seed": 0, "model": "tiny"})
        """
        t0 = time.perf_counter()
        self._ensure_open()
        step = int(step)
        self._collect()
        if not (force or step % self.save_every == 0):
            return SaveResult(False, time.perf_counter() - t0, step)
        if step == self._inflight or step in self._session_steps:
            return SaveResult(False, time.perf_counter() - t0, step, note=f"step {step} was already saved by this run")
        if not self._owner:
            raise CheckpointError(f"cannot save step {step}: {self.directory} is being written by "
                                  f"{self._lock.holder()}; use another run folder, or stop that process")
        for name, value in (("data_state", data_state), ("metadata", metadata)):
            if not isinstance(value, dict):
                raise CheckpointError(f"{name} must be a dict of JSON values, got {type(value).__name__}")
            problem = _json_problem(value, name)
            if problem:
                raise CheckpointError(f"cannot save step {step}: {problem}")
        self._wait_inflight()
        self._prepare_step_folder(step)
        self._check_space(step, state)
        # one Orbax item only (each item costs directories and threads in the blocking part); the JSON
        # goes into the step folder from the save thread, just before the manifest and the commit
        self._inflight_meta = {
            "format": META_FORMAT, "step": step, "user": metadata, "data_state": data_state,
            "tree": describe_tree(state), "saved_unix": time.time(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "compression": self.compression.value,
            "versions": {"jax": jax.__version__, "orbax": getattr(ocp, "__version__", "?")}}
        self._inflight = step
        try:
            # Orbax's blocking part copies the arrays to host; it must not pin the caller's buffers,
            # or the next (donating) train step silently keeps a second copy of the state. A
            # synchronous save releases them before it returns: no copy (saves time and one state
            # of host memory on CPU; tests/test_checkpoint_speed.py checks the donation).
            if self.async_save or self._copy_before_sync_save:
                state = _detach_from_donation(state)
            args = ocp.args.Composite(state=ocp.args.PyTreeSave(to_nested(state)))
            del state   # the worker must not keep the caller's buffers (they are donated next)
            if self._starts_in_background():
                # the copies are enqueued (XLA orders them before any later step that donates the
                # originals); Orbax waits for them in the worker, then writes as usual. The future
                # exists before the hand-off, so a Ctrl-C at any point of it finds the step either
                # claimed by the worker (in flight) or cancellable (never started): see below.
                if self._starter is None:
                    self._starter = ThreadPoolExecutor(1, thread_name_prefix="meshtrain-ckpt-start")
                self._started = Future()
                self._starter.submit(self._hand_off, self._started, step, args)
            else:
                self._manager.save(step, args=args, force=True)
        except BaseException as exc:
            if self._started is not None and not self._started.cancel():
                # the worker is already saving this step: it is in flight, close() waits for it
                if isinstance(exc, Exception):
                    self._wait_inflight()
                raise
            # The step never started committing (a Ctrl-C inside Orbax's blocking part or during the
            # hand-off): forget it and remove its partial folder, so close() does not report an
            # interrupted save as a failure and no worker writes a step nobody waits for.
            self._started = None
            self._inflight = None
            self._after_failure(step)
            if isinstance(exc, Exception):   # every failure becomes a CheckpointError naming the step
                raise self._save_error(step, exc) from exc
            raise
        if not self.async_save:
            self._wait_inflight()
        return SaveResult(True, time.perf_counter() - t0, step)

    def _hand_off(self, started: Future, step: int, args) -> None:
        """The worker's side of the hand-off: claim ``started`` (skip the step when ``maybe_save``
        cancelled it first, on a Ctrl-C), run :meth:`_start_save`, and always complete ``started``
        (a wait on it must never hang); its error is raised by ``_wait_inflight``."""
        if not started.set_running_or_notify_cancel():
            return
        try:
            self._start_save(step, args)
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
            started.set_exception(exc)
        except BaseException as exc:   # e.g. SystemExit inside Orbax: a failed save like any other
            started.set_exception(RuntimeError(f"the save was interrupted: {exc!r}"))
        else:
            started.set_result(None)

    def _start_save(self, step: int, args) -> None:
        """Orbax's save() on the worker thread (background_start)."""
        self._manager.save(step, args=args, force=True)

    def _starts_in_background(self) -> bool:
        return (self.async_save and self.background_start and jax.default_backend() == "cpu"
                and jax.process_count() == 1)

    def _saving(self) -> bool:
        """True while the step in flight is still being started (background_start) or written."""
        started = self._started
        return (started is not None and not started.done()) or self._manager.is_saving_in_progress()

    def _prepare_step_folder(self, step: int) -> None:
        self._clean_tmp(f"before saving step {step} again", step=step)
        existing = integrity.step_dirs(self.directory).get(step)
        if existing is None:
            if step in self._manager.all_steps():   # deleted by retention or by hand since Orbax listed it
                self._manager.reload()
            return
        check = self.check(step)
        if check.status is StepStatus.OK:
            raise CheckpointError(
                f"step {step} already exists in {self.directory} (a good checkpoint from an earlier run); "
                f"meshtrain does not overwrite it. If you rewound training on purpose, move or delete "
                f"{existing} and the steps after it; otherwise resume from the latest step")
        # never delete: the damaged folder may be all that is left of the step (and the reason why)
        if self._primary:
            try:
                moved = integrity.move_aside(existing)
            except OSError as exc:
                raise CheckpointError(f"cannot save step {step}: {existing} is {check.status.value} "
                                      f"({check.reason}) and could not be moved aside: {exc}; move it away by "
                                      f"hand") from exc
            _warn(f"checkpoint step {step} in {self.directory} is {check.status.value} ({check.reason}); "
                  f"moved {existing} aside to {moved} (kept, not deleted) to save step {step} again")
        else:
            _warn(f"checkpoint step {step} in {self.directory} is {check.status.value} ({check.reason}); "
                  f"process 0 moves it aside (to {existing.name}{integrity.ASIDE_MARKER}) to save it again")
        self._verified.pop(step, None)
        self._manager.reload()

    def _check_space(self, step: int, state) -> None:
        need = state_bytes(state) + FREE_MARGIN
        free = _free_bytes(self.directory)
        if free < need:
            raise CheckpointDiskError(
                f"not enough disk space to save step {step}: the state needs ~{fmt_bytes(need)} but "
                f"{self.directory} has {fmt_bytes(free)} free. Free space, lower keep_last (now {self.keep_last})"
                f"{'' if self.keep_every is None else f' or keep_every (now {self.keep_every})'}, or move the run "
                f"folder; steps {self.all_steps()} are intact")

    def _collect(self) -> None:
        """Non-blocking: if the save in flight has finished, surface its error or apply retention."""
        if self._inflight is not None and not self._saving():
            self._wait_inflight()

    def _wait_inflight(self) -> None:
        step = self._inflight
        if step is None:
            return
        try:
            # A Ctrl-C in either wait leaves the step in flight (the next call waits again): it lands in
            # a future's result(), never inside Orbax (whose wait logs a KeyboardInterrupt traceback
            # and forgets the step while its threads still write it).
            if self._started is not None:
                self._started.result()     # Orbax's blocking part, run by the worker (background_start)
            self._wait_finalized()
        except Exception as exc:  # noqa: BLE001
            self._started = self._finalized = None
            self._inflight = None
            self._after_failure(step)
            raise self._save_error(step, exc) from exc
        self._started = self._finalized = None
        self._inflight = None
        check = self.check(step, Verify.QUICK)
        if check.status is not StepStatus.OK:
            self._after_failure(step)
            raise CheckpointError(f"saving step {step} to {self.directory} did not commit: {check.status.value} "
                                  f"({check.reason}); steps {self._good_steps()} are intact")
        self._session_steps.add(step)
        self._apply_retention()

    def _wait_finalized(self) -> None:
        """Orbax's wait for the write and commit; with background_start it runs on the worker thread."""
        if self._starter is None:
            self._manager.wait_until_finished()
            return
        if self._finalized is None:
            self._finalized = self._starter.submit(self._manager.wait_until_finished)
        self._finalized.result()

    def _after_failure(self, step: int) -> None:
        # Orbax raises as soon as one of its writer threads fails; the others (and tensorstore's
        # own writers) can still create files in the temporary folder for a moment. Join Orbax's
        # threads, then clean until the folder stays gone, so the disk space really comes back.
        _join_orbax_threads(timeout_s=30.0)
        self._clean_tmp(f"after the failed save of step {step}", step=step)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if any(integrity.tmp_step(p) == step for p in integrity.tmp_dirs(self.directory)):
                self._clean_tmp(f"after the failed save of step {step} (a late write recreated it)", step=step)
        self._manager.reload()

    def _save_error(self, step: int, exc: BaseException) -> CheckpointError:
        good = self._good_steps()
        tail = (f"the temporary folder was removed; steps {good} are intact and the next due step tries again"
                if good else "the temporary folder was removed; no earlier checkpoint exists")
        if is_disk_full(exc):
            free = fmt_bytes(_free_bytes(self.directory))
            return CheckpointDiskError(
                f"saving step {step} to {self.directory} failed: {_disk_reason(exc)} ({free} free after cleaning). "
                f"{disk_hint(exc).capitalize()}, lower keep_last (now {self.keep_last}) or move the run folder; "
                f"{tail}")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CheckpointError(f"saving step {step} to {self.directory} failed: {type(exc).__name__}: {first}; {tail}")

    def _good_steps(self) -> List[int]:
        return [s for s in integrity.step_dirs(self.directory) if self.check(s, Verify.QUICK).status.usable]

    def _known_check(self, step: int, step_dir: Path) -> StepCheck:
        """The best verdict available without re-reading the files: a full check cached for the
        current files (e.g. the step just restored), else the quick check."""
        cached = self._verified.get(step)
        if cached is not None and step_dir.is_dir() and cached[0] == integrity.stat_key(step_dir):
            return cached[1]
        return self.check(step, Verify.QUICK)

    def _apply_retention(self) -> None:
        """Keep the newest ``keep_last`` good steps and every multiple of ``keep_every``; delete the
        older good steps. What is never deleted:

        * a step that does not pass its check (quick, or the full verdict when one is cached): it is
          reported once with a :class:`CheckpointWarning` and left in place (a damaged manifest or
          Orbax metadata included), for a person to inspect;
        * the newest step known to be valid: a step this Checkpointer saved (its checksums were
          computed from the committed files) or one whose full check passed; when none is known,
          retention deletes nothing;
        * every step newer than the newest step saved by this Checkpointer (left by an earlier run
          that went further; :meth:`maybe_save` moves a damaged one aside when it saves that step).
        """
        if self._janitor is None or not self._session_steps:   # not the folder's writer, or nothing saved
            return
        horizon = max(self._session_steps)
        dirs = integrity.step_dirs(self.directory)
        good: List[int] = []
        for s, path in dirs.items():
            if s > horizon:
                continue
            check = self._known_check(s, path)
            if check.status.usable:
                good.append(s)
                continue
            key = (s, check.status, check.reason)
            if key not in self._kept_warned:
                self._kept_warned.add(key)
                _warn(f"retention leaves checkpoint step {s} in {self.directory} in place: it is "
                      f"{check.status.value} ({check.reason}); damaged steps are never deleted automatically: "
                      f"inspect it (meshtrain ckpt list), then move or delete {path} by hand")
        anchor = next((s for s in reversed(good) if s in self._session_steps
                       or (s in self._verified and self._verified[s][1].status.usable)), None)
        if anchor is None:
            return
        keep = set(good[-self.keep_last:]) | {anchor}
        if self.keep_every:
            keep |= {s for s in good if s % self.keep_every == 0}
        doomed = [s for s in good if s not in keep]
        if not doomed:
            return
        trash = []
        for s in doomed:   # rename now (O(1), atomic), delete the files in a background thread
            trash.append(integrity.move_to_trash(dirs[s]))
            self._verified.pop(s, None)
        log.info("retention removes checkpoint steps %s from %s", doomed, self.directory)
        self._janitor.delete(trash)

    # -- reading ------------------------------------------------------------------------------------

    def check(self, step: int, verify: Verify = Verify.FULL) -> StepCheck:
        """Integrity of one committed step (full checks are cached while the files are unchanged)."""
        step_dir = self.directory / str(int(step))
        if verify is Verify.QUICK:
            return integrity.check_step(step_dir, step, Verify.QUICK)
        key = integrity.stat_key(step_dir) if step_dir.is_dir() else None
        cached = self._verified.get(step)
        if cached is not None and cached[0] == key:
            return cached[1]
        result = integrity.check_step(step_dir, step, Verify.FULL)
        self._verified[step] = (key, result)
        return result

    def all_steps(self) -> List[int]:
        """Every committed step folder, oldest first, whatever its integrity (see :meth:`check`).
        Folders moved aside (``<step>.corrupt``) and temporary folders are not steps."""
        return list(integrity.step_dirs(self.directory))

    def inventory(self) -> List[StepCheck]:
        """The full check of every step folder, oldest first: one :class:`StepCheck` (``step``,
        ``status``, ``reason``) each. Reads every file once (results are cached while the files are
        unchanged, so a following :meth:`restore` does not read them again). Example::

            for c in ckpt.inventory():
                print(c.step, c.status.value, c.reason)     # 20 corrupt checksum mismatch: state/...
        """
        return [self.check(s) for s in self.all_steps()]

    def require_resumable(self) -> Optional[int]:
        """The step a resume should start from, refusing to silently start over.

        Returns ``None`` when the folder has no step folders at all (a new run), else the newest step
        that passes the full check (:meth:`latest_valid_step`, which warns about each newer damaged
        step it skips). Raises :class:`NoValidCheckpoint` (a :class:`CheckpointError`: the CLI exits
        2) when step folders exist but none is valid; the message lists every step and why it
        failed, and ``exc.checks`` holds the :class:`StepCheck` of each. Example::

            step = ckpt.require_resumable()      # None: fresh start; 40: restore step 40
            if step is not None:
                r = ckpt.restore(plan, step)
        """
        checks = self.inventory()
        if not checks:
            return None
        if not any(c.status.usable for c in checks):
            lines = "\n".join(f"  step {c.step}: {c.status.value}: {c.reason}" for c in checks)
            aside = integrity.aside_dirs(self.directory)
            extra = (f"\n({len(aside)} damaged folder(s) moved aside earlier: "
                     f"{', '.join(p.name for p in aside[:5])}{' ...' if len(aside) > 5 else ''})" if aside else "")
            raise NoValidCheckpoint(
                f"cannot resume: {self.directory} holds {len(checks)} checkpoint step(s) and none is valid:\n"
                f"{lines}{extra}\nNothing was deleted. Repair or move these folders away to start over, "
                f"restore an explicit copy, or point to another run folder", checks)
        return self.latest_valid_step()

    def latest_valid_step(self) -> Optional[int]:
        """The newest step that passes the full checksum check; each newer step that fails is skipped
        with a :class:`CheckpointWarning` naming the reason (once per step and reason for this
        Checkpointer: ``restore()`` after ``latest_valid_step()`` does not repeat it). ``None`` when
        there is none."""
        for step in reversed(self.all_steps()):
            check = self.check(step)
            if check.status.usable:
                return step
            key = (step, check.status, check.reason)
            if key not in self._skip_warned:
                self._skip_warned.add(key)
                _warn(f"skipping checkpoint step {step} in {self.directory}: {check.status.value}: {check.reason}")
        return None

    def restore(self, plan, step: Optional[int] = None, *, allow_cast: bool = False) -> Restored:
        """Restore onto ``plan``'s shardings (another recipe, mesh or device count reshards on load).

        ``step=None`` takes :meth:`latest_valid_step`. Every leaf, scalars included, comes back with
        the plan's ``NamedSharding``. Raises :class:`CheckpointError` when no valid step exists, when
        the requested step fails its check, or listing every path whose tree position, shape or dtype
        differs (dtypes are cast only with ``allow_cast=True``). Example::

            r = ckpt.restore(plan)                 # Restored(step, state, data_state, metadata)
        """
        self._ensure_open()
        self.wait()
        if step is None:
            step = self.latest_valid_step()
            if step is None:
                found = ", ".join(f"{s}: {self.check(s).status.value}" for s in self.all_steps()) or "no step folders"
                raise CheckpointError(f"no valid checkpoint to restore in {self.directory} ({found}); start "
                                      f"without resuming or point to another run folder")
        else:
            step = int(step)
            check = self.check(step)
            if not check.status.usable:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} cannot be restored: "
                                      f"{check.status.value}: {check.reason or 'no such step'}; steps: "
                                      f"{self.all_steps()}; pass step=None for the latest valid one")
            newer = [s for s in self.all_steps() if s > step and self.check(s, Verify.QUICK).status.usable]
            if newer:
                _warn(f"restoring step {step} while newer good steps {newer} exist in {self.directory}; saving "
                      f"one of those steps again will fail while the good one is there")
        meta = read_meta(self.directory / str(step))
        final = abstract_train_state(plan)
        target, convert = _precision_bridge(meta["tree"], final)
        problems = mismatches(meta["tree"], target, allow_cast=allow_cast)
        if problems:
            raise mismatch_error(step, self.directory, problems, meta.get("user", {}))
        nested = to_nested(target)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=nested, restore_args=ocp.checkpoint_utils.construct_restore_args(nested)))
        try:
            out = self._manager.restore(step, args=args)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"restoring step {step} from {self.directory} failed: {type(exc).__name__}: "
                                  f"{str(exc).strip()[:500]}") from exc
        state = _onto_target(convert(_onto_target(from_nested(out["state"], target), target)), final)
        return Restored(step, state, dict(meta.get("data_state") or {}), meta.get("user", {}), meta["tree"])

    # -- lifecycle ----------------------------------------------------------------------------------

    @property
    def pending_step(self) -> Optional[int]:
        """The step whose async save was started and not yet collected, or ``None``."""
        return self._inflight

    @property
    def busy(self) -> bool:
        """True while a background save is still writing (the next due save would wait for it)."""
        return self._inflight is not None and self._saving()

    def wait(self) -> float:
        """Block until the pending async save is committed and verified; raises its error if it failed.

        Returns the seconds spent blocked (count them as checkpoint stall, like ``blocking_s``)."""
        self._ensure_open()
        t0 = time.perf_counter()
        self._wait_inflight()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the pending save (raising its error), then release Orbax's threads. Idempotent."""
        if self._closed:
            return
        try:
            self._wait_inflight()
        finally:
            self._closed = True
            if self._starter is not None:
                self._starter.shutdown(wait=True)
            if self._janitor is not None:
                self._janitor.close()
            if self._lock is not None:
                self._lock.release()
            try:
                self._manager.close()
            except Exception as exc:  # noqa: BLE001 - the save error, if any, was raised above
                log.debug("orbax close: %s", exc)

    def _ensure_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the Checkpointer for {self.directory} is closed; create a new one")

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpointer({str(self.directory)!r}, save_every={self.save_every}, keep_last={self.keep_last}, "
                f"keep_every={self.keep_every}, async_save={self.async_save}, compression={self.compression.value}"
                f"{', background_start=True' if self.background_start else ''})")


def _precision_bridge(saved_tree: Dict[str, Any], final):
    """``(what to read, how to turn it into final)`` across a change of parameter precision.

    A plan with 16-bit parameters keeps f32 master weights in ``opt_state.master`` (see
    :mod:`meshtrain.precision`). From an f32 checkpoint it reads the f32 parameters as the master
    copy (bit-exact) and the optimizer state as the inner state, and rounds the working parameters;
    from a 16-bit checkpoint into an f32 plan it takes the master copy as the parameters. Otherwise
    the checkpoint is read as the plan is."""
    saved_master = any(p.startswith("opt_state/master/") for p in saved_tree)
    want_master = has_master_weights(final.opt_state)
    if saved_master == want_master:
        return final, lambda state: state
    sds = lambda t, dtype: jax.ShapeDtypeStruct(t.shape, dtype, sharding=t.sharding)  # noqa: E731
    if want_master:  # f32 checkpoint -> 16-bit parameters + f32 master
        master = final.opt_state.master
        target = TrainState(final.step, master, final.opt_state.inner, final.model_state)

        def convert(state):
            params = jax.tree.map(lambda m, p: m.astype(p.dtype), state.params, final.params)
            return TrainState(state.step, params, MasterWeightsState(state.params, state.opt_state), state.model_state)
        return target, convert
    # 16-bit checkpoint with master weights -> f32 parameters from the master copy
    saved_params = {p[len("params/"):]: d for p, d in saved_tree.items() if p.startswith("params/")}
    working = jax.tree_util.tree_map_with_path(
        lambda kp, t: sds(t, jnp.dtype(saved_params.get("/".join(key_name(k) for k in kp), {}).get("dtype", t.dtype))),
        final.params)
    target = TrainState(final.step, working, MasterWeightsState(final.params, final.opt_state), final.model_state)
    return target, lambda state: TrainState(state.step, state.opt_state.master, state.opt_state.inner,
                                            state.model_state)


def _onto_target(state, target):
    """Put any leaf whose sharding differs from the target's onto the target's NamedSharding."""
    def fix(x, t):
        if isinstance(x.sharding, NamedSharding) and x.sharding == t.sharding:
            return x
        return jax.device_put(x, t.sharding)
    return jax.tree.map(fix, state, target)
