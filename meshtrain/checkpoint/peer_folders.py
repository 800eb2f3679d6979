"""Where the in-memory peer copies live (:mod:`meshtrain.checkpoint.peers`): one RAM folder per run folder.

Standard library only, so ``meshtrain launch`` names the folder it cleans up without loading JAX::

    store_folder(Path("runs/a/checkpoints"))      # /dev/shm/meshtrain-peers-<16 hex digits>
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

ENV_PEER_DIR = "MESHTRAIN_PEER_DIR"


def peer_root() -> Path:
    """The RAM-backed folder the copies go to (``MESHTRAIN_PEER_DIR``, else /dev/shm, else tmp)."""
    given = os.environ.get(ENV_PEER_DIR)
    if given:
        return Path(given)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def store_folder(checkpoint_dir: Path, root: Optional[Path] = None) -> Path:
    """The peer folder of a run's ``checkpoints/`` folder (one per run folder path)."""
    key = hashlib.sha256(str(Path(checkpoint_dir).absolute()).encode()).hexdigest()[:16]
    return (root or peer_root()) / f"meshtrain-peers-{key}"


def process_folder(checkpoint_dir: Path, process: int, root: Optional[Path] = None) -> Path:
    """Where ``process`` keeps its own copies and its predecessor's (what a lost host loses)."""
    return store_folder(checkpoint_dir, root) / f"process-{process}"
