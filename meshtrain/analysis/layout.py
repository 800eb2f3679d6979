"""What the analysis needs to know about a plan's layout, read from its rules and mesh sizes.

Example::

    lay = layout_of(plan)
    lay.batch_split, lay.tensor, lay.sequence     # 8, 1, 1 for `dp` on 8 devices
    lay.split()                                   # ActivationSplit for the activation model

Works for plans on a ``Mesh`` and on an ``AbstractMesh`` (pod-sized planning).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any, Dict, Optional, Tuple

from meshtrain.analysis.activations import ActivationSplit
from meshtrain.parallel.resolved import batch_splits, resolve_step
from meshtrain.plan import ShardingPlan


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """Mesh sizes and which mesh axes split the batch, the heads (tensor) and the residual sequence."""

    mesh_sizes: Tuple[Tuple[str, int], ...]
    batch_axes: Tuple[str, ...]
    tensor_axes: Tuple[str, ...]
    sequence_axes: Tuple[str, ...]
    vocab_axes: Tuple[str, ...]
    micro_batches: int
    param_dtype: str
    compute_dtype: str
    dcn_axes: Tuple[str, ...] = ()
    #: mesh axes that split the sequence inside attention / MLP blocks (context parallelism)
    context_axes: Tuple[str, ...] = ()

    @property
    def sizes(self) -> Dict[str, int]:
        return dict(self.mesh_sizes)

    # the figures below are read many times per plan (the layout is immutable): computed once, stored on the
    # instance (not fields: equality, hashing and ``dataclasses.replace`` see only the fields)
    @functools.cached_property
    def _size_of(self) -> Dict[str, int]:
        return dict(self.mesh_sizes)

    def size(self, axes) -> int:
        sizes = self._size_of
        return int(math.prod(sizes.get(a, 1) for a in axes))

    @functools.cached_property
    def num_devices(self) -> int:
        return self.size(self._size_of)

    @functools.cached_property
    def batch_split(self) -> int:
        return self.size(self.batch_axes)

    @functools.cached_property
    def tensor(self) -> int:
        return self.size(self.tensor_axes)

    @functools.cached_property
    def sequence(self) -> int:
        return self.size(self.sequence_axes)

    @functools.cached_property
    def context(self) -> int:
        return self.size(self.context_axes)

    def split(self) -> ActivationSplit:
        return self._split

    @functools.cached_property
    def _split(self) -> ActivationSplit:
        return ActivationSplit(self.batch_split, self.tensor, self.sequence, self.micro_batches, self.context)


def _split_axes(table, sizes, logical: str) -> Tuple[str, ...]:
    """The mesh axes (of size > 1) the activation rule for ``logical`` splits over."""
    rule = table.get(logical)
    return tuple(a for a in (rule.mesh_axes if rule else ()) if sizes.get(a, 1) > 1)


class _KeyedRef(weakref.ref):
    """A weak reference that remembers the memo key of its object."""

    __slots__ = ("key",)


class IdentityMemo(Dict[int, Dict[Any, Any]]):
    """Results derived from immutable objects, kept per live object (by identity) and dropped when the object
    is collected: a memo owned by whoever computes the results, not written into the objects themselves.

    ``memo.slot(obj)`` is ``obj``'s dict of results (``memo.get(id(obj))``: the same, ``None`` before the
    first); ``share_with``: a new object's slot is that dict (a variant of ``obj`` whose results of that kind
    are the same)."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: Dict[int, _KeyedRef] = {}

    def slot(self, obj, share_with: Optional[Dict[Any, Any]] = None) -> Dict[Any, Any]:
        key = id(obj)
        found = self.get(key)
        if found is None:
            found = self[key] = {} if share_with is None else share_with
            # dropped when obj is collected, before its id can be reused (a bare weak reference: the planner
            # makes thousands of plans, and heavier finalizers cost garbage-collector time)
            ref = self._refs[key] = _KeyedRef(obj, self._drop)
            ref.key = key
        return found

    def _drop(self, ref: _KeyedRef) -> None:
        self.pop(ref.key, None)
        self._refs.pop(ref.key, None)


#: The planner's memo of figures derived from plans (immutable): per plan, and per layout (shared by the
#: variants :func:`plan_variant` makes of one plan).
_PER_PLAN = IdentityMemo()
_PER_LAYOUT = IdentityMemo()


def cached(plan, key, fn, *, layout_only: bool = False):
    """``fn(plan)``, computed once per plan and ``key`` (``layout_only``: ``fn`` reads only the leaves,
    mesh, rules, abstract state and batch, not the recipe's knobs, so the variants of one plan share it).
    Anything that is not a ``ShardingPlan`` is computed every time."""
    memos = _PER_LAYOUT if layout_only else _PER_PLAN
    memo = memos.get(id(plan))  # the planner asks this ~20 times per candidate: the fast path first
    if memo is None:
        if not isinstance(plan, ShardingPlan):
            return fn(plan)
        memo = memos.slot(plan)
    try:
        return memo[key]
    except KeyError:
        out = memo[key] = fn(plan)
        return out


def resolved_step(plan, target=None):
    """``resolve_step(plan, target)``, once per plan and ``target`` (the planner reads a candidate's step from
    five of its terms): the same object, never a second decision."""
    return cached(plan, ("resolve_step", target), lambda p: resolve_step(p, target))


def per_device_bytes(plan) -> Dict[str, int]:
    """``plan.per_device_bytes()``, once per layout (a variant's recipe places nothing differently); not to
    be modified."""
    return cached(plan, "per_device_bytes", lambda p: p.per_device_bytes(), layout_only=True)


def plan_variant(plan, recipe):
    """``plan`` under ``recipe``, a copy of its recipe that differs only in knobs that do not change any
    leaf's layout (remat, micro-batches, pipeline schedule and repeats, compute dtype, attention): the
    planner's variants of one layout, sharing its layout-only figures. The caller vouches for that;
    nothing is re-resolved."""
    out = dataclasses.replace(plan, recipe=recipe)
    if isinstance(plan, ShardingPlan):
        _PER_LAYOUT.slot(out, share_with=_PER_LAYOUT.slot(plan))
    return out


def layout_of(plan) -> PlanLayout:
    """The :class:`PlanLayout` of a :class:`meshtrain.ShardingPlan` (computed once per plan)."""
    return cached(plan, "layout", _layout_of)


def _layout_of(plan) -> PlanLayout:
    r = plan.recipe
    dcn = tuple(a for a, s in r.mesh.dcn if s > 1)
    sizes, table = plan.mesh_sizes, plan.rules.table("activations")  # read once for the five axes
    axes = lambda logical: _split_axes(table, sizes, logical)  # noqa: E731
    return PlanLayout(tuple(sizes.items()), axes("batch"), axes("heads"), axes("residual_seq"), axes("vocab"),
                      batch_splits(r), r.param_dtype, r.compute_dtype, dcn, axes("seq"))
