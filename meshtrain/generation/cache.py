"""The KV cache: keys and values of every layer, with logical names like any activation.

Shape ``(layers, batch, seq, kv_heads, head_dim)`` (:data:`meshtrain.models.decoder.CACHE`): the
leading ``layers`` axis stacks the layers as the block parameters are stacked, so the decoder's layer
scan reads and writes one layer's slice. The cache's sharding comes from the recipe's *activation*
rules (the rules the attention's keys and values follow in training): ``kv_heads`` over ``tensor``,
``batch`` over the data axes (``data``, ``fsdp``, ``expert``), ``seq`` over ``context`` where a recipe
maps it. Prompts are left-padded: ``pad[b]`` slots at the start of row ``b`` hold no token.

Example::

    cache = empty_cache(cfg, plan, batch=8, seq=64)
    cache_bytes_per_device(cfg, plan, batch=8, seq=64)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.models.decoder import CACHE, DecoderConfig

#: logical names the generation steps may replicate where a dimension does not divide its mesh axes
#: (one decoded token is a sequence of length 1)
REPLICATE_OK = frozenset({"seq", "residual_seq"})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values ``(layers, batch, seq, kv_heads, head_dim)``; ``index`` (int32 scalar) the slot the
    next token goes to; ``pad`` ``(batch,)`` each row's left padding."""

    k: jax.Array
    v: jax.Array
    index: jax.Array
    pad: jax.Array


def cache_shape(cfg: DecoderConfig, batch: int, seq: int):
    return (cfg.n_layers, batch, seq, cfg.n_kv_heads, cfg.head_dim)


def cache_spec(cfg: DecoderConfig, plan, batch: int, seq: int) -> PartitionSpec:
    """The ``PartitionSpec`` of ``k`` and ``v``: :data:`CACHE` through the plan's activation rules."""
    return plan.rules.resolve("activations", CACHE, cache_shape(cfg, batch, seq), plan.mesh_sizes,
                              path="kv_cache", replicate_ok=plan.recipe.replicate_ok() | REPLICATE_OK
                              ).spec


def cache_shardings(cfg: DecoderConfig, plan, batch: int, seq: int) -> KVCache:
    """A :class:`KVCache` of ``NamedSharding`` s (``index`` replicated, ``pad`` along ``batch``)."""
    kv = NamedSharding(plan.mesh, cache_spec(cfg, plan, batch, seq))
    pad = NamedSharding(plan.mesh, plan.rules.resolve("activations", ("batch",), (batch,), plan.mesh_sizes,
                                                      path="kv_cache/pad").spec)
    return KVCache(kv, kv, NamedSharding(plan.mesh, PartitionSpec()), pad)


def empty_cache(cfg: DecoderConfig, plan, pad, seq: int, dtype=jnp.float32) -> KVCache:
    """A zero cache of ``seq`` slots for ``len(pad)`` rows, placed by :func:`cache_shardings`."""
    batch = len(pad)
    sh = cache_shardings(cfg, plan, batch, seq)
    zeros = _zeros(cache_shape(cfg, batch, seq), jnp.dtype(dtype).name, sh.k)
    return KVCache(zeros(), zeros(), jax.device_put(jnp.int32(0), sh.index),
                   jax.device_put(jnp.asarray(pad, jnp.int32), sh.pad))


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype: str, sharding):
    """A compiled maker of zeros laid out by ``sharding``, one per shape: a new ``jax.jit`` per call
    would compile again each generation (0.14-0.16 s of a 0.17-0.26 s tiny-model call on CPU)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def shard_elements(shape, spec, mesh_sizes) -> int:
    """Elements of one device's shard of an array of ``shape`` laid out by ``spec`` on a mesh of ``mesh_sizes``
    (works for an ``AbstractMesh`` plan too: no devices needed)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    n = 1
    for dim, entry in zip(shape, entries):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        n *= -(-dim // math.prod(mesh_sizes[a] for a in axes))
    return n


def cache_bytes_per_device(cfg: DecoderConfig, plan, batch: int, seq: int, dtype: Any = jnp.float32) -> int:
    """Bytes of ``k`` + ``v`` one device holds (its shard's elements × itemsize)."""
    shape = cache_shape(cfg, batch, seq)
    return 2 * shard_elements(shape, cache_spec(cfg, plan, batch, seq), plan.mesh_sizes) * np.dtype(dtype).itemsize
