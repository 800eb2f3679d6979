"""Batch layouts: what a batch looks like (a pytree of shape, dtype and logical axes per leaf).

The plan resolves every leaf through the recipe's *activation* rules, so nothing is placed by
hand and nothing silently replicates::

    layout = BatchLayout.from_example({"images": images, "labels": labels})   # 'batch' on dim 0
    layout = BatchLayout.from_example(batch, axes={"images": ("batch", None, None, None)},
                                      allow_replicated=("mask",))             # a leaf on purpose whole
    plan = make_plan(abstract, "fsdp", batch=layout)     # or batch=BatchSpec(16, 128) for tokens

:class:`BatchSpec` is the language-model shorthand: keys ``inputs / targets / positions /
segment_ids``, each ``(batch, seq)`` int32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np

from meshtrain.abstract import path_str
from meshtrain.errors import ConfigError, RulesError

#: The logical axis the data-parallel mesh axes split (and micro-batching cuts).
BATCH_AXIS = "batch"
#: The logical axis of the sequence (context parallelism splits it and may reorder it).
SEQ_AXIS = "seq"


def _canonical_dtype(dtype) -> np.dtype:
    """The dtype ``jit`` gives an input of ``dtype`` (int64 numpy → int32 unless x64 is on)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return dtype
    return jax.dtypes.canonicalize_dtype(np.dtype(dtype))


def _is_axes(x) -> bool:
    return isinstance(x, (tuple, list)) and all(a is None or isinstance(a, str) for a in x)


def _shape_dtype(x) -> Tuple[Tuple[int, ...], Any]:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(int(d) for d in x.shape), _canonical_dtype(x.dtype)
    arr = np.asarray(x)
    return tuple(arr.shape), _canonical_dtype(arr.dtype)


def _fmt(shape, dtype) -> str:
    return f"{tuple(shape)} {dtype}"


@dataclasses.dataclass(frozen=True)
class BatchLeaf:
    """One batch leaf: global ``shape``, ``dtype``, one logical axis name (or ``None``) per dimension.

    ``allow_replicated=True`` lets this leaf be whole on every device under data parallelism.
    """

    shape: Tuple[int, ...]
    dtype: Any
    axes: Tuple[Optional[str], ...]
    allow_replicated: bool = False

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", _canonical_dtype(self.dtype))
        object.__setattr__(self, "axes", tuple(self.axes))

    @property
    def batch_dim(self) -> Optional[int]:
        """The dimension named ``batch`` (split over data-parallel devices and micro-batches), if any."""
        return self.axes.index(BATCH_AXIS) if BATCH_AXIS in self.axes else None

    @property
    def seq_dim(self) -> Optional[int]:
        """The dimension named ``seq``, if any."""
        return self.axes.index(SEQ_AXIS) if SEQ_AXIS in self.axes else None

    def abstract(self, sharding=None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)


