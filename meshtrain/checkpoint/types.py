"""Result and status types of :mod:`meshtrain.checkpoint` (no JAX or Orbax imports here)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Optional

from meshtrain.errors import DiskError, MeshtrainError


class CheckpointError(MeshtrainError):
    """A checkpoint cannot be written or restored; the message names the step, the folder and what to
    change (free disk space, the mismatching paths/shapes/dtypes, a different step)."""


class CheckpointDiskError(CheckpointError, DiskError):
    """A checkpoint could not be written because the disk (or the file-size limit) is full; the
    failed step's temporary folder was removed and every committed step is intact. The CLI exits
    with :data:`meshtrain.errors.EXIT_DISK` (74), not 2: the command was fine, the storage was not."""


class NoValidCheckpoint(CheckpointError):
    """The checkpoint folder holds step folders but none passes the full check, so a resume would
    silently start from scratch. Raised by :meth:`Checkpointer.require_resumable`; ``checks`` holds
    one :class:`StepCheck` per step folder (oldest first) and the message lists each step and why it
    failed. Like every ``CheckpointError`` the CLI prints it and exits 2::

        try:
            step = ckpt.require_resumable()
        except NoValidCheckpoint as exc:
            bad = [(c.step, c.status.value, c.reason) for c in exc.checks]
    """

    def __init__(self, message: str, checks=()):
        super().__init__(message)
        self.checks = list(checks)


class CheckpointWarning(UserWarning):
    """A checkpoint step was skipped (corrupt, incomplete, empty, unverified) or a folder was cleaned.

    Filter or assert it like any warning: ``pytest.warns(CheckpointWarning, match="step 20")``."""


class StepStatus(str, enum.Enum):
    """Integrity of one step folder, from :func:`meshtrain.checkpoint.integrity.check_step`.

    ``ok``: committed, every file in the manifest matches its size (and checksum when verified).
    ``unverified``: committed but without a manifest (written by plain Orbax, or the manifest was
    removed); never restored automatically. ``incomplete``: files listed in the manifest are missing.
    ``corrupt``: a size or checksum differs, or the manifest itself is unreadable. ``empty``: the
    folder has no files. ``in_progress``: a save to this step is still being written by this process.
    """

    OK = "ok"
    UNVERIFIED = "unverified"
    INCOMPLETE = "incomplete"
    CORRUPT = "corrupt"
    EMPTY = "empty"
    IN_PROGRESS = "in_progress"

    @property
    def usable(self) -> bool:
        return self is StepStatus.OK


class Checksum(str, enum.Enum):
    """The block checksum of a step's manifest (``meshtrain-manifest.json`` records it as ``algorithm``;
    verification reads whichever a manifest names, so older SHA-256 checkpoints still verify).

    ``xxh3_128`` (what saves write): XXH3's 128-bit hash (the ``xxhash`` package), ~22 GB/s per core on the
    development host against ~1.8 GB/s for SHA-256: it detects accidental damage (flipped bits, torn or
    truncated writes) as SHA-256 does, but it is not cryptographic (no protection against deliberate
    tampering). ``sha256``: checkpoints written before it, or :func:`meshtrain.checkpoint.integrity.
    write_manifest` called directly."""

    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"


class Compression(str, enum.Enum):
    """How array chunks are stored. Restore reads either, whatever the reader's setting.

    ``none`` (meshtrain's default): raw bytes. Trained f32/bf16 weights and Adam moments are close to
    incompressible (zstd saves ~8% on them), while compressing costs CPU time on the save thread
    (0.3-0.5 s per 200 MB on a 2-core host, competing with the training step) and one more copy of
    the state in host memory while it is written (measured: +0.9x the state). ``zstd`` (Orbax's
    default): worth it where disk space or bandwidth matters more than CPU, e.g. a slow network file
    system, or checkpoints of zero-heavy states (a fresh optimizer state shrinks a lot).
    Figures: BENCHMARKS.md, "Checkpoint benchmark"."""

    ZSTD = "zstd"
    NONE = "none"


class Verify(str, enum.Enum):
    """How deeply a step is checked: ``full`` re-reads every file and compares SHA-256 checksums
    (what restore uses); ``quick`` compares only file presence and sizes (retention, ``ckpt list --quick``)."""

    FULL = "full"
    QUICK = "quick"


@dataclasses.dataclass(frozen=True)
class StepCheck:
    """The integrity verdict for one step: ``status``, a human ``reason`` ("" when ok), bytes on disk."""

    step: int
    status: StepStatus
    reason: str = ""
    bytes: int = 0
    files: int = 0
    verify: Verify = Verify.FULL

    def to_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "status": self.status.value, "reason": self.reason, "bytes": self.bytes,
                "files": self.files, "verify": self.verify.value}


@dataclasses.dataclass(frozen=True)
class SaveResult:
    """What :meth:`Checkpointer.maybe_save` did: ``saved`` (a save was started, or finished when
    synchronous), ``blocking_s`` (seconds the caller was blocked: the training stall), ``step``.
    ``note`` says why nothing was saved when that was not simply the interval (e.g. already saved)."""

    saved: bool
    blocking_s: float
    step: int
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` returns: the ``step`` restored, the ``state`` on the plan's
    shardings, the data iterator's ``data_state`` and the ``metadata`` dict given at save time."""

    step: int
    state: Any
    data_state: Dict[str, Any]
    metadata: Dict[str, Any]
    saved_tree: Optional[Dict[str, Any]] = dataclasses.field(default=None, repr=False)
