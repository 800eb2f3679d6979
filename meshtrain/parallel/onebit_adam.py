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
momentum, ``mu`` is set to it, ``nu`` and ``nu``'s bias correction stay as at the freeze, and clipping is off
(the exact gradient's norm is known on no replica; clipping the momentum's noisy increment would bend ``m``).
Weight decay and the learning-rate schedule apply as in AdamW. The frozen ``nu`` of each parameter leaf is scaled
by that leaf's *trend*: the b2-average of the exact per-leaf energy of the replicas' local gradients (one f32 per
leaf, summed over ``data`` by the step) over its mean in the first :data:`TREND_REFERENCE_STEPS` compressed steps,
because with AdamW's ``b2`` 0.95 the exact variance keeps falling after the freeze and a fixed one takes too
small steps (measured: BENCHMARKS.md "Compressed gradient reduction across DCN").

Example::

    tx = onebit_adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, 250), weight_decay=0.1, clip_norm=1.0)
    abstract = mt.abstract_state(feedback_factory(factory, recipe), tx)   # recipe: onebit, warm-up K > 0
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


#: compressed steps whose gradient energy is averaged into the trend's reference (the trend is 1 until then)
TREND_REFERENCE_STEPS = 10


class OneBitAdamState(NamedTuple):
    """Adam's moments plus what the compressed phase needs: ``nu_count`` (gradients ``nu`` has seen: its bias
    correction, which stops at the freeze), ``frozen`` (set by the compressed step), ``b1`` (the step forms each
    replica's local momentum with it) and the variance trend (one f32 per parameter leaf, in
    ``jax.tree.leaves`` order): ``energy`` the step's exact per-leaf gradient energy (written by the compressed
    step before the update), ``energy_ema`` its b2-average, ``energy_ref`` its mean over the first
    :data:`TREND_REFERENCE_STEPS` compressed steps, ``trend`` = ``energy_ema / energy_ref`` (the factor on the
    frozen ``nu``) and ``trend_count`` the compressed steps so far."""

    count: jax.Array
    mu: Any
    nu: Any
    nu_count: jax.Array
    frozen: jax.Array
    b1: jax.Array
    energy: jax.Array
    energy_ema: jax.Array
    energy_ref: jax.Array
    trend: jax.Array
    trend_count: jax.Array


def _trend(state: OneBitAdamState, b2: float):
    """``(energy_ema, energy_ref, trend, trend_count)`` after a compressed step (unchanged in an exact one)."""
    k = state.trend_count
    e = state.energy
    ema = jnp.where(k == 0, e, b2 * state.energy_ema + (1 - b2) * e)
    ref = jnp.where(k < TREND_REFERENCE_STEPS, (state.energy_ref * k + e) / (k + 1), state.energy_ref)
    ready = (k + 1 >= TREND_REFERENCE_STEPS) & (ref > 0)
    trend = jnp.where(ready, ema / jnp.where(ref > 0, ref, 1.0), 1.0)
    new = (ema, ref, trend, k + 1)
    old = (state.energy_ema, state.energy_ref, state.trend, state.trend_count)
    return tuple(jnp.where(state.frozen, n, o) for n, o in zip(new, old))


def scale_by_onebit_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                         clip_norm: float = 0.0) -> optax.GradientTransformation:
    """Adam's scaling (with ``clip_by_global_norm(clip_norm)`` first when ``clip_norm > 0``) that, once the state
    is ``frozen``, takes the averaged momentum as its input and keeps ``nu`` fixed (module docstring)."""
    clip = optax.clip_by_global_norm(clip_norm) if clip_norm > 0 else None

    def init(params):
        zeros = optax.tree.zeros_like(params)
        leaves = jnp.zeros([len(jax.tree.leaves(params))], jnp.float32)
        return OneBitAdamState(jnp.zeros([], jnp.int32), zeros, optax.tree.zeros_like(params),
                               jnp.zeros([], jnp.int32), jnp.zeros([], jnp.bool_), jnp.asarray(b1, jnp.float32),
                               leaves, leaves, leaves, jnp.ones_like(leaves), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        frozen = state.frozen
        exact = updates if clip is None else clip.update(updates, optax.EmptyState())[0]
        adam_mu = optax.tree.update_moment(exact, state.mu, b1, 1)
        adam_nu = optax.tree.update_moment_per_elem_norm(exact, state.nu, b2, 2)
        # frozen: the input *is* the new momentum (the replicas' compressed average); nu stays
        mu = jax.tree.map(lambda m, a: jnp.where(frozen, m.astype(a.dtype), a), updates, adam_mu)
        nu = jax.tree.map(lambda old, a: jnp.where(frozen, old, a), state.nu, adam_nu)
        count_inc = optax.safe_increment(state.count)
        nu_count = jnp.where(frozen, state.nu_count, optax.safe_increment(state.nu_count))
        mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        nu_hat = optax.tree.bias_correction(nu, b2, nu_count)
        ema, ref, trend, trend_count = _trend(state, b2)
        nu_hat = scaled(nu_hat, trend)   # frozen: the frozen nu follows each leaf's exact gradient-energy trend
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return out, OneBitAdamState(count_inc, mu, nu, nu_count, frozen, state.b1, state.energy, ema, ref, trend,
                                    trend_count)

    return optax.GradientTransformation(init, update)


def onebit_adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-4,
                 mask=None, clip_norm: float = 0.0) -> optax.GradientTransformation:
    """``optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(...))`` (no clipping for ``clip_norm`` 0)
    whose variance freezes when ``grad_compression: onebit`` starts; pass it where you would pass AdamW, e.g.
    ``onebit_adamw(3e-3, weight_decay=0.1, clip_norm=1.0)``."""
    return optax.chain(scale_by_onebit_adam(b1, b2, eps, clip_norm),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))


def scaled(nu, trend):
    """``nu`` with leaf ``i`` (``jax.tree.leaves`` order) times ``trend[i]``: the variance the update uses."""
    leaves, treedef = jax.tree_util.tree_flatten(nu)
    return jax.tree_util.tree_unflatten(treedef, [v * trend[i] for i, v in enumerate(leaves)])


def _is_state(x) -> bool:
    return isinstance(x, OneBitAdamState)


def find_state(opt_state) -> Optional[OneBitAdamState]:
    """The one :class:`OneBitAdamState` in ``opt_state`` (``None`` without; two would be ambiguous)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(s)]
    return found[0] if len(found) == 1 else None


def frozen(opt_state, energy):
    """``opt_state`` with its :class:`OneBitAdamState` marked frozen and this step's per-leaf gradient ``energy``
    recorded (the compressed step's acts before the update)."""
    return jax.tree.map(lambda s: s._replace(frozen=jnp.ones([], jnp.bool_), energy=energy) if _is_state(s) else s,
                        opt_state, is_leaf=_is_state)
