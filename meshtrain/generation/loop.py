"""Decoding in one compiled program: every decode step of a generation inside one ``lax.while_loop``,
with sampling, each row's stop conditions and the KV cache carried inside, and the layer weights
stored one array per layer so that each step reads them where they lie.

Why (measured on the 2-core CPU host, 1 device, f32, 16-token prompt, batch 1; ``tools/bench_decode_loop.py``
and BENCHMARKS.md have the figures): the per-token loop of :class:`DecodeLoop.HOST` (one compiled step
per token, the host reads each token back) costs a fixed dispatch per token (about 0.35-0.5 ms: the
``tiny`` model's step computes in ~0.1-0.25 ms of a ~0.6 ms token); on a ~135M model the step's own
compute dominates, and it was inflated by the layer stack: XLA:CPU cannot feed a slice of the stacked
``(layers, ...)`` weights to a matmul, so each step first *copied* every layer's weights out of the
stack (a ``fusion`` per weight in the compiled step) and then read the copy: three passes over the
weights where one will do. :func:`unstack_layers` stores each layer's weights as their own arrays
(the same bytes, laid out by the plan's sharding without the ``layers`` axis), and
:func:`layered_forward` runs the layers one after another over them.

* :class:`DecodeLoop` ``DEVICE`` (the default): the prefill, then one program runs every decode step.
  ``HOST``: today's loop, one program per token; kept as the reference the loop is tested and
  benchmarked against (``tests/test_generation_loop.py``, ``tools/bench_decode_loop.py``).
* Each row stops after a stop id or after its own token limit (``limit_b``: the batch pads with rows
  of limit 1); the loop ends when every row has stopped or ``n_new`` tokens are out.

Example (inside a compiled step, under the plan's step context)::

    cache = empty_layer_cache(cfg, plan, pad_b, seq)
    logits_btv, cache = layered_forward(model, block_graphdef, layers, tokens_bt, cache)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.errors import ConfigError
from meshtrain.generation.cache import KVCache, cache_shape, cache_shardings, cache_spec
from meshtrain.generation.sampling import Sampling, choose_with_logprobs
from meshtrain.models.decoder import DecoderConfig
from meshtrain.models.moe import pop_moe_stats


class DecodeLoop(str, enum.Enum):
    """Where the decode loop runs. ``device``: all decode steps in one compiled ``while_loop`` (the
    tokens reach the host once, at the end). ``host``: one compiled step per token, the host loops and
    reads each token back (the engine before the compiled loop: the reference of the tests and benchmark)."""

    DEVICE = "device"
    HOST = "host"


def decode_loop_kind(value) -> DecodeLoop:
    try:
        return DecodeLoop(value)
    except ValueError:
        raise ConfigError(f"decode loop {value!r}: use one of {[m.value for m in DecodeLoop]}") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
    """The KV cache one array per layer: ``k[l]``, ``v[l]`` ``(batch, seq, kv_heads, head_dim)``; ``index``
    (int32 scalar) the slot the next token goes to; ``pad`` ``(batch,)`` each row's left padding (as
    :class:`meshtrain.generation.cache.KVCache`, whose stacked layout the scanned layer loop needs)."""

    k: Tuple[jax.Array, ...]
    v: Tuple[jax.Array, ...]
    index: jax.Array
    pad: jax.Array


def _without_layers(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked array: its spec without the leading ``layers`` entry."""
    spec = tuple(sharding.spec)
    if spec and spec[0] is not None:
        raise ConfigError(f"the layer stack is sharded over mesh axis {spec[0]!r} (a pipeline plan); generation "
                          f"runs on a plan without a pipeline: use a recipe such as fsdp, tp or fsdp_tp")
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]), memory_kind=sharding.memory_kind)


def unstack_layers(stacked, n_layers: int) -> Tuple:
    """The stacked layer weights (a tree whose leaves have a leading ``layers`` axis, any format: an
    ``Int8Weight`` is a tree too) as ``n_layers`` trees of one layer each, each leaf laid out by its
    stacked sharding without the ``layers`` axis. One compiled program writes every slice straight
    into its own buffer; the stacked arrays can then be freed."""
    shardings = tuple(jax.tree.map(_without_layers, jax.tree.map(lambda x: x.sharding, stacked))
                      for _ in range(n_layers))
    split = jax.jit(lambda s: tuple(jax.tree.map(lambda x: x[l], s) for l in range(n_layers)),
                    out_shardings=shardings)
    return split(stacked)


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype: str, sharding: NamedSharding, count: int = 1):
    """A compiled maker of ``count`` zero arrays laid out by ``sharding``, one per shape and count (a new
    ``jax.jit`` per call would compile again at every generation; one program makes them all: one dispatch)."""
    return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for _ in range(count)), out_shardings=(sharding,) * count)


