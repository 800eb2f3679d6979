"""Housekeeping for a checkpoint folder: the single-writer lock and background deletion.

* :class:`WriterLock`: ``checkpoints/.meshtrain-writer.lock``, an exclusive ``flock`` held by the one
  ``Checkpointer`` that saves into the folder (process 0 of a run). A second ``Checkpointer`` on the
  same folder (an evaluator, a notebook) gets no lock: it may restore but neither saves, nor cleans
  temporary folders (which could be the writer's save in flight), nor applies retention. The kernel
  drops the lock when the writer exits or is killed, so a crashed run never blocks its restart.
* :class:`Janitor`: one long-lived thread that deletes the step folders retention renamed, so the
  training loop never waits for ``rmtree`` or for a thread to start.
* :func:`warn`: how every part of the checkpointer reports a step it skipped, kept or cleaned.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import List, Optional

from meshtrain.checkpoint import integrity
from meshtrain.checkpoint.types import CheckpointWarning

log = logging.getLogger("meshtrain.checkpoint")

LOCK_FILE = ".meshtrain-writer.lock"


def warn(message: str) -> None:
    """Log ``message`` and raise it as a :class:`CheckpointWarning` (which tests and users can filter)."""
    log.warning(message)
    warnings.warn(CheckpointWarning(message), stacklevel=3)


class WriterLock:
    """Try to become the folder's only writer: ``WriterLock(dir).acquired`` (False: someone else is)."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        self._file = None
        try:
            import fcntl
        except ImportError:  # no flock on this platform: assume a single writer
            self.acquired = True
            return
        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            self.acquired = False
            return
        f.seek(0)
        f.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time()}, f)
        f.flush()
        self._file, self.acquired = f, True

    def holder(self) -> str:
        """Who holds the lock, for error messages (``pid 123 on host``), or ``another process``."""
        try:
            info = json.loads(self.path.read_text())
            return f"pid {info['pid']} on {info['host']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def release(self) -> None:
        if self._file is not None:
            self._file.close()   # closing the descriptor releases the flock
            self._file = None


class Janitor:
    """Deletes folders handed to :meth:`delete` in one daemon thread; :meth:`close` waits for it."""

    def __init__(self):
        self._work: "queue.SimpleQueue[Optional[List[Path]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="meshtrain-ckpt-retention", daemon=True)
        self._thread.start()

    def delete(self, paths: List[Path]) -> None:
        self._work.put(list(paths))

    def _run(self) -> None:
        while True:
            paths = self._work.get()
            if paths is None:
                return
            for p in paths:
                try:
                    integrity.remove_tree(p)
                except OSError as exc:  # left as *.meshtrain-deleting-*: the next writer removes it
                    log.warning("could not delete old checkpoint folder %s: %s", p, exc)

    def close(self) -> None:
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()