def _is_leaf(x) -> bool:
    return isinstance(x, BatchLeaf)


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """A pytree of :class:`BatchLeaf`: the global batch a step takes.

    Args:
      tree: any pytree (dict, list, tuple, registered node) whose leaves are :class:`BatchLeaf`.
      allow_replicated: leaf paths (``"mask"``, ``"extras/mask"``; a prefix covers what is under it)
        that may be whole on every device under data parallelism, or ``True`` for all leaves.
        Without it, a leaf no mesh axis splits is a ``PlanError`` when the recipe has
        data-parallel devices.

    Build one with :meth:`from_example`; :class:`BatchSpec` gives the language-model layout.
    """

    tree: Any
    allow_replicated: Union[bool, Tuple[str, ...]] = ()
    _seen: set = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self):
        allow = self.allow_replicated
        if isinstance(allow, str):
            allow = (allow,)
        object.__setattr__(self, "allow_replicated", allow if isinstance(allow, bool) else tuple(allow))
        flat = self.leaves()
        if not flat:
            raise ConfigError("the batch layout has no leaves; a batch is a pytree of arrays")
        for path, leaf in flat:
            if not isinstance(leaf, BatchLeaf):
                raise ConfigError(f"batch layout leaf {path!r} is a {type(leaf).__name__}, not a BatchLeaf; build "
                                  f"layouts with BatchLayout.from_example(batch, axes=...)")
            if len(leaf.axes) != len(leaf.shape):
                raise RulesError(
                    f"batch leaf {path!r} (shape {leaf.shape}, dtype {leaf.dtype}) has logical axes {leaf.axes} of "
                    f"rank {len(leaf.axes)} but the array has rank {len(leaf.shape)}; give one logical name (or "
                    f"None) per dimension, e.g. {(BATCH_AXIS,) + (None,) * max(len(leaf.shape) - 1, 0)}")
        if not isinstance(self.allow_replicated, bool):
            paths = [p for p, _ in flat]
            unknown = [a for a in self.allow_replicated if not any(_covers(a, p) for p in paths)]
            if unknown:
                raise ConfigError(f"allow_replicated names {unknown}, which the batch does not have; its leaves "
                                  f"are {paths}")

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_example(cls, batch, axes=None, *, allow_replicated: Union[bool, Sequence[str]] = ()) -> "BatchLayout":
        """The layout of ``batch``: a pytree of arrays (numpy, jax) or ``jax.ShapeDtypeStruct``s.

        Args:
          batch: an example (or abstract) global batch.
          axes: logical axes per leaf. ``None``: ``batch`` on the leading dimension, the rest
            ``None``. Otherwise a pytree matching ``batch`` (or a prefix of it) whose leaves are axes
            tuples; a dict may name only some keys (the rest keep the default), e.g.
            ``{"images": ("batch", None, None, None), "labels": ("batch",)}``.
          allow_replicated: see :class:`BatchLayout`.
        """
        chosen: Dict[str, Tuple[Optional[str], ...]] = {}
        _assign(batch, axes, (), chosen)

        def leaf(keypath, x):
            shape, dtype = _shape_dtype(x)
            default = ((BATCH_AXIS,) + (None,) * (len(shape) - 1)) if shape else ()
            return BatchLeaf(shape, dtype, chosen.get(path_str(keypath), default))

        tree = jax.tree_util.tree_map_with_path(leaf, batch)
        return cls(tree, True if allow_replicated is True else tuple(allow_replicated or ()))

    # -- views ---------------------------------------------------------------------------------
    def leaves(self) -> List[Tuple[str, BatchLeaf]]:
        """``[(path, leaf)]`` in pytree order."""
        return [(path_str(kp), leaf) for kp, leaf in self._flat[0]]

    def leaves_as_given(self) -> List[Tuple[str, BatchLeaf]]:
        """``[(path, leaf)]`` with dict entries in the order they were written (pytree order sorts
        dict keys); for tables and reports."""
        rank = {}

        def walk(tree, prefix):
            if isinstance(tree, dict):
                for k, v in tree.items():
                    walk(v, prefix + (jax.tree_util.DictKey(k),))
            elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
                for i, v in enumerate(tree):
                    walk(v, prefix + (jax.tree_util.SequenceKey(i),))
            else:
                for kp, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)[0]:
                    rank.setdefault(path_str(prefix + tuple(kp)), len(rank))

        walk(self.tree, ())
        flat = self.leaves()
        return sorted(flat, key=lambda item: rank.get(item[0], len(rank)))

    @functools.cached_property
    def _flat(self):
        return jax.tree_util.tree_flatten_with_path(self.tree, is_leaf=_is_leaf)

    @property
    def treedef(self):
        return self._flat[1]

    def map(self, fn) -> Any:
        """A pytree like the batch with ``fn(path, leaf)`` at each leaf."""
        return jax.tree_util.tree_map_with_path(lambda kp, leaf: fn(path_str(kp), leaf), self.tree, is_leaf=_is_leaf)

    def abstract(self, shardings=None) -> Any:
        """The batch as ``jax.ShapeDtypeStruct``s (with ``shardings``, a matching pytree, if given)."""
        if shardings is None:
            return self.map(lambda _, leaf: leaf.abstract())
        return jax.tree.map(lambda leaf, s: leaf.abstract(s), self.tree, shardings, is_leaf=_is_leaf)

    def allows_replicated(self, path: str, leaf: BatchLeaf) -> bool:
        if leaf.allow_replicated or self.allow_replicated is True:
            return True
        return bool(self.allow_replicated) and any(_covers(a, path) for a in self.allow_replicated)

    @property
    def batch_size(self) -> int:
        """The global size of the ``batch`` dimension (the same in every leaf that has one)."""
        sizes = {p: leaf.shape[leaf.batch_dim] for p, leaf in self.leaves() if leaf.batch_dim is not None}
        if not sizes:
            raise ConfigError("no batch leaf has a 'batch' axis, so the layout has no batch size")
        if len(set(sizes.values())) > 1:
            raise ConfigError(f"batch leaves disagree on the batch size: {sizes}")
        return next(iter(sizes.values()))

    @property
    def seq_len(self) -> int:
        """The size of the ``seq`` dimension (language-model layouts)."""
        sizes = {p: leaf.shape[leaf.seq_dim] for p, leaf in self.leaves() if leaf.seq_dim is not None}
        if not sizes:
            raise ConfigError("no batch leaf has a 'seq' axis (this is not a token batch); sequence length is "
                              "undefined for this layout")
        if len(set(sizes.values())) > 1:
            raise ConfigError(f"batch leaves disagree on the sequence length: {sizes}")
        return next(iter(sizes.values()))

    def permute_seq(self, batch, order: np.ndarray) -> Any:
        """``batch`` (numpy, this layout's structure) with every leaf that has a ``seq`` axis taken in
        ``order`` along it (``x[:, order]`` for ``(batch, seq, ...)``); the other leaves, and a leaf
        of the wrong length (the feed's shape check names it), as they are."""
        def take(leaf, x):
            arr = np.asarray(x)
            if leaf.seq_dim is None or arr.ndim <= leaf.seq_dim or arr.shape[leaf.seq_dim] != len(order):
                return x
            return np.take(arr, order, axis=leaf.seq_dim)

        return jax.tree.map(take, self.tree, batch, is_leaf=_is_leaf)

    # -- per-step check ------------------------------------------------------------------------
    def check(self, batch) -> None:
        """Raise ``ConfigError`` naming the leaf when ``batch`` differs from this layout in structure,
        shape or dtype. Cheap per step: one flatten, then a set lookup per distinct signature."""
        flat, treedef = jax.tree_util.tree_flatten(batch)
        try:
            sig = (treedef, tuple((tuple(x.shape), x.dtype) for x in flat))
            if sig in self._seen:
                return
        except (AttributeError, TypeError):  # python scalars or lists as leaves: compare the slow way
            sig = None
        self._check_slow(batch)
        if sig is not None and len(self._seen) < 64:
            self._seen.add(sig)

    def _check_slow(self, batch) -> None:
        want = dict(self.leaves())
        got = [(path_str(kp), x) for kp, x in jax.tree_util.tree_flatten_with_path(batch)[0]]
        have = [p for p, _ in got]
        missing = [p for p in want if p not in have]
        extra = [p for p in have if p not in want]
        if missing or extra:
            raise ConfigError(
                "the batch does not have the plan's structure: "
                + (f"missing leaves {missing}" if missing else "")
                + ("; " if missing and extra else "") + (f"unexpected leaves {extra}" if extra else "")
                + f" (plan: {list(want)}); rebuild the plan with make_plan(..., batch=BatchLayout.from_example(batch))"
                " or fix the data")
        for path, x in got:
            shape, dtype = _shape_dtype(x)
            leaf = want[path]
            if shape != leaf.shape or dtype != leaf.dtype:
                raise ConfigError(
                    f"batch leaf {path!r} is {_fmt(shape, dtype)} but the plan expects {_fmt(leaf.shape, leaf.dtype)} "
                    f"(logical axes {leaf.axes}); pass batches of the planned global shape and dtype or rebuild the "
                    f"plan with make_plan(..., batch=BatchLayout.from_example(batch))")
        if jax.tree_util.tree_structure(batch) != jax.tree_util.tree_structure(self.tree, is_leaf=_is_leaf):
            raise ConfigError(f"the batch's container types differ from the plan's: got "
                              f"{jax.tree_util.tree_structure(batch)}, plan {self.treedef}")