def empty_layer_cache(cfg: DecoderConfig, plan, pad, seq: int, dtype=jnp.float32) -> LayerCache:
    """A zero :class:`LayerCache` of ``seq`` slots for ``len(pad)`` rows, each layer laid out by the
    stacked cache's sharding (:func:`meshtrain.generation.cache.cache_spec`) without the ``layers`` axis."""
    batch, n = len(pad), cfg.n_layers
    spec = cache_spec(cfg, plan, batch, seq)
    layer = NamedSharding(plan.mesh, PartitionSpec(*tuple(spec)[1:]))
    kv = _zeros((batch, seq, cfg.n_kv_heads, cfg.head_dim), jnp.dtype(dtype).name, layer, 2 * n)()
    rows = plan.rules.resolve("activations", ("batch",), (batch,), plan.mesh_sizes, path="kv_cache/pad").spec
    return LayerCache(kv[:n], kv[n:], jax.device_put(jnp.int32(0), NamedSharding(plan.mesh, PartitionSpec())),
                      jax.device_put(jnp.asarray(pad, jnp.int32), NamedSharding(plan.mesh, rows)))


def traced_cache(cfg: DecoderConfig, plan, pad_b, seq: int, dtype=jnp.float32, *, layered: bool = True):
    """:func:`empty_layer_cache` (``layered``) or :func:`stacked_cache` made *inside* a compiled program (``pad_b``
    traced): the prefill makes its own cache, so a generation runs no zeros program and transfers no cache."""
    batch, n = pad_b.shape[0], cfg.n_layers
    spec = tuple(cache_spec(cfg, plan, batch, seq))
    if not layered:
        zeros = jnp.zeros(cache_shape(cfg, batch, seq), dtype)
        k_v = [jax.lax.with_sharding_constraint(zeros, NamedSharding(plan.mesh, PartitionSpec(*spec)))
               for _ in range(2)]
        return KVCache(k_v[0], k_v[1], jnp.int32(0), pad_b)
    layer = NamedSharding(plan.mesh, PartitionSpec(*spec[1:]))
    kv = [jax.lax.with_sharding_constraint(jnp.zeros((batch, seq, cfg.n_kv_heads, cfg.head_dim), dtype), layer)
          for _ in range(2 * n)]
    return LayerCache(tuple(kv[:n]), tuple(kv[n:]), jnp.int32(0), pad_b)


def stacked_cache(cfg: DecoderConfig, plan, pad, seq: int, dtype=jnp.float32) -> KVCache:
    """:func:`meshtrain.generation.cache.empty_cache` (the stacked layout the scanned layers take) made by
    one compiled program per shape, not a new one per generation."""
    sh = cache_shardings(cfg, plan, len(pad), seq)
    k, v = _zeros(cache_shape(cfg, len(pad), seq), jnp.dtype(dtype).name, sh.k, 2)()
    return KVCache(k, v, jax.device_put(jnp.int32(0), sh.index), jax.device_put(jnp.asarray(pad, jnp.int32),
                                                                                           sh.pad))


def cache_mask(index, pad_b, t: int, seq: int):
    """``(positions_bt, allowed_bts)`` of ``t`` new tokens written at slot ``index`` of a ``seq``-slot
    cache of left-padded rows: row ``b``'s token at slot ``s`` has position ``s - pad[b]`` and sees slots
    ``pad[b] .. s`` (as :meth:`meshtrain.models.decoder.Decoder.cached`); a padding slot's query sees
    itself, so no softmax row is empty (its output is never read). ``index`` may also be ``(batch,)``:
    each row's own slot (a server's rows, :mod:`meshtrain.serving.slots`)."""
    slots_bt = jnp.reshape(index, (-1, 1)) + jnp.arange(t, dtype=jnp.int32)[None, :]  # (1, t), or (batch, t)
    positions_bt = jnp.maximum(slots_bt - pad_b[:, None], 0)
    keys_s = jnp.arange(seq, dtype=jnp.int32)
    allowed_bts = (keys_s[None, None, :] >= pad_b[:, None, None]) & (keys_s[None, None, :] <= slots_bt[:, :, None])
    return positions_bt, allowed_bts | (keys_s[None, None, :] == slots_bt[:, :, None])


