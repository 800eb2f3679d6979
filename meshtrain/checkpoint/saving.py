"""The save path of :class:`~meshtrain.checkpoint.Checkpointer`: one step at a time into Orbax, its
temporary folder cleaned on failure, its manifest written before the commit.

:class:`Saver` owns the Orbax ``CheckpointManager`` and the step in flight; the CPU donation worker
(``background_start``) is :class:`~meshtrain.checkpoint.donation.StartWorker`. How a save is carried
out, not what it writes, is a :class:`SaveTuning`; only ``tools/bench_checkpoint.py`` changes it
(:func:`tuned`), to measure the earlier behaviour in the same run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import jax
import orbax.checkpoint as ocp

from meshtrain.checkpoint import integrity
from meshtrain.checkpoint.donation import StartWorker, replica_zero_registry
from meshtrain.checkpoint.staging import HostStaging
from meshtrain.checkpoint.faults import DiskFullInjector
from meshtrain.checkpoint.housekeeping import WriterLock, warn
from meshtrain.checkpoint.inspection import META_FILE, META_FORMAT
from meshtrain.checkpoint.layout import describe_tree, state_bytes, to_nested
from meshtrain.checkpoint.retention import RetentionPolicy
from meshtrain.checkpoint.types import (Checksum, CheckpointDiskError, CheckpointError, Compression, SaveResult,
                                       StepStatus, Verify)
from meshtrain.errors import disk_hint, is_disk_full, is_file_size_limit
from meshtrain.plan import fmt_bytes as plan_fmt_bytes

log = logging.getLogger("meshtrain.checkpoint")

#: The one Orbax item; the JSON (metadata, data position, tree) is written by process 0 with the manifest.
ITEMS = ("state",)
#: Bytes required beyond the state's size before a save starts (JSON items, OCDBT indices, manifest).
FREE_MARGIN = 256 << 10


@dataclasses.dataclass(frozen=True)
class SaveTuning:
    """How a save is carried out (benchmark-only: ``tools/bench_checkpoint.py --compare``).

    ``mapped_hashing``: hash the new files from the page cache (``integrity.digest_range``) instead
    of 8 MiB reads. ``copy_before_sync_save``: copy the arrays before a *synchronous* save too.
    ``checksum``: the manifest's block checksum."""

    mapped_hashing: bool = True
    copy_before_sync_save: bool = False
    #: the manifest's block checksum (``sha256``: what saves wrote before XXH3-128)
    checksum: Checksum = Checksum.XXH3_128


_TUNING: contextvars.ContextVar = contextvars.ContextVar("meshtrain_save_tuning", default=SaveTuning())


@contextlib.contextmanager
def tuned(tuning: SaveTuning) -> Iterator[None]:
    """Checkpointers created inside the block save with ``tuning`` (for the checkpoint benchmark)."""
    token = _TUNING.set(tuning)
    try:
        yield
    finally:
        _TUNING.reset(token)


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (a module function so that tests can replace it)."""
    return shutil.disk_usage(path).free


def fmt_bytes(n: float) -> str:
    return plan_fmt_bytes(n, ".1f")  # checkpoint messages keep one decimal


def json_problem(obj, where: str) -> Optional[str]:
    """The path of the first value that JSON cannot encode, or None."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                return f"{where} has a non-string key {k!r}"
            p = json_problem(v, f"{where}[{k!r}]")
            if p:
                return p
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            p = json_problem(v, f"{where}[{i}]")
            if p:
                return p
        return None
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return None
    return (f"{where} is a {type(obj).__name__} ({obj!r:.60}), which JSON cannot store; "
            f"convert it (int(), float(), str())")


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
# Orbax's per-fragment write tasks that failed after the save was abandoned are reported by asyncio at
# exit ("Task exception was never retrieved", one traceback per fragment: ~150 seen under `ulimit -f`).
logging.getLogger("asyncio").addFilter(_DropDiskFullTracebacks())


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



