"""Collectives of the context-parallel attention kinds, per device and step (analytic).

For a decoder with ``L`` layers, ``m`` micro-batches, ``b`` sequences per device per micro-batch,
sequence ``T``, ``kv`` key/value heads and ``n`` query heads per device (after tensor parallelism),
head width ``h``, compute bytes ``c``; ring size ``R``, Ulysses size ``U``:

* ``ring``: forward ``R-1`` collective-permutes of the K/V block ``2·b·(T/R)·kv·h·c`` (plus its
  indices and segment ids); backward ``R-1`` permutes of the K/V block with the f32 dK/dV
  accumulators (``2·b·(T/R)·kv·h·4``; not on a two-device ring, whose one trip XLA folds while the
  accumulators are still zeros) and one more hop of the accumulators. A rematerialising
  recipe runs the forward ring again in the backward.
* ``all_gather``: forward all-gather of K/V (result ``2·b·T·kv·h·c``) and segment ids; backward
  reduce-scatter of dK/dV (result ``2·b·(T/R)·kv·h·c``).
* ``ulysses``: four all-to-alls forward (q, k, v in, output back: ``b·(T/U)·(2n + 2kv')·h·c``
  with ``kv' = max(kv, U)`` after repeating K/V heads) and four backward, plus one all-gather of
  the segment ids (the same in every layer, so XLA hoists it out of the layer loop).

Besides these, the weights' gradients are reduced over the context axes too (each device saw part
of every sequence): :func:`meshtrain.analysis.comms.analytic_collectives` counts the context axes
with the batch axes.
* ``usp``: Ulysses over ``U`` on the ``T/R`` ring chunk, then the ring over ``R`` with ``n/U``
  query and ``kv'/U`` key/value heads.

Example::

    for e in context_collectives(plan, cfg):
        print(e.kind, e.axes, e.bytes_per_step, e.what)
"""

from __future__ import annotations

from typing import List

import numpy as np

from meshtrain.analysis.layout import layout_of
from meshtrain.parallel.context import plan_layout
from meshtrain.recipes import AttentionKind, Remat


def context_collectives(plan, cfg, backend: str = "tpu") -> List[dict]:
    """Rows ``{kind, axes, bytes, executions, bytes_per_step, what, phase}`` for the attention
    collectives of ``plan``'s kind (empty when the sequence is not sharded)."""
    layout = plan_layout(plan)
    if not layout.sharded or cfg is None:
        return []
    lay = layout_of(plan)
    c = np.dtype(lay.compute_dtype).itemsize
    m, L, h = lay.micro_batches, cfg.n_layers, cfg.head_dim
    b = plan.batch.batch_size // (lay.batch_split * m)
    T = plan.batch.seq_len
    n = max(cfg.n_heads // lay.tensor, 1)
    kv = max(cfg.n_kv_heads // lay.tensor, 1)
    recompute = plan.recipe.remat is not Remat.NONE
    rows: List[dict] = []

    def add(kind, axes, nbytes, executions, what, phase):
        if executions and nbytes:
            rows.append({"kind": kind, "axes": tuple(axes), "bytes": float(nbytes), "executions": int(executions),
                         "bytes_per_step": float(nbytes) * int(executions), "what": what, "phase": phase})

    def ring(R, t_ring, heads_kv, axes):
        if R < 2:
            return
        block = 2 * b * (t_ring // R) * heads_kv * h * c + (b + 1) * (t_ring // R) * 4  # K, V + segment ids, indices
        acc = 2 * b * (t_ring // R) * heads_kv * h * 4
        fwd = (R - 1) * L * m * (2 if recompute else 1)
        add("collective-permute", axes, block, fwd, "ring: K/V blocks (forward)", "forward")
        # a two-device ring's backward is one trip whose dK/dV are still the zeros they start as: XLA folds
        # the loop and sends no accumulator on that hop (measured: usp's R = 2 ring on 8xH100 and v5p:2x2x2)
        riding = acc if R > 2 else 0
        add("collective-permute", axes, block + riding, (R - 1) * L * m,
            "ring: K/V blocks" + (" + dK/dV" if riding else "") + " (backward)", "backward")
        add("collective-permute", axes, acc, L * m, "ring: dK/dV home (backward)", "backward")

    def ulysses(U, t_part, axes):
        kv_u = kv if kv % U == 0 else U
        per = b * (t_part // U) * (2 * n + 2 * kv_u) * h * c  # q, k, v in + output back, per layer
        add("all-to-all", axes, per, L * m * (2 if recompute else 1), "ulysses: q, k, v, o (forward)", "forward")
        add("all-to-all", axes, per, L * m, "ulysses: do, dq, dk, dv (backward)", "backward")
        add("all-gather", axes, b * t_part * 4, m, "ulysses: segment ids (the same in every layer: once)", "forward")
        return kv_u

    kind = layout.kind
    if kind is AttentionKind.RING:
        ring(layout.ring, T, kv, layout.ring_axes)
    elif kind is AttentionKind.ALL_GATHER:
        R = layout.ring
        gathered = 2 * b * T * kv * h * c
        add("all-gather", layout.ring_axes, gathered + b * T * 4, L * m * (2 if recompute else 1),
            "all_gather: K/V and segment ids (forward)", "forward")
        # the transpose of shard_map's all_gather is an explicit reduce-scatter (XLA:CPU too)
        add("reduce-scatter", layout.ring_axes, gathered / R, L * m, "all_gather: dK/dV reduce-scatter", "backward")
    elif kind is AttentionKind.ULYSSES:
        ulysses(layout.ulysses, T, layout.ulysses_axes)
    elif kind is AttentionKind.USP:
        kv_u = ulysses(layout.ulysses, T // layout.ring, layout.ulysses_axes)  # on the T/R ring chunk
        ring(layout.ring, T, max(kv_u // layout.ulysses, 1), layout.ring_axes)
    return rows
