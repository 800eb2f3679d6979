"""The weight gradient the backward holds at full size before reducing it over the data-parallel axes: a
working buffer of the traced estimate (an ``AbstractMesh``) that neither the gradients (kept sharded) nor the
saved activations count.

Under FSDP or ZeRO-2 a device's gradient of a weight is a partial sum over its own rows, computed at the
weight's full (gathered) size, and only then reduce-scattered to the device's shard. The backward's peak is at
its start, where every saved activation is still live; the first weight gradient it makes (the output head's,
``x^T · dlogits``) is live there at full size. With a large vocabulary that buffer is the step's largest::

    first_gradient_bytes(plan, jaxpr, backward, grads)   # bytes per device, 0 without sharded gradients

Measured on HuggingFace's Flax T5 under ``fsdp`` on 64 CPU devices (``tools/bench_plan_any_model.py --models t5
--buffers DIR``; BENCHMARKS.md, "T5 at 64 devices"): XLA's buffer at the peak is ``ynn_fusion.11``,
``f32[2064,256]`` (2,113,536 B, ``transpose(jvp(...))/lm_head/dot_general``), next to the gathered table
``all-gather.34`` (counted with the gathered weights).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.extend.core import Literal

from meshtrain.plan import gradient_shardings


#: Loops whose outputs stack one slice per iteration (a scanned layer stack's gradients).
_LOOPS = ("scan", "while")


def _earliest_full_size(producer, grad) -> Optional[tuple]:
    """``(index, var)``: the earliest backward equation (``producer``: value -> (index, equation), the backward's
    only) that makes a value of ``grad``'s dimensions flowing into ``grad`` (through transposes, casts, reshapes,
    sums of partial gradients), or ``None`` when ``grad`` is not made in the backward (an input passed through, a
    zero). Only values with ``grad``'s dimensions in some order count (or a reshape's input of its size): the
    head's ``dlogits`` ``(b, T, V)`` may have as many elements as its ``(D, V)`` gradient, and is not it."""
    if isinstance(grad, Literal):
        return None
    size, dims = math.prod(grad.aval.shape), sorted(grad.aval.shape)
    best, todo, seen = None, [(grad, False)], set()
    while todo:
        v, reshaped = todo.pop()
        if isinstance(v, Literal) or v in seen or v not in producer:
            continue
        shape = getattr(v.aval, "shape", ())
        if math.prod(shape) != size or not (reshaped or sorted(shape) == dims):
            continue
        seen.add(v)
        i, e = producer[v]
        if best is None or i < best[0]:
            best = (i, v)
        todo.extend((x, e.primitive.name == "reshape") for x in e.invars)
    return best


def _batch_axes(plan) -> set:
    rule = plan.rules.table("activations").get("batch")
    return set(rule.mesh_axes if rule else ())


def _reduced_over_batch(plan, sharding) -> bool:
    """Whether a gradient kept in ``sharding`` is split over a data-parallel (batch) axis of more than one device:
    the full-size partial sum is then reduce-scattered, a buffer of its own."""
    batch_axes = _batch_axes(plan)
    sizes = plan.mesh_sizes
    for entry in sharding.spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis in batch_axes and sizes.get(axis, 1) > 1:
                return True
    return False


def _non_batch_shards(plan, sharding) -> int:
    batch_axes = _batch_axes(plan)
    sizes = plan.mesh_sizes
    shards = 1
    for entry in sharding.spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis and axis not in batch_axes:
                shards *= sizes.get(axis, 1)
    return shards


def first_gradient_bytes(plan, jaxpr, backward: int, grads: Sequence) -> int:
    """Bytes per device of the first weight gradient the backward makes at full size among those the step keeps
    split over the data-parallel axes (FSDP, ZeRO-2: reduce-scattered after it is made); 0 without such gradients.
    A gradient kept whole (a replicated bias) is skipped: it is its own buffer, counted with the gradients.

    ``jaxpr``: the loss's VJP traced on one device's rows (:func:`meshtrain.analysis.traced._residuals`),
    ``backward``: the index of its first backward equation, ``grads``: its gradient outputs in the parameters'
    tree order. The buffer is the value of the gradient's size the backward makes first (a matmul's output, in
    its dtype), divided by the shards of the gradient's non-batch axes (tensor parallelism keeps it split); made
    by a layer scan, one layer's slice (each iteration makes its own); of the gradients one equation makes
    first, the largest.
    E.g. T5 (vocabulary 4096, width 256, f32) under ``fsdp`` on 64 devices: the head's ``(256, 4096)`` gradient,
    4 MiB per device, where the gradients count 64 KiB."""
    shardings = jax.tree.leaves(gradient_shardings(plan))
    if len(shardings) != len(grads):
        return 0
    producer = {v: (i, e) for i, e in enumerate(jaxpr.eqns) if i >= backward for v in e.outvars}
    made = []  # (index of the equation that makes it first, bytes per device)
    for grad, sharding in zip(grads, shardings):
        if isinstance(grad, Literal) or not hasattr(grad.aval, "shape") or not _reduced_over_batch(plan, sharding):
            continue  # a gradient kept whole is its own buffer, counted with the gradients
        found = _earliest_full_size(producer, grad)
        if found is None:
            continue
        index, var = found
        nbytes = math.prod(var.aval.shape) * np.dtype(var.aval.dtype).itemsize
        if jaxpr.eqns[index].primitive.name in _LOOPS and var.aval.shape:
            nbytes //= max(var.aval.shape[0], 1)  # a layer scan reduces each layer's slice as its iteration makes it
        made.append((index, nbytes // max(_non_batch_shards(plan, sharding), 1)))
    if not made:
        return 0
    first = min(index for index, _ in made)
    return int(max(nbytes for index, nbytes in made if index == first))
