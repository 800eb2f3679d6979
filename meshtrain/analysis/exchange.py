"""The expert token exchange's collectives over ICI and DCN: modelled for a plan, and read from a compiled program.

:mod:`meshtrain.parallel.moe_exchange` runs the exchange flat (one all-to-all over the ``ep = n·m`` expert
devices of ``n`` slices) or hierarchical (inside each slice over ``m``, then across slices over ``n``; tensor
ranks moving ``1/t`` of the width, PCC). For one all-to-all whose result is ``B`` bytes on a device, a direct
all-to-all sends ``B/g`` to each of the other ``g − 1`` members of its group; what crosses DCN is what goes to
members in other slices:

* flat: ``B · (n − 1)/n`` bytes across DCN, in ``(n − 1)·m`` messages of ``B/(n·m)``;
* hierarchical: the DCN level moves ``B/t`` over ``n``: ``B/t · (n − 1)/n`` bytes in ``n − 1`` messages of
  ``B/(t·n)``; the ICI level ``B/t · (m − 1)/m`` inside the slice.

So DCN bytes drop by ``t`` (the tensor ranks' shares: 1 without tensor parallelism) and DCN messages by ``m``
(:func:`dcn_per_op`). :func:`compiled_dcn` reads the same figures from the compiled HLO's all-to-alls (their
replica groups against the slices of the plan's mesh). Example::

    slices = slice_of_positions(plan)                    # slice index of each mesh position
    compiled_dcn(hlo_collectives(text, plan.mesh), slices)   # {"bytes": ..., "messages": ...} per step
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import numpy as np

from meshtrain.analysis.collectives import _replica_groups
from meshtrain.parallel.moe_exchange import ExpertExchange


@dataclasses.dataclass(frozen=True)
class ExchangeLevel:
    """One all-to-all of the exchange per dispatch or combine: ``group`` devices, ``bytes`` its result per device,
    ``span`` ``"ici"`` (inside a slice), ``"dcn"`` (across slices) or ``""`` (the flat exchange, priced by its axes)."""

    group: int
    bytes: float
    span: str


def exchange_levels(ex: ExpertExchange, per_op: float, tensor: int) -> Tuple[ExchangeLevel, ...]:
    """The all-to-alls one dispatch (or combine) runs for a buffer of ``per_op`` bytes per device (flat: one over
    ``ep``; hierarchical: the ICI level over ``m`` if ``m > 1`` and the DCN level over ``n``, each on ``1/tensor`` of
    the width)."""
    if not ex.hierarchical:
        return (ExchangeLevel(ex.ep, float(per_op), ""),)
    share = float(per_op) / max(tensor, 1)
    inside = (ExchangeLevel(ex.per_slice, share, "ici"),) if ex.per_slice > 1 else ()
    return inside + (ExchangeLevel(ex.slices, share, "dcn"),)


def dcn_per_op(ex: ExpertExchange, per_op: float, tensor: int) -> Dict[str, float]:
    """``{"bytes", "messages"}`` one device sends across DCN per dispatch (or combine) of a ``per_op``-byte buffer
    (see the module docstring); zeros when the expert axes stay inside one slice."""
    n, m = ex.slices, ex.per_slice
    if n <= 1:
        return {"bytes": 0.0, "messages": 0.0}
    if ex.hierarchical:
        return {"bytes": per_op / max(tensor, 1) * (n - 1) / n, "messages": float(n - 1)}
    return {"bytes": per_op * (n - 1) / n, "messages": float((n - 1) * m)}


def slice_of_positions(plan) -> np.ndarray:
    """The slice (DCN group) of every mesh position (``mesh.devices.flat`` order, the HLO's partition ids), from the
    recipe's ICI × DCN sizes: along an axis of total size ``ici · dcn`` the DCN index is the outer part
    (:meth:`meshtrain.MeshSpec.build`)."""
    sizes = dict(plan.mesh_sizes)
    dcn = {a: s for a, s in plan.recipe.mesh.dcn if s > 1}
    names = tuple(sizes)
    coords = np.indices(tuple(sizes[a] for a in names)).reshape(len(names), -1)
    slice_id = np.zeros(coords.shape[1], np.int64)
    for i, a in enumerate(names):
        if a in dcn:
            slice_id = slice_id * dcn[a] + coords[i] // (sizes[a] // dcn[a])
    return slice_id


def compiled_dcn(collectives: Sequence, slices: np.ndarray, kinds=("all-to-all",)) -> Dict[str, float]:
    """``{"bytes", "messages"}`` per step that one device (the busiest) sends across slices in the compiled
    collectives of ``kinds`` (direct all-to-all: ``result/g`` to each member of its group in another slice),
    with ``slices`` from :func:`slice_of_positions`."""
    total_bytes, total_msgs = 0.0, 0.0
    for c in collectives:
        if c.kind not in kinds or c.group_size <= 1:
            continue
        groups: List[List[int]] = _replica_groups(c.line) or []
        remote = max((sum(1 for q in g if slices[q] != slices[p]) for g in groups for p in g), default=0)
        total_bytes += c.bytes * remote / c.group_size * c.executions
        total_msgs += remote * c.executions
    return {"bytes": total_bytes, "messages": total_msgs}
