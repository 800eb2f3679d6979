"""`TrainState` and sharded initialisation.

The model is never materialised on one device: the factory runs inside ``jit`` whose
``out_shardings`` come from the plan, so each device creates only its own shards::

    state = init_state(plan, seed=0)
    state.params["embedding_vd"].sharding      # NamedSharding(mesh, P(None, 'fsdp'))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.abstract import _build, split_model
from meshtrain.errors import ConfigError
from meshtrain.plan import ShardingPlan
from meshtrain.precision import has_master_weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything a step reads and writes: ``step`` (int32 scalar), ``params`` and ``opt_state``
    (pytrees of sharded arrays), ``model_state`` (non-parameter variables: batch statistics, RNG
    keys and counters; replicated unless they carry logical axes). Every leaf has a mesh sharding."""

    step: Any
    params: Any
    opt_state: Any
    model_state: Any


def state_shardings(plan: ShardingPlan) -> TrainState:
    """The ``TrainState`` of ``NamedSharding``s for ``jit`` (scalars get a replicated mesh sharding)."""
    return TrainState(NamedSharding(plan.mesh, PartitionSpec()), plan.param_shardings, plan.opt_shardings,
                      plan.model_state_shardings)


def abstract_train_state(plan: ShardingPlan) -> TrainState:
    """``TrainState`` of ``ShapeDtypeStruct``s with shardings: the target for a checkpoint restore."""
    sh = state_shardings(plan)
    a = plan.abstract
    as_sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    return TrainState(
        jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.step),
        jax.tree.map(as_sds, a.params, sh.params),
        jax.tree.map(as_sds, a.opt_state, sh.opt_state),
        jax.tree.map(as_sds, a.model_state, sh.model_state))


def init_state(plan: ShardingPlan, seed: int = 0, params: Any = None) -> TrainState:
    """Build params, optimizer state and model state (RNG streams, batch statistics) directly in
    their shards (``jit`` with ``out_shardings``).

    Values do not depend on the mesh (JAX's partitionable threefry), so a 1-device and an
    8-device run of the same seed start from identical weights and identical RNG keys.
    ``params`` (a tree like the plan's, e.g. imported weights): start from these instead of the
    factory's; the optimizer state is initialised from them (fine-tuning starts it fresh). With LoRA
    (the plan's factory has ``build_on``) ``params`` are the *base* model's: the adapters go on them.
    """
    a = plan.abstract
    if a.tx is None:
        raise ConfigError("init_state needs an optimizer: build the abstract state with abstract_state(factory, tx)")

    # LoRA (meshtrain.models.lora.LoRAFactory): given weights are the base's; the adapters go on them
    on_base = getattr(a.factory, "build_on", None)

    def _init(given):
        if on_base is not None and given is not None:
            _, built, model_state = split_model(_build(lambda rngs: on_base(rngs, given), seed))
            given = None
        else:
            _, built, model_state = split_model(_build(a.factory, seed))
        if given is not None:
            built = jax.tree.map(lambda x: x.astype(jnp.float32), given)
        params = jax.tree.map(lambda x, target: x.astype(target.dtype), built, a.params)
        # f32 master weights start from the factory's own (f32) values, not the 16-bit rounding.
        opt_state = a.tx.init(built if has_master_weights(a.opt_state) else params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, model_state)

    with jax.set_mesh(plan.mesh):
        return jax.jit(_init, out_shardings=state_shardings(plan))(params)
