"""The Linen adapter: a Flax Linen module as a meshtrain model factory (``rngs -> nnx.Module``),
built on ``flax.nnx.bridge`` (``ToNNX`` + ``lazy_init``).

Logical axes:

* Parameters created with ``nn.with_logical_partitioning(init, names)`` keep ``names``: the bridge
  turns Linen's ``LogicallyPartitioned`` box into an ``nnx.Param`` whose ``out_sharding`` metadata
  is ``names`` (what :func:`meshtrain.abstract_state` reads). ``nn.with_partitioning`` boxes carry
  *mesh* axis names and land in the same place, so use the logical variant.
* Parameters without a box get axes from ``rules`` (a rules YAML file, a dict with ``paths:`` and
  ``logical:``, a :class:`meshtrain.ModelRules` or :class:`meshtrain.PathRules`, matched on paths like
  ``"Dense_0/kernel"`` or ``"transformer/h/0/attn/c_attn/kernel"``; ``meshtrain.list_params(factory)``
  prints them). The factory carries them (``factory.model_rules``) to :func:`meshtrain.abstract_state`:
  they are never written into the parameters, so a module that reads ``self.variables`` directly (a
  tied output layer: ``embedding.T``) sees plain arrays.
* Fewer names than dimensions (Flax's ``DenseGeneral`` names its flattened kernel) leave the trailing
  dimensions unsharded; names meshtrain does not know (``kv``, ``joined_kv``) are mapped by the rules'
  ``logical:`` section, without editing the model.

HuggingFace Flax models: pass the pretrained-model object (``FlaxGPT2LMHeadModel(config)``); the adapter
takes its ``.module``, starts from its ``.params`` (every collection they hold: a ResNet's ``batch_stats``
too; ``weights=Weights.INIT``: fresh ones instead) and keeps its ``.config`` as ``factory.config``. The model
calls that Linen module, not the HF wrapper's ``__call__``: what the wrapper does to the inputs (ResNet's and
ViT's NCHW -> NHWC transpose, GPT-2's and BERT's default position ids and attention mask) is the caller's.

Model state: every Linen collection besides ``params`` that ``init`` created (``batch_stats``, ``cache``; not
``intermediates``) is mutable on every call, so ``model(x, train=True)`` updates BatchNorm's running
statistics in place with no ``mutable=`` keyword; the train step carries them out as ``model_state``.

Activations: inside a meshtrain step, every Linen submodule's outputs keep their batch dimension (the
leading one, of the call's batch size) on the recipe's batch mesh axes; the other dimensions are left to
XLA. Meshtrain's own models say this with ``constrain``; a Linen model has no such calls, and XLA's
propagation alone split flax's lm1b model's activations by feature over the FSDP axis, keeping the whole
batch on every device (16 devices, fsdp: 331 MiB per device and 454 MiB of collectives per step, 68 MiB
and 18 MiB with the constraint; the planner's traced estimate, 74 MiB, assumes the batch is split).

Nothing runs when ``from_linen`` is called (no JAX backend starts): the sample inputs are made into
arrays, and ``init`` traced, only when the Trainer or the planner builds the model.

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

    factory = from_linen(MLP(), jax.ShapeDtypeStruct((1, 8), jnp.float32), rules={"paths": {".*bias": [None]}})
    abstract = meshtrain.abstract_state(factory, optax.adamw(1e-3))
    abstract.param_axes["Dense_0/kernel"]      # ('embed', 'mlp')
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from flax.nnx import variablelib

from meshtrain.abstract import Annotations
from meshtrain.annotate import ModelRules, StepContext, current_step_context


class Weights(str, enum.Enum):
    """Where a wrapped model's starting weights come from: ``pretrained`` (the HF object's ``.params``,
    when it has them) or ``init`` (the module's initialisers, seeded by the run)."""

    PRETRAINED = "pretrained"
    INIT = "init"


def _concrete(x):
    """Sample inputs may be ``jax.ShapeDtypeStruct`` or numpy arrays: arrays only inside the factory (traced)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.zeros(x.shape, x.dtype)
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def _unwrap(module: Any) -> Tuple[nn.Module, Any, Any]:
    """``(linen module, pretrained params or None, config or None)`` of a Linen module or a HF Flax model."""
    if isinstance(module, nn.Module):
        return module, None, None
    inner = getattr(module, "module", None)
    if isinstance(inner, nn.Module):  # a HF FlaxPreTrainedModel (or anything else that holds its module)
        try:  # HF models made with _do_init=False hold no weights (their .params raises ValueError)
            params = getattr(module, "_params", None) if hasattr(module, "_params") else module.params
        except (AttributeError, ValueError):
            params = None
        return inner, params, getattr(module, "config", None)
    hint = (" (an nnx.Module needs no adapter: pass `lambda rngs: MyModel(..., rngs=rngs)`)"
            if isinstance(module, nnx.Module) else "")
    raise TypeError(f"from_linen takes a flax.linen Module or a HuggingFace Flax model (an object with a Linen "
                    f".module, e.g. FlaxGPT2LMHeadModel(config)); got {type(module).__name__}{hint}")


def _load_params(model: nnx.Module, params: Dict[str, Any]) -> None:
    """Replace the initialised variables with ``params``: a Linen variables tree (``{'params': ...,
    'batch_stats': ...}``: every collection it holds, so a pretrained BatchNorm keeps its running
    statistics) or the inside of ``'params'`` alone."""
    is_variables = isinstance(params, Mapping) and "params" in params
    collections = dict(params) if is_variables else {"params": params}
    for name, tree in collections.items():
        kind = nnx.Param if name == "params" else variablelib.variable_type_from_name(name)
        state = nnx.state(model, kind)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, nn.unbox(tree)))
        nnx.update(model, state)


#: Collections a Linen module writes only to report (``self.sow``): never made mutable by default, as their
#: values would grow (sow appends) and change the model state's structure from one step to the next.
REPORT_ONLY = ("intermediates",)


def state_collections(model: nnx.bridge.ToNNX) -> Tuple[str, ...]:
    """The Linen collections other than ``params`` that ``model`` holds after ``init`` (``batch_stats``,
    ``cache``, ...; not :data:`REPORT_ONLY`): what each call makes mutable, so their updates become the
    model's new state (the train step carries it out as ``model_state``)."""
    names = set()
    for key, value in vars(model).items():
        if key.startswith(("to_nnx__", "_pytree__")):
            continue
        for leaf in jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, nnx.Variable)):
            if isinstance(leaf, nnx.Variable) and not isinstance(leaf, nnx.Param):
                names.add(variablelib.variable_name_from_type(type(leaf)))
    return tuple(sorted(names - set(REPORT_ONLY)))


