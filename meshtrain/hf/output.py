"""The output folder of ``meshtrain import`` / ``export``: written beside ``--out`` and renamed at the
end (:func:`meshtrain.folders.new_folder`), with the ways writing fails turned into typed errors:
a full disk or file-size limit is a :class:`DiskError` (exit 74), a read-only or forbidden folder a
:class:`ConfigError` naming it (exit 2); a Ctrl-C that a library swallowed (a garbage-collector
callback, a checkpoint thread) still stops the command before the rename. Nothing is left at
``--out`` on any failure.

    with output_folder("runs/llama") as partial:
        write_everything_into(partial)
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from meshtrain.errors import ConfigError, DiskError, MeshtrainError, disk_hint, is_disk_full
from meshtrain.folders import new_folder
from meshtrain.interrupts import InterruptGuard


class Interrupts(InterruptGuard):
    """The command's Ctrl-C: raised where it lands, except inside :meth:`deferred` (a checkpoint save:
    a KeyboardInterrupt inside Orbax leaves its threads writing into a folder being removed, and
    their tracebacks), where it is recorded and raised when the block ends."""

    deferring = 0

    def _interrupt(self, signum, frame):
        self.interrupted = True
        if not self.deferring:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        self.check()


@contextlib.contextmanager
def output_folder(out: str, flag: str = "--out", guard: Optional[InterruptGuard] = None) -> Iterator[str]:
    """``new_folder(out)`` with typed write errors and Ctrl-C honoured (see the module docstring);
    ``guard``: the caller's, when it installed one for the whole command (else one for the writing)."""
    own = guard is None
    guard = guard or Interrupts()
    try:
        with new_folder(out, flag) as partial:
            yield partial
            guard.check()  # a Ctrl-C swallowed while writing: raised here, before the rename
    except Exception as exc:
        if guard.interrupted:  # a library (e.g. the checkpoint's commit) turned the Ctrl-C into its own error
            raise KeyboardInterrupt from None
        if isinstance(exc, MeshtrainError):
            raise
        if is_disk_full(exc):
            raise DiskError(f"cannot write {flag} {out}: {getattr(exc, 'strerror', None) or exc}; {disk_hint(exc)} "
                            f"(nothing was left at {out})") from None
        if isinstance(exc, OSError):
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            raise ConfigError(f"cannot write {flag} {out}{where}: {exc.strerror or exc}; pass a folder you can write "
                              f"to (nothing was left at {out})") from None
        raise
    finally:
        if own:
            guard.restore()
