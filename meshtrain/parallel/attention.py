"""Attention through one function with a ``kind``; models call :func:`attention` and the recipe
picks the kind (:class:`~meshtrain.recipes.AttentionKind`): ``dense``, ``flash``, and the
context-parallel ``all_gather``, ``ring``, ``ulysses``, ``usp`` (:mod:`meshtrain.parallel.context`).

Shapes: ``q_btnh`` (batch, seq, query heads, head dim), ``k_bskh`` / ``v_bskh`` with ``k`` key/value
heads (grouped-query attention when ``n > k``; ``n`` must be a multiple of ``k``).

Inside a step whose recipe shards ``seq`` over context axes, the sequence dimension of ``q``/``k``/
``v``/``segment_ids`` is in the recipe's layout order (zig-zag for ring / all_gather / usp; the
built-in language-model data arrive in that order with their positions). Outside a step (or with
no sharded context axis) a context kind computes the same attention as ``flash`` on one device.

Example::

    o_btnh = attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=seg_bt, kind="flash")
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from meshtrain.annotate import current_step_context
from meshtrain.errors import ConfigError
from meshtrain.parallel.context import context_attention
from meshtrain.parallel.flash import flash_attention
from meshtrain.parallel.resolved import active_attention
from meshtrain.recipes import AttentionKind

__all__ = ["attention", "reference_attention", "AttentionKind"]


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
              segment_ids_bt: Optional[jax.Array] = None, causal: bool = True,
              kind: Optional[AttentionKind] = None) -> jax.Array:
    """Scaled dot-product attention; returns ``(batch, seq, heads, head_dim)`` in ``q``'s dtype.

    ``segment_ids_bt`` keeps packed documents apart (a token attends only within its segment).
    ``kind`` defaults to the active recipe's attention kind (``dense`` outside a step).
    """
    ctx = current_step_context()
    if kind is None:
        kind = ctx.attention if ctx is not None else AttentionKind.DENSE
    try:
        kind = AttentionKind(kind)
    except ValueError:
        raise ConfigError(f"attention kind {kind!r}; use one of {[a.value for a in AttentionKind]}") from None
    n, kv = q_btnh.shape[2], k_bskh.shape[2]
    if n % kv:
        raise ConfigError(f"attention: {n} query heads are not a multiple of {kv} key/value heads")
    if kind is AttentionKind.DENSE:
        return _dense(q_btnh, k_bskh, v_bskh, segment_ids_bt, causal)
    if ctx is None:  # outside a step: one device holds everything; flash_attention picks its backend
        return flash_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, causal=causal)
    choice = active_attention(ctx, kind, dtype=q_btnh.dtype, segmented=segment_ids_bt is not None)
    choice.check()
    if choice.context_kernel:
        return context_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, causal, choice, ctx)
    return flash_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, causal=causal, backend=choice.backend)


def _dense(q, k, v, segment_ids, causal):
    mask = None
    if segment_ids is not None:
        mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # (b, 1, t, s)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal).astype(q.dtype)


def reference_attention(q, k, v, segment_ids=None, causal=True):
    """Plain-jnp attention in f32 (tests compare kernels against it)."""
    n, kv = q.shape[2], k.shape[2]
    k = jnp.repeat(k, n // kv, axis=2)
    v = jnp.repeat(v, n // kv, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) / jnp.sqrt(q.shape[-1])
    t, s = q.shape[1], k.shape[1]
    allowed = jnp.ones((t, s), bool)
    if causal:
        allowed = jnp.tril(allowed)
    allowed = allowed[None, None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = jnp.where(allowed, scores, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v.astype(jnp.float32))
