"""Typed errors. Every message names what to change; the CLI prints them without a traceback.

Exit codes of the ``meshtrain`` command (README, "Errors and interruptions"): 0 done (or stopped by
SIGTERM after saving), 2 bad input (:class:`MeshtrainError`), :data:`EXIT_DISK` a full disk or a
file-size limit (:class:`DiskError`), :data:`EXIT_HANG` the watchdog found a hang, 130 Ctrl-C.
"""

from __future__ import annotations

import errno

#: Bad input that the user can fix (argparse uses 2 too).
EXIT_BAD_INPUT = 2
#: The environment could not store the run's files: a full disk, a quota, a file-size limit
#: (``ulimit -f``). sysexits.h's EX_IOERR: distinct from bad input (2) and from a crash (1), so a
#: scheduler can tell "free space and run again with --resume" from "fix the command".
EXIT_DISK = 74
#: The watchdog (:mod:`meshtrain.train.watchdog`) saw no step complete within its bound: a hung or
#: stopped process. sysexits.h's EX_TEMPFAIL ("try again"): ``meshtrain launch --max-restarts``
#: restarts the job from its last checkpoint; the stacks are in ``<run>/hang-<process>.txt``.
EXIT_HANG = 75

#: errno values that mean "the storage is full", not "this input is wrong".
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class MeshtrainError(Exception):
    """Base class: bad input that the user can fix. The CLI turns it into `error: ...`, exit 2."""

    exit_code = EXIT_BAD_INPUT


class MeshError(MeshtrainError):
    """A `MeshSpec` cannot be built on the given devices (sizes, names, device count)."""


class RulesError(MeshtrainError):
    """Logical axes cannot be mapped onto the mesh (unknown name, axis reused, indivisible dim)."""


class RecipeError(MeshtrainError):
    """A recipe or strategy composition is invalid (unknown name, conflicting strategies, bad file)."""


class PlanError(MeshtrainError):
    """A sharding plan violates a guard (e.g. too many parameter bytes left replicated)."""


class ConfigError(MeshtrainError):
    """A model, data or training setting is out of range (batch size, sequence length, paths)."""


class DiskError(MeshtrainError):
    """A file of the run could not be written because the disk (or quota, or the file-size limit)
    is full. The message names the file or checkpoint step and says what to free; committed
    checkpoints are intact. The CLI exits :data:`EXIT_DISK`."""

    exit_code = EXIT_DISK


def is_disk_full(exc: BaseException) -> bool:
    """True for an ``OSError`` (or a library's error text) that means the storage is full."""
    if getattr(exc, "errno", None) in DISK_ERRNOS:
        return True
    text = str(exc)
    # Orbax/TensorStore report the errno only in their message (e.g. "OUT_OF_RANGE ... File too large")
    return any(s in text for s in ("No space left", "ENOSPC", "os_error_code='28'", "File too large",
                                   "os_error_code='27'", "Disk quota exceeded"))


def is_file_size_limit(exc: BaseException) -> bool:
    """True when the write hit the process's file-size limit (EFBIG, ``ulimit -f``), not a full disk."""
    return getattr(exc, "errno", None) == errno.EFBIG or any(
        s in str(exc) for s in ("File too large", "os_error_code='27'"))


def disk_hint(exc: BaseException) -> str:
    """What to do about a full-storage error: free space, or raise the file-size limit."""
    if is_file_size_limit(exc):
        return "raise the file-size limit (ulimit -f) or write to another folder"
    return "free disk space or write to another folder"
