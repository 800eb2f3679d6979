"""Results of meshtrain's abstract traces, kept on disk between processes, keyed by the code that made them.

The planner's activation formulas (:func:`meshtrain.analysis.activations.saved_activations`) come from
tracing a probe decoder's loss VJP, ~0.4 CPU s, and every ``meshtrain train`` (its memory pre-flight) and
``meshtrain plan`` traced them again. What such a trace returns depends only on its key and on the code:
meshtrain's own sources and the versions of jax, jaxlib and flax. So it is kept as JSON under
``$MESHTRAIN_CACHE_DIR/traces`` (default ``~/.cache/meshtrain/traces``), one file per key and code
fingerprint. A file that is missing, unreadable or malformed is traced again and rewritten; a folder that
cannot be written costs the trace, never the run. ``MESHTRAIN_CACHE_DIR=off``: nothing read or written.

Example (what :mod:`meshtrain.analysis.activations` does)::

    model = cached_trace("activations", ["full", "float32"], trace, encode, decode)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from typing import Any, Callable, List, Optional

#: ``False`` once this process's code was patched (:func:`forget_for_this_process`)
_ENABLED: List[bool] = [True]


def cache_dir() -> Optional[str]:
    """The folder of the traces, or ``None`` (``MESHTRAIN_CACHE_DIR=off``, or this process forgot them)."""
    root = os.environ.get("MESHTRAIN_CACHE_DIR")
    if root == "off" or not _ENABLED[0]:
        return None
    return os.path.join(root or os.path.join(os.path.expanduser("~"), ".cache", "meshtrain"), "traces")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of meshtrain's sources (every ``.py`` and ``.cc`` file of the package, by path and content) and of
    the jax, jaxlib and flax versions: a trace made by other code is never read (~10 ms, once per process)."""
    import flax
    import jax
    import jaxlib

    digest = hashlib.sha256()
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".cc")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, package).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    digest.update(f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__}".encode())
    return digest.hexdigest()[:32]


def cached_trace(kind: str, key: Any, compute: Callable[[], Any], encode: Callable[[Any], Any],
                 decode: Callable[[Any], Any]) -> Any:
    """``compute()``, or what an earlier process stored for ``kind`` and ``key`` (JSON-able) under this code.

    ``encode`` turns the result into JSON-able data, ``decode`` turns that back (and raises ``KeyError``,
    ``TypeError`` or ``ValueError`` on data it cannot read: the trace is then made again)."""
    folder = cache_dir()
    if folder is None:
        return compute()
    name = hashlib.sha256(json.dumps([kind, key, code_fingerprint()]).encode()).hexdigest()[:32]
    path = os.path.join(folder, f"{kind}-{name}.json")
    try:
        with open(path) as f:
            return decode(json.load(f))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    value = compute()
    _write(folder, path, encode(value))
    return value


def _write(folder: str, path: str, data: Any) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed: concurrent processes that
    made the same trace each rename a complete file)."""
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass   # a read-only or full disk: the next process traces again
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def forget_for_this_process() -> None:
    """Neither read nor write traces on disk from now on in this process: its code was patched (a test's
    monkeypatch of what a trace runs), so the fingerprint of its files no longer says what it computes."""
    _ENABLED[0] = False
