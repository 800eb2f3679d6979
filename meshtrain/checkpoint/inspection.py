"""Read-only views of a checkpoint folder (no JAX devices, no Orbax): what ``meshtrain ckpt`` prints.

::

    info = inspect_checkpoint("runs/exp1")           # the run folder or its checkpoints/ subfolder
    info["integrity"]["status"], info["recipe"]["name"], info["tree"][0]
    [c.status for c in list_checkpoints("runs/exp1")]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from meshtrain.checkpoint import integrity
from meshtrain.checkpoint.types import CheckpointError, StepCheck, Verify

META_FORMAT = "meshtrain-checkpoint/1"
META_FILE = "meshtrain-meta.json"


def resolve_directory(path) -> Path:
    """The checkpoint folder for ``path``: the folder itself when it holds step folders (or is named
    ``checkpoints``), else its ``checkpoints/`` subfolder. Raises :class:`CheckpointError` otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; pass a run folder or its checkpoints/ folder")
    if not p.is_dir():
        raise CheckpointError(f"{p} is a file; pass a run folder or its checkpoints/ folder")
    if integrity.step_dirs(p) or integrity.tmp_dirs(p) or p.name == "checkpoints":
        return p
    if (p / "checkpoints").is_dir():
        return p / "checkpoints"
    raise CheckpointError(f"{p} holds no checkpoints (no numbered step folders and no checkpoints/ subfolder); "
                          f"pass a run folder or its checkpoints/ folder")


def _read_json(path: Path, what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {what} {path}: {exc}") from exc


def read_meta(step_dir: Path) -> Dict[str, Any]:
    """A step's ``meshtrain-meta.json``: user metadata, data state, saved tree, versions."""
    path = step_dir / META_FILE
    meta = _read_json(path, "metadata")
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or not isinstance(meta.get("tree"), dict):
        raise CheckpointError(f"{path} is not meshtrain checkpoint metadata (format {META_FORMAT})")
    return meta


def list_checkpoints(directory, verify: Verify = Verify.FULL) -> List[StepCheck]:
    """One :class:`StepCheck` per committed step folder, oldest first."""
    d = resolve_directory(directory)
    return [integrity.check_step(p, s, Verify(verify)) for s, p in integrity.step_dirs(d).items()]


def inspect_checkpoint(directory, step: Optional[int] = None) -> Dict[str, Any]:
    """Everything known about one step, as a JSON-able dict.

    ``step=None`` takes the newest step that passes the full check (the one ``restore`` would use),
    or the newest step when none passes. Keys: ``directory``, ``step``, ``integrity`` (status, reason,
    bytes), ``steps`` (every step, quick check), ``temporary`` (uncommitted folders), ``set_aside``
    (damaged steps moved aside as ``<step>.corrupt``), ``recipe``, ``mesh``
    (axis sizes the state was saved from),
    ``model``, ``metadata``, ``data_state``, ``tree`` (path, shape, dtype, saved sharding, bytes),
    ``state_bytes``, ``items`` (bytes on disk per item), ``saved_unix``, ``versions``; ``error`` when
    the metadata cannot be read.
    """
    d = resolve_directory(directory)
    steps = integrity.step_dirs(d)
    if not steps:
        raise CheckpointError(f"{d} has no committed checkpoint steps"
                              + (f" (temporary folders: {[p.name for p in integrity.tmp_dirs(d)]})"
                                 if integrity.tmp_dirs(d) else ""))
    full: Dict[int, StepCheck] = {}
    if step is None:
        for s in reversed(list(steps)):
            full[s] = integrity.check_step(steps[s], s, Verify.FULL)
            if full[s].status.usable:
                step = s
                break
        else:
            step = max(steps)
    elif int(step) not in steps:
        raise CheckpointError(f"step {step} is not in {d}; steps: {list(steps)}")
    step = int(step)
    check = full.get(step) or integrity.check_step(steps[step], step, Verify.FULL)
    info: Dict[str, Any] = {
        "directory": str(d), "step": step, "integrity": check.to_dict(),
        "steps": [full.get(s, integrity.check_step(p, s, Verify.QUICK)).to_dict() for s, p in steps.items()],
        "temporary": [p.name for p in integrity.tmp_dirs(d)],
        "set_aside": [p.name for p in integrity.aside_dirs(d)],
        "items": {p.name: (integrity.folder_bytes(p) if p.is_dir() else p.stat().st_size)
                  for p in sorted(steps[step].iterdir())},
    }
    try:
        meta = read_meta(steps[step])
    except CheckpointError as exc:
        info["error"] = str(exc)
        return info
    user = meta.get("user") or {}
    tree = [{"path": path, **entry} for path, entry in meta["tree"].items()]
    mesh = next((e["sharding"]["mesh"] for e in tree if isinstance(e.get("sharding"), dict)), None)
    info.update({
        "recipe": user.get("recipe"), "model": user.get("model"), "seed": user.get("seed"),
        "metadata": user, "tree": tree, "state_bytes": sum(e.get("bytes", 0) for e in tree),
        "saved_unix": meta.get("saved_unix"), "process_count": meta.get("process_count"),
        "device_count": meta.get("device_count"), "versions": meta.get("versions"),
        "compression": meta.get("compression"), "mesh": mesh,
        "data_state": meta.get("data_state"),
    })
    return info
