"""Mixed precision as the ZeRO and Megatron papers do it: 16-bit working parameters, f32 master
weights inside the (sharded) optimizer state.

With ``Recipe(param_dtype="bfloat16")`` the plan wraps the user's optimizer in
:func:`master_weights`: the parameters the model reads (and the gradients the backward produces)
are bfloat16, replicated or sharded by the *parameter* rules; the f32 master copy lives in the
optimizer state next to Adam's moments, so it is sharded by the *optimizer* rules (ZeRO-1/2 split it
over the data-parallel axis). Per parameter that is ``2 + 2 + 12`` bytes (bf16 weight, bf16 gradient,
f32 master + momentum + variance), ZeRO's ``K = 12``.

Each update runs the inner optimizer in f32 on the master copy, then sets the working parameters
to the new master rounded to 16 bits (the returned updates are f32 differences, so
``optax.apply_updates`` lands exactly on the rounded master)::

    tx = master_weights(optax.adamw(3e-4))
    state = tx.init(params_bf16)            # master = params in f32
    updates, state = tx.update(grads_bf16, state, params_bf16)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from meshtrain.errors import ConfigError


class MasterWeightsState(NamedTuple):
    """The f32 master copy of the parameters (a parameter-shaped tree) and the inner optimizer's state."""

    master: Any
    inner: Any


def cast_floats(tree, dtype):
    """Every floating leaf of ``tree`` as ``dtype`` (integer and key leaves unchanged)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def master_weights(inner: optax.GradientTransformation, dtype=jnp.float32) -> optax.GradientTransformation:
    """Wrap ``inner`` so it updates an f32 (``dtype``) master copy kept in its state.

    ``init(params)`` copies the parameters to ``dtype`` (pass the f32 values where you have them:
    the initialisation then keeps its full precision); ``update`` casts the gradients to ``dtype``,
    runs ``inner`` on the master copy and returns updates that move each parameter to the new master
    rounded to the parameter's own dtype.
    """
    dtype = jnp.dtype(dtype)

    def init(params):
        master = cast_floats(params, dtype)
        return MasterWeightsState(master, inner.init(master))

    def update(grads, state, params=None):
        if params is None:
            raise ConfigError("master_weights.update needs params (the working parameters it rounds to)")
        updates, inner_state = inner.update(cast_floats(grads, dtype), state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # f32 differences: p + (round(m) - p) is exact in f32 for any two bf16 values, so apply_updates
        # (which adds in f32 and casts back) yields round(m) bit for bit.
        to_working = jax.tree.map(
            lambda m, p: (m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32))
            if jnp.issubdtype(p.dtype, jnp.floating) else jnp.zeros_like(p), master, params)
        return to_working, MasterWeightsState(master, inner_state)

    return optax.GradientTransformation(init, update)


def has_master_weights(opt_state) -> bool:
    """Whether an optimizer state (or its abstract shape) comes from :func:`master_weights`."""
    return isinstance(opt_state, MasterWeightsState)
