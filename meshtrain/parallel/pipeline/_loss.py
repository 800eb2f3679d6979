"""The model-level entry points the train step uses: the stand-in model ``loss_fn`` receives,
:func:`pipelined_loss` (gpipe, circular) and :func:`value_and_grad_1f1b`."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
from flax import nnx

from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline._parts import (STAGE, PipelineParts, get_parts, get_path, stack_module, with_path,
                                                without_path)
from meshtrain.parallel.pipeline._schedules import merge_micro, one_f_one_b, run_stack, split_micro
from meshtrain.parallel.pipeline._tables import PipelineConfig
from meshtrain.parallel.pipeline._zero_bubble import zero_bubble
from meshtrain.strategies import Schedule


# ---- the model-level entry points the train step uses -------------------------------------------

class _Captured(Exception):
    def __init__(self, args, kwargs):
        super().__init__("model call captured")
        self.call_args, self.call_kwargs = args, kwargs


class StandIn(nnx.Module):
    """What ``loss_fn`` receives under a pipeline: calling it runs ``call`` (the pipelined model);
    every other attribute is the real model's. The real model is also its child node, so what
    walks the model's state (``nnx.pop(model, nnx.Intermediate)``,
    :func:`meshtrain.models.moe.pop_moe_stats`) finds the values ``PipelineParts.sown`` stored."""

    def __init__(self, model, call):
        self._pipeline_model = model
        self._pipeline_call = call

    def __call__(self, *args, **kwargs):
        return self._pipeline_call(*args, **kwargs)

    def __getattr__(self, name):
        model = vars(self).get("_pipeline_model")
        if model is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(model, name)


def _capture(loss_fn, model, batch) -> Tuple[tuple, dict]:
    """The arguments ``loss_fn`` passes to ``model(...)`` for ``batch``."""

    def stop(*args, **kwargs):
        raise _Captured(args, kwargs)

    try:
        loss_fn(StandIn(model, stop), batch)
    except _Captured as got:
        return got.call_args, got.call_kwargs
    raise ConfigError(f"loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} never calls model(...); a pipeline runs the "
                      f"model's layer stack inside that call")


def _path(keypath) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def _stack_io(model, parts: PipelineParts):
    """``layer_fn(w, x, side) -> (x, values)`` for one layer of the stack (``values``: what the layer
    stored with ``nnx.Intermediate``, a pure dict) and the stack's state. ``ConfigError`` when a layer
    changes other state (running statistics), which the schedules do not carry."""
    gd, stack = nnx.split(stack_module(model, parts.stack))

    def raw(block):  # {path: (variable type, array)} of the layer's state
        return {k: (type(v), v.get_value() if isinstance(v, nnx.Variable) else v)
                for k, v in nnx.to_flat_state(nnx.state(block))}

    def layer_fn(w, x, side):
        block = nnx.merge(gd, w)
        before = raw(block)
        y = parts.layer(block, x, side)
        values = nnx.to_pure_dict(nnx.pop(block, nnx.Intermediate))
        for key, (kind, value) in raw(block).items():
            if issubclass(kind, nnx.RngState):  # dropout counters: not carried (see README, known limits)
                continue
            if key not in before or value is not before[key][1]:
                raise ConfigError(
                    f"a layer of {type(model).__name__}.{parts.stack} changes its state {'/'.join(map(str, key))} "
                    f"({kind.__name__}) in the forward pass (e.g. running batch statistics); a pipeline carries "
                    f"only parameters and values stored with nnx.Intermediate through its schedule: store such values "
                    f"with nnx.Intermediate and apply them in PipelineParts.sown, use a layer without running "
                    f"statistics, or pick a recipe without the 'pp' strategy")
        return y, values

    return layer_fn, stack


def _store_values(parts: PipelineParts, model, values) -> None:
    """Hand one micro-batch's layer values to ``parts.sown`` (``ConfigError`` when the model has none)."""
    if not jax.tree.leaves(values):
        return
    if parts.sown is None:
        paths = sorted({_path(k) for k, _ in jax.tree_util.tree_flatten_with_path(values)[0]})
        raise ConfigError(
            f"the layers of {type(model).__name__}.{parts.stack} store values with nnx.Intermediate "
            f"({', '.join(paths)}) "
            f"that a pipeline would drop: add sown=<function(values)> to {type(model).__name__}.pipeline_parts()'s "
            f"PipelineParts to store what the model's own __call__ keeps of them (values: the layers' nnx.Intermediate "
            f"state of one micro-batch as a pure dict, leading `layers` axis; see meshtrain.models.decoder), or stop "
            f"storing them in the layer")
    parts.sown(values)


