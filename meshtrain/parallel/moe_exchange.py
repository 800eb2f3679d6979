"""The expert token exchange: flat, or hierarchical over an ``expert`` axis that spans slices (ICI × DCN).

Expert parallelism moves every device's tokens to the devices that hold their experts and back
(:mod:`meshtrain.parallel.moe`). Over ``ep = n · m`` devices, ``n`` slices (DCN groups) of ``m`` devices:

* **flat**: one ``all_to_all`` over the whole expert axis: each device sends ``ep − 1`` messages of
  ``B / ep`` (``B`` its buffer), ``(n − 1) · m`` of them across DCN;
* **hierarchical** (Tutel's 2D all-to-all): an ``all_to_all`` among the ``m`` devices of each slice first
  (device ``(s, l)`` hands local peer ``l'`` everything bound for ``(·, l')``), then one among the ``n``
  devices with the same local index (``(s, l')`` → ``(s', l')``, the rows of all ``m`` sources for ``s'`` in one
  message). DCN carries the same bytes, ``B · (n − 1) / n``, in ``n − 1`` messages instead of ``(n − 1) · m``;
  ICI carries ``B · (m − 1) / m`` instead of ``B · (m − 1) / (n·m)``. The result equals the flat one row for row.
* **PCC** (tensor parallelism, DeepSpeed-TED's Parallelism Coordinated Communication): the tokens are the same
  on every tensor rank, so each rank sends only its ``1/t`` share of the hidden width through the exchange and
  the ranks all-gather after; on the way back the experts' partial sums are reduce-scattered over ``tensor``
  first (each rank keeps its reduced share), exchanged, combined, and all-gathered. Both exchange levels, DCN
  included, carry ``1/t`` of the bytes, for one all-gather and one reduce-scatter over ``tensor`` (ICI).

The decision is made once per step (:func:`resolve_exchange`, read by
:class:`meshtrain.parallel.resolved.ResolvedStep`); the kernels run it inside ``shard_map`` through
:class:`TokenExchange`. Example::

    ex = resolve_exchange(recipe.dimension(Expert), plan.rules, recipe.mesh, plan.mesh_sizes)
    ex.describe()    # "hierarchical: all-to-all inside 2 slices of 4, then across them ..."
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Mapping, Optional, Tuple

import jax

from meshtrain.errors import ConfigError
from meshtrain.strategies import AllToAll


@dataclasses.dataclass(frozen=True)
class ExpertExchange:
    """How a step's expert parallelism exchanges tokens: ``kind`` (flat or hierarchical) over ``expert_axes``
    (mesh axes of size > 1 that split the experts), which span ``slices`` DCN groups of ``per_slice`` devices
    each (``slices = 1``: the axes stay inside one slice). Example: ``ExpertExchange(AllToAll.HIERARCHICAL,
    ("expert",), 2, 4)`` for ``expert=8`` laid out as ICI 4 × DCN 2."""

    kind: AllToAll = AllToAll.FLAT
    expert_axes: Tuple[str, ...] = ()
    slices: int = 1
    per_slice: int = 1

    @property
    def hierarchical(self) -> bool:
        return self.kind is AllToAll.HIERARCHICAL

    @property
    def ep(self) -> int:
        return self.slices * self.per_slice

    def groups(self) -> Tuple[List[List[int]], List[List[int]]]:
        """``(inside, across)``: replica groups over the expert axes' linear index (slice-major, ``s·m + l``):
        the devices of one slice, and the devices of one local index across slices."""
        n, m = self.slices, self.per_slice
        return ([[s * m + l for l in range(m)] for s in range(n)], [[s * m + l for s in range(n)] for l in range(m)])

    def describe(self) -> str:
        """What the plan prints, e.g. ``"flat: one all-to-all over expert (8 devices, 2 slices)"``."""
        axes = "+".join(self.expert_axes) or "no axis"
        if not self.hierarchical:
            where = f", {self.slices} slices" if self.slices > 1 else ""
            return f"flat: one all-to-all over {axes} ({self.ep} devices{where})"
        return (f"hierarchical: all-to-all inside each of {self.slices} slices ({self.per_slice} devices over ICI), "
                f"then across slices ({self.slices} devices over DCN); tensor ranks send their share (PCC)")


def resolve_exchange(expert, rules, mesh_spec, sizes: Mapping[str, int]) -> ExpertExchange:
    """The :class:`ExpertExchange` of a recipe's ``ep`` dimension ``expert`` (``None``: no expert parallelism)
    under ``rules`` on a mesh of total ``sizes`` whose DCN part is ``mesh_spec.dcn``. Raises ``ConfigError``
    for ``hierarchical`` where it cannot apply: no expert axis across DCN, or DCN inside an ICI-split axis
    (the slices must be the outer part of the expert index)."""
    if expert is None:
        return ExpertExchange()
    rule = rules.table("params").get("expert")
    axes = tuple(a for a in (rule.mesh_axes if rule else ()) if sizes.get(a, 1) > 1)
    dcn = dict(mesh_spec.dcn) if mesh_spec is not None else {}
    per_axis = [(a, dcn.get(a, 1), sizes[a] // dcn.get(a, 1)) for a in axes]
    slices = math.prod(d for _, d, _ in per_axis)
    ex = ExpertExchange(expert.all_to_all, axes, slices, math.prod(i for _, _, i in per_axis))
    if not ex.hierarchical:
        return ex
    if slices == 1:
        where = f"the expert axes {'+'.join(axes)} lie" if axes else "no mesh axis of size > 1 splits the experts; all"
        raise ConfigError(f"all_to_all=hierarchical needs an expert axis that spans slices/nodes (DCN), but {where} "
                          f"inside one slice (mesh {dict(sizes)}, dcn {dcn or 'none'}): use --all-to-all flat, or "
                          f"put part of `expert` on DCN (a recipe's mesh `dcn: {{expert: 2}}`, or train --dcn "
                          f"expert=2 across processes)")
    last_dcn = max(i for i, (_, d, _) in enumerate(per_axis) if d > 1)
    first_ici = min((i for i, (_, _, s) in enumerate(per_axis) if s > 1), default=len(per_axis))
    if first_ici < last_dcn:
        raise ConfigError(f"all_to_all=hierarchical: the DCN part of the expert axes {axes} is inside an axis that "
                          f"is split within a slice ({per_axis[first_ici][0]}); put the DCN factor on the outermost "
                          f"expert axis, or use --all-to-all flat")
    return ex


def exchange(x, ex: ExpertExchange):
    """All-to-all of ``x`` (leading dimension ``ep``: row ``j`` goes to expert device ``j``) over ``ex``'s axes;
    the result's row ``i`` came from device ``i`` (the same as ``all_to_all(x, axes, 0, 0, tiled=True)``).
    Hierarchical: inside each slice, then across slices (see the module docstring)."""
    if not ex.hierarchical:
        return jax.lax.all_to_all(x, ex.expert_axes, 0, 0, tiled=True)
    n, m = ex.slices, ex.per_slice
    rest = x.shape[1:]
    inside, across = ex.groups()
    y = x.reshape((n, m) + rest).swapaxes(0, 1)                    # [local destination, slice destination]
    if m > 1:  # to the local peer with the destination's local index
        y = jax.lax.all_to_all(y, ex.expert_axes, 0, 0, tiled=True, axis_index_groups=inside)
    y = y.swapaxes(0, 1)                                           # [slice destination, local source]
    if n > 1:  # one message per remote slice: the rows of every local source for it
        y = jax.lax.all_to_all(y, ex.expert_axes, 0, 0, tiled=True, axis_index_groups=across)
    return y.reshape((n * m,) + rest)                              # [slice source · m + local source]


@dataclasses.dataclass(frozen=True)
class TokenExchange:
    """The exchange one ``shard_map`` body of the expert kernels runs: ``ex`` and the tensor axes ``mlp_axes``
    (``t`` devices) that split the experts' width. Flat: :meth:`send` and :meth:`back` are plain all-to-alls
    and :meth:`finish` all-reduces the partial outputs over ``tensor``. Hierarchical with ``t > 1``: PCC
    (each tensor rank moves its ``1/t`` share of the width; see the module docstring)."""

    ex: ExpertExchange
    mlp_axes: Tuple[str, ...] = ()
    tensor: int = 1

    @property
    def pcc(self) -> bool:
        return self.ex.hierarchical and self.tensor > 1

    def check_width(self, d: int) -> None:
        if self.pcc and d % self.tensor:
            raise ConfigError(f"all_to_all=hierarchical with tensor parallelism sends each of the {self.tensor} "
                              f"tensor ranks a share of the width d_model={d}, which does not divide: use a d_model "
                              f"divisible by {self.tensor}, or --all-to-all flat")

    def send(self, x):
        """``x`` (``ep`` destinations first, full width) → the rows received (``ep`` sources first, full width)."""
        if not self.pcc:
            return exchange(x, self.ex)
        share = x.shape[-1] // self.tensor
        mine = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.mlp_axes) * share, share, axis=x.ndim - 1)
        return jax.lax.all_gather(exchange(mine, self.ex), self.mlp_axes, axis=x.ndim - 1, tiled=True)

    def back(self, y):
        """The experts' outputs (``ep`` sources first; partial sums over ``tensor`` when it splits the experts)
        back to their sources: full-width partial sums (flat), or each tensor rank's reduced share (PCC)."""
        if not self.pcc:
            return exchange(y, self.ex)
        return exchange(jax.lax.psum_scatter(y, self.mlp_axes, scatter_dimension=y.ndim - 1, tiled=True), self.ex)

    def finish(self, y_btd):
        """The combined output, the same on every tensor rank: the all-reduce of the partial sums (flat), or the
        all-gather of the reduced shares (PCC)."""
        if self.pcc:
            return jax.lax.all_gather(y_btd, self.mlp_axes, axis=y_btd.ndim - 1, tiled=True, to="invarying")
        return jax.lax.psum(y_btd, self.mlp_axes) if self.mlp_axes else y_btd


def active_exchange(ctx, expert_axes: Tuple[str, ...]) -> Optional[ExpertExchange]:
    """The step's resolved :class:`ExpertExchange` when it is hierarchical over ``expert_axes`` (the axes the
    kernel found), else ``None`` (the flat exchange)."""
    resolved = getattr(ctx, "resolved", None) if ctx is not None else None
    ex = getattr(resolved, "expert_exchange", None)
    if ex is None or not ex.hierarchical:
        return None
    if tuple(ex.expert_axes) != tuple(expert_axes):
        raise ConfigError(f"all_to_all=hierarchical was planned over the expert axes {ex.expert_axes}, but this "
                          f"layer's experts split over {expert_axes}; use --all-to-all flat")
    return ex
