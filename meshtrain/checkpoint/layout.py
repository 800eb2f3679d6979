"""How a ``TrainState`` is laid out in a checkpoint, and how it is compared with a restore target.

The state is saved as a nested dict of string keys built from its pytree paths (dataclass fields,
dict keys, tuple indices), so the on-disk format does not depend on Python classes such as optax's
named tuples::

    flat_paths(state)[:2]   # [("step", ...), ("params/blocks/attn/wk_dkh", ...)]
    to_nested(state)        # {"step": a, "params": {"blocks": ...}, "opt_state": {"0": {"count": ...}}}

A description of every leaf (shape, dtype, saved sharding, bytes) goes into the checkpoint's
``meta`` item; restore compares it with the target and lists every mismatching path.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshtrain.checkpoint.types import CheckpointError

_ESCAPES = (("%", "%25"), (".", "%2E"), ("/", "%2F"))


def _escape(name: str) -> str:
    for a, b in _ESCAPES:
        name = name.replace(a, b)
    return name


def key_name(k) -> str:
    """One path component as a string: dict key, sequence index or attribute name."""
    if isinstance(k, jax.tree_util.DictKey):
        return _escape(str(k.key))
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return _escape(k.name)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return _escape(str(k))


def flat_paths(tree) -> List[Tuple[str, Any]]:
    """``[(path, leaf)]`` with paths like ``opt_state/0/mu/embedding_vd``; raises on duplicate paths."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = [("/".join(key_name(k) for k in path), leaf) for path, leaf in leaves]
    seen = set()
    for p, _ in out:
        if p in seen:
            raise CheckpointError(f"two state leaves map to the checkpoint path {p!r}; rename the dict key "
                                  f"so that keys and tuple indices differ")
        seen.add(p)
    return out


def to_nested(tree) -> Dict[str, Any]:
    """The state as nested dicts of string keys (what Orbax writes)."""
    root: Dict[str, Any] = {}
    for path, leaf in flat_paths(tree):
        node = root
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    return root


def from_nested(nested: Dict[str, Any], like) -> Any:
    """Rebuild a pytree shaped like ``like`` from the nested dict that :func:`to_nested` made."""
    leaves = []
    for path, _ in flat_paths(like):
        node = nested
        for part in path.split("/"):
            node = node[part]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def sharding_json(sharding) -> Any:
    """A JSON description of a sharding: ``{"spec": [...], "mesh": {axis: size}}`` or a string."""
    if isinstance(sharding, NamedSharding):
        spec = [list(e) if isinstance(e, tuple) else e for e in sharding.spec]
        return {"spec": spec, "mesh": {str(k): int(v) for k, v in sharding.mesh.shape.items()}}
    if sharding is None:
        return None
    return type(sharding).__name__


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def dtype_name(dtype) -> str:
    """``float32``, ``int32``, ... and ``key<fry>`` for PRNG key arrays (dropout streams), which
    ``np.dtype`` cannot interpret."""
    return str(dtype) if _is_key(dtype) else np.dtype(dtype).name


def itemsize(dtype) -> int:
    """Bytes per element; a threefry key is two uint32 words."""
    if _is_key(dtype):
        return 8  # threefry2x32 (JAX's default) keys are two uint32 words
    return np.dtype(dtype).itemsize


def describe_tree(tree) -> Dict[str, Dict[str, Any]]:
    """``{path: {"shape", "dtype", "sharding", "bytes"}}`` for every leaf of arrays or ShapeDtypeStructs."""
    out = {}
    for path, x in flat_paths(tree):
        shape = tuple(int(d) for d in np.shape(x))
        out[path] = {"shape": list(shape), "dtype": dtype_name(x.dtype),
                     "sharding": sharding_json(getattr(x, "sharding", None)),
                     "bytes": int(math.prod(shape)) * itemsize(x.dtype)}
    return out


def state_bytes(tree) -> int:
    """Global bytes of all leaves (each array counted once, however it is sharded)."""
    return sum(int(math.prod(np.shape(x))) * itemsize(x.dtype) for x in jax.tree.leaves(tree))


def _shape(s) -> str:
    return "(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")"


def mismatches(saved: Dict[str, Dict[str, Any]], target, *, allow_cast: bool) -> List[str]:
    """Every difference between a saved tree description and a restore target, one line per path,
    in the target's tree order (``step``, ``params``, ``opt_state``, ...), then saved-only paths."""
    problems = []
    want = dict(flat_paths(target))
    for path, t in want.items():
        s = saved.get(path)
        if s is None:
            problems.append(f"missing in checkpoint: {path} (the plan has shape {_shape(t.shape)} "
                            f"{dtype_name(t.dtype)})")
        elif tuple(s["shape"]) != tuple(t.shape):
            problems.append(f"shape: {path} saved {_shape(s['shape'])}, the plan has {_shape(t.shape)}")
        elif s["dtype"] != dtype_name(t.dtype) and not allow_cast:
            problems.append(f"dtype: {path} saved {s['dtype']}, the plan has {dtype_name(t.dtype)} "
                            f"(pass allow_cast=True to cast)")
    for path in saved:
        if path not in want:
            problems.append(f"not in the plan: {path} (saved {_shape(saved[path]['shape'])} {saved[path]['dtype']})")
    return problems


def mismatch_error(step: int, directory, problems: List[str], metadata: Dict[str, Any]) -> CheckpointError:
    shown = problems[:20]
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    saved_with = ", ".join(f"{k}={metadata[k]!r}" for k in ("model",) if k in metadata)
    recipe = metadata.get("recipe")
    if isinstance(recipe, dict) and "name" in recipe:
        saved_with += (", " if saved_with else "") + f"recipe={recipe['name']!r}"
    hint = (f"; it was saved with {saved_with}" if saved_with else "")
    if all(p.startswith("dtype:") for p in problems):
        fix = f"use the recipe's param_dtype of the checkpoint{hint}, or pass allow_cast=True to cast on load"
    else:
        fix = f"build the plan from the same model and optimizer as the checkpoint{hint}, or start a new run folder"
    return CheckpointError(
        f"checkpoint step {step} in {directory} does not match the restore target ({len(problems)} "
        f"difference(s)):\n  " + "\n  ".join(shown) + more + "\n" + fix)
