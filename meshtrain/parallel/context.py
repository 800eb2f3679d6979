"""Context parallelism: attention over a sequence sharded on the ``context`` mesh axis (and, for
``usp``, also on ``ulysses``).

Kinds (all with causal + packed-document masks and grouped-query attention):

* ``all_gather``: each device keeps its query chunk and all-gathers K/V (Llama 3). The backward
  reduce-scatters dK/dV.
* ``ring``: K/V blocks travel around the ring with ``ppermute`` while each device accumulates an
  online softmax (log-sum-exp merging). The backward rings too: dK/dV accumulators travel with their
  blocks and arrive home after one more hop (custom VJP, recomputing probabilities block by block).
* ``ulysses``: ``all_to_all`` from sequence-sharded to head-sharded, full-sequence flash attention
  per head group, ``all_to_all`` back (DeepSpeed-Ulysses). Query heads must divide the axis; with
  fewer K/V heads than devices (GQA), K/V heads are repeated up to the axis size (each device then
  holds the one K/V head its query heads share), which needs ``axis size % kv heads == 0``.
* ``usp``: Ulysses over the inner ``ulysses`` axis, then ring over ``context`` (USP / LoongTrain).

Load balance: causal attention gives the device holding the end of the sequence the most work. The
*zig-zag* order cuts the sequence into ``2 × ring`` chunks and gives device ``r`` chunks ``r`` and
``2·ring − 1 − r``, so every device sees the same causal work. The data arrive in that order already
(the Trainer permutes every batch leaf with a ``seq`` axis, positions and segment ids included; the
loss is a sum over tokens and RoPE reads the carried positions), and the kernels derive each row's
original index from the layout for the causal mask. :func:`sequence_permutation` is the one
definition of the order; :func:`layout_positions` gives a model the original positions of its rows.

Bidirectional attention needs no balancing (every device computes all its score blocks) and its
masks depend on segment ids only, which travel with the tokens: any order gives the same result.
So the Trainer reorders only for models whose context-parallel attention is causal
(:func:`recording_causality` finds out from one abstract trace); others keep natural order.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator, Optional, Set, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from meshtrain.annotate import current_step_context
from meshtrain.errors import ConfigError
from meshtrain.parallel.flash import F32, block_for, blocks_backward, blocks_forward, flash_attention, flash_xla, \
    match_varying, pick_block, varying_axes
from meshtrain.parallel.resolved import recipe_attention_kind
from meshtrain.parallel.seq_layout import (CONTEXT_KINDS, ULYSSES_AXIS, ContextLayout,  # noqa: F401 (re-exported)
                                          context_layout, ring_chunk_index)
from meshtrain.recipes import AttentionKind
from meshtrain.strategies import Context, FlashBackend, LoadBalance


def plan_layout(plan) -> ContextLayout:
    """The :class:`ContextLayout` a plan's step uses (recipe attention kind, rules, mesh)."""
    return context_layout(recipe_attention_kind(plan.recipe), plan.rules, plan.mesh_sizes, _load_balance(plan.recipe))


def check_seq_len(recipe, rules, mesh_sizes, seq_len: int) -> None:
    """Before anything is built (``meshtrain plan`` and ``train``): ``seq_len`` splits over the context
    layout of ``recipe`` under activation ``rules`` on a mesh of ``mesh_sizes`` (see
    :meth:`ContextLayout.check_length`); nothing to check without a context-parallel attention kind."""
    layout = context_layout(recipe_attention_kind(recipe), rules, dict(mesh_sizes), _load_balance(recipe))
    if layout.sharded:
        layout.check_length(seq_len, dict(mesh_sizes))


def _load_balance(holder) -> LoadBalance:
    """The load balance of the ``cp`` dimension of a recipe or step context (zig-zag without one)."""
    context = holder.dimension(Context)
    return context.load_balance if context is not None else LoadBalance.ZIGZAG


def sequence_permutation(plan, seq_len: int) -> Optional[np.ndarray]:
    """The token order the data must arrive in for ``plan`` (``None``: natural order)."""
    layout = plan_layout(plan)
    return layout.permutation(seq_len) if layout.reorders else None


def layout_positions(seq_len: int) -> jax.Array:
    """``(seq_len,)`` original positions of the rows of a sequence inside the active step: the
    layout's order under zig-zag context parallelism (causal attention; the Trainer permutes the
    data so), else ``arange``. For a model whose batch carries no positions."""
    ctx = current_step_context()
    if ctx is None or ctx.attention not in CONTEXT_KINDS:
        return jnp.arange(seq_len)
    layout = context_layout(ctx.attention, ctx.rules, dict(ctx.mesh.shape), _load_balance(ctx))
    return jnp.asarray(layout.permutation(seq_len)) if layout.reorders else jnp.arange(seq_len)


