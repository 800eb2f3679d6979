"""1-bit Adam's optimizer half (Tang et al. 2021): Adam whose second moment freezes when ``onebit`` compression
starts, and whose first moment is then the momentum the replicas averaged compressed.

Why: error feedback (EF) makes compression error a delay, not a loss, only when the compressed quantity enters
the update *linearly*. Adam divides by ``sqrt(nu)``, and ``nu`` grows with the compression noise of an
EF-compressed gradient, so EF + Adam drifts (measured: +8.8 % final loss, README "Compressed gradient reduction
across slices"). 1-bit Adam runs exact Adam for a warm-up (``grad_compression_warmup`` K steps), then freezes
``nu``: the update ``m / (sqrt(nu) + eps)`` is linear in the momentum ``m``, so the step compresses the momentum
(each replica's ``b1 m + (1 - b1) g_i`` plus its residual; :func:`meshtrain.parallel.grad_compression.exchange`)
and the replicas' average becomes the new shared ``m``.

:func:`onebit_adamw` is ``optax.chain(clip_by_global_norm, adamw)`` with that switch: until the step marks its
state ``frozen`` (the compressed program does, before the update) it is exactly that chain (the same optax
functions, so the warm-up matches an uncompressed run bit for bit); from then on its input is the averaged
momentum, ``mu`` is set to it, ``nu`` is the step's (see below) with its bias correction as at the freeze, clipping is off
(the exact gradient's norm is known on no replica; clipping the momentum's noisy increment would bend ``m``).
Weight decay and the learning-rate schedule apply as in AdamW.

The frozen ``nu`` does not stay fixed: with AdamW's ``b2`` 0.95 the exact variance keeps falling after the freeze
and a fixed one takes too small steps (measured: BENCHMARKS.md "Compressed gradient reduction across DCN"). Each
compressed step, :func:`track_variance` moves every block of :data:`VARIANCE_BLOCK` values one b2-step towards
an unbiased estimate of the *global* gradient's energy in that block (one random projection per block and
replica, summed over ``data``: one f32 per block crosses DCN), keeping the frozen per-value shape inside the
block (Adam-mini's observation that a block's second moment can be one number, applied to the level only).

Example::

    tx = onebit_adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 250), weight_decay=0.1, clip_norm=1.0)
    abstract = mt.abstract_state(feedback_factory(factory, recipe), tx)   # recipe: onebit, warm-up K > 0
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


#: values per variance block: the step sends one f32 per block of each device's gradient shard (its random
#: projection) and tracks the block's mean variance (:func:`track_variance`)
VARIANCE_BLOCK = 64


class OneBitAdamState(NamedTuple):
    """Adam's moments plus what the compressed phase needs: ``nu_count`` (gradients ``nu`` has seen: its bias
    correction, which stops at the freeze), ``frozen`` (set by the compressed step), ``b1`` (the step forms each
    replica's local momentum with it) and ``b2`` (the step tracks each block's variance level with it:
    :func:`track_variance` rewrites ``nu`` before the update)."""

    count: jax.Array
    mu: Any
    nu: Any
    nu_count: jax.Array
    frozen: jax.Array
    b1: jax.Array
    b2: jax.Array


def _signs(n: int, seed) -> jax.Array:
    """``n`` pseudo-random +-1 (f32) from an integer hash of the position and ``seed``: the same on every
    ``data`` replica for the same value of the same step (they hold the same shard layout), new each step."""
    h = jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.asarray(seed).astype(jnp.uint32) * \
        jnp.uint32(0x85EBCA77)
    for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        h = (h ^ (h >> shift)) * jnp.uint32(mult)
    h = h ^ (h >> 16)
    return jnp.where((h >> 31) == 1, 1.0, -1.0).astype(jnp.float32)


def track_variance(g_local, nu_hat, b2, seed, axis: str, replicas: int):
    """The factor (one per value of ``g_local``, f32) that moves each block's mean variance one b2-step towards
    the block's energy of the *global* mean gradient; call it inside ``shard_map`` manual over ``axis``.

    ``g_local``: this replica's local mean gradient, this device's flattened shard; ``nu_hat``: the
    bias-corrected frozen variance of the same values (the same on every replica); ``seed``: the step (the
    projection's signs change with it). Each replica projects each block of :data:`VARIANCE_BLOCK` values on one
    shared random sign vector ``s`` (one f32 per block), the projections are summed over ``axis`` (the only
    communication: one f32 per block) and divided by the replicas: ``r = s . g`` with ``g`` the global mean
    gradient, so ``r^2`` is an unbiased estimate of the block's ``sum g^2`` (E[s_j s_k] = 0 for j != k; the mean
    over replicas of their local energies would instead add the slices' gradient noise). Returns
    ``b2 + (1 - b2) r^2 / sum(nu_hat)`` per block, broadcast to its values: ``nu`` times it keeps the frozen
    variance's shape inside the block and makes the block's level the b2-average of the estimates.

    Example (inside the step's shard_map body)::

        factor = track_variance(g_flat, nu_hat_flat, 0.95, count, "data", 2)
        nu_flat = nu_flat * factor
    """
    n = g_local.size
    pad = -n % VARIANCE_BLOCK
    block = lambda x: jnp.pad(x.astype(jnp.float32), (0, pad)).reshape(-1, VARIANCE_BLOCK)  # noqa: E731
    proj = jnp.sum(block(g_local * _signs(n, seed)), axis=1)
    proj = jax.lax.psum(proj, axis) / replicas   # the DCN collective: one f32 per block
    level = jnp.sum(block(nu_hat), axis=1)
    ratio = jnp.where(level > 0, jnp.square(proj) / jnp.where(level > 0, level, 1.0), 1.0)
    factor = b2 + (1 - b2) * ratio
    return jnp.repeat(factor, VARIANCE_BLOCK)[:n]


def scale_by_onebit_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                         clip_norm: float = 0.0) -> optax.GradientTransformation:
    """Adam's scaling (with ``clip_by_global_norm(clip_norm)`` first when ``clip_norm > 0``) that, once the state
    is ``frozen``, takes the averaged momentum as its input and keeps ``nu`` fixed (module docstring)."""
    clip = optax.clip_by_global_norm(clip_norm) if clip_norm > 0 else None

    def init(params):
        zeros = optax.tree.zeros_like(params)
        return OneBitAdamState(jnp.zeros([], jnp.int32), zeros, optax.tree.zeros_like(params),
                               jnp.zeros([], jnp.int32), jnp.zeros([], jnp.bool_), jnp.asarray(b1, jnp.float32),
                               jnp.asarray(b2, jnp.float32))

    def update(updates, state, params=None):
        del params
        frozen = state.frozen
        exact = updates if clip is None else clip.update(updates, optax.EmptyState())[0]
        adam_mu = optax.tree.update_moment(exact, state.mu, b1, 1)
        adam_nu = optax.tree.update_moment_per_elem_norm(exact, state.nu, b2, 2)
        # frozen: the input *is* the new momentum (the replicas' compressed average); nu is the step's (its block
        # levels tracked by track_variance before this update)
        mu = jax.tree.map(lambda m, a: jnp.where(frozen, m.astype(a.dtype), a), updates, adam_mu)
        nu = jax.tree.map(lambda old, a: jnp.where(frozen, old, a), state.nu, adam_nu)
        count_inc = optax.safe_increment(state.count)
        nu_count = jnp.where(frozen, state.nu_count, optax.safe_increment(state.nu_count))
        mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        nu_hat = optax.tree.bias_correction(nu, b2, nu_count)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return out, OneBitAdamState(count_inc, mu, nu, nu_count, frozen, state.b1, state.b2)

    return optax.GradientTransformation(init, update)


def onebit_adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
                 mask=None, clip_norm: float = 0.0) -> optax.GradientTransformation:
    """``optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(...))`` (no clipping for ``clip_norm`` 0)
    whose variance freezes when ``grad_compression: onebit`` starts; pass it where you would pass AdamW, e.g.
    ``onebit_adamw(3e-3, weight_decay=0.1, clip_norm=1.0)``."""
    return optax.chain(scale_by_onebit_adam(b1, b2, eps, clip_norm),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))


def _is_state(x) -> bool:
    return isinstance(x, OneBitAdamState)


def find_state(opt_state) -> Optional[OneBitAdamState]:
    """The one :class:`OneBitAdamState` in ``opt_state`` (``None`` without; two would be ambiguous)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
    return found[0] if len(found) == 1 else None


def frozen(opt_state, nu):
    """``opt_state`` with its :class:`OneBitAdamState` marked frozen and its variance replaced by ``nu`` (the
    compressed step's acts before the update: ``nu`` with its block levels tracked, :func:`track_variance`)."""
    return jax.tree.map(lambda s: s._replace(frozen=jnp.ones([], jnp.bool_), nu=nu) if _is_state(s) else s,
                        opt_state, is_leaf=_is_state)


def bias_correction(state: OneBitAdamState) -> jax.Array:
    """``1 / (1 - b2^nu_count)``: ``nu`` times it is Adam's bias-corrected variance (frozen count after the freeze)."""
    return 1.0 / (1.0 - state.b2 ** state.nu_count.astype(jnp.float32))
