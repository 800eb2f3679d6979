"""Memory-efficient ("flash") attention: never materialises the ``T × S`` scores.

Three backends behind :func:`flash_attention`, picked by :func:`meshtrain.parallel.resolved.flash_backend`
(inside a step: the step's :class:`~meshtrain.parallel.resolved.ResolvedStep` says which):

* ``xla``: blockwise online softmax in plain XLA (every platform). Queries are cut into blocks of
  ``block_q`` rows, keys into blocks of ``block_k``; the largest live score tensor is
  ``block_q × block_k`` per head. A custom VJP recomputes the blocks in the backward pass from the
  saved log-sum-exp (FlashAttention-2), so the backward is memory-efficient too. Blocks that the
  causal mask hides completely are skipped (``lax.cond``). The masks are tied to the layer's data
  (``_tie``) so that JAX cannot hoist them out of a differentiated layer scan, which would keep
  every block's mask (and, with the skipping ``cond``, its scores) at once: ``T × T`` memory.
* ``cudnn``: cuDNN's fused attention on NVIDIA GPUs, for bf16/fp16. Without segment ids through
  ``jax.nn.dot_product_attention(implementation="cudnn")``; with packed documents through cuDNN's
  ragged ("THD") layout (:func:`cudnn_segments`): each row's runs of equal segment ids become
  ``(offset, length)`` pairs, at most :data:`CUDNN_MAX_SEGMENTS` per row, so nothing of size
  ``T × S`` is built (a dense segment mask would be a ``(b, 1, T, S)`` bias per layer). The layout
  needs a Hopper or newer GPU. A batch that does not fit it (a row with more segments than the
  bound, or a segment id that recurs after another one) runs the ``xla`` kernel instead, chosen on
  the device (``lax.cond``): the result is the same attention either way.
* ``splash``: the Pallas TPU splash-attention kernel (causal and segment-id masks, GQA by repeating
  K/V heads).

Masks come from *indices*, not from array positions: ``q_idx`` / ``k_idx`` give each row's position
in the original sequence (a context-parallel layout may reorder the sequence, see
:mod:`meshtrain.parallel.context`), so a query attends to key ``j`` when ``k_idx[j] <= q_idx[i]``
(causal) and both carry the same segment id.

The building blocks :func:`blocks_forward` and :func:`blocks_backward` are shared with the ring
kernel, which runs them once per K/V block that passes by.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from meshtrain.annotate import activation_spec, current_step_context, target_platform
from meshtrain.errors import ConfigError
# the backend's eligibility is decided in one place, the step resolver (re-exported here for kernel callers)
from meshtrain.parallel.resolved import (CUDNN_MAX_SEGMENTS, PACKED_MIN_CAPABILITY, flash_backend,  # noqa: F401
                                        parse_capability)
from meshtrain.strategies import FlashBackend  # noqa: F401 (re-exported: the cp dimension's option)

F32 = jnp.float32

#: Largest block edge (rows of queries / keys per block).
DEFAULT_BLOCK = 512
#: Elements of one f32 score block over all the rows × heads a device holds (2 MiB): the block edge
#: shrinks with more heads per device so the backward's working set (4 such blocks) stays small.
BLOCK_ELEMENTS = 2 ** 19


def pick_block(n: int, target: int = DEFAULT_BLOCK) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (``n`` itself when that divisor would
    be tiny, e.g. for a prime length)."""
    for b in range(min(n, target), 0, -1):
        if n % b == 0:
            return b if b >= min(n, 16) else n
    return n


def block_for(n: int, rows_heads: int) -> int:
    """Block edge for a length-``n`` axis when ``rows_heads`` (batch rows × heads) share each block:
    a power of two in [128, 512] with ``rows_heads · edge²`` ≤ :data:`BLOCK_ELEMENTS`, dividing ``n``."""
    edge = math.sqrt(BLOCK_ELEMENTS / max(rows_heads, 1))
    target = max(128, min(DEFAULT_BLOCK, 2 ** int(math.log2(max(edge, 1.0)))))
    return pick_block(n, target)


