"""Ctrl-C that is never lost: :class:`InterruptGuard` records a SIGINT and raises it again at the
next :meth:`~InterruptGuard.check`, also when Python swallowed the ``KeyboardInterrupt`` where it
landed (a garbage-collector callback, a ``__del__``). The training loop (``meshtrain.train.loop``)
and the commands that write folders (``meshtrain.hf.output``) use it; it needs nothing but the
standard library, so any layer may.

    guard = InterruptGuard()
    try:
        ...            # work that a library may interrupt badly
        guard.check()  # a swallowed Ctrl-C is raised here
    finally:
        guard.restore()
"""

from __future__ import annotations

import signal
import sys
import threading


class InterruptGuard:
    """Ctrl-C raises KeyboardInterrupt wherever Python happens to be; when that is a garbage collector
    callback (jax's _xla_gc_callback runs often while a pipeline step compiles) or a ``__del__``,
    Python prints "Exception ignored" and the run went on to the end (exit 0). The handler also
    records the interrupt, and the loop raises it again at its next :meth:`check`."""

    def __init__(self):
        self.interrupted = False
        self._previous = self._previous_unraisable = None
        main_thread = threading.current_thread() is threading.main_thread()
        # A background job of a non-interactive shell (or `nohup cmd &`) starts with SIGINT ignored. It
        # stays ignored, as in any POSIX tool (a terminal's Ctrl-C was not meant for that job); the run
        # says so, and SIGTERM remains the way to stop it cleanly.
        self.sigint_ignored = main_thread and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._interrupt)
            self._previous_unraisable = sys.unraisablehook
            sys.unraisablehook = self._unraisable

    def _interrupt(self, signum, frame):
        self.interrupted = True
        raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        """The swallowed KeyboardInterrupt is raised again by :meth:`check`: no traceback."""
        if not (self.interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self._previous_unraisable(unraisable)

    def check(self) -> None:
        """Raise the Ctrl-C that arrived since the start, in case it was swallowed where it landed."""
        if self.interrupted:
            raise KeyboardInterrupt

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            sys.unraisablehook = self._previous_unraisable
            self._previous = None
