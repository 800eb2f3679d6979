"""The sharded train step: ``jit`` with the plan's shardings and buffer donation, activation
constraints from the model's logical names, precision and remat from the recipe, gradient
accumulation over micro-batches, and a non-finite policy.

Example (your own loop)::

    step = make_train_step(plan, loss_fn=my_loss)
    state, metrics = step(state, batch)   # loss, grad_norm, weight, tokens, finite + my_loss's metrics

The loss contract: ``loss_fn(model, batch)`` returns ``(loss_sum, weight)`` or
``(loss_sum, weight, metrics)``. ``loss_sum`` is the *sum* of per-example (or per-token) losses in
this batch, ``weight`` how many examples (tokens, or a sum of sample weights) it counted, and
``metrics`` a dict of scalar *sums* (e.g. ``{"correct": jnp.sum(pred == label)}``). The step adds
these up over micro-batches and divides each by the global weight of the whole batch, so any
split into devices or micro-batches gives the one-device value: ``metrics["correct"]`` arrives as
accuracy. A weight of 0 divides by 1 (the loss reads 0).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain import fp8
from meshtrain.annotate import current_step_context, step_context  # noqa: F401 (re-exported)
from meshtrain.errors import ConfigError
from meshtrain.losses import (RESERVED_METRICS, LossFn, next_token_loss,  # noqa: F401 (re-export)
                              unpack_loss)
from meshtrain.parallel import grad_compression as gc
from meshtrain.parallel import onebit_adam
from meshtrain.parallel import pipeline as pipe
from meshtrain.parallel.resolved import step_context_for  # noqa: F401 (step_context_for re-exported)
from meshtrain.plan import ShardingPlan, gradient_shardings  # noqa: F401 (re-export)
from meshtrain.precision import cast_floats
from meshtrain.strategies import GradCompression, Pipeline, ZeRO
from meshtrain.train.config import NonFinite  # noqa: F401 (re-exported: the step's policy is a run setting)
from meshtrain.state import TrainState, state_shardings


def pipeline_config(plan: ShardingPlan) -> Optional[pipe.PipelineConfig]:
    """The pipeline of a recipe with the ``pp`` strategy (``None`` otherwise), checked against the
    model (the pipeline contract, layers divisible into groups) and the batch (``ConfigError``s that
    name the fix)."""
    if plan.recipe.dimension(Pipeline) is None:
        return None
    cfg = pipe.config_for(plan.recipe, plan.mesh_sizes)
    model = nnx.merge(plan.abstract.graphdef, plan.abstract.params, plan.abstract.model_state)
    parts = pipe.get_parts(model)
    stack = pipe.get_path(plan.abstract.params, parts.stack)
    if not stack:
        raise ConfigError(f"pipeline_parts().stack = {parts.stack!r} holds no parameters of "
                          f"{type(model).__name__}; name the nnx.vmap'ed layer stack")
    sizes = {int(x.shape[0]) for x in jax.tree.leaves(stack)}
    if len(sizes) != 1:
        raise ConfigError(f"the leaves of {parts.stack!r} have different leading (layers) sizes {sorted(sizes)}; "
                          f"the pipeline stack must be one nnx.vmap'ed layer with a leading `layers` axis")
    batch = None
    if plan.batch is not None:
        dims = [(leaf.shape[leaf.batch_dim]) for _, leaf in plan.batch.leaves() if leaf.batch_dim is not None]
        batch = dims[0] if dims else None
    cfg.check(sizes.pop(), batch)
    return cfg


def _split_batch(batch, plan: ShardingPlan, micro: int):
    """Every leaf cut along its ``batch`` dim into ``(micro, ...)`` (rows stay on their devices);
    leaves without one are repeated."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    dims = [leaf.batch_dim for _, leaf in plan.batch.leaves()]
    out = []
    for x, d in zip(leaves, dims):
        if d is None:
            out.append(jnp.broadcast_to(x, (micro,) + x.shape))
            continue
        y = x.reshape(x.shape[:d] + (x.shape[d] // micro, micro) + x.shape[d + 1:])
        out.append(jnp.moveaxis(y, d + 1, 0))
    return jax.tree_util.tree_unflatten(treedef, out)


def _loss_and_grads(plan: ShardingPlan, loss_fn: LossFn, pipeline: Optional[pipe.PipelineConfig]):
    """``(params, model_state, batch) -> ((loss sum, (weight, metrics, model_state)), grads)``;
    ``pipeline`` is :func:`pipeline_config` of the plan (computed once by the caller)."""
    graphdef = plan.abstract.graphdef
    compute_dtype = jnp.dtype(plan.recipe.compute_dtype)

    def summed(params, model_state, batch):
        # Cast before use: under FSDP the all-gathers then move compute-dtype bytes.
        model = nnx.merge(graphdef, cast_floats(params, compute_dtype), model_state)
        if pipeline is None:
            out = loss_fn(model, batch)
        else:  # gpipe / circular: the stack runs through the schedule inside model(...), autodiff replays it
            # (layers that store values, e.g. MoE router statistics: the loss runs per micro-batch)
            out = pipe.pipelined_loss(model, loss_fn, batch, pipeline,
                                      split_batch=lambda: _split_batch(batch, plan, pipeline.micro_batches),
                                      unpack=lambda o: unpack_loss(o, loss_fn))
        total, weight, metrics = unpack_loss(out, loss_fn)
        # Values a layer stored for the loss (MoE router statistics) are per call, not state: a loss
        # that did not pop them must not turn them into a model-state leaf the plan never saw.
        nnx.pop(model, nnx.Intermediate)
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return total, (weight, metrics, nnx.to_pure_dict(new_model_state))

    # FP8 scales/histories (model state) are differentiated too and overwritten, never optimised
    meta = fp8.meta_paths(graphdef, plan.abstract.params, plan.abstract.model_state)
    fp8.check_pipeline(meta, pipeline)
    if pipeline is None or not pipeline.schedule.explicit_vjp:
        return fp8.value_and_grad(summed, meta)

    def one_f_one_b(params, model_state, batch):
        # 1F1B / zero-bubble: the backward is written out per stage inside the schedule (no jax.grad over it).
        build = lambda p: nnx.merge(graphdef, cast_floats(p, compute_dtype), model_state)  # noqa: E731
        total, weight, metrics, grads = pipe.value_and_grad_1f1b(
            build, params, loss_fn, _split_batch(batch, plan, pipeline.micro_batches), pipeline,
            lambda out: unpack_loss(out, loss_fn))
        return (total, (weight, metrics, model_state)), grads

    return one_f_one_b


def _batch_layout(plan: ShardingPlan, what: str):
    if plan.batch is None:
        raise ConfigError(f"{what} needs a plan with a batch layout (otherwise the batch would silently be "
                          f"replicated): make_plan(..., batch=BatchSpec(B, T)) for tokens, or "
                          f"batch=BatchLayout.from_example(example_batch) for any pytree")
    return plan.batch


def _accumulate(grad_fn, params, model_state, batch, micro: int, plan: ShardingPlan, grad_sh=None):
    """Sums of losses, weights, metrics and gradients over ``micro`` micro-batches (lax.scan).

    Each leaf is cut along its ``batch`` dimension; leaves without one go whole to every micro-batch.
    The gradient accumulator is laid out as ``grad_sh`` (default: the parameters' shardings).
    """
    grad_sh = plan.param_shardings if grad_sh is None else grad_sh
    if micro == 1:
        (total, (weight, metrics, model_state)), grads = grad_fn(params, model_state, batch)
        return total, weight, metrics, grads, model_state

    leaves, treedef = jax.tree_util.tree_flatten(batch)
    dims = [leaf.batch_dim for _, leaf in plan.batch.leaves()]
    shardings = jax.tree.leaves(plan.batch_shardings)

    def split(x, d):  # (.., B, ..) -> (micro, .., B/micro, ..) keeping each device's rows local
        y = x.reshape(x.shape[:d] + (x.shape[d] // micro, micro) + x.shape[d + 1:])
        return jnp.moveaxis(y, d + 1, 0)

    xs = [split(x, d) for x, d in zip(leaves, dims) if d is not None]

    def micro_batch(parts):
        it = iter(parts)
        out = [jax.lax.with_sharding_constraint(next(it), sh) if d is not None else x
               for x, d, sh in zip(leaves, dims, shardings)]
        return jax.tree_util.tree_unflatten(treedef, out)

    zero = current_step_context().dimension(ZeRO)
    shard_gradients = zero is not None and zero.shard_gradients
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = jax.lax.with_sharding_constraint(zeros, grad_sh)
    first = micro_batch([x[0] for x in xs])
    _, (_, metric_shapes, _) = jax.eval_shape(grad_fn, params, model_state, first)[0]
    metrics0 = {k: jnp.zeros((), jnp.float32) for k in metric_shapes}

    def body(carry, parts):
        total, weight, metrics, grads, ms = carry
        (t, (w, m, ms)), g = grad_fn(params, ms, micro_batch(parts))
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        if shard_gradients:  # ZeRO-2: reduce-scatter each micro-batch into the sharded sum
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
        metrics = {k: metrics[k] + m[k] for k in metrics}
        return (total + t, weight + w, metrics, grads, ms), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), metrics0, zeros, model_state)
    (total, weight, metrics, grads, model_state), _ = jax.lax.scan(body, init, xs)
    return total, weight, metrics, grads, model_state


def _compressed(choice, grad_fn, state, batch, plan: ShardingPlan, grad_sh, ctx):
    """:func:`_accumulate` (one micro-batch) per ``data`` replica, then the reduction over ``data`` sent compressed
    (:mod:`meshtrain.parallel.grad_compression`); the new error feedback lands in the model state.

    Returns ``(total, weight, metrics, optimizer input, its gradient norm, model_state, opt_state)``: the
    optimizer input is the mean gradient, or under 1-bit Adam (``onebit`` with :func:`onebit_adam.onebit_adamw`)
    the replicas' averaged momentum, with the optimizer state marked frozen so that it takes it as such; the
    norm is then that of the gradient the new momentum implies, ``(m_new - b1 m_old) / (1 - b1)``."""
    def local(params, model_state, batch):
        # inside shard_map over `data`: constraints name the other axes only, on the mesh with `data` manual
        local_ctx = dataclasses.replace(ctx, rules=gc.local_rules(ctx.rules), mesh=jax.sharding.get_abstract_mesh())
        with step_context(local_ctx):
            (total, (weight, metrics, new_ms)), grads = grad_fn(params, model_state, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return total, weight, metrics, grads, new_ms

    total, weight, metrics, stacked, model_state = gc.per_replica(local, plan, state.params, state.model_state, batch)
    denom = _denominator(weight)
    adam = onebit_adam.find_state(state.opt_state) if choice.has_feedback else None
    if adam is None:   # the gradient sum, compressed (int8; onebit under an optimizer linear in the gradient)
        grads, model_state, _ = gc.reduce_across_dcn(choice, plan, stacked, grad_sh, model_state)
        grads = jax.tree.map(lambda g: g / denom, grads)
        return total, weight, metrics, grads, optax.tree.norm(grads), model_state, state.opt_state
    momentum = gc.Momentum(adam.mu, adam.nu, adam.b1, adam.b2, onebit_adam.bias_correction(adam), adam.count,
                           choice.replicas / denom)
    mu, model_state, nu = gc.reduce_across_dcn(choice, plan, stacked, grad_sh, model_state, momentum)
    implied = jax.tree.map(lambda new, old: (new - adam.b1 * old) / (1 - adam.b1), mu, adam.mu)
    opt_state = onebit_adam.frozen(state.opt_state, nu)
    return total, weight, metrics, mu, optax.tree.norm(implied), model_state, opt_state


def _denominator(weight):
    return jnp.where(weight > 0, weight, 1.0)


class CheckedStep:
    """A jitted step that first checks the batch against the plan's layout (structure, shapes,
    dtypes; cached per distinct signature), then runs. ``lower`` / ``trace`` / ``eval_shape``
    check too; other attributes are the jitted function's."""

    def __init__(self, jitted, plan: ShardingPlan):
        self._jitted, self._plan = jitted, plan

    def __call__(self, state, batch):
        self._plan.check_batch(batch)
        return self._jitted(state, batch)

    def lower(self, state, batch, *args, **kwargs):
        self._plan.check_batch(batch)
        return self._jitted.lower(state, batch, *args, **kwargs)

    def trace(self, state, batch, *args, **kwargs):
        self._plan.check_batch(batch)
        return self._jitted.trace(state, batch, *args, **kwargs)

    def eval_shape(self, state, batch):
        self._plan.check_batch(batch)
        return self._jitted.eval_shape(state, batch)

    def __getattr__(self, name):
        return getattr(self._jitted, name)


def make_train_step(plan: ShardingPlan, *, loss_fn: Optional[LossFn] = None,
                    nonfinite: NonFinite = NonFinite.RAISE, donate: bool = True) -> CheckedStep:
    """A jitted ``step(state, batch) -> (state, metrics)`` for ``plan``.

    ``metrics`` holds ``loss`` (global loss sum / global weight), ``grad_norm``, ``weight`` (the
    global weight; ``tokens`` is the same number, kept for token-count readers), ``finite``, and
    each metric the loss function returned, summed over micro-batches and divided by the weight.

    Args:
      plan: from :func:`meshtrain.make_plan` with an optimizer and a batch layout.
      loss_fn: ``(model, batch) -> (loss_sum, weight[, metrics])`` (see the module docstring);
        default :func:`next_token_loss`.
      nonfinite: :class:`NonFinite` policy; ``metrics["finite"]`` is reported either way.
      donate: donate the input state's buffers (the old state is invalid after the call).
    """
    _batch_layout(plan, "make_train_step")
    loss_fn = loss_fn or next_token_loss
    tx = plan.abstract.tx
    pipeline = pipeline_config(plan)
    grad_fn = _loss_and_grads(plan, loss_fn, pipeline)
    ctx = step_context_for(plan)  # its resolved step: kernels, layer loop, accumulation, schedule
    micro = ctx.resolved.grad_accum  # 1 under a pipeline: its micro-batches are the schedule's
    if pipeline and pipe.bubble_warning(pipeline):
        warnings.warn(pipe.bubble_warning(pipeline), stacklevel=2)
    nonfinite = NonFinite(nonfinite)
    grad_sh = gradient_shardings(plan)  # ZeRO-2: the optimizer state's sharding; else the params'

    compression = ctx.resolved.grad_compression
    if compression.active:
        gc.check_model_state(plan)
        gc.sent_quantity(compression, plan.abstract.opt_state)   # refuses optax's Adam under onebit

    def step(state: TrainState, batch, compression=compression):
        with step_context(ctx):
            if compression.active:  # per-replica gradients, then a compressed exchange over `data` (DCN)
                total, weight, metrics, grads, grad_norm, model_state, opt_state = _compressed(
                    compression, grad_fn, state, batch, plan, grad_sh, ctx)
            else:
                total, weight, metrics, grads, model_state = _accumulate(grad_fn, state.params, state.model_state,
                                                                         batch, micro, plan, grad_sh)
                grads = jax.tree.map(lambda g: g / _denominator(weight), grads)
                grad_norm, opt_state = None, state.opt_state
            denom = _denominator(weight)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
            loss = total / denom
            grad_norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
            updates, opt_state = tx.update(grads, opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            if nonfinite is NonFinite.SKIP:
                keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
                params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
                model_state = keep(model_state, state.model_state)
        new_state = TrainState(state.step + 1, params, opt_state, model_state)
        out = {"loss": loss, "grad_norm": grad_norm, "weight": weight, "tokens": weight, "finite": finite}
        out.update({k: v / denom for k, v in metrics.items()})
        return new_state, out

    shardings = state_shardings(plan)
    scalar = NamedSharding(plan.mesh, PartitionSpec())
    jit = lambda fn: CheckedStep(jax.jit(fn, in_shardings=(shardings, plan.batch_shardings),  # noqa: E731
                                         out_shardings=(shardings, scalar), donate_argnums=(0,) if donate else ()), plan)
    if compression.active and compression.warmup:   # the first steps full precision: a second program
        exact = dataclasses.replace(compression, kind=GradCompression.NONE)
        return WarmupStep(jit(step), jit(lambda state, batch: step(state, batch, exact)), compression.warmup)
    return jit(step)


class WarmupStep:
    """``grad_compression_warmup``: ``exact`` (the full-precision reduction) while ``state.step < warmup``, then
    ``compressed``. Both programs take and return the same state (the error feedback stays zero in the first),
    so a resume past the warm-up compiles only the compressed one. ``lower(...)`` is the compressed program's
    (what crosses DCN once the warm-up is over); its ``compile()`` returns a callable that picks by the step."""

    def __init__(self, compressed: CheckedStep, exact: CheckedStep, warmup: int):
        self.compressed, self.exact, self.warmup = compressed, exact, warmup

    def _pick(self, state) -> CheckedStep:
        return self.exact if int(state.step) < self.warmup else self.compressed

    def __call__(self, state, batch):
        return self._pick(state)(state, batch)

    def lower(self, state, batch, *args, **kwargs):
        warm = self.exact.lower(state, batch, *args, **kwargs) if int(state.step) < self.warmup else None
        return _WarmupLowered(self.compressed.lower(state, batch, *args, **kwargs), warm, self.warmup)

    def __getattr__(self, name):   # trace, eval_shape...: the compressed program's
        return getattr(self.compressed, name)


@dataclasses.dataclass(frozen=True)
class _WarmupLowered:
    compressed: Any
    exact: Any
    warmup: int

    def compile(self, *args, **kwargs):
        return _WarmupCompiled(self.compressed.compile(*args, **kwargs),
                               None if self.exact is None else self.exact.compile(*args, **kwargs), self.warmup)

    def __getattr__(self, name):
        return getattr(self.compressed, name)


@dataclasses.dataclass(frozen=True)
class _WarmupCompiled:
    compressed: Any
    exact: Any
    warmup: int

    def __call__(self, state, batch):
        use_exact = self.exact is not None and int(state.step) < self.warmup
        return (self.exact if use_exact else self.compressed)(state, batch)

    def __getattr__(self, name):   # as_text, memory_analysis...: the compressed program's
        return getattr(self.compressed, name)


def make_eval_step(plan: ShardingPlan, *, loss_fn: Optional[LossFn] = None, eval_mode: bool = True) -> CheckedStep:
    """A jitted ``eval_step(state, batch) -> {"loss", "weight", "tokens", **metrics}`` (no update,
    no donation; the same loss contract and division by the weight as :func:`make_train_step`).

    ``eval_mode`` calls ``model.eval()`` first (dropout off, batch norm on its running averages).
    """
    _batch_layout(plan, "make_eval_step")
    loss_fn = loss_fn or next_token_loss
    graphdef = plan.abstract.graphdef
    compute_dtype = jnp.dtype(plan.recipe.compute_dtype)

    def evaluate(state: TrainState, batch):
        with step_context(step_context_for(plan)):
            model = nnx.merge(graphdef, cast_floats(state.params, compute_dtype), state.model_state)
            if eval_mode:
                model.eval()
            total, weight, metrics = unpack_loss(loss_fn(model, batch), loss_fn)
        denom = _denominator(weight)
        return {"loss": total / denom, "weight": weight, "tokens": weight, **{k: v / denom for k, v in metrics.items()}}

    scalar = NamedSharding(plan.mesh, PartitionSpec())
    return CheckedStep(jax.jit(evaluate, in_shardings=(state_shardings(plan), plan.batch_shardings),
                               out_shardings=scalar), plan)


def make_grad_fn(plan: ShardingPlan, *, loss_fn: Optional[LossFn] = None) -> CheckedStep:
    """A jitted ``grad_fn(state, batch) -> (loss, grads)`` with grads laid out like the params.

    The same loss scaling as :func:`make_train_step` (sum / global weight, micro-batched by the
    recipe); use it to inspect or compare gradients across recipes.
    """
    _batch_layout(plan, "make_grad_fn")
    pipeline = pipeline_config(plan)
    grad_fn = _loss_and_grads(plan, loss_fn or next_token_loss, pipeline)
    ctx = step_context_for(plan)
    micro = ctx.resolved.grad_accum

    def grads(state: TrainState, batch):
        with step_context(ctx):
            total, weight, _, g, _ = _accumulate(grad_fn, state.params, state.model_state, batch, micro, plan)
            denom = _denominator(weight)
            return total / denom, jax.tree.map(lambda x: x / denom, g)

    scalar = NamedSharding(plan.mesh, PartitionSpec())
    return CheckedStep(jax.jit(grads, in_shardings=(state_shardings(plan), plan.batch_shardings),
                               out_shardings=(scalar, plan.param_shardings)), plan)