def varying_axes(*xs) -> frozenset:
    """Manual mesh axes over which any of ``xs`` varies (inside ``shard_map``; empty outside)."""
    out = frozenset()
    for x in xs:
        if x is not None:
            mat = getattr(jax.typeof(x), "manual_axis_type", None)
            out |= frozenset(getattr(mat, "varying", ()) or ())
    return out


def match_varying(x, axes: frozenset):
    """``x`` marked as varying over ``axes`` (scan carries must agree with their updates)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _allowed(qi, ki, qs, ks, causal):
    """Boolean ``(b or 1, bq, bk)`` mask, or ``None`` when everything is allowed."""
    mask = None
    if causal:
        mask = (qi[:, None] >= ki[None, :])[None]
    if qs is not None:
        seg = qs[:, :, None] == ks[:, None, :]
        mask = seg if mask is None else mask & seg
    return mask


def _q_blocks(x_btnh, kv: int, bq: int):
    """``(b, t, n, h)`` → ``(t/bq, b, kv, g, bq, h)``."""
    b, t, n, h = x_btnh.shape
    x = x_btnh.reshape(b, t // bq, bq, kv, n // kv, h)
    return x.transpose(1, 0, 3, 4, 2, 5)


def _q_unblock(x, n: int):
    """Inverse of :func:`_q_blocks`."""
    nq, b, kv, g, bq, h = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, n, h)


def _row_blocks(x_btn, kv: int, bq: int):
    """``(b, t, n)`` → ``(t/bq, b, kv, g, bq)``."""
    b, t, n = x_btn.shape
    return x_btn.reshape(b, t // bq, bq, kv, n // kv).transpose(1, 0, 3, 4, 2)


def _row_unblock(x, n: int):
    nq, b, kv, g, bq = x.shape
    return x.transpose(1, 0, 4, 2, 3).reshape(b, nq * bq, n)


def _k_blocks(x_bskh, bk: int):
    """``(b, s, kv, h)`` → ``(s/bk, b, bk, kv, h)``."""
    b, s, kv, h = x_bskh.shape
    return x_bskh.reshape(b, s // bk, bk, kv, h).transpose(1, 0, 2, 3, 4)


def _seg_blocks(seg_bt, blk: int):
    if seg_bt is None:
        return None
    b, t = seg_bt.shape
    return seg_bt.reshape(b, t // blk, blk).transpose(1, 0, 2)


def _check_blocks(t, s, bq, bk):
    if t % bq or s % bk:
        raise ConfigError(f"flash attention blocks {bq}×{bk} do not divide the lengths {t}×{s}; "
                          f"pick block sizes that divide the sequence")


def _tie(anchor, *masks):
    """``masks`` (indices, segment ids) made to depend on ``anchor``. The masks alone are the same in
    every layer; inside a differentiated layer scan JAX would hoist their per-block computation out
    of the scan and keep all blocks at once (``T × T`` memory)."""
    return jax.lax.optimization_barrier((anchor, *masks))[1:]


def blocks_forward(q, k, v, q_idx, k_idx, q_seg, k_seg, *, causal: bool, block_q: int, block_k: int):
    """Attention of ``q`` (b, t, n, h) over ``k``/``v`` (b, s, kv, h), block by block.

    Returns ``(o_btnh, lse_btn)`` in f32: the normalised output and the log-sum-exp of each row's
    scores (``-inf`` for a row that may see no key here, whose output is 0).
    """
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    _check_blocks(t, s, block_q, block_k)
    scale = h ** -0.5
    q_idx, k_idx, q_seg, k_seg = _tie(q, q_idx, k_idx, q_seg, k_seg)
    axes = varying_axes(q, k, v, q_idx, k_idx, q_seg, k_seg)
    qb = _q_blocks(q, kv, block_q)
    kb, vb = _k_blocks(k, block_k), _k_blocks(v, block_k)
    kib, ksb = k_idx.reshape(s // block_k, block_k), _seg_blocks(k_seg, block_k)
    qib, qsb = q_idx.reshape(t // block_q, block_q), _seg_blocks(q_seg, block_q)

    def one_q(args):
        q_i, qi_i, qs_i = args
        q_i = q_i.astype(F32) * scale
        acc0 = match_varying(jnp.zeros(q_i.shape, F32), axes)
        carry0 = (acc0[..., 0] - jnp.inf, acc0[..., 0], acc0)

        def compute(carry, k_j, v_j, ki_j, ks_j):
            m, l, acc = carry
            sc = jnp.einsum("bkgqh,bskh->bkgqs", q_i, k_j.astype(F32))
            mask = _allowed(qi_i, ki_j, qs_i, ks_j, causal)
            if mask is not None:
                sc = jnp.where(mask[:, None, None], sc, -jnp.inf)
            m_new = jnp.maximum(m, sc.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(sc - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskh->bkgqh", p, v_j.astype(F32))
            return m_new, l, acc

        def body(carry, kargs):
            k_j, v_j, ki_j, ks_j = kargs
            if not causal:
                return compute(carry, k_j, v_j, ki_j, ks_j), None
            # a block entirely above the diagonal contributes nothing: skip its work
            live = jnp.max(qi_i) >= jnp.min(ki_j)
            return jax.lax.cond(live, lambda c: compute(c, k_j, v_j, ki_j, ks_j), lambda c: c, carry), None

        (m, l, acc), _ = jax.lax.scan(body, carry0, (kb, vb, kib, ksb))
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return acc / jnp.where(l > 0, l, 1.0)[..., None], lse

    o, lse = jax.lax.map(one_q, (qb, qib, qsb))
    return _q_unblock(o, n), _row_unblock(lse, n)


def blocks_backward(q, k, v, q_idx, k_idx, q_seg, k_seg, lse, delta, do, *, causal: bool, block_q: int,
                    block_k: int):
    """Gradients ``(dq, dk, dv)`` (f32) of the attention of ``q`` over this ``k``/``v`` given the
    *final* row statistics ``lse`` (b, t, n) and ``delta = sum(do * o, -1)``: the probabilities are
    recomputed block by block (``exp(score - lse)``), so nothing of size ``T × S`` is stored."""
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    _check_blocks(t, s, block_q, block_k)
    scale = h ** -0.5
    q_idx, k_idx, q_seg, k_seg = _tie(do, q_idx, k_idx, q_seg, k_seg)
    axes = varying_axes(q, k, v, q_idx, k_idx, q_seg, k_seg, lse, delta, do)
    qb, dob = _q_blocks(q, kv, block_q), _q_blocks(do, kv, block_q)
    lseb = _row_blocks(jnp.where(jnp.isfinite(lse), lse, 0.0), kv, block_q)
    deltab = _row_blocks(delta, kv, block_q)
    qib, qsb = q_idx.reshape(t // block_q, block_q), _seg_blocks(q_seg, block_q)
    kb, vb = _k_blocks(k, block_k), _k_blocks(v, block_k)
    kib, ksb = k_idx.reshape(s // block_k, block_k), _seg_blocks(k_seg, block_k)

    def per_k(dq, kargs):
        k_j, v_j, ki_j, ks_j = kargs
        k_j, v_j = k_j.astype(F32), v_j.astype(F32)
        zero_kv = match_varying(jnp.zeros(k_j.shape, F32), axes)

        def compute(carry, q_i, do_i, lse_i, delta_i, qi_i, qs_i):
            dk, dv = carry
            q_i, do_i = q_i.astype(F32), do_i.astype(F32)
            sc = jnp.einsum("bkgqh,bskh->bkgqs", q_i * scale, k_j)
            p = jnp.exp(sc - lse_i[..., None])
            mask = _allowed(qi_i, ki_j, qs_i, ks_j, causal)
            if mask is not None:
                p = jnp.where(mask[:, None, None], p, 0.0)
            dv = dv + jnp.einsum("bkgqs,bkgqh->bskh", p, do_i)
            dp = jnp.einsum("bkgqh,bskh->bkgqs", do_i, v_j)
            ds = p * (dp - delta_i[..., None])
            dq_i = match_varying(jnp.einsum("bkgqs,bskh->bkgqh", ds, k_j) * scale, axes)
            dk = dk + jnp.einsum("bkgqs,bkgqh->bskh", ds, q_i) * scale
            return (dk, dv), dq_i

        def body(carry, qargs):
            q_i, do_i, lse_i, delta_i, qi_i, qs_i = qargs
            run = lambda c: compute(c, q_i, do_i, lse_i, delta_i, qi_i, qs_i)  # noqa: E731
            if not causal:
                return run(carry)
            skip = lambda c: (c, match_varying(jnp.zeros(q_i.shape, F32), axes))  # noqa: E731
            return jax.lax.cond(jnp.max(qi_i) >= jnp.min(ki_j), run, skip, carry)

        (dk, dv), dq_parts = jax.lax.scan(body, (zero_kv, zero_kv), (qb, dob, lseb, deltab, qib, qsb))
        return dq + dq_parts, (dk, dv)

    dq0 = match_varying(jnp.zeros(qb.shape, F32), axes)
    dq, (dk, dv) = jax.lax.scan(per_k, dq0, (kb, vb, kib, ksb))
    unk = lambda x: x.transpose(1, 0, 2, 3, 4).reshape(b, s, kv, h)  # noqa: E731
    return _q_unblock(dq, n), unk(dk), unk(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def flash_xla(q, k, v, q_idx, k_idx, q_seg, k_seg, causal, block_q, block_k):
    """Blockwise attention with explicit row indices and segment ids for queries and keys (custom
    VJP that recomputes blocks). ``causal``, ``block_q``, ``block_k`` are static."""
    o, _ = blocks_forward(q, k, v, q_idx, k_idx, q_seg, k_seg, causal=causal, block_q=block_q, block_k=block_k)
    return o.astype(q.dtype)


def flash_xla_fwd(q, k, v, q_idx, k_idx, q_seg, k_seg, causal, block_q, block_k):
    o, lse = blocks_forward(q, k, v, q_idx, k_idx, q_seg, k_seg, causal=causal, block_q=block_q, block_k=block_k)
    o = o.astype(q.dtype)
    return o, (q, k, v, q_idx, k_idx, q_seg, k_seg, o, lse)


def flash_xla_bwd(causal, block_q, block_k, res, do):
    q, k, v, q_idx, k_idx, q_seg, k_seg, o, lse = res
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)
    dq, dk, dv = blocks_backward(q, k, v, q_idx, k_idx, q_seg, k_seg, lse, delta, do, causal=causal,
                                 block_q=block_q, block_k=block_k)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


flash_xla.defvjp(flash_xla_fwd, flash_xla_bwd)


def target_compute_capability() -> Optional[Tuple[int, int]]:
    """The compute capability of the GPU the active step is compiled for (its mesh's devices; a
    compile-only XLA:GPU device reports its target's), else of this host's GPU; ``None`` when there is
    no GPU device to ask (an abstract mesh, another platform)."""
    ctx = current_step_context()
    mesh = ctx.mesh if ctx is not None else None
    if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
        device = mesh.devices.flat[0]
    elif ctx is None and jax.default_backend() == "gpu":
        device = jax.devices()[0]
    else:
        return None
    return parse_capability(getattr(device, "compute_capability", None))


def flash_attention(q, k, v, segment_ids=None, *, causal: bool = True, q_idx=None, k_idx=None,
                    backend: "FlashBackend | str" = FlashBackend.AUTO, block_q: Optional[int] = None,
                    block_k: Optional[int] = None, max_segments: Optional[int] = None):
    """Memory-efficient attention, ``(b, t, n, h)`` out in ``q``'s dtype.

    ``segment_ids`` (b, t) keeps packed documents apart (queries and keys share them when ``t ==
    s``). ``q_idx`` / ``k_idx`` (1-D) give each row's original sequence position for the causal mask
    (default ``arange``). ``max_segments``: cuDNN's room for packed documents per row (default
    :data:`CUDNN_MAX_SEGMENTS`). Example: ``flash_attention(q, k, v, seg, causal=True)``.
    """
    t, s = q.shape[1], k.shape[1]
    platform, segmented = target_platform(), segment_ids is not None
    room = _max_segments(max_segments) if segmented else None
    capability = target_compute_capability() if segmented and platform in ("gpu", "cuda") else None
    chosen, _ = flash_backend(backend, platform=platform, dtype=q.dtype, segmented=segmented,
                              compute_capability=capability)
    natural = q_idx is None and k_idx is None
    rows_heads = q.shape[0] * q.shape[2]
    block_q, block_k = block_q or block_for(t, rows_heads), block_k or block_for(s, rows_heads)
    if chosen is FlashBackend.CUDNN and natural and segment_ids is None:
        cudnn = lambda q_, k_, v_, _: jax.nn.dot_product_attention(q_, k_, v_, is_causal=causal,  # noqa: E731
                                                                    implementation="cudnn").astype(q_.dtype)
        return per_device(cudnn, q, k, v, None)
    if chosen is FlashBackend.CUDNN and natural and t == s:
        return per_device(lambda q_, k_, v_, seg: _cudnn_packed(q_, k_, v_, seg, causal, room), q, k, v,
                          segment_ids)
    if chosen is FlashBackend.SPLASH and natural and t == s:
        return per_device(lambda q_, k_, v_, seg: _splash(q_, k_, v_, seg, causal), q, k, v, segment_ids)
    q_idx = jnp.arange(t, dtype=jnp.int32) if q_idx is None else q_idx
    k_idx = jnp.arange(s, dtype=jnp.int32) if k_idx is None else k_idx
    return flash_xla(q, k, v, q_idx, k_idx, segment_ids, segment_ids if s == t else None, causal, block_q, block_k)


def _max_segments(given: Optional[int]) -> int:
    room = CUDNN_MAX_SEGMENTS if given is None else given
    if isinstance(room, bool) or not isinstance(room, int) or room < 1:
        raise ConfigError(f"flash attention max_segments (flash.CUDNN_MAX_SEGMENTS) is {room!r}; give a whole "
                          f"number ≥ 1 of packed documents per row")
    return room


def cudnn_segments(segment_ids, max_segments: int):
    """cuDNN's ragged description of packed rows: ``(lengths, offsets, fits)``.

    Each maximal run of equal ids in a row of ``segment_ids`` (b, t) is one segment. ``lengths``
    (b, max_segments) holds the runs' lengths and ``offsets`` (b, max_segments + 1) their first
    positions, both ``-1`` past a row's last run (the layout of
    ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``'s ``q_seqlen``/``q_offsets``).
    ``fits`` (a scalar bool) says whether the runs describe the rows exactly: every row has at most
    ``max_segments`` runs and no id recurs after another (ids ``[1, 1, 2, 1]`` are two documents to the
    segment mask but three runs). Every token lies in a run, so none is left to cuDNN's padding.
    Example: ``[[7, 7, 7, 9]]`` with room 3 → lengths ``[[3, 1, -1]]``, offsets ``[[0, 3, -1, -1]]``.
    """
    b, t = segment_ids.shape
    seg = segment_ids.astype(jnp.int32)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # each token's run in its row
    runs = run[:, -1] + 1
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    # a run's first token writes its offset; runs past the room fall off (mode="drop")
    slot = jnp.where(starts, run, max_segments)
    offsets = jnp.full((b, max_segments), -1, jnp.int32).at[rows, slot].set(pos, mode="drop")
    lengths = jnp.zeros((b, max_segments), jnp.int32).at[rows, run].add(1, mode="drop")
    used = jnp.arange(max_segments, dtype=jnp.int32)[None] < runs[:, None]
    lengths = jnp.where(used, lengths, -1)
    offsets = jnp.concatenate([offsets, jnp.full((b, 1), -1, jnp.int32)], axis=1)
    ordered = jnp.sort(seg, axis=1)
    distinct = 1 + jnp.sum(ordered[:, 1:] != ordered[:, :-1], axis=1, dtype=jnp.int32)
    fits = jnp.all((runs <= max_segments) & (distinct == runs))
    return lengths, offsets, fits


def _cudnn_packed(q, k, v, segment_ids, causal: bool, max_segments: int):
    """cuDNN's fused attention over packed documents (ragged segments), per device; blockwise XLA on
    a batch whose segments do not fit :func:`cudnn_segments`' description (same masks, same result)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    b, t, n, h = q.shape
    lengths, offsets, fits = cudnn_segments(segment_ids, max_segments)
    mask = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING

    def fused(q_, k_, v_):
        # K/V at the query heads: JAX 0.10's ragged offsets count the key's stride with the query's heads
        g = n // k_.shape[2]
        k_, v_ = jnp.repeat(k_, g, axis=2), jnp.repeat(v_, g, axis=2)
        return cudnn_attention(q_, k_, v_, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                               kv_offsets=offsets, scale=h ** -0.5, mask_type=mask).astype(q_.dtype)

    def blockwise(q_, k_, v_):
        idx = jnp.arange(t, dtype=jnp.int32)
        block = block_for(t, b * n)
        return flash_xla(q_, k_, v_, idx, idx, segment_ids, segment_ids, causal, block, block)

    return jax.lax.cond(fits, fused, blockwise, q, k, v)


