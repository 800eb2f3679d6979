"""The Linen adapter: a Flax Linen module as a meshtrain model factory (``rngs -> nnx.Module``),
built on ``flax.nnx.bridge`` (``ToNNX`` + ``lazy_init``).

Logical axes:

* Parameters created with ``nn.with_logical_partitioning(init, names)`` keep ``names``: the bridge
  turns Linen's ``LogicallyPartitioned`` box into an ``nnx.Param`` whose ``out_sharding`` metadata
  is ``names`` (what :func:`meshtrain.abstract_state` reads). ``nn.with_partitioning`` boxes carry
  *mesh* axis names and land in the same place, so use the logical variant.
* Parameters without a box get axes from ``rules`` (a :class:`meshtrain.PathRules`, matched on
  paths like ``"Dense_0/kernel"`` or ``"Block_0/Attn/query/kernel"``): the factory writes them into
  ``out_sharding``. Alternatively pass the rules to ``abstract_state(..., annotations=rules)``.

Randomness: the wrapper holds one NNX RNG stream per name in ``rng_streams`` (``params`` and
``dropout`` by default); each call draws a fresh key from every stream and hands them to Linen's
``apply(rngs=...)``. These streams (a ``key<fry>`` key and a counter each) are model state: planned,
sharded and checkpointed like the rest.

Train / eval: Linen modules take their mode as a call argument; pass it through the model call,
e.g. ``model(x, deterministic=True)`` (the keyword is whatever the Linen module defines).

Example::

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = lambda f, names: nn.Dense(f, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), names))
            return dense(4, ("mlp", "embed"))(nn.relu(dense(16, ("embed", "mlp"))(x)))

    factory = from_linen(MLP(), jnp.zeros((1, 8)), rules=PathRules([(r".*bias", (None,))]))
    abstract = meshtrain.abstract_state(factory, optax.adamw(1e-3))
    abstract.param_axes["Dense_0/kernel"]      # ('embed', 'mlp')
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from meshtrain.abstract import ModelFactory
from meshtrain.annotate import PathRules
from meshtrain.errors import RulesError


def _concrete(x):
    """Sample inputs may be ``jax.ShapeDtypeStruct`` (no data needed to trace ``init``)."""
    return jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x


def _stamp_axes(model: nnx.Module, rules: PathRules) -> None:
    """Write ``rules``' axes into the ``out_sharding`` of every parameter that has none."""
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param) or var.get_metadata().get("out_sharding") is not None:
            continue
        name = "/".join(str(p) for p in path)
        axes = rules.lookup(name)
        if axes is None:
            continue  # abstract_state names every parameter still without axes
        if len(axes) != len(var.shape):
            raise RulesError(f"Linen parameter {name!r} (shape {tuple(var.shape)}) matched path rule axes "
                             f"{tuple(axes)} of rank {len(axes)}; give one logical name (or None) per dimension")
        var.set_metadata("out_sharding", tuple(axes))


def from_linen(module: nn.Module, *sample_args: Any, rules: Optional[PathRules] = None,
               rng_streams: Sequence[str] = ("params", "dropout"), method: Any = None,
               **sample_kwargs: Any) -> ModelFactory:
    """A model factory ``rngs -> nnx.Module`` wrapping the Linen ``module``.

    Args:
      module: a Linen module (unbound).
      *sample_args, **sample_kwargs: inputs for Linen's ``init`` (arrays or ``jax.ShapeDtypeStruct``;
        only their shapes and dtypes matter, the factory runs under ``eval_shape`` / ``jit``).
      rules: logical axes by parameter path for parameters without ``with_logical_partitioning``.
      rng_streams: NNX RNG streams the wrapper holds and passes to Linen on every call.
      method: the Linen method to initialise through (default ``__call__``).

    The returned model is called like the Linen module's ``apply`` without variables:
    ``model(x, deterministic=True)``; extra Linen methods are available as attributes.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_linen takes a flax.linen Module; got {type(module).__name__} "
                        f"(an nnx.Module needs no adapter: pass `lambda rngs: MyModel(..., rngs=rngs)`)")
    args = jax.tree.map(_concrete, sample_args)
    kwargs = jax.tree.map(_concrete, sample_kwargs)
    if method is not None:
        kwargs["method"] = method
    streams = tuple(rng_streams)

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        # Metadata only: meshtrain places parameters through jit out_shardings, never eagerly.
        with nnx.use_eager_sharding(False):
            linen_rngs = nnx.Rngs(**{name: rngs[name]() for name in streams})
            model = nnx.bridge.ToNNX(module, rngs=linen_rngs)
            nnx.bridge.lazy_init(model, *args, **kwargs)
            if rules is not None:
                _stamp_axes(model, rules)
        return model

    return factory
