"""Which checkpoint steps retention deletes: a pure function of step numbers (no disk, no JAX).

:class:`~meshtrain.checkpoint.Checkpointer` decides what each step folder is (usable or damaged,
saved by this run, fully verified) and moves the doomed folders to the trash; the policy itself is
here, so that it can be read and tested on its own::

    policy = RetentionPolicy(keep_last=2, keep_every=4)
    policy.steps_to_delete([2, 4, 6, 8, 10], trusted={10}, newest_saved=10)    # [2, 6]
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Iterable, List, Optional

from meshtrain.checkpoint.types import CheckpointError


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` usable steps plus every multiple of ``keep_every`` (None: none extra)."""

    keep_last: int = 3
    keep_every: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise CheckpointError(f"keep_last={self.keep_last!r}: give an integer >= 1")
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise CheckpointError(f"keep_every={self.keep_every!r}: give an integer >= 1 or None")

    def steps_to_delete(self, usable: Iterable[int], *, trusted: Collection[int], newest_saved: int) -> List[int]:
        """The steps to delete, oldest first.

        Args:
          usable: the steps whose folders pass their check (damaged steps are never deleted, so they
            are not passed here at all).
          trusted: the steps known to be valid: saved by this Checkpointer (its checksums were
            computed from the committed files) or whose full check passed. The newest usable trusted
            step (the anchor) is always kept; without one nothing is deleted, so that retention can
            never leave only steps that nobody verified.
          newest_saved: the newest step this Checkpointer saved; newer steps (left by an earlier run
            that went further) are never deleted.
        """
        good = sorted(s for s in usable if s <= newest_saved)
        anchor = next((s for s in reversed(good) if s in trusted), None)
        if anchor is None:
            return []
        keep = set(good[-self.keep_last:]) | {anchor}
        if self.keep_every:
            keep |= {s for s in good if s % self.keep_every == 0}
        return [s for s in good if s not in keep]
