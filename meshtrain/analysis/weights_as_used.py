"""The plan's parameters as the step multiplies with them, read off the plan alone (no trace): the
dimension sizes split over the tensor axes, and the bytes of the weights as multiplied (compute
dtype, all-gathered over the data-parallel axes that shard them). :mod:`meshtrain.analysis.traced`
uses them for its activation estimate; the memory and step-time estimates read them directly::

    t, sizes, width = tensor_split_sizes(plan)      # e.g. (4, frozenset({1024, 16}), 256)
    total, extra = working_weight_bytes(plan)       # bytes per device; extra: gathered or cast copies
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from meshtrain.analysis.layout import cached, layout_of


def tensor_split_sizes(plan) -> Tuple[int, frozenset, Optional[int]]:
    """``(t, sizes, width)``: the tensor-parallel size and the dimension sizes the plan splits over the tensor
    axes in some parameter (heads, MLP width, a sharded vocabulary), less the model width (the most common
    dimension of the parameters: the residual stream stays whole), and that width. An
    activation with a dimension of one of ``sizes`` is split ``t`` ways, as the step's sharding propagation
    splits it (e.g. attention scores by their heads)."""
    return cached(plan, "tensor_split_sizes", _tensor_split_sizes, layout_only=True)


def _tensor_split_sizes(plan) -> Tuple[int, frozenset, Optional[int]]:
    lay = layout_of(plan)
    axes, t = set(lay.tensor_axes), lay.tensor
    if t <= 1:
        return 1, frozenset(), None
    sharded, dims = set(), {}
    for leaf in plan.group("params"):
        for size, entry in zip(leaf.shape, tuple(leaf.spec) + (None,) * len(leaf.shape)):
            dims[size] = dims.get(size, 0) + 1
            if _axes_in((entry,)) & axes and size % t == 0:
                sharded.add(size)
    width = max(dims, key=dims.get) if dims else None
    return t, frozenset(sharded - {width}), width


def _tensor_divisor(shape, shape_more_rows, t: int, split: frozenset) -> int:
    """``t`` when a dimension of an activation other than its rows has a tensor-split size, else 1."""
    return t if any(d in split for i, d in enumerate(shape)
                    if i >= len(shape_more_rows) or shape_more_rows[i] == d) else 1


def _axes_in(spec) -> set:
    out = set()
    for e in spec:
        out |= {e} if isinstance(e, str) else set(e or ())
    return out


def working_weight_bytes(plan, *, layers_only: bool = False) -> Tuple[int, int]:
    """``(W, extra)``: bytes per device of the weights as the step multiplies with them (compute
    dtype, all-gathered over the data-parallel axes that shard them: ``Σ E·c / non-batch shards``),
    and the part of that which is not the stored parameter itself (gathered or cast copies).
    ``layers_only``: only the stacked layer weights (leading logical axis ``layers``). Once per layout,
    compute dtype and ``layers_only``."""
    key = ("working_weight_bytes", layers_only, str(np.dtype(plan.recipe.compute_dtype)))
    return cached(plan, key, lambda p: _working_weight_bytes(p, layers_only), layout_only=True)


def _weights_as_multiplied(plan):
    """``(leaf, bytes, copy)`` per parameter: its bytes per device as the step multiplies with it (compute dtype,
    gathered over the data-parallel axes that shard it), and whether that is a copy (gathered or cast), not the
    stored parameter itself."""
    sizes = plan.mesh_sizes
    rule = plan.rules.table("activations").get("batch")
    batch_axes = set(rule.mesh_axes if rule else ())
    compute = np.dtype(plan.recipe.compute_dtype)
    for leaf in plan.group("params"):
        axes = _axes_in(leaf.spec)
        shards = math.prod(sizes.get(a, 1) for a in axes - batch_axes)
        gathered = any(sizes.get(a, 1) > 1 for a in axes & batch_axes)
        yield leaf, math.prod(leaf.shape) * compute.itemsize // max(shards, 1), gathered or np.dtype(leaf.dtype) != compute


def _frozen_as_multiplied(plan):
    """``(leaf, bytes, copy)`` per frozen weight of a LoRA plan (model state in ``abstract.frozen_paths``): a
    target's base (``.../base``) is read as ``base + scale·A@B``, a new buffer in the compute dtype, gathered
    over the data-parallel axes that shard it; another frozen weight is multiplied in its stored dtype,
    gathered likewise (a copy when gathered). An int8 base's scales (``.../base_scale``) are left out (tiny)."""
    frozen = getattr(plan.abstract, "frozen_paths", frozenset())
    if not frozen:
        return
    sizes = plan.mesh_sizes
    rule = plan.rules.table("activations").get("batch")
    batch_axes = set(rule.mesh_axes if rule else ())
    compute = np.dtype(plan.recipe.compute_dtype)
    for leaf in plan.group("model_state"):
        if leaf.path not in frozen or leaf.path.endswith("/base_scale"):
            continue
        axes = _axes_in(leaf.spec)
        shards = math.prod(sizes.get(a, 1) for a in axes - batch_axes)
        gathered = any(sizes.get(a, 1) > 1 for a in axes & batch_axes)
        target = leaf.path.endswith("/base")
        itemsize = compute.itemsize if target else np.dtype(leaf.dtype).itemsize
        yield leaf, math.prod(leaf.shape) * itemsize // max(shards, 1), gathered or target


def _stacked(leaf) -> bool:
    """A stacked layer weight: leading logical axis ``layers`` (a layer scan reads one slice per iteration)."""
    return bool(leaf.logical_axes) and leaf.logical_axes[0] == "layers"


def _working_weight_bytes(plan, layers_only: bool) -> Tuple[int, int]:
    total = extra = 0
    for leaf, w, copy in _weights_as_multiplied(plan):
        if layers_only and not _stacked(leaf):
            continue
        total += w
        extra += w if copy else 0
    return total, extra


def gathered_layer_bytes(plan, *, remat: bool) -> int:
    """Bytes per device of the gathered or cast weight copies the step holds at once on a traced plan: as
    :func:`working_weight_bytes`'s ``extra``, except that with ``remat`` (the traced program runs remat
    segments) a stacked layer weight (:func:`_stacked`) counts one layer's slice: the backward recomputes each
    layer's forward, gathering its slice again, so no gathered copy is kept from the forward (big_vision's ViT
    with its own scan+remat, fsdp on 16 devices: +26 % with every layer's copy counted, −7 % with one). Without
    remat every layer's copy counts (XLA may keep the forward's gathered slices for the backward: vit-tiny, fsdp,
    8 devices). A LoRA plan's frozen base counts as the parameters do (:func:`_frozen_as_multiplied`)."""
    return sum(w // (leaf.shape[0] if remat and _stacked(leaf) and leaf.shape[0] > 0 else 1)
               for leaf, w, copy in (*_weights_as_multiplied(plan), *_frozen_as_multiplied(plan)) if copy)
