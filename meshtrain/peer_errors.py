"""A peer's death, said in one line: when another process of a multi-process run dies (killed, out of
memory, its host lost), the collective waiting for it fails in this process with a runtime error and
a long traceback (``jax.errors.JaxRuntimeError: UNKNOWN: Gloo AllGather failed: ... Connection reset
by peer``). ``meshtrain``'s command line prints :func:`peer_failure`'s line instead, e.g.::

    error: [process 0] process 1 stopped answering (UNKNOWN: Gloo AllGather failed: Read error
    [127.0.0.1]:45267: Connection reset by peer); the launcher restarts the job from its last checkpoint
    if it has restarts left (traceback in runs/job/error-0.txt)

and keeps the traceback in a file (:func:`keep_traceback`).
"""

from __future__ import annotations

import os
import re
import tempfile
import traceback
from typing import Mapping, Optional

from meshtrain import distributed
from meshtrain.distributed import error_gist

#: Set by ``meshtrain launch --max-restarts`` (the watchdog's ``ENV_ATTEMPT``): a supervisor restarts the job.
_ENV_ATTEMPT = "MESHTRAIN_ATTEMPT"
#: What a collective or the coordination service says when a peer process died, was killed or hangs.
_PEER_GONE = re.compile(r"Gloo .*failed|Connection (?:reset|closed|refused)|Broken pipe|Socket closed|"
                        r"coordination service|heartbeat|task .*(?:died|disconnected|unavailable)|"
                        r"UNAVAILABLE|barrier timed out|GetKeyValue\(\) timed out", re.IGNORECASE)


def peer_failure(exc: BaseException, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """One line for an error that says another process of this run stopped answering (killed, dead,
    unreachable), e.g. ``[process 0] process 1 stopped answering (Gloo AllGather failed: Connection
    reset by peer); the launcher restarts the job from its last checkpoint``; ``None`` for any other
    error, or outside a multi-process run."""
    if not distributed.is_multiprocess() or not _PEER_GONE.search(f"{type(exc).__name__}: {exc}"):
        return None
    env = os.environ if environ is None else environ
    where = distributed.current()
    me, n = where.process_id, where.num_processes
    who = f"process {1 - me}" if n == 2 else f"another process (of {', '.join(str(i) for i in range(n) if i != me)})"
    then = ("the launcher restarts the job from its last checkpoint if it has restarts left"
            if env.get(_ENV_ATTEMPT) is not None else
            "the run stops; continue it with --resume (meshtrain launch --max-restarts K restarts it by itself)")
    return f"[process {me}] {who} stopped answering ({error_gist(exc)}); {then}"


def keep_traceback(exc: BaseException, run_dir: Optional[str]) -> Optional[str]:
    """Write ``exc``'s traceback to ``<run_dir>/error-<process>.txt`` (an existing run folder), else
    to a file in the temporary folder; returns the path, or None when nothing could be written."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = distributed.current()
    me = where.process_id if where is not None else 0
    try:
        if run_dir and os.path.isdir(run_dir):
            path = os.path.join(run_dir, f"error-{me}.txt")
            with open(path, "w") as f:
                f.write(text)
            return path
        fd, path = tempfile.mkstemp(prefix=f"meshtrain-error-{me}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path
    except OSError:
        return None