_CAUSALITY: contextvars.ContextVar[Optional[Set[bool]]] = contextvars.ContextVar("meshtrain_causality", default=None)


@contextlib.contextmanager
def recording_causality() -> Iterator[Set[bool]]:
    """A set that collects the ``causal`` flag of every context-parallel attention traced inside
    (``{True}``: the sequence order matters for the mask; ``{False}``: it does not)."""
    seen: Set[bool] = set()
    token = _CAUSALITY.set(seen)
    try:
        yield seen
    finally:
        _CAUSALITY.reset(token)


# -- schedule accounting ---------------------------------------------------------------------------

def ring_work(seq_len: int, ring: int, zigzag: bool, block: Optional[int] = None) -> np.ndarray:
    """Causal score entries each ring member computes, counted from the ring schedule: at step ``s``
    member ``r`` holds the K/V of member ``r - s``; a (query block, key block) pair is computed
    unless the causal mask hides it entirely (as the kernel skips it). Returns ``(ring,)`` counts.

    Example: ``w = ring_work(4096, 8, True); w.max() / w.min()`` → 1.0 (``False``: ≈ 2 × the mean).
    """
    t_loc = seq_len // ring
    block = block or pick_block(t_loc // 2 if zigzag else t_loc)
    idx = [ring_chunk_index(r, t_loc, ring, zigzag).reshape(-1, block) for r in range(ring)]
    work = np.zeros(ring, np.int64)
    for r in range(ring):
        for s in range(ring):
            kv = idx[(r - s) % ring]
            live = idx[r].max(axis=1)[:, None] >= kv.min(axis=1)[None, :]
            work[r] += int(live.sum()) * block * block
    return work


# -- kernels ---------------------------------------------------------------------------------------

def _ring_perm(ring: int):
    return [(i, (i + 1) % ring) for i in range(ring)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _ring(q, k, v, idx, q_seg, k_seg, axes, ring, causal, block):
    return _ring_fwd(q, k, v, idx, q_seg, k_seg, axes, ring, causal, block)[0]


def _ring_fwd(q, k, v, idx, q_seg, k_seg, axes, ring, causal, block):
    perm = _ring_perm(ring)

    def visit(o, lse, kc, vc, kic, ksc):  # fold one K/V block into the running softmax
        o_s, lse_s = blocks_forward(q, kc, vc, idx, kic, q_seg, ksc, causal=causal, block_q=block, block_k=block)
        new = jnp.logaddexp(lse, lse_s)
        safe = jnp.where(jnp.isfinite(new), new, 0.0)
        return o * jnp.exp(lse - safe)[..., None] + o_s * jnp.exp(lse_s - safe)[..., None], new

    vary = varying_axes(q, k, v, idx, q_seg, k_seg)
    o = match_varying(jnp.zeros(q.shape, F32), vary)
    o, lse = visit(o, o[..., 0] - jnp.inf, k, v, idx, k_seg)  # own block first: no communication

    def step(carry, _):  # then ring - 1 times: receive the neighbour's block, fold it in
        o, lse, blk = carry
        blk = jax.lax.ppermute(blk, axes, perm)
        o, lse = visit(o, lse, *blk)
        return (o, lse, blk), None

    (o, lse, _), _ = jax.lax.scan(step, (o, lse, (k, v, idx, k_seg)), None, length=ring - 1)
    o = o.astype(q.dtype)
    return o, (q, k, v, idx, q_seg, k_seg, o, lse)


def _ring_bwd(axes, ring, causal, block, res, do):
    q, k, v, idx, q_seg, k_seg, o, lse = res
    perm = _ring_perm(ring)
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1)
    vary = varying_axes(q, k, v, idx, q_seg, k_seg, do)

    def visit(kc, vc, kic, ksc):
        return blocks_backward(q, kc, vc, idx, kic, q_seg, ksc, lse, delta, do, causal=causal, block_q=block,
                               block_k=block)

    dq, dk, dv = (match_varying(x, vary) for x in visit(k, v, idx, k_seg))

    def step(carry, _):  # the dK/dV accumulators travel with their K/V block ...
        dq, blk, dk, dv = carry
        blk, dk, dv = jax.lax.ppermute((blk, dk, dv), axes, perm)
        dq_s, dk_s, dv_s = visit(*blk)
        return (dq + dq_s, blk, dk + dk_s, dv + dv_s), None

    (dq, _, dk, dv), _ = jax.lax.scan(step, (dq, (k, v, idx, k_seg), dk, dv), None, length=ring - 1)
    dk, dv = jax.lax.ppermute((dk, dv), axes, perm)  # ... and one more hop brings them home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ulysses_sizes(heads: int, kv_heads: int, devices: int) -> Tuple[int, ...]:
    """The all-to-all axis sizes (at most ``devices``) that split ``heads`` query heads and
    ``kv_heads`` key/value heads (per device): divisors of the query heads that the K/V heads divide
    or are repeated up to."""
    return tuple(w for w in range(1, min(heads, devices) + 1)
                 if heads % w == 0 and (kv_heads % w == 0 or w % kv_heads == 0))


def _size_choice(sizes: Tuple[int, ...]) -> str:
    words = [str(s) for s in sizes]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _repeat_kv_for(k, v, ways: int, n_loc: int, kind: str, devices: int, axes: Tuple[str, ...]):
    """K/V heads for an all-to-all over ``ways`` devices: as they are when they divide ``ways``,
    repeated up to ``ways`` when ``ways`` is a multiple of them (GQA), else an error that lists the
    axis sizes that work on ``devices`` devices."""
    kv = k.shape[2]
    if n_loc % ways == 0 and kv % ways == 0:
        return k, v
    if n_loc % ways == 0 and ways % kv == 0:
        rep = ways // kv  # GQA: each device then holds exactly the K/V head its query heads share
        return jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    choice = _size_choice(ulysses_sizes(n_loc, kv, devices))
    fix = (f"use {choice} context devices" if kind == AttentionKind.ULYSSES.value else
           f"use a {'×'.join(axes)} axis of size {choice}")
    why = (f"{n_loc} query heads per device are not divisible by" if n_loc % ways else
           f"{kv} key/value heads per device neither divide nor are divided by")
    raise ConfigError(f"attention {kind!r}: {why} the ulysses axis size {ways} (its all-to-all gives each device "
                      f"whole heads): {fix} (the divisors of the {n_loc} query heads, with {kv} key/value heads, "
                      f"that fit the {devices} devices; after tensor parallelism), or attention 'ring'")


def _a2a_in(x, axes):
    return jax.lax.all_to_all(x, axes, 2, 1, tiled=True)  # seq-sharded -> head-sharded


def _a2a_out(x, axes):
    return jax.lax.all_to_all(x, axes, 1, 2, tiled=True)  # head-sharded -> seq-sharded


def _local_kernel(choice, causal: bool, t_total: int, devices: int, packed: bool = True):
    """The per-device function for ``layout.kind`` (run under ``shard_map``; ``devices``: the mesh's
    size, for error messages; ``packed``: the batch has segment ids, else the ulysses local attention
    gets none, so a fused kernel without a segment mask (cuDNN) can take it)."""
    layout = choice.layout
    kind = layout.kind

    def ring_index(t_loc):
        r = jax.lax.axis_index(layout.ring_axes)
        return ring_chunk_index(r, t_loc, layout.ring, layout.zigzag).astype(jnp.int32)

    def ring_block(q):
        t_loc = q.shape[1]
        return block_for(t_loc // 2 if layout.zigzag else t_loc, q.shape[0] * q.shape[2])

    def fn(q, k, v, seg):
        if kind is AttentionKind.ALL_GATHER:
            idx_q = ring_index(q.shape[1])
            k_all, v_all, seg_all = (jax.lax.all_gather(x, layout.ring_axes, axis=1, tiled=True) for x in (k, v, seg))
            idx_k = jnp.asarray(layout.permutation(t_total), jnp.int32)
            return _gathered(q, k_all, v_all, idx_q, idx_k, seg, seg_all, causal)
        if kind is AttentionKind.RING:
            return _ring(q, k, v, ring_index(q.shape[1]), seg, seg, layout.ring_axes, layout.ring, causal,
                         ring_block(q))
        uly = layout.ulysses_axes
        k, v = _repeat_kv_for(k, v, layout.ulysses, q.shape[2], kind.value, devices, uly)
        q2, k2, v2 = _a2a_in(q, uly), _a2a_in(k, uly), _a2a_in(v, uly)
        seg2 = jax.lax.all_gather(seg, uly, axis=1, tiled=True)
        if kind is AttentionKind.ULYSSES:
            o2 = flash_attention(q2, k2, v2, seg2 if packed else None, causal=causal, backend=choice.backend)
        else:  # usp: ring over the remaining axes on the gathered ring chunk
            o2 = _ring(q2, k2, v2, ring_index(q2.shape[1]), seg2, seg2, layout.ring_axes, layout.ring, causal,
                       ring_block(q2))
        return _a2a_out(o2, uly)

    return fn


def _gathered(q, k_all, v_all, idx_q, idx_k, seg_q, seg_all, causal):
    """Local queries over gathered keys (flash blocks, custom VJP)."""
    rows_heads = q.shape[0] * q.shape[2]
    bq, bk = block_for(q.shape[1], rows_heads), block_for(k_all.shape[1], rows_heads)
    return flash_xla(q, k_all, v_all, idx_q, idx_k, seg_q, seg_all, causal, bq, bk)


def context_attention(q, k, v, segment_ids, causal: bool, choice, ctx):
    """Run the resolved ``choice`` (a :class:`meshtrain.parallel.resolved.AttentionChoice` whose ``layout`` shards
    the sequence) under ``shard_map`` on the step's mesh. Specs come from the activation
    rules (``batch``, ``seq``, ``heads`` / ``kv_heads``), so batch / FSDP / TP sharding passes through."""
    b, t, n, h = q.shape
    layout = choice.layout
    layout.check_length(t, dict(ctx.mesh.shape))
    seen = _CAUSALITY.get()
    if seen is not None:
        seen.add(bool(causal))
    sizes = dict(ctx.mesh.shape)

    def spec(logical, shape, name):
        return ctx.rules.resolve("activations", logical, shape, sizes, path=name, replicate_ok=ctx.replicate_ok).spec

    q_spec = spec(("batch", "seq", "heads", "head_dim"), q.shape, "attention q")
    kv_spec = spec(("batch", "seq", "kv_heads", "head_dim"), k.shape, "attention k/v")
    seg_spec = spec(("batch", "seq"), (b, t), "attention segment_ids")
    pad = lambda s, r: tuple(s) + (None,) * (r - len(s))  # noqa: E731
    q_spec, kv_spec, seg_spec = (PartitionSpec(*pad(s, r)) for s, r in ((q_spec, 4), (kv_spec, 4), (seg_spec, 2)))
    seq_entry = q_spec[1] if isinstance(q_spec[1], tuple) else (q_spec[1],)
    if tuple(a for a in seq_entry if a) != layout.seq_axes:
        raise ConfigError(f"attention {layout.kind.value!r}: the sequence of q is sharded over {seq_entry}, the layout "
                          f"expects {layout.seq_axes}; map `seq` to the context axes only")
    if (q_spec[2] is None) != (kv_spec[2] is None):
        raise ConfigError(f"attention {layout.kind.value!r}: query heads are sharded {q_spec[2]!r} but kv heads "
                          f"{kv_spec[2]!r}; make kv_heads divisible by the tensor axis so both shard alike")
    seg = segment_ids if segment_ids is not None else jnp.zeros((b, t), jnp.int32)
    fn = _local_kernel(choice, causal, t, ctx.mesh.size, packed=segment_ids is not None)
    # A Pallas kernel inside (splash under ulysses) carries no varying-axes types: check them only without one.
    check = choice.backend is not FlashBackend.SPLASH
    return jax.shard_map(fn, mesh=ctx.mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=check)(q, k, v, seg.astype(jnp.int32))


def attention_block_shape(layout: ContextLayout, seq_len: int, heads: int, rows: int = 1) -> Tuple[int, int, int]:
    """``(block_q, block_k, heads)`` of the score blocks one device works on for ``layout`` (the XLA
    blockwise kernels; ``heads`` = query heads per device before Ulysses, ``rows`` = sequences per
    device). The planner's working set."""
    kind = layout.kind
    if kind is AttentionKind.ULYSSES and layout.sharded:
        heads = max(heads // layout.ulysses, 1)
    elif kind is AttentionKind.USP and layout.sharded:
        heads = max(heads // layout.ulysses, 1)
    rh = rows * heads
    if not layout.sharded or kind is AttentionKind.ULYSSES:
        return block_for(seq_len, rh), block_for(seq_len, rh), heads
    t_ring = seq_len // layout.ring
    if kind is AttentionKind.ALL_GATHER:
        return block_for(t_ring, rh), block_for(seq_len, rh), heads
    blk = block_for(t_ring // 2 if layout.zigzag else t_ring, rh)
    return blk, blk, heads
