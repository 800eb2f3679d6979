"""The sharded train step: ``jit`` with the plan's shardings and buffer donation, activation
constraints from the model's logical names, precision and remat from the recipe, gradient
accumulation over micro-batches, and a non-finite policy.

Example (your own loop)::

    step = make_train_step(plan)
    state, metrics = step(state, batch)       # metrics: loss, grad_norm, tokens, finite

The loss is a sum over tokens divided by the token count of the whole global batch, so any
split into devices or micro-batches gives the same value as one device.
"""

from __future__ import annotations

import enum
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain.annotate import StepContext, step_context
from meshtrain.plan import ShardingPlan
from meshtrain.train.state import TrainState, state_shardings

#: ``loss_fn(model, batch) -> (sum of per-token losses, number of tokens)``.
LossFn = Callable[[nnx.Module, Dict[str, jax.Array]], Tuple[jax.Array, jax.Array]]


class NonFinite(str, enum.Enum):
    """What a step does with a non-finite loss or gradient: ``raise`` (the Trainer stops and names the
    step) or ``skip`` (parameters and optimizer state stay unchanged for that step)."""

    RAISE = "raise"
    SKIP = "skip"


def next_token_loss(model: nnx.Module, batch: Dict[str, jax.Array]) -> Tuple[jax.Array, jax.Array]:
    """Cross-entropy of ``targets`` under ``model(inputs, positions, segment_ids)``; targets < 0 are
    ignored (padding). Returns ``(sum, count)`` in f32."""
    logits = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids")).astype(jnp.float32)
    targets = batch["targets"]
    mask = (targets >= 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    return jnp.sum(ce * mask), jnp.sum(mask)


def _cast_floats(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def step_context_for(plan: ShardingPlan) -> StepContext:
    r = plan.recipe
    return StepContext(plan.mesh, plan.rules, frozenset(r.replicate_indivisible), r.remat, r.attention)


def _loss_and_grads(plan: ShardingPlan, loss_fn: LossFn):
    graphdef = plan.abstract.graphdef
    compute_dtype = jnp.dtype(plan.recipe.compute_dtype)

    def summed(params, model_state, batch):
        # Cast before use: under FSDP the all-gathers then move compute-dtype bytes.
        model = nnx.merge(graphdef, _cast_floats(params, compute_dtype), model_state)
        total, count = loss_fn(model, batch)
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return total.astype(jnp.float32), (count.astype(jnp.float32), nnx.to_pure_dict(new_model_state))

    return jax.value_and_grad(summed, has_aux=True)


def _accumulate(grad_fn, params, model_state, batch, micro: int, plan: ShardingPlan):
    """Sum of losses, token counts and gradients over ``micro`` micro-batches (lax.scan)."""
    if micro == 1:
        (total, (count, model_state)), grads = grad_fn(params, model_state, batch)
        return total, count, grads, model_state

    def split(x):  # (B, ...) -> (micro, B/micro, ...) keeping each device's rows local
        b = x.shape[0]
        y = x.reshape((b // micro, micro) + x.shape[1:])
        return jnp.moveaxis(y, 1, 0)

    micro_batches = jax.tree.map(split, batch)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = jax.lax.with_sharding_constraint(zeros, plan.param_shardings)

    def body(carry, mb):
        total, count, grads, ms = carry
        mb = {k: jax.lax.with_sharding_constraint(v, plan.batch_shardings[k]) for k, v in mb.items()} \
            if plan.batch_shardings else mb
        (t, (c, ms)), g = grad_fn(params, ms, mb)
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        return (total + t, count + c, grads, ms), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros, model_state)
    (total, count, grads, model_state), _ = jax.lax.scan(body, init, micro_batches)
    return total, count, grads, model_state


def make_train_step(plan: ShardingPlan, *, loss_fn: Optional[LossFn] = None,
                    nonfinite: NonFinite = NonFinite.RAISE, donate: bool = True):
    """A jitted ``step(state, batch) -> (state, metrics)`` for ``plan``.

    Args:
      plan: from :func:`meshtrain.make_plan` (with an optimizer and a ``BatchSpec``).
      loss_fn: ``(model, batch) -> (loss sum, token count)``; default :func:`next_token_loss`.
      nonfinite: :class:`NonFinite` policy; ``metrics["finite"]`` is reported either way.
      donate: donate the input state's buffers (the old state is invalid after the call).
    """
    loss_fn = loss_fn or next_token_loss
    tx = plan.abstract.tx
    grad_fn = _loss_and_grads(plan, loss_fn)
    micro = plan.recipe.micro_batches
    nonfinite = NonFinite(nonfinite)

    def step(state: TrainState, batch):
        with step_context(step_context_for(plan)):
            total, count, grads, model_state = _accumulate(grad_fn, state.params, state.model_state, batch, micro,
                                                           plan)
            count = jnp.maximum(count, 1.0)
            grads = jax.tree.map(lambda g, p: (g / count).astype(p.dtype), grads, state.params)
            grads = jax.lax.with_sharding_constraint(grads, plan.param_shardings)
            loss = total / count
            grad_norm = optax.tree.norm(grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            if nonfinite is NonFinite.SKIP:
                keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
                params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
                model_state = keep(model_state, state.model_state)
        new_state = TrainState(state.step + 1, params, opt_state, model_state)
        return new_state, {"loss": loss, "grad_norm": grad_norm, "tokens": count, "finite": finite}

    shardings = state_shardings(plan)
    scalar = NamedSharding(plan.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(shardings, plan.batch_shardings), out_shardings=(shardings, scalar),
                   donate_argnums=(0,) if donate else ())


def make_eval_step(plan: ShardingPlan, *, loss_fn: Optional[LossFn] = None):
    """A jitted ``eval_step(state, batch) -> {"loss", "tokens"}`` (no update, no donation)."""
    loss_fn = loss_fn or next_token_loss
    graphdef = plan.abstract.graphdef
    compute_dtype = jnp.dtype(plan.recipe.compute_dtype)

    def evaluate(state: TrainState, batch):
        with step_context(step_context_for(plan)):
            model = nnx.merge(graphdef, _cast_floats(state.params, compute_dtype), state.model_state)
            total, count = loss_fn(model, batch)
        return {"loss": total / jnp.maximum(count, 1.0), "tokens": count}

    scalar = NamedSharding(plan.mesh, PartitionSpec())
    return jax.jit(evaluate, in_shardings=(state_shardings(plan), plan.batch_shardings), out_shardings=scalar)


def make_grad_fn(plan: ShardingPlan, *, loss_fn: Optional[LossFn] = None):
    """A jitted ``grad_fn(state, batch) -> (loss, grads)`` with grads laid out like the params.

    The same loss scaling as :func:`make_train_step` (sum / global token count, micro-batched by
    the recipe); use it to inspect or compare gradients across recipes.
    """
    grad_fn = _loss_and_grads(plan, loss_fn or next_token_loss)

    def grads(state: TrainState, batch):
        with step_context(step_context_for(plan)):
            total, count, g, _ = _accumulate(grad_fn, state.params, state.model_state, batch,
                                             plan.recipe.micro_batches, plan)
            count = jnp.maximum(count, 1.0)
            return total / count, jax.tree.map(lambda x: x / count, g)

    scalar = NamedSharding(plan.mesh, PartitionSpec())
    return jax.jit(grads, in_shardings=(state_shardings(plan), plan.batch_shardings),
                   out_shardings=(scalar, plan.param_shardings))
