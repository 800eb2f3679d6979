"""Bidirectional transformer encoder parts shared by :mod:`meshtrain.models.vit` and
:mod:`meshtrain.models.bert`: LayerNorm, non-causal multi-head attention with biases, a GELU MLP,
one block (pre-LN or post-LN) and a scanned stack of blocks with a leading ``layers`` axis.

Dropout. The owning model keeps one ``nnx.Dropout(rate, rngs=rngs)`` (the model's only RNG stream,
``dropout/rngs``: a key and a counter in the model state, so a checkpoint restores it). Each call in
training mode draws one key from it and splits it per layer; the blocks' own ``nnx.Dropout``
modules hold no RNG and take the per-layer key. Dropout sits on the embeddings, on the attention
output and on the MLP output (no dropout on attention probabilities: attention kernels are
recipe-selected and take none).

Training / evaluation: ``model.eval()`` (sets ``deterministic=True`` on every ``nnx.Dropout``),
``model.train()``, ``nnx.view(model, deterministic=True)`` (a view, the original unchanged), or a
per-call ``model(..., deterministic=True)`` which wins over the attribute.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshtrain.annotate import constrain, scan_layers
from meshtrain.parallel.attention import attention
from meshtrain.parallel.heads import head_layout

RESIDUAL = ("batch", "residual_seq", "embed")


def dense_init(in_axis=0, out_axis=-1):
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis,
                                                out_axis=out_axis)


def param(rngs: nnx.Rngs, init, shape, names) -> nnx.Param:
    """A float32 ``nnx.Param`` with logical axis names as ``out_sharding`` metadata."""
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=names)


def zeros(shape, names) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=names)


class LayerNorm(nnx.Module):
    def __init__(self, d: int, eps: float):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), out_sharding=("embed",))
        self.bias = zeros((d,), ("embed",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class SelfAttention(nnx.Module):
    """Non-causal multi-head attention with biases; ``segment_ids`` keep packed sequences apart."""

    def __init__(self, d: int, n_heads: int, head_dim: int, rngs: nnx.Rngs):
        qkv = ("embed", "heads", "head_dim")
        self.wq_dnh = param(rngs, dense_init(0, (1, 2)), (d, n_heads, head_dim), qkv)
        self.wk_dnh = param(rngs, dense_init(0, (1, 2)), (d, n_heads, head_dim), qkv)
        self.wv_dnh = param(rngs, dense_init(0, (1, 2)), (d, n_heads, head_dim), qkv)
        self.bq_nh = zeros((n_heads, head_dim), ("heads", "head_dim"))
        self.bk_nh = zeros((n_heads, head_dim), ("heads", "head_dim"))
        self.bv_nh = zeros((n_heads, head_dim), ("heads", "head_dim"))
        self.wo_nhd = param(rngs, dense_init((0, 1), 2), (n_heads, head_dim, d), ("heads", "head_dim", "embed"))
        self.bo_d = zeros((d,), ("embed",))

    def __call__(self, x_btd, segment_ids_bt=None):
        names = ("batch", "seq", "heads", "head_dim")
        # heads that do not divide `tensor`: padded with zero heads (or replicated), meshtrain.parallel.heads
        lay = head_layout(self.wq_dnh[...].shape[1])
        wq_dnh = lay.pad_heads(self.wq_dnh[...], 1, ("embed",) + names[2:])
        q = constrain(jnp.einsum("btd,dnh->btnh", x_btd, wq_dnh) + lay.pad_heads(self.bq_nh[...], 0, names[2:]), names)
        k = constrain(jnp.einsum("btd,dnh->btnh", x_btd, self.wk_dnh[...]) + self.bk_nh[...], names)
        v = constrain(jnp.einsum("btd,dnh->btnh", x_btd, self.wv_dnh[...]) + self.bv_nh[...], names)
        o = attention(q, lay.kv_for_queries(k), lay.kv_for_queries(v), segment_ids_bt=segment_ids_bt, causal=False)
        wo_nhd = lay.pad_heads(self.wo_nhd[...], 0, names[2:] + ("embed",))
        return jnp.einsum("btnh,nhd->btd", constrain(o, names), wo_nhd) + self.bo_d[...]


class MLP(nnx.Module):
    """``down(gelu(up(x)))`` with biases; ``mlp`` is the column/row split axis."""

    def __init__(self, d: int, d_ff: int, rngs: nnx.Rngs):
        self.up_df = param(rngs, dense_init(), (d, d_ff), ("embed", "mlp"))
        self.up_bias_f = zeros((d_ff,), ("mlp",))
        self.down_fd = param(rngs, dense_init(), (d_ff, d), ("mlp", "embed"))
        self.down_bias_d = zeros((d,), ("embed",))

    def __call__(self, x_btd):
        h = constrain(jax.nn.gelu(x_btd @ self.up_df[...] + self.up_bias_f[...]), ("batch", "seq", "mlp"))
        return h @ self.down_fd[...] + self.down_bias_d[...]


class EncoderBlock(nnx.Module):
    """Pre-LN (``x + f(norm(x))``, ViT) or post-LN (``norm(x + f(x))``, original BERT)."""

    def __init__(self, d: int, n_heads: int, head_dim: int, d_ff: int, dropout: float, eps: float,
                 pre_ln: bool, rngs: nnx.Rngs):
        self.attn_norm = LayerNorm(d, eps)
        self.attn = SelfAttention(d, n_heads, head_dim, rngs)
        self.mlp_norm = LayerNorm(d, eps)
        self.mlp = MLP(d, d_ff, rngs)
        self.drop = nnx.Dropout(dropout)  # no RNG of its own: the stack passes a key per layer
        self.pre_ln = pre_ln

    def __call__(self, x_btd, segment_ids_bt, *, deterministic: bool, key: Optional[jax.Array]):
        k_attn, k_mlp = (None, None) if key is None else tuple(jax.random.split(key))
        drop = lambda y, k: self.drop(y, deterministic=deterministic, rngs=k)  # noqa: E731
        if self.pre_ln:
            x_btd = constrain(x_btd + drop(self.attn(self.attn_norm(x_btd), segment_ids_bt), k_attn), RESIDUAL)
            return constrain(x_btd + drop(self.mlp(self.mlp_norm(x_btd)), k_mlp), RESIDUAL)
        x_btd = constrain(self.attn_norm(x_btd + drop(self.attn(x_btd, segment_ids_bt), k_attn)), RESIDUAL)
        return constrain(self.mlp_norm(x_btd + drop(self.mlp(x_btd), k_mlp)), RESIDUAL)


class EncoderStack(nnx.Module):
    """``n_layers`` identical blocks, parameters stacked on a leading ``layers`` axis, run by
    :func:`meshtrain.annotate.scan_layers` with the recipe's remat policy and layer loop (the
    decoder's pattern)."""

    def __init__(self, n_layers: int, rngs: nnx.Rngs, **block_kwargs):
        self.n_layers = n_layers

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return EncoderBlock(rngs=rngs, **block_kwargs)

        self.blocks = make_blocks(rngs)

    def __call__(self, x_btd, segment_ids_bt=None, *, deterministic: bool, key: Optional[jax.Array]):
        graphdef, layers = nnx.split(self.blocks)
        keys = None if key is None else jax.random.split(key, self.n_layers)

        def layer(x, xs):
            layer_state, layer_key = xs
            return nnx.merge(graphdef, layer_state)(x, segment_ids_bt, deterministic=deterministic,
                                                    key=layer_key), None

        x_btd, _ = scan_layers(layer, x_btd, (layers, keys))
        return x_btd


def dropout_key(dropout: nnx.Dropout, deterministic: Optional[bool]) -> Tuple[bool, Optional[jax.Array]]:
    """Resolve the effective mode (call argument over the module attribute) and, in training mode
    with a non-zero rate, draw this call's key from the model's dropout stream."""
    det = dropout.deterministic if deterministic is None else deterministic
    det = bool(det) or dropout.rate == 0.0
    return det, (None if det else dropout.rngs())


def class_cross_entropy(logits_bc, labels_b, weights_b=None):
    """``(loss sum, weight, {"accuracy": number correct})`` (the step divides by the weight: accuracy) of softmax cross-entropy over integer ``labels``.

    All three are *sums* over the examples (weighted by ``weights_b``, default 1, and labels < 0
    ignored), so the caller divides loss and metrics by the same global weight.
    """
    logits = logits_bc.astype(jnp.float32)
    w = (labels_b >= 0).astype(jnp.float32)
    if weights_b is not None:
        w = w * weights_b.astype(jnp.float32)
    labels = jnp.maximum(labels_b, 0)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return jnp.sum(ce * w), jnp.sum(w), {"accuracy": jnp.sum(correct * w)}
