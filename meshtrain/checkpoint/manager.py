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

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import jax

from meshtrain.checkpoint import integrity
from meshtrain.checkpoint.faults import DiskFullInjector
from meshtrain.checkpoint.housekeeping import Janitor, WriterLock, warn
from meshtrain.checkpoint.peers import PeerStore
from meshtrain.checkpoint.adapters import read_lora_parts
from meshtrain.checkpoint.restoring import read_params, read_step
from meshtrain.checkpoint.retention import RetentionPolicy
from meshtrain.checkpoint.saving import Saver, fmt_bytes  # noqa: F401 - fmt_bytes: `meshtrain ckpt` reads it here
from meshtrain.checkpoint.types import (CheckpointError, Compression, NoValidCheckpoint, Restored, SaveResult,
                                        StepCheck, Verify)

log = logging.getLogger("meshtrain.checkpoint")


class _ReadOnly:
    """The writer lock of a reader (``Checkpointer(..., reader=True)``): never acquired, so the reader
    neither saves, nor cleans temporary folders (a live writer's save in flight), nor applies
    retention, and the folder's lock file stays as it was."""

    acquired = False

    def holder(self) -> str:
        return "no one: this Checkpointer was opened to read only"

    def release(self) -> None:
        pass


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
      peer_every: also keep in-memory peer copies every N steps (:mod:`meshtrain.checkpoint.peers`;
        0: off): :meth:`latest_valid_step` and :meth:`restore` then take the newest step that every
        process can rebuild from them when it is newer than the newest valid disk step. Every process
        must make the same calls (they hold collectives).
      reader: open another run's folder to restore only (:meth:`read_params`): it never becomes the
        writer (no save, no cleaning, no retention) and leaves the lock file as it was.

    Next: :meth:`require_resumable` (or :meth:`inventory`) and :meth:`restore` on start,
    :meth:`maybe_save` each step, :meth:`close` at the end.
    """

    def __init__(self, directory, *, save_every: int, keep_last: int = 3, keep_every: Optional[int] = None,
                 async_save: bool = True, compression: Compression = Compression.NONE,
                 background_start: bool = False, peer_every: int = 0, reader: bool = False):
        if not isinstance(save_every, int) or save_every < 1:
            raise CheckpointError(f"save_every={save_every!r}: give an integer >= 1")
        self._retention = RetentionPolicy(keep_last, keep_every)
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
        self._checks = integrity.CheckCache(self.directory)
        self._skip_warned: set = set()   # (step, status, reason) already reported by this Checkpointer
        self._kept_warned: set = set()   # (step, status, reason) that retention reported and left in place
        self._janitor: Optional[Janitor] = None
        self._closed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {self.directory}: {exc}") from exc
        # process 0 writes manifests, cleans and deletes; it must be the folder's only writer. A reader
        # (read_params: export, generate) is never the writer and does not touch the lock file either.
        self._lock = (_ReadOnly() if reader else WriterLock(self.directory)) if jax.process_index() == 0 else None
        if self._lock is not None and not self._lock.acquired and not reader:
            warn(f"{self.directory} is being written by {self._lock.holder()}; this Checkpointer can restore "
                 f"but not save, clean or delete there")
        #: test-only fault injection into this checkpointer's saves (:mod:`meshtrain.checkpoint.faults`)
        self.faults = DiskFullInjector()
        self._saver = Saver(self.directory, self._checks, self._retention, save_every=save_every,
                            async_save=self.async_save, background_start=self.background_start,
                            compression=self.compression, lock=self._lock, on_commit=self._apply_retention,
                            faults=self.faults)
        if self._lock is not None and self._lock.acquired:
            for p in integrity.trash_dirs(self.directory):   # retention deletes interrupted by a crash
                integrity.remove_tree(p)
            self._janitor = Janitor()
        self._manager = self._saver.manager   # Orbax's CheckpointManager, shared by saves and restores
        self._peers = PeerStore(self.directory, peer_every) if peer_every else None

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
        self._ensure_open()
        peer_s = 0.0
        if self._peers is not None and self._peers.due(step):
            # first, and on disk steps too: the disk save is asynchronous and may fail (a full disk)
            t0 = time.perf_counter()
            self._peers.save(step, state, data_state=data_state, metadata=metadata)
            peer_s = time.perf_counter() - t0
        result = self._saver.maybe_save(step, state, data_state=data_state, metadata=metadata, force=force)
        return dataclasses.replace(result, blocking_s=result.blocking_s + peer_s) if peer_s else result

    def peer_step(self) -> Optional[int]:
        """The newest step that the in-memory peer copies can restore on every process, or ``None``
        (no copies, or ``peer_every`` off). Every process must call it (a collective)."""
        return self._peers.latest() if self._peers is not None else None

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
        session = self._saver.session_steps
        if self._janitor is None or not session:   # not the folder's writer, or nothing saved
            return
        horizon = max(session)
        dirs = integrity.step_dirs(self.directory)
        usable: List[int] = []
        for s in dirs:
            if s > horizon:
                continue
            check = self._checks.best_known(s)
            if check.status.usable:
                usable.append(s)
                continue
            key = (s, check.status, check.reason)
            if key not in self._kept_warned:
                self._kept_warned.add(key)
                warn(f"retention leaves checkpoint step {s} in {self.directory} in place: it is "
                     f"{check.status.value} ({check.reason}); damaged steps are never deleted automatically: "
                     f"inspect it (meshtrain ckpt list), then move or delete {dirs[s]} by hand")
        trusted = session | {s for s in usable if self._checks.passed_full(s)}
        doomed = self._retention.steps_to_delete(usable, trusted=trusted, newest_saved=horizon)
        if not doomed:
            return
        trash = []
        for s in doomed:   # rename now (O(1), atomic), delete the files in a background thread
            trash.append(integrity.move_to_trash(dirs[s]))
            self._checks.forget(s)
        log.info("retention removes checkpoint steps %s from %s", doomed, self.directory)
        self._janitor.delete(trash)

    # -- reading ------------------------------------------------------------------------------------

    def check(self, step: int, verify: Verify = Verify.FULL) -> StepCheck:
        """Integrity of one committed step (full checks are cached while the files are unchanged)."""
        return self._checks.check(step, verify)

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
        there is none. With ``peer_every``, a newer :meth:`peer_step` wins."""
        disk = self._latest_disk_step()
        peer = self.peer_step()
        return peer if peer is not None and (disk is None or peer > disk) else disk

    def _latest_disk_step(self) -> Optional[int]:
        for step in reversed(self.all_steps()):
            check = self.check(step)
            if check.status.usable:
                return step
            key = (step, check.status, check.reason)
            if key not in self._skip_warned:
                self._skip_warned.add(key)
                warn(f"skipping checkpoint step {step} in {self.directory}: {check.status.value}: {check.reason}")
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
        if step is None and self._peers is not None:
            peer, disk = self.peer_step(), self._latest_disk_step()
            if peer is not None and (disk is None or peer > disk):
                restored = self._peers.restore(plan, peer)
                if restored is not None:
                    return restored
                warn(f"the in-memory peer copies of step {peer} cannot be restored on every process (another "
                     f"mesh or dtype than this run's plan, or a copy lost since); restoring from {self.directory} "
                     f"instead")
        if step is None:
            step = self._latest_disk_step()
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
                warn(f"restoring step {step} while newer good steps {newer} exist in {self.directory}; saving "
                      f"one of those steps again will fail while the good one is there")
        return read_step(self._manager, self.directory, step, plan, allow_cast=allow_cast)

    # -- lifecycle ----------------------------------------------------------------------------------

    def restore_params(self, plan, step: Optional[int] = None):
        """``(step, params)``: only the parameters of ``step`` (default: the latest valid one), on
        ``plan``'s shardings and dtypes, whatever optimizer saved them (fine-tuning from a run)."""
        self._ensure_open()
        self.wait()
        step = self.latest_valid_step() if step is None else int(step)
        if step is None or not self.check(step).status.usable:
            raise CheckpointError(f"no valid checkpoint {'step ' + str(step) + ' ' if step is not None else ''}in "
                                  f"{self.directory} (steps: {self.all_steps()}); pass another run or step")
        return step, read_params(self._manager, self.directory, step, plan)

    @classmethod
    def read_params(cls, directory, plan, step: Optional[int] = None):
        """``(step, params)`` of checkpoint folder ``directory`` (another run's) on ``plan``, opened
        and closed here: :meth:`restore_params` for a caller that only reads."""
        ckpt = cls(directory, save_every=1, reader=True)
        try:
            return ckpt.restore_params(plan, step)
        finally:
            ckpt.close()

    @classmethod
    def read_adapters(cls, directory, step: Optional[int] = None):
        """``(step, LoRAParts)``: the LoRA adapters (and settings) of checkpoint folder ``directory``'s
        ``step`` (default: the latest valid one) on the host; :mod:`meshtrain.checkpoint.adapters`."""
        ckpt = cls(directory, save_every=1, reader=True)
        try:
            step = ckpt.latest_valid_step() if step is None else int(step)
            if step is None or not ckpt.check(step).status.usable:
                raise CheckpointError(f"no valid checkpoint {'step ' + str(step) + ' ' if step is not None else ''}"
                                      f"in {ckpt.directory} (steps: {ckpt.all_steps()}); pass another run or step")
            return step, read_lora_parts(ckpt._manager, ckpt.directory, step)
        finally:
            ckpt.close()

    @property
    def pending_step(self) -> Optional[int]:
        """The step whose async save was started and not yet collected, or ``None``."""
        return self._saver.inflight

    @property
    def busy(self) -> bool:
        """True while a background save is still writing (the next due save would wait for it)."""
        return self._saver.inflight is not None and self._saver.saving()

    def wait(self) -> float:
        """Block until the pending async save is committed and verified; raises its error if it failed.

        Returns the seconds spent blocked (count them as checkpoint stall, like ``blocking_s``)."""
        self._ensure_open()
        t0 = time.perf_counter()
        self._saver.wait_inflight()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the pending save (raising its error), then release Orbax's threads. Idempotent."""
        if self._closed:
            return
        try:
            self._saver.wait_inflight()
            self._discard_peers()
        finally:
            self._closed = True
            self._saver.close_worker()
            if self._janitor is not None:
                self._janitor.close()
            if self._lock is not None:
                self._lock.release()
            self._saver.close()

    def _discard_peers(self) -> None:
        """Free the peer copies once this Checkpointer committed a newer (or the same) step to disk:
        they can add nothing (after a failure they are kept for the restart)."""
        saved = self._saver.session_steps
        if self._peers is not None and saved and max(saved) >= max(self._peers.steps(), default=-1):
            self._peers.discard()

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
                f"{', background_start=True' if self.background_start else ''}"
                f"{f', peer_every={self._peers.every}' if self._peers is not None else ''})")
