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

import ctypes
import os
import signal
import sys
import threading
from typing import Callable, Mapping, Optional

from meshtrain.errors import ConfigError


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


# -- SIGTERM: the status after a preemption save, and SIGTERM during start-up ------------------------
#: Exit status of a run that SIGTERM stopped after saving (default 0). Job templates set it so the
#: scheduler can tell "stopped for preemption, requeue me" from "finished": SLURM's ``--requeue``
#: and a JobSet's ``maxRestarts`` do nothing for a job that exits 0 (recipes/launch/).
ENV_PREEMPTED_EXIT = "MESHTRAIN_PREEMPTED_EXIT"

_preempted = False


def preempted_exit_status(environ: Optional[Mapping[str, str]] = None) -> int:
    """The status ``$MESHTRAIN_PREEMPTED_EXIT`` asks for after a SIGTERM stop (0 when unset), e.g.
    ``MESHTRAIN_PREEMPTED_EXIT=99``. ConfigError for anything but 0..255."""
    raw = (os.environ if environ is None else environ).get(ENV_PREEMPTED_EXIT, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) > 255:
        raise ConfigError(f"{ENV_PREEMPTED_EXIT}={raw!r}: give the exit status (0..255) a run stopped by SIGTERM "
                          f"should end with, e.g. {ENV_PREEMPTED_EXIT}=99, or unset it for 0")
    return int(raw)


def note_preempted() -> None:
    """Called once the run has stopped for a SIGTERM (and saved): :func:`exit_status` maps its 0."""
    global _preempted
    _preempted = True


def exit_status(status: int, environ: Optional[Mapping[str, str]] = None) -> int:
    """The command's exit status: a successful run that SIGTERM stopped ends with
    ``$MESHTRAIN_PREEMPTED_EXIT`` instead of 0; any other status stays."""
    return preempted_exit_status(environ) if status == 0 and _preempted else status


class _SigAction(ctypes.Structure):
    """glibc's ``struct sigaction`` (Linux): handler, mask, flags, restorer."""

    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


_SA_SIGINFO = 4


def _native_handler(signum: int) -> Optional[Callable[[int], None]]:
    """The C-level handler installed for ``signum`` (JAX's preemption notifier installs one for SIGTERM
    that Python does not see), as a callable; ``None`` for none, SIG_DFL/SIG_IGN, or off Linux."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = _SigAction()
        if libc.sigaction(signum, None, ctypes.byref(old)) != 0 or old.handler in (None, 0, 1):
            return None
    except (OSError, AttributeError):
        return None
    if old.flags & _SA_SIGINFO:
        three = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(old.handler)
        return lambda s: three(s, None, None)
    return ctypes.CFUNCTYPE(None, ctypes.c_int)(old.handler)


class StartupTerm:
    """SIGTERM before the first training step ends the process at once, with ``status``: until then the
    state is the last checkpoint (or a fresh start), so there is nothing to save, and waiting for the
    first step's compilation (a minute and more) can overrun the grace a scheduler gives.

    Python runs signal handlers only between bytecodes, never inside a long XLA compilation; the
    signal's wakeup byte (``signal.set_wakeup_fd``) reaches a thread at once. After :meth:`started`,
    SIGTERM goes where it went before: JAX's preemption notifier (its C handler, called from the
    thread) or the training loop's own handler, which replaces this one::

        term = StartupTerm(status=99, say=print).install()   # after jax.distributed.initialize
        ...                                                   # plan, restore, compile, first step
        term.started()                                        # from here SIGTERM saves after a step
    """

    def __init__(self, status: int, say: Callable[[str], None]):
        self.status, self.say = status, say
        self.starting = True
        self._forward: Optional[Callable[[int], None]] = None
        self._read_fd = self._write_fd = -1

    def install(self) -> "StartupTerm":
        if threading.current_thread() is not threading.main_thread():
            return self
        if self._read_fd >= 0:   # again, after jax.distributed put its own C handler in place: take it over
            self._forward = _native_handler(signal.SIGTERM) or self._forward
            signal.signal(signal.SIGTERM, self._ignore)
            return self
        self._forward = _native_handler(signal.SIGTERM)
        if self._forward is None and signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return self   # someone's Python handler: leave SIGTERM to it
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        try:
            signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        except ValueError:
            return self
        signal.signal(signal.SIGTERM, self._ignore)
        threading.Thread(target=self._watch, name="meshtrain-startup-sigterm", daemon=True).start()
        return self

    @staticmethod
    def _ignore(signum, frame) -> None:
        """The Python-level handler does nothing: the thread acts on the wakeup byte."""

    def started(self) -> None:
        """The first step is done: from now on a SIGTERM stops the run after a step, with a save."""
        self.starting = False

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM not in data:
                continue
            if self.starting:
                self.say(f"SIGTERM during start-up: nothing trained since the last checkpoint; exiting at once "
                         f"(status {self.status})")
                os._exit(self.status)
            if self._forward is not None:
                self._forward(signal.SIGTERM)   # JAX's notifier: every process stops after the same step


_startup: Optional[StartupTerm] = None


def guard_startup(say: Callable[[str], None], environ: Optional[Mapping[str, str]] = None) -> Optional[StartupTerm]:
    """With ``$MESHTRAIN_PREEMPTED_EXIT`` set (a job template that requeues on that status, where the
    scheduler signals every process), a SIGTERM before the first step exits at once with it. Call it
    first thing and again after ``jax.distributed`` started (whose C handler replaces Python's; the
    second call takes SIGTERM back and forwards it there after start-up). Unset: nothing changes (a
    SIGTERM during start-up stops the run after its first step, with a save)."""
    global _startup
    env = os.environ if environ is None else environ
    if not env.get(ENV_PREEMPTED_EXIT, "").strip():
        return None
    _startup = (_startup or StartupTerm(preempted_exit_status(env), say)).install()
    return _startup


def startup_done() -> None:
    """The first step finished: a SIGTERM from now on stops the run after a step, with a save."""
    if _startup is not None:
        _startup.started()
