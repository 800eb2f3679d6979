"""Attention through one function with a ``kind``; models call :func:`attention` and the recipe
picks the kind (``dense`` now; context-parallel kinds plug in here).

Shapes: ``q_btnh`` (batch, seq, query heads, head dim), ``k_bskh`` / ``v_bskh`` with ``k`` key/value
heads (grouped-query attention when ``n > k``; ``n`` must be a multiple of ``k``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from meshtrain.annotate import current_step_context
from meshtrain.recipes import AttentionKind


def attention(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, *,
              segment_ids_bt: Optional[jax.Array] = None, causal: bool = True,
              kind: Optional[AttentionKind] = None) -> jax.Array:
    """Scaled dot-product attention; returns ``(batch, seq, heads, head_dim)`` in ``q``'s dtype.

    ``segment_ids_bt`` keeps packed documents apart (a token attends only within its segment).
    ``kind`` defaults to the active recipe's attention kind (``dense`` outside a step).
    """
    if kind is None:
        ctx = current_step_context()
        kind = ctx.attention if ctx is not None else AttentionKind.DENSE
    kind = AttentionKind(kind)
    if kind is AttentionKind.DENSE:
        return _dense(q_btnh, k_bskh, v_bskh, segment_ids_bt, causal)
    raise NotImplementedError(f"attention kind {kind.value!r}")  # unreachable: the enum lists only kinds above


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
