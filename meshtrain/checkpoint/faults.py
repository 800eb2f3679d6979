"""Fault injection for the save path (tests and ``tools/bench_resilience.py`` only).

A :class:`DiskFullInjector` belongs to one :class:`~meshtrain.checkpoint.Checkpointer` (its
``faults`` attribute); whoever injects faults (the watchdog, from ``MESHTRAIN_FAULT=full@step=N``)
is handed that object and arms it, so an injected fault lives and dies with its checkpointer::

    ckpt = Checkpointer(folder, save_every=2)
    ckpt.faults.arm(4, on_fire=print)   # the first save at step >= 4 fails as a full disk would
"""

from __future__ import annotations

import dataclasses
import errno
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class DiskFullFault:
    """The first save at or after ``step`` fails with ENOSPC where Orbax would start writing, as a
    full disk fails it; ``on_fire(step)`` logs the fault (the watchdog writes ``events.jsonl``)."""

    step: int
    on_fire: Callable[[int], None]


class DiskFullInjector:
    """Holds at most one armed :class:`DiskFullFault`; the saver calls :meth:`before_save`."""

    def __init__(self) -> None:
        self.armed: Optional[DiskFullFault] = None

    def arm(self, step: int, on_fire: Callable[[int], None]) -> None:
        self.armed = DiskFullFault(step, on_fire)

    def disarm(self) -> None:
        self.armed = None

    def before_save(self, step: int) -> None:
        """Raise the injected ENOSPC once, at the first save at or after the armed step."""
        fault = self.armed
        if fault is not None and step >= fault.step:
            self.armed = None   # once: the restart's saves go through
            fault.on_fire(step)
            raise OSError(errno.ENOSPC, f"No space left on device (injected by MESHTRAIN_FAULT at step {step})")
