"""Folders written all at once: beside their final path, renamed into place at the end.

    with new_folder("data/notes") as tmp:        # refuses an existing, non-empty folder
        write_everything_into(tmp)               # any error: nothing is left at data/notes
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Iterator

from meshtrain.errors import ConfigError


@contextlib.contextmanager
def new_folder(out: str, flag: str = "--out") -> Iterator[str]:
    """Yield a fresh folder beside ``out``; when the block ends, rename it to ``out`` (which must not
    exist, or be an empty folder: else a ``ConfigError`` naming ``flag``). On any error, or Ctrl-C,
    the partial folder is removed and nothing is left at ``out``."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"{flag} {out!r} already exists and is not an empty folder; pass a new folder")
    partial = os.path.abspath(out).rstrip(os.sep) + f".partial-{os.getpid()}"
    os.makedirs(partial)
    try:
        yield partial
        if os.path.isdir(out):
            os.rmdir(out)  # the empty folder given as out
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
