"""Retention as a pure function of step numbers: which steps a Checkpointer deletes (no disk, no JAX)."""

import pytest

from meshtrain.checkpoint import CheckpointError
from meshtrain.checkpoint.retention import RetentionPolicy


@pytest.mark.parametrize("keep_last, keep_every, usable, trusted, newest_saved, doomed", [
    (2, None, [2, 4, 6, 8, 10], {10}, 10, [2, 4, 6]),          # the newest keep_last stay
    (2, 4, [2, 4, 6, 8, 10], {10}, 10, [2, 6]),               # plus every multiple of keep_every
    (2, None, [2, 4, 6, 8, 10], set(), 10, []),               # nothing known valid: delete nothing
    (2, None, [2, 4, 6, 8], {4}, 8, [2]),                     # the newest trusted step (4) is kept too
    (1, None, [2, 4, 6, 8, 10], {6}, 6, [2, 4]),              # steps after this run's newest save stay
    (1, None, [10, 2, 6], {10}, 10, [2, 6]),                  # any order in, oldest first out
    (1, None, [2, 6], {6}, 6, [2]),                           # a damaged step 4 is not passed: kept
    (5, None, [2, 4, 6], {6}, 6, []),                         # fewer steps than keep_last
    (1, None, [2, 4], {6}, 6, []),                            # the trusted step is not usable: no anchor
    (1, 3, [3, 6, 9, 10], {10}, 10, []),                      # keep_every covers everything older
])
def test_steps_to_delete(keep_last, keep_every, usable, trusted, newest_saved, doomed):
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
    assert policy.steps_to_delete(usable, trusted=trusted, newest_saved=newest_saved) == doomed


@pytest.mark.parametrize("kwargs, message", [
    (dict(keep_last=0), r"^keep_last=0: give an integer >= 1$"),
    (dict(keep_last="3"), r"^keep_last='3': give an integer >= 1$"),
    (dict(keep_every=0), r"^keep_every=0: give an integer >= 1 or None$"),
    (dict(keep_every=2.5), r"^keep_every=2.5: give an integer >= 1 or None$"),
])
def test_policy_refuses_bad_values(kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        RetentionPolicy(**kwargs)