def per_device(kernel, q, k, v, segment_ids):
    """Run ``kernel(q, k, v, segment_ids)`` — a custom call XLA cannot partition (Pallas splash,
    cuDNN) — inside ``shard_map`` over the active step's mesh: batch and heads stay split as the
    rules place them, each device sees whole sequences. K/V are repeated to the query heads first, so
    a device holds exactly the K/V heads its query heads read whatever the head split. Outside a
    step, or on one device, the kernel runs as is."""
    ctx = current_step_context()
    if ctx is None or ctx.mesh.size == 1 or jax.sharding.get_abstract_mesh().manual_axes:
        return kernel(q, k, v, segment_ids)  # one device, or already per device (inside a context kernel)
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    spec = tuple(activation_spec(("batch", "seq", "heads", "head_dim"), q.shape, name="attention"))
    spec += (None,) * (4 - len(spec))
    qspec = P(spec[0], None, spec[2], spec[3])  # the sequence whole on each device (gathered if it was split)
    segspec = P(spec[0], None)
    if segment_ids is None:
        run = jax.shard_map(lambda q_, k_, v_: kernel(q_, k_, v_, None), mesh=ctx.mesh,
                            in_specs=(qspec, qspec, qspec), out_specs=qspec, check_vma=False)
        return run(q, k, v)
    run = jax.shard_map(kernel, mesh=ctx.mesh, in_specs=(qspec, qspec, qspec, segspec), out_specs=qspec,
                        check_vma=False)
    return run(q, k, v, segment_ids)


def _splash(q, k, v, segment_ids, causal, interpret: bool = False):
    """Pallas splash attention (TPU): heads-major layout, K/V heads repeated to the query heads."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, n, h = q.shape
    g = n // k.shape[2]
    one = sm.CausalMask((t, t)) if causal else sm.FullMask((t, t))
    kernel = sk.make_splash_mha(sm.MultiHeadMask([one] * n), head_shards=1, q_seq_shards=1, interpret=interpret)
    qh = (q * h ** -0.5).transpose(0, 2, 1, 3)
    kh = jnp.repeat(k, g, axis=2).transpose(0, 2, 1, 3)
    vh = jnp.repeat(v, g, axis=2).transpose(0, 2, 1, 3)
    if segment_ids is None:
        out = jax.vmap(kernel)(qh, kh, vh)
    else:
        seg = jax.vmap(lambda s_: sk.SegmentIds(q=s_, kv=s_))(segment_ids.astype(jnp.int32))
        out = jax.vmap(lambda a, b_, c, d: kernel(a, b_, c, segment_ids=d))(qh, kh, vh, seg)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)