def layered_forward(model, block_graphdef, layers: Tuple, tokens_bt, cache: LayerCache,
                    load_layer: Callable = lambda layer: layer):
    """``(logits_btv, cache)`` for ``t`` new tokens per row written at slot ``cache.index``: the model's
    embedding and head around its blocks run one after another, block ``l`` from ``layers[l]`` (one
    layer's weights, brought into compute form by ``load_layer`` where it runs) against ``cache.k[l]``,
    ``cache.v[l]``. Each block is the model's own (:meth:`Block.cached`), so the arithmetic is the
    scanned loop's."""
    t = tokens_bt.shape[1]
    positions_bt, allowed_bts = cache_mask(cache.index, cache.pad, t, cache.k[0].shape[1])
    x_btd = model.embed(tokens_bt)
    ks, vs = [], []
    for layer, k_bskh, v_bskh in zip(layers, cache.k, cache.v):
        block = nnx.merge(block_graphdef, load_layer(layer))
        x_btd, k_bskh, v_bskh = block.cached(x_btd, positions_bt, allowed_bts, k_bskh, v_bskh, cache.index)
        if model.cfg.n_experts:
            pop_moe_stats(block)  # router statistics are for the training loss
        ks.append(k_bskh)
        vs.append(v_bskh)
    return model.head(x_btd), dataclasses.replace(cache, k=tuple(ks), v=tuple(vs), index=cache.index + t)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoded:
    """What the loop hands back: ``new_bn`` / ``logprobs_bn`` each row's tokens and their log-probabilities
    (column 0: the prefill's token; columns past ``length_b[b]`` are not the row's), ``length_b`` each row's
    count of new tokens (a stop token included), ``steps`` the decode steps run."""

    new_bn: jax.Array
    logprobs_bn: jax.Array
    length_b: jax.Array
    steps: jax.Array


def decode_loop(forward: Callable, first_b, first_lp_b, cache, limit_b, is_stop_v, key, *, n_new: int,
                sampling: Sampling) -> Tuple[Decoded, object]:
    """Decode steps ``1 .. n_new - 1`` in one ``lax.while_loop`` (traced inside a compiled step).

    ``forward(tokens_bt, cache) -> (logits_btv, cache)``: one step of the model (or ``(logits_btv, cache,
    (greedy_b, greedy_logprob_b))``: a step that also made the greedy choice, used when ``sampling`` is greedy);
    ``first_b``, ``first_lp_b``: the prefill's tokens and log-probabilities; ``limit_b``: each row's most new
    tokens (>= 1); ``is_stop_v``: ``(vocab,)`` bool, the stop ids; ``key``: the sampling seed's key (step ``i``
    draws with ``fold_in(key, i)``, as the per-token loop's ``Sampling.key(i)``). A row is done after a stop id or
    at its limit; its later tokens are computed (the batch moves together) but not counted. Returns the
    :class:`Decoded` and the cache (returned so that a donated cache is updated in place)."""
    batch = first_b.shape[0]
    new_bn = jnp.zeros((batch, n_new), jnp.int32).at[:, 0].set(first_b)
    lp_bn = jnp.zeros((batch, n_new), jnp.float32).at[:, 0].set(first_lp_b)
    length_b = jnp.ones((batch,), jnp.int32)
    done_b = is_stop_v[first_b] | (length_b >= limit_b)

    def more(state):
        i, _, _, _, _, _, done_b = state
        return (i < n_new) & ~jnp.all(done_b)

    def step(state):
        i, token_b, cache, new_bn, lp_bn, length_b, done_b = state
        logits_btv, cache, *greedy = forward(token_b[:, None], cache)
        if greedy and sampling.greedy:  # the step chose already (the fused step: no kernels over the vocabulary)
            token_b, lp_b = greedy[0]
        else:
            token_b, lp_b = choose_with_logprobs(logits_btv[:, 0], jax.random.fold_in(key, i), sampling)
        new_bn = jax.lax.dynamic_update_slice_in_dim(new_bn, token_b[:, None], i, axis=1)
        lp_bn = jax.lax.dynamic_update_slice_in_dim(lp_bn, lp_b[:, None], i, axis=1)
        length_b = length_b + (~done_b).astype(jnp.int32)
        done_b = done_b | is_stop_v[token_b] | (length_b >= limit_b)
        return i + 1, token_b, cache, new_bn, lp_bn, length_b, done_b

    state = (jnp.int32(1), first_b, cache, new_bn, lp_bn, length_b, done_b)
    steps, _, cache, new_bn, lp_bn, length_b, _ = jax.lax.while_loop(more, step, state)
    return Decoded(new_bn, lp_bn, length_b, steps - 1), cache


def stop_mask(stop_ids, vocab_size: int) -> np.ndarray:
    """``(vocab,)`` bool: True at each stop id (one shape whatever the number of stop ids: one compile)."""
    mask = np.zeros(vocab_size, bool)
    mask[list(stop_ids)] = True
    return mask
