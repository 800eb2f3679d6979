"""Values the layers store (nnx.Intermediate: MoE router statistics) carried through the pipeline
schedules: a tiny MoE decoder under ``pp`` / ``pp_fsdp`` matches one device with the same micro-batches
(loss with the router losses, router metrics, gradients), for gpipe, circular and 1f1b; models that
sow without saying what to keep, or update other state in a layer, get errors naming the fix."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import host, kept_grads, put, rel_diff, token_batch, with_kept_grads

import meshtrain as mt
from meshtrain.errors import ConfigError
from meshtrain.models.decoder import Decoder
from meshtrain.parallel import pipeline as pipe
from meshtrain.parallel.pipeline._loss import _stack_io
from meshtrain.state import abstract_train_state

B, T, M, STEPS = 16, 16, 4, 2
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_load_max", "moe_drop_frac")


def _config(**overrides):
    # 4 layers (circular needs stages × repeats = 4 groups); capacity n_experts/top_k: nothing drops
    return mt.models.get_config("tiny-moe", n_layers=4, capacity_factor=4.0, **overrides)


_INIT = {}


def _run(recipe, n_devices, factory=None, steps=STEPS):
    """(step-0 grads on host, per-step metrics) of ``steps`` steps from the seed-0 state. The gradients are the
    ones the train step applies (kept by the optimizer, helpers.with_kept_grads): one compiled program per
    recipe gives gradients, losses and router metrics (a separate make_grad_fn would be a second compile)."""
    abstract = mt.abstract_state(factory or mt.models.model_factory(_config()), with_kept_grads(optax.adamw(3e-3)))
    plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()[:n_devices]), batch=mt.BatchSpec(B, T))
    if "host" not in _INIT:
        _INIT["host"] = host(mt.init_state(plan, seed=0))
    state = jax.device_put(_INIT["host"], mt.state_shardings(plan))
    step = mt.make_train_step(plan)
    metrics = []
    for i in range(steps):
        state, out = step(state, put(token_batch(i, B, T), plan))
        if i == 0:
            grads = kept_grads(state)
        metrics.append({k: float(v) for k, v in out.items()})
    return grads, metrics


@pytest.fixture(scope="module")
def baseline():
    # One device, gradient accumulation over the same M micro-batches (rows i, i+M, ... as the pipeline
    # cuts them): the router statistics are per micro-batch in both.
    return _run(mt.get_recipe("dp").with_options(grad_accum=M), 1)


#: circular runs gpipe's code path with interleaved groups, pp_fsdp × 1f1b the explicit per-stage VJP, pp ×
#: zero_bubble the split one (the router losses' cotangents reach both halves);
#: MESHTRAIN_FULL_PARITY=1 adds pp × gpipe and pp × 1f1b (pp_fsdp × gpipe: the same path as pp × gpipe).
FULL = os.environ.get("MESHTRAIN_FULL_PARITY", "") not in ("", "0")
CASES = [("pp", "circular"), ("pp_fsdp", "1f1b"), ("pp", "zero_bubble")] + (
    [("pp", "gpipe"), ("pp", "1f1b")] if FULL else [])


@pytest.mark.slow
@pytest.mark.parametrize("recipe,schedule", CASES)
def test_moe_router_losses_and_metrics_through_the_pipeline(baseline, recipe, schedule):
    r = mt.get_recipe(recipe).with_options(schedule=schedule, pipeline_micro_batches=M,
                                           repeats=2 if schedule == "circular" else 1)
    grads, metrics = _run(r, 8)
    want_grads, want = baseline
    worst = jax.tree.map(rel_diff, grads, want_grads)
    assert max(jax.tree.leaves(worst)) <= 1e-5, worst
    losses = [m["loss"] for m in metrics]
    assert rel_diff(losses, [m["loss"] for m in want]) <= 1e-5, (losses, want)
    for key in MOE_METRICS:
        assert key in metrics[0], sorted(metrics[0])
        got, ref = [m[key] for m in metrics], [m[key] for m in want]
        assert np.allclose(got, ref, rtol=1e-5, atol=1e-7), (key, got, ref)
    assert want[0]["moe_drop_frac"] == 0.0 and want[0]["moe_aux_loss"] > 0.5
    # the loss includes the router penalty: aux_coef·aux + z_coef·z on top of the cross-entropy
    penalty = 0.01 * want[0]["moe_aux_loss"] + 0.001 * want[0]["moe_z_loss"]
    assert penalty > 1e-3 and abs(losses[0] - want[0]["loss"]) < 1e-3 * penalty


def test_router_statistics_are_per_micro_batch(baseline):
    # what the pipeline matches is gradient accumulation, not one pass over the whole batch: the
    # load-balancing loss of the whole batch is a different number (so the parity above is not vacuous)
    abstract = mt.abstract_state(mt.models.model_factory(_config()), optax.adamw(3e-3))
    model = nnx.merge(abstract.graphdef, _INIT["host"].params, _INIT["host"].model_state)
    _, count, metrics = mt.next_token_loss(model, {k: jnp.asarray(v) for k, v in token_batch(0, B, T).items()})
    whole = float(metrics["moe_aux_loss"] / count)
    assert whole != pytest.approx(baseline[1][0]["moe_aux_loss"], rel=1e-5)


class _NoSown(Decoder):
    """An MoE decoder whose pipeline parts forget to say what to keep of the router statistics."""

    def pipeline_parts(self):
        return dataclasses.replace(super().pipeline_parts(), sown=None)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sown_values_without_a_sown_part_name_the_fix(schedule):
    cfg = _config()
    recipe = mt.get_recipe("pp").with_options(schedule=schedule, pipeline_micro_batches=M)
    abstract = mt.abstract_state(lambda rngs: _NoSown(cfg, rngs=rngs), optax.adamw(3e-3))
    plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()), batch=mt.BatchSpec(B, T))
    state = abstract_train_state(plan)
    batch = put(token_batch(0, B, T), plan)
    with pytest.raises(ConfigError, match=r"_NoSown.blocks store values with nnx.Intermediate "
                                          r"\(mlp/moe_stats/aux_loss.*add sown=<function\(values\)> to "
                                          r"_NoSown.pipeline_parts\(\)"):
        mt.make_grad_fn(plan).trace(state, batch)


class _Counting(nnx.Module):
    """One layer that keeps a running mean of its input (state the schedules do not carry)."""

    def __init__(self, rngs):
        self.w = nnx.Param(jnp.eye(8) * 0.5)
        self.mean = nnx.BatchStat(jnp.zeros((8,)))

    def __call__(self, x):
        self.mean[...] = 0.9 * self.mean[...] + 0.1 * jnp.mean(x, axis=0)
        return x @ self.w[...]


class _Stack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _Counting(rngs)

        self.blocks = make(rngs)

    def pipeline_parts(self):
        return pipe.PipelineParts(stack="blocks", before=lambda x: (x, {}), layer=lambda b, x, side: b(x),
                                  after=lambda x, side: x)


def test_layer_state_updates_name_the_fix():
    model = _Stack(nnx.Rngs(0))
    layer_fn, stack = _stack_io(model, pipe.get_parts(model))
    one = jax.tree.map(lambda a: a[0], stack)
    with pytest.raises(ConfigError, match=r"a layer of _Stack.blocks changes its state mean \(BatchStat\).*"
                                          r"nnx.Intermediate.*without the 'pp' strategy"):
        layer_fn(one, jnp.ones((4, 8)), {})