def _batch_rows(args, kwargs) -> Optional[int]:
    """The leading dimension of the call's first array input: the batch rows this call sees."""
    for leaf in jax.tree.leaves((args, kwargs)):
        if isinstance(leaf, jax.Array) and leaf.ndim:
            return int(leaf.shape[0])
    return None


def _keep_batch_sharded(ctx: StepContext, rows: int, next_fun, args, kwargs, context):
    """A Linen method interceptor: the outputs of every submodule's ``__call__`` whose leading dimension is
    the batch keep it on the batch mesh axes (the other dimensions are left to XLA). Meshtrain's own models
    say this with ``constrain``; without it XLA's propagation may split a Linen model's activations on the
    FSDP axis by their feature dimension and keep the whole batch on every device (measured: flax's lm1b
    under fsdp on 16 devices, 4.5x the memory and 200 MiB of activation all-reduces per step)."""
    out = next_fun(*args, **kwargs)
    if context.method_name != "__call__":
        return out
    rule = ctx.rules.table("activations").get("batch")
    sizes = ctx.mesh_sizes()
    axes = tuple(a for a in (rule.mesh_axes if rule else ()) if sizes.get(a, 1) > 1)
    if not axes or rows % math.prod(sizes[a] for a in axes):
        return out

    def keep(x):
        if not isinstance(x, jax.Array) or not x.ndim or x.shape[0] != rows:
            return x
        spec = jax.sharding.PartitionSpec(axes, *[jax.sharding.PartitionSpec.UNCONSTRAINED] * (x.ndim - 1))
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(ctx.mesh, spec))

    return jax.tree.map(keep, out)


