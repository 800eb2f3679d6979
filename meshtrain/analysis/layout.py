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
from typing import Dict, Tuple

from meshtrain.analysis.activations import ActivationSplit


@dataclasses.dataclass(frozen=True)
class Layout:
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


def _axes(plan, logical: str) -> Tuple[str, ...]:
    rule = plan.rules.table("activations").get(logical)
    sizes = plan.mesh_sizes
    return tuple(a for a in (rule.mesh_axes if rule else ()) if sizes.get(a, 1) > 1)


def cached(plan, key, fn, *, layout_only: bool = False):
    """``fn(plan)``, memoised on the plan (:meth:`meshtrain.ShardingPlan.cached`; ``layout_only``: ``fn``
    reads only the leaves, mesh, rules, abstract state and batch, not the recipe's knobs). Anything that
    is not a ``ShardingPlan`` is computed every time."""
    memo = getattr(plan, "cached", None)
    return memo(key, fn, layout_only=layout_only) if memo is not None else fn(plan)


def layout_of(plan) -> Layout:
    """The :class:`Layout` of a :class:`meshtrain.ShardingPlan` (computed once per plan)."""
    return cached(plan, "layout", _layout_of)


def _layout_of(plan) -> Layout:
    r = plan.recipe
    dcn = tuple(a for a, s in r.mesh.dcn if s > 1)
    return Layout(tuple(plan.mesh_sizes.items()), _axes(plan, "batch"), _axes(plan, "heads"),
                  _axes(plan, "residual_seq"), _axes(plan, "vocab"), r.micro_batches, r.param_dtype,
                  r.compute_dtype, dcn, _axes(plan, "seq"))
