"""A LoRA run's checkpoint (:mod:`meshtrain.models.lora`) read as what a reader of parameters wants.

A LoRA state saves the adapters as parameters (``params/.../wq_dnh/lora_a``, ``lora_b``) and the frozen base
as model state (``model_state/.../wq_dnh/base`` [``base_scale``], ``model_state/embedding_vd``, ...); the run's
``alpha`` is in the step's metadata (``user.lora``). A plan of the plain model (``meshtrain export``,
``meshtrain generate``, ``--init-from`` a LoRA run) gets the merged weights ``base + (alpha/r)·A@B``
(:func:`~meshtrain.models.lora.merge_adapters`: float64, one rounding), put onto its shardings::

    parts = read_lora_parts(manager, directory, step)      # LoRAParts(adapters, frozen, alpha, rank, ...)
    params = merged_params(parts, plan_params)             # the plain model's tree, on the plan

The leaves are read whole onto the host (the merge is a host computation): memory of the model in f32,
plus one weight in f64 at a time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from meshtrain.checkpoint.inspection import read_meta
from meshtrain.checkpoint.layout import flat_paths
from meshtrain.checkpoint.types import CheckpointError
from meshtrain.models.lora import merge_adapters

#: the checkpoint metadata key (``user``) under which the Trainer records a LoRA run's settings
LORA_META = "lora"


@dataclasses.dataclass(frozen=True)
class LoRAParts:
    """One LoRA checkpoint step on the host: ``adapters`` ``{path/lora_a|lora_b: array}`` (the f32 master
    copy when the run kept one), ``frozen`` ``{path: array}`` (the base), and the run's settings."""

    adapters: Dict[str, np.ndarray]
    frozen: Dict[str, np.ndarray]
    alpha: float
    rank: int
    targets: tuple = ()
    base: str = "param"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def holds_adapters(saved_tree: Dict[str, Any]) -> bool:
    """Whether a checkpoint's leaf description (``meta["tree"]``) is a LoRA state's."""
    return any(p.startswith(("params/", "opt_state/master/")) and p.endswith("/lora_a") for p in saved_tree)


def read_host_leaves(manager: ocp.CheckpointManager, step: int, paths: Iterable[str]) -> Dict[str, np.ndarray]:
    """``{path: numpy array}`` of the named saved leaves (``params/blocks/attn/wq_dnh/lora_a``, ...), whole."""
    item: Dict[str, Any] = {}
    how: Dict[str, Any] = {}
    paths = list(paths)
    for path in paths:
        node, args = item, how
        *parents, leaf = path.split("/")
        for part in parents:
            node, args = node.setdefault(part, {}), args.setdefault(part, {})
        node[leaf], args[leaf] = np.zeros((1,)), ocp.RestoreArgs(restore_type=np.ndarray)
    restore = ocp.args.Composite(state=ocp.args.PyTreeRestore(item=item, restore_args=how, partial_restore=True))
    out = manager.restore(step, args=restore)["state"]
    found = {}
    for path in paths:
        node = out
        for part in path.split("/"):
            node = node[part]
        found[path] = np.asarray(node)
    return found


def read_lora_parts(manager: ocp.CheckpointManager, directory: Path, step: int,
                    weights: Iterable[str] = ()) -> LoRAParts:
    """The adapters of LoRA checkpoint ``step`` and the frozen base of the plain model's ``weights`` (paths
    such as ``blocks/attn/wq_dnh``; none: the adapters alone), see :class:`LoRAParts`. Raises
    :class:`CheckpointError` for a checkpoint without adapters or without the run's LoRA settings."""
    meta = read_meta(directory / str(step))
    saved = meta["tree"]
    if not holds_adapters(saved):
        raise CheckpointError(f"step {step} in {directory} holds no LoRA adapters (the run trained without "
                              f"--lora-rank); export it merged (the default) instead")
    settings = (meta.get("user") or {}).get(LORA_META)
    if not isinstance(settings, dict) or not isinstance(settings.get("alpha"), (int, float)):
        raise CheckpointError(f"step {step} in {directory} holds LoRA adapters but not the run's --lora-alpha "
                              f"(metadata 'user.{LORA_META}' is missing: saved by an older meshtrain); retrain, or "
                              f"merge with meshtrain.hf.peft.merge_lora(params, model_state, LoRAConfig(...))")
    source = "opt_state/master/" if any(p.startswith("opt_state/master/") for p in saved) else "params/"
    adapter_paths = [p for p in saved if p.startswith(source) and p.endswith(("/lora_a", "/lora_b"))]
    frozen_paths = [p for w in weights for p in (f"model_state/{w}", f"model_state/{w}/base",
                                                 f"model_state/{w}/base_scale") if p in saved]
    try:
        host = read_host_leaves(manager, step, adapter_paths + frozen_paths)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"reading the LoRA adapters and base of step {step} from {directory} failed: "
                              f"{type(exc).__name__}: {str(exc).strip()[:500]}") from exc
    adapters = {p[len(source):]: host[p] for p in adapter_paths}
    rank = int(next(a for p, a in adapters.items() if p.endswith("/lora_a")).shape[-1])
    return LoRAParts(adapters, {p[len("model_state/"):]: host[p] for p in frozen_paths}, float(settings["alpha"]),
                     rank, tuple(settings.get("targets") or ()), str(settings.get("base", "param")))


def merged_params(parts: LoRAParts, final, directory: Optional[Path] = None, step: Optional[int] = None):
    """The plain model's parameters (a tree like ``final``, the plan's ``ShapeDtypeStruct`` params) with the
    adapters merged, each put onto its planned sharding and dtype."""
    merged = merge_adapters(parts.adapters, parts.frozen, parts.scale)
    wanted = flat_paths(final)
    problems = [f"{path}: saved {list(np.shape(merged[path])) if path in merged else None}, planned "
                f"{list(sds.shape)}" for path, sds in wanted
                if path not in merged or tuple(np.shape(merged[path])) != tuple(sds.shape)]
    if problems:
        raise CheckpointError(f"LoRA step {step} in {directory} does not hold this model's base weights: "
                              f"{'; '.join(problems[:8])}{' ...' if len(problems) > 8 else ''}")
    leaves = [jax.device_put(np.asarray(merged[path]).astype(sds.dtype), sds.sharding) for path, sds in wanted]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(final), leaves)
