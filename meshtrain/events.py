"""A run's ``events.jsonl`` (restarts, faults, first steps) and the attempt number the launcher
hands its children, shared by the supervisor (``meshtrain launch``, outside the training processes)
and the watchdog (inside them). Standard library only: ``meshtrain launch`` must start without JAX::

    append_event(run_dir, {"event": "restart", "attempt": 1})
"""

from __future__ import annotations

import json
import os

#: The attempt number (0 for the first) that ``meshtrain launch --max-restarts`` gives its children.
ENV_ATTEMPT = "MESHTRAIN_ATTEMPT"
#: One JSON record per line in the run folder.
EVENTS_FILE = "events.jsonl"


def append_event(run_dir: str, record: dict) -> None:
    """One line of ``<run>/events.jsonl`` (O_APPEND: whole lines from several writers)."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, EVENTS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")