class LinenModel(nnx.bridge.ToNNX):
    """``nnx.bridge.ToNNX`` that, inside a meshtrain step, keeps the batch dimension of its submodules'
    outputs on the batch mesh axes (:func:`_keep_batch_sharded`); outside a step it is ``ToNNX``."""

    def __call__(self, *args, **kwargs):
        if "mutable" not in kwargs and not self._pytree__state.initializing:
            # BatchNorm's statistics and other non-parameter collections update in place (the bridge keeps
            # the updates as the model's new state), so `model(x, train=True)` needs no `mutable=` keyword.
            kwargs["mutable"] = list(state_collections(self)) or False
        ctx = current_step_context()
        rows = _batch_rows(args, kwargs) if ctx is not None else None
        if rows is None:
            return super().__call__(*args, **kwargs)
        with nn.intercept_methods(functools.partial(_keep_batch_sharded, ctx, rows)):
            return super().__call__(*args, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity, like a function
class LinenFactory:
    """A model factory ``rngs -> nnx.Module`` around a Linen module (what :func:`from_linen` returns).

    ``model_rules``: the rules given to :func:`from_linen`, read by :func:`meshtrain.abstract_state`;
    ``config``: the wrapped HF model's config (``None`` for a plain Linen module)."""

    module: nn.Module
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    streams: Tuple[str, ...]
    model_rules: Optional[ModelRules] = None
    params: Any = None
    config: Any = None

    def __call__(self, rngs: nnx.Rngs) -> nnx.Module:
        args = jax.tree.map(_concrete, self.args)
        kwargs = jax.tree.map(_concrete, self.kwargs)
        # Metadata only: meshtrain places parameters through jit out_shardings, never eagerly.
        with nnx.use_eager_sharding(False):
            linen_rngs = nnx.Rngs(**{name: rngs[name]() for name in self.streams})
            model = LinenModel(self.module, rngs=linen_rngs)
            nnx.bridge.lazy_init(model, *args, **kwargs)
            if self.params is not None:
                _load_params(model, self.params)
        return model


def from_linen(module: Any, *sample_args: Any, rules: Annotations = None,
               rng_streams: Sequence[str] = ("params", "dropout"), method: Any = None,
               weights: Weights = Weights.PRETRAINED, **sample_kwargs: Any) -> LinenFactory:
    """A model factory ``rngs -> nnx.Module`` wrapping the Linen ``module``.

    Args:
      module: a Linen module (unbound), or a HuggingFace Flax model (its ``.module``, ``.params``, ``.config``).
      *sample_args, **sample_kwargs: inputs for Linen's ``init`` (``jax.ShapeDtypeStruct``, numpy or JAX
        arrays; only their shapes and dtypes matter, the factory runs under ``eval_shape`` / ``jit``).
      rules: logical axes by parameter path (``paths:``) and mappings for the model's own logical names
        (``logical:``): a YAML file, a dict, :class:`meshtrain.ModelRules` or :class:`meshtrain.PathRules`.
      rng_streams: NNX RNG streams the wrapper holds and passes to Linen on every call.
      method: the Linen method to initialise through (default ``__call__``).
      weights: a HF model's starting weights: its ``.params`` (``pretrained``) or fresh ones (``init``).

    The returned model is called like the Linen module's ``apply`` without variables:
    ``model(x, deterministic=True)``; extra Linen methods are available as attributes.
    """
    linen, params, config = _unwrap(module)
    kwargs = dict(sample_kwargs)
    if method is not None:
        kwargs["method"] = method
    params = params if Weights(weights) is Weights.PRETRAINED else None
    return LinenFactory(linen, tuple(sample_args), kwargs, tuple(rng_streams), ModelRules.load(rules), params, config)