class Saver:
    """The save path of one checkpoint folder: :meth:`maybe_save`, the step in flight, its commit.

    ``on_commit`` runs after each step this Saver saved is committed and passed the quick check (the
    Checkpointer applies retention there). ``checks`` is the folder's shared :class:`CheckCache`."""

    def __init__(self, directory: Path, checks: integrity.CheckCache, policy: RetentionPolicy, *, save_every: int,
                 async_save: bool, background_start: bool, compression: Compression, lock: Optional[WriterLock],
                 on_commit: Callable[[], None], faults: Optional[DiskFullInjector] = None):
        self.faults = faults if faults is not None else DiskFullInjector()   # tests' injected full disk
        self.directory, self._checks, self._policy, self._every = directory, checks, policy, save_every
        self.async_save, self.background_start, self.compression = async_save, background_start, compression
        self.tuning: SaveTuning = _TUNING.get()
        self._primary = jax.process_index() == 0
        self._lock = lock
        self.owner = lock is None or lock.acquired   # processes other than 0 write their shards too
        self._on_commit = on_commit
        self.inflight: Optional[int] = None
        self._inflight_meta: Optional[Dict[str, Any]] = None
        self.session_steps: set = set()   # steps committed by this Saver
        if self._primary and self.owner:
            self.clean_tmp("left by an earlier run that did not finish it")
        self.manager = self._new_manager()
        self.worker = StartWorker(self.manager) if self.in_background else None
        # CPU backend: Orbax gets host copies of the shards (the next step donates the originals)
        self.staging = HostStaging() if jax.default_backend() == "cpu" else None

    @property
    def in_background(self) -> bool:
        """Whether Orbax's blocking part runs on the worker (``background_start``; CPU, one process)."""
        return (self.async_save and self.background_start and jax.default_backend() == "cpu"
                and jax.process_count() == 1)

    def _new_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, save_interval_steps=1, create=True, cleanup_tmp_directories=False,
            enable_async_checkpointing=True,  # a synchronous save is an async save plus wait()
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest))
        extra = {}
        if self.in_background:
            extra["type_handler_registry"] = replica_zero_registry()
        handler = ocp.PyTreeCheckpointHandler(use_compression=self.compression is Compression.ZSTD, **extra)
        return ocp.CheckpointManager(self.directory, item_names=ITEMS, item_handlers={"state": handler},
                                     options=options)

    def clean_tmp(self, why: str, step: Optional[int] = None) -> List[Path]:
        """Remove temporary step folders (all, or those of ``step``) on process 0."""
        removed = []
        if not (self._primary and self.owner):
            return removed
        for p in integrity.tmp_dirs(self.directory):
            if step is not None and integrity.tmp_step(p) != step:
                continue
            size = integrity.folder_bytes(p)
            integrity.remove_tree(p)
            removed.append(p)
            warn(f"removed temporary checkpoint folder {p} ({fmt_bytes(size)}) {why}")
        return removed

    def _write_manifest(self) -> None:
        """Orbax's post-finalization hook: runs on process 0 in the save thread, after every process
        wrote its shards and before the rename that commits the step."""
        step = self.inflight
        if step is None:
            raise CheckpointError("internal: a save finished but no step is in flight")
        candidates = [p for p in integrity.tmp_dirs(self.directory) if integrity.tmp_step(p) == step]
        final = self.directory / str(step)
        target = candidates[0] if len(candidates) == 1 else (final if not candidates and final.is_dir() else None)
        if target is None:
            raise CheckpointError(f"cannot find the folder being written for step {step} in {self.directory} "
                                  f"(found {[p.name for p in candidates]})")
        integrity.write_json_atomic(target / META_FILE, self._inflight_meta, sort_keys=False)  # tree order
        with integrity.manifest_checksum(self.tuning.checksum):   # XXH3-128 unless the benchmark asks for SHA-256
            if self.tuning.mapped_hashing:
                integrity.write_manifest(target, step)              # hashed from the page cache
            else:                                                   # 8 MiB reads (bench_checkpoint --compare)
                integrity.write_manifest(target, step, mapped=False)

    # -- saving -------------------------------------------------------------------------------------

    def maybe_save(self, step: int, state, *, data_state: Dict[str, Any], metadata: Dict[str, Any],
                   force: bool) -> SaveResult:
        """:meth:`Checkpointer.maybe_save <meshtrain.checkpoint.Checkpointer.maybe_save>`."""
        t0 = time.perf_counter()
        step = int(step)
        self.collect()
        if not (force or step % self._every == 0):
            if self.async_save and self.staging is not None:
                self.staging.prepare(state)   # the copy's host buffers, allocated long before the first save
            return SaveResult(False, time.perf_counter() - t0, step)
        if step == self.inflight or step in self.session_steps:
            return SaveResult(False, time.perf_counter() - t0, step, note=f"step {step} was already saved by this run")
        if not self.owner:
            raise CheckpointError(f"cannot save step {step}: {self.directory} is being written by "
                                  f"{self._lock.holder()}; use another run folder, or stop that process")
        for name, value in (("data_state", data_state), ("metadata", metadata)):
            if not isinstance(value, dict):
                raise CheckpointError(f"{name} must be a dict of JSON values, got {type(value).__name__}")
            problem = json_problem(value, name)
            if problem:
                raise CheckpointError(f"cannot save step {step}: {problem}")
        self.wait_inflight()
        self._prepare_step_folder(step)
        self._check_space(step, state)
        # one Orbax item only (each item costs directories and threads in the blocking part); the JSON
        # goes into the step folder from the save thread, just before the manifest and the commit
        self._inflight_meta = {
            "format": META_FORMAT, "step": step, "user": metadata, "data_state": data_state,
            "tree": describe_tree(state), "saved_unix": time.time(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "compression": self.compression.value,
            "versions": {"jax": jax.__version__, "orbax": getattr(ocp, "__version__", "?")}}
        self.inflight = step
        try:
            # Orbax's blocking part copies the arrays to host; it must not pin the caller's buffers,
            # or the next (donating) train step silently keeps a second copy of the state. A
            # synchronous save releases them before it returns: no copy (saves time and one state
            # of host memory on CPU; tests/test_checkpoint_speed.py checks the donation).
            self.faults.before_save(step)
            if (self.async_save or self.tuning.copy_before_sync_save) and self.staging is not None:
                state = self.staging.stage(state)
            args = ocp.args.Composite(state=ocp.args.PyTreeSave(to_nested(state)))
            del state   # the worker must not keep the caller's buffers (they are donated next)
            if self.worker is not None:
                # the shards are copied already (HostStaging); Orbax starts and writes in the worker
                self.worker.start(step, args)
            else:
                self.manager.save(step, args=args, force=True)
        except BaseException as exc:
            if self.worker is not None and not self.worker.cancel():
                # the worker is already saving this step: it is in flight, close() waits for it
                if isinstance(exc, Exception):
                    self.wait_inflight()
                raise
            # The step never started committing (a Ctrl-C inside Orbax's blocking part or during the
            # hand-off): forget it and remove its partial folder, so close() does not report an
            # interrupted save as a failure and no worker writes a step nobody waits for.
            self.inflight = None
            self._after_failure(step)
            if isinstance(exc, Exception):   # every failure becomes a CheckpointError naming the step
                raise self._save_error(step, exc) from exc
            raise
        if not self.async_save:
            self.wait_inflight()
        return SaveResult(True, time.perf_counter() - t0, step)

    def saving(self) -> bool:
        """True while the step in flight is still being started (background_start) or written."""
        return (self.worker is not None and self.worker.starting) or self.manager.is_saving_in_progress()

    def _prepare_step_folder(self, step: int) -> None:
        self.clean_tmp(f"before saving step {step} again", step=step)
        existing = integrity.step_dirs(self.directory).get(step)
        if existing is None:
            if step in self.manager.all_steps():   # deleted by retention or by hand since Orbax listed it
                self.manager.reload()
            return
        check = self._checks.check(step)
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
            warn(f"checkpoint step {step} in {self.directory} is {check.status.value} ({check.reason}); "
                 f"moved {existing} aside to {moved} (kept, not deleted) to save step {step} again")
        else:
            warn(f"checkpoint step {step} in {self.directory} is {check.status.value} ({check.reason}); "
                 f"process 0 moves it aside (to {existing.name}{integrity.ASIDE_MARKER}) to save it again")
        self._checks.forget(step)
        self.manager.reload()

    def _check_space(self, step: int, state) -> None:
        need = state_bytes(state) + FREE_MARGIN
        free = free_bytes(self.directory)
        if free < need:
            keep_every = self._policy.keep_every
            raise CheckpointDiskError(
                f"not enough disk space to save step {step}: the state needs ~{fmt_bytes(need)} but "
                f"{self.directory} has {fmt_bytes(free)} free. Free space, lower keep_last (now "
                f"{self._policy.keep_last}){'' if keep_every is None else f' or keep_every (now {keep_every})'}, "
                f"or move the run folder; steps {list(integrity.step_dirs(self.directory))} are intact")

    # -- the step in flight -------------------------------------------------------------------------

    def collect(self) -> None:
        """Non-blocking: if the save in flight has finished, surface its error or commit it."""
        if self.inflight is not None and not self.saving():
            self.wait_inflight()

    def wait_inflight(self) -> None:
        step = self.inflight
        if step is None:
            return
        try:
            # A Ctrl-C here leaves the step in flight (the next call waits again); with the worker it
            # lands in a future's result(), never inside Orbax (see StartWorker).
            if self.worker is not None:
                self.worker.wait()
            else:
                self.manager.wait_until_finished()
        except Exception as exc:  # noqa: BLE001
            self._forget_inflight()
            self._after_failure(step)
            raise self._save_error(step, exc) from exc
        self._forget_inflight()
        check = self._checks.check(step, Verify.QUICK)
        if check.status is not StepStatus.OK:
            self._after_failure(step)
            raise CheckpointError(f"saving step {step} to {self.directory} did not commit: {check.status.value} "
                                  f"({check.reason}); steps {self._checks.good_steps()} are intact")
        self.session_steps.add(step)
        self._on_commit()

    def _forget_inflight(self) -> None:
        if self.worker is not None:
            self.worker.forget()
        self.inflight = None

    def _after_failure(self, step: int) -> None:
        # Orbax raises as soon as one of its writer threads fails; the others (and tensorstore's
        # own writers) can still create files in the temporary folder for a moment. Join Orbax's
        # threads, then clean until the folder stays gone, so the disk space really comes back.
        _join_orbax_threads(timeout_s=30.0)
        self.clean_tmp(f"after the failed save of step {step}", step=step)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if any(integrity.tmp_step(p) == step for p in integrity.tmp_dirs(self.directory)):
                self.clean_tmp(f"after the failed save of step {step} (a late write recreated it)", step=step)
        self.manager.reload()

    def _save_error(self, step: int, exc: BaseException) -> CheckpointError:
        good = self._checks.good_steps()
        tail = (f"the temporary folder was removed; steps {good} are intact and the next due step tries again"
                if good else "the temporary folder was removed; no earlier checkpoint exists")
        if is_disk_full(exc):
            free = fmt_bytes(free_bytes(self.directory))
            return CheckpointDiskError(
                f"saving step {step} to {self.directory} failed: {_disk_reason(exc)} ({free} free after cleaning). "
                f"{disk_hint(exc).capitalize()}, lower keep_last (now {self._policy.keep_last}) or move the run "
                f"folder; {tail}")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return CheckpointError(f"saving step {step} to {self.directory} failed: {type(exc).__name__}: {first}; {tail}")

    def close_worker(self) -> None:
        """Stop the worker thread (after :meth:`wait_inflight`)."""
        if self.worker is not None:
            self.worker.close()

    def close(self) -> None:
        """Release Orbax's threads (after :meth:`close_worker`) and the host copy of the saved shards."""
        if self.staging is not None:
            self.staging.release()
        try:
            self.manager.close()
        except Exception as exc:  # noqa: BLE001 - the save error, if any, was raised above
            log.debug("orbax close: %s", exc)