def _covers(name: str, path: str) -> bool:
    return path == name or path.startswith(name.rstrip("/") + "/")


def _assign(batch, axes, prefix: tuple, out: Dict[str, Tuple[Optional[str], ...]]) -> None:
    """Fill ``out[path] = axes`` for each leaf of ``batch`` that ``axes`` (a prefix tree) names."""
    where = path_str(prefix) or "the batch"
    if axes is None:
        return
    if _is_axes(axes):
        for kp, _ in jax.tree_util.tree_flatten_with_path(batch)[0]:
            out[path_str(prefix + tuple(kp))] = tuple(axes)
        return
    if isinstance(axes, Mapping):
        if not isinstance(batch, Mapping):
            raise ConfigError(f"axes give a dict for {where}, which is a {type(batch).__name__}")
        unknown = [k for k in axes if k not in batch]
        if unknown:
            raise ConfigError(f"axes name keys {unknown} that {where} does not have (keys: {list(batch)})")
        for k, sub in axes.items():
            _assign(batch[k], sub, prefix + (jax.tree_util.DictKey(k),), out)
        return
    if isinstance(axes, (list, tuple)) and isinstance(batch, (list, tuple)) and len(axes) == len(batch):
        for i, sub in enumerate(axes):
            _assign(batch[i], sub, prefix + (jax.tree_util.SequenceKey(i),), out)
        return
    leaves, treedef = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: x is None or _is_axes(x))
    try:
        treedef.flatten_up_to(batch)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"axes for {where} do not match its structure: {exc}") from None
    for kp, sub in leaves:
        subtree = batch
        for k in kp:
            subtree = _child(subtree, k)
        _assign(subtree, sub, prefix + tuple(kp), out)