def pipelined_loss(model, loss_fn, batch, cfg: PipelineConfig, *, split_batch=None, unpack=None):
    """``loss_fn(model, batch)`` with the model's layer stack run through the gpipe / circular schedule
    (differentiate it as usual; autodiff replays the ticks).

    When the layers store values (``nnx.Intermediate``, e.g. MoE router statistics) the loss runs per
    micro-batch, as gradient accumulation over the same micro-batches would: ``loss_fn`` on
    ``split_batch()[i]`` with the model holding micro-batch ``i``'s values (``PipelineParts.sown``);
    ``unpack(loss_fn output) -> (loss_sum, weight, metrics)`` and the sums are returned as one
    ``(loss_sum, weight, metrics)``. Otherwise ``loss_fn`` runs once on the whole batch.
    """
    parts = get_parts(model)
    layer_fn, stack = _stack_io(model, parts)
    m = cfg.micro_batches
    kept = {}

    def call(*args, **kwargs):
        x, side = parts.before(*args, **kwargs)
        side_m = jax.tree.map(lambda a: split_micro(a, m), side)
        y_m, values_m = run_stack(layer_fn, stack, split_micro(x, m), side_m, cfg, sown=True)
        if jax.tree.leaves(values_m):
            kept.update(y_m=y_m, side_m=side_m, values_m=values_m)
        return parts.after(merge_micro(y_m), side)

    out = loss_fn(StandIn(model, call), batch)
    if not kept:
        return out
    if parts.sown is None:  # names what to add
        _store_values(parts, model, kept["values_m"])
    if split_batch is None or unpack is None:
        raise ConfigError("pipelined_loss: the layers store values (nnx.Intermediate); pass split_batch and unpack "
                          "so that the loss runs per micro-batch")
    graphdef, state = nnx.split(model)

    def one(xs):
        y, side, values, b = xs
        fresh = nnx.merge(graphdef, state)  # the map body's own copy (nnx refuses mutation across traces)
        pp = get_parts(fresh)

        def call_one(*args, **kwargs):
            _store_values(pp, fresh, values)
            return pp.after(y, side)

        return unpack(loss_fn(StandIn(fresh, call_one), b))

    total, weight, metrics = jax.lax.map(one, (kept["y_m"], kept["side_m"], kept["values_m"], split_batch()))
    return jnp.sum(total), jnp.sum(weight), {k: jnp.sum(v) for k, v in metrics.items()}


def value_and_grad_1f1b(build, params: Dict[str, Any], loss_fn, batch_m, cfg: PipelineConfig, unpack):
    """Loss sums and gradients of ``params`` (a pure dict) under the 1F1B or zero-bubble schedule
    (``cfg.schedule``; both write the backward out per stage).

    ``build(params) -> model``; ``batch_m`` the batch cut into micro-batches (leading ``m``);
    ``unpack(loss_fn output) -> (loss_sum, weight, metrics)``. Returns
    ``(loss_sum, weight, metrics, grads)``. Embedding (``before``) gradients come from one VJP after
    the schedule; head and loss run per micro-batch inside it, with the values the layers stored for
    that micro-batch (``PipelineParts.sown``).
    """
    parts = get_parts(build(params))
    name = parts.stack
    stack_p = get_path(params, name)
    rest = without_path(params, name)

    def model_of(rest_):
        return build(with_path(rest_, name, stack_p))

    def before_all(rest_):
        model = model_of(rest_)
        pp = get_parts(model)

        def one(b):
            args, kwargs = _capture(loss_fn, model, b)
            return pp.before(*args, **kwargs)

        # every micro-batch at once, not a loop over them: the lookup's backward is then one scatter-add
        # and one data-parallel reduction of the table's gradient per step, not one per micro-batch
        # (analysis/comms.py counts it once)
        x_m, side_m = jax.vmap(one)(batch_m)
        return x_m, side_m

    (x_m, before_vjp, side_m) = jax.vjp(before_all, rest, has_aux=True)
    model0 = build(params)
    layer_fn, _ = _stack_io(model0, parts)
    stack_state = nnx.state(stack_module(model0, name))

    def head_loss(rest_, y_b, values, i, inputs):
        model = model_of(rest_)
        pp = get_parts(model)
        side_i, b_i = inputs  # micro-batch i's side inputs and batch (or one data shard's rows of them)

        def call(*args, **kwargs):
            _store_values(pp, model, values)
            return pp.after(y_b, side_i)

        total, weight, metrics = unpack(loss_fn(StandIn(model, call), b_i))
        return total, (weight, metrics)

    run = zero_bubble if cfg.schedule is Schedule.ZERO_BUBBLE else one_f_one_b
    loss, (weight, metrics), d_stack, d_rest, dx_pm = run(layer_fn, stack_state, x_m, side_m, head_loss, rest, cfg,
                                                          head_inputs=(side_m, batch_m), dx_per_stage=True)
    # the embedding's VJP on every stage's (p, m, ...) input cotangents, stage 0's the real ones and the others'
    # zeros: its gradient (the table's size) is reduced over `stage`, where taking stage 0's cotangents to every
    # stage all-reduced m micro-batches' activations (tokens × d_model, more than vocab × d_model for most runs)
    d_before_p = jax.vmap(lambda dx: before_vjp(dx)[0], spmd_axis_name=STAGE)(dx_pm)
    d_before = jax.tree.map(lambda a: jnp.sum(a, axis=0), d_before_p)
    grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), d_rest, d_before)
    grads = with_path(grads, name, nnx.to_pure_dict(d_stack) if isinstance(d_stack, nnx.State) else d_stack)
    return loss, weight, metrics, grads
