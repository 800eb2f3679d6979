"""No launched process outlives ``meshtrain launch``, even a launcher killed by SIGKILL.

A SIGKILL runs no handler and no ``finally``: the launcher cannot clean up after itself. Two
mechanisms that need nothing from the dying launcher do it instead:

* **Parent-death signal.** Every launched process starts through :func:`exec_child` (this file run
  as a script, ``exec`` mode): it asks the kernel for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), checks that the parent is still the launcher (it may have died
  before the request), then ``exec``s the command; the setting survives ``exec``. The launcher
  starts its children from its main thread, whose end is the end of the process (the kernel sends
  the signal when the parent *thread* exits).
* **The guard.** A small process (this file, ``guard`` mode: standard library only, so it starts
  in milliseconds and holds no JAX) reads the launcher's notes on a pipe: ``pid N`` for each
  started process (the leader of its own process group), ``gone N`` once reaped, ``dir PATH`` for a
  folder that must not outlive the job (the run's in-memory peer copies in ``/dev/shm``), ``bye``
  when the launcher finishes normally. End of file without ``bye`` means the launcher died: the
  guard SIGKILLs every process group still listed (also their children, and processes that got
  past the first mechanism), waits until they are gone (at most :data:`WAIT_S`), removes the
  folders, says so in one line and exits. It ignores SIGINT, SIGTERM and SIGHUP (in a session of
  its own it gets none from a terminal): only the end of the pipe ends it.

Linux only (``prctl``); elsewhere the first mechanism is skipped and the guard still works.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import sys
import time
from typing import BinaryIO, List, Set

PR_SET_PDEATHSIG = 1
#: Seconds the guard waits for killed processes to disappear before it removes their folders.
WAIT_S = 10.0


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_argv(argv: List[str]) -> List[str]:
    """``argv`` started through this file, so that it dies with the process that starts it."""
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), "exec", str(os.getpid()), *argv]


def exec_child(parent: int, argv: List[str]) -> None:
    for name in ("SIGPIPE", "SIGXFSZ"):   # what Python ignores at start-up; subprocess restores them too
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    die_with_parent()
    if os.getppid() != parent:   # the launcher died before the request: the kernel will not tell us
        os._exit(128 + signal.SIGKILL)
    os.execv(argv[0], argv)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:   # a zombie has ended; its new parent reaps it
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def guard(notes: BinaryIO) -> int:
    """Read the launcher's notes until the pipe ends; clean up unless it said ``bye``."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    groups: Set[int] = set()
    folders: List[str] = []
    for raw in iter(notes.readline, b""):
        kind, _, value = raw.decode(errors="replace").rstrip("\n").partition(" ")
        if kind == "pid":
            groups.add(int(value))
        elif kind == "gone":
            groups.discard(int(value))
        elif kind == "dir":
            folders.append(value)
        elif kind == "bye":
            return 0
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + WAIT_S
    while any(_alive(p) for p in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(p for p in groups if _alive(p))
    removed = [f for f in folders if os.path.exists(f)]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    sys.stderr.write(f"[launch] the launcher ended without finishing: killed processes "
                     f"{' '.join(map(str, sorted(groups))) or '(none left)'}"
                     + (f" (still alive: {left})" if left else "")
                     + (f"; removed {', '.join(removed)}" if removed else "") + "\n")
    sys.stderr.flush()
    return 1 if left else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["exec"]:
        exec_child(int(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1:2] == ["guard"]:
        sys.exit(guard(sys.stdin.buffer))
    else:
        sys.exit(f"usage: {sys.argv[0]} exec PARENT_PID ARGV... | guard")