def _child(tree, key):
    for attr in ("key", "idx"):
        if hasattr(key, attr):
            return tree[getattr(key, attr)]
    return getattr(tree, key.name)


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """Global token batch: ``batch_size`` sequences of ``seq_len`` tokens, each key ``(batch, seq)``.

    The language-model shorthand for a :class:`BatchLayout` (:meth:`layout`).
    """

    batch_size: int
    seq_len: int
    keys: Tuple[str, ...] = ("inputs", "targets", "positions", "segment_ids")
    dtype: str = "int32"

    def abstract(self) -> Dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct((self.batch_size, self.seq_len), np.dtype(self.dtype)) for k in self.keys}

    def layout(self) -> BatchLayout:
        if self.batch_size < 1 or self.seq_len < 1:
            raise ConfigError(f"batch size {self.batch_size} and sequence length {self.seq_len} must be positive")
        return BatchLayout({k: BatchLeaf((self.batch_size, self.seq_len), self.dtype, (BATCH_AXIS, "seq"))
                            for k in self.keys})


def as_batch_layout(batch, axes=None) -> BatchLayout:
    """A :class:`BatchLayout` from a layout, a :class:`BatchSpec`, or an example batch pytree."""
    if isinstance(batch, BatchLayout):
        return batch
    if isinstance(batch, BatchSpec):
        return batch.layout()
    return BatchLayout.from_example(batch, axes)
