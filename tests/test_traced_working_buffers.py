"""The traced estimate (an ``AbstractMesh``: nothing compiled) counts the buffers XLA keeps that issue 31 found
missing on T5 at 64 devices (BENCHMARKS.md, "T5 at 64 devices"): the first weight gradient at full size before
its reduce-scatter, ReLU's f32 pre-activation instead of its bool mask, and an RMS norm's normalised input.
A T5-shaped Linen model (a head tied to the embedding over a large vocabulary, RMS norms, ReLU MLP), 8 devices,
one row each."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn

import meshtrain as mt
from meshtrain.analysis import estimate_memory, program_cost
from meshtrain.analysis import traced as tr
from meshtrain.models import from_linen

VOCAB, DIM, HIDDEN, T, BATCH = 2048, 64, 256, 32, 8
lp = nn.with_logical_partitioning


class RMSNorm(nn.Module):
    """T5's layer norm: ``w · x / sqrt(mean(x²) + ε)`` (no centring, no bias)."""

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", lp(nn.initializers.ones, ("embed",)), (DIM,))
        return w * (x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6))


class T5Shaped(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.lecun_normal()
        embed = nn.Embed(VOCAB, DIM, embedding_init=lp(nn.initializers.normal(1.0), ("vocab", "embed")))
        x = embed(tokens)
        for _ in range(2):
            h = nn.relu(nn.Dense(HIDDEN, use_bias=False, kernel_init=lp(init, ("embed", "mlp")))(RMSNorm()(x)))
            x = x + nn.Dense(DIM, use_bias=False, kernel_init=lp(init, ("mlp", "embed")))(h)
        return embed.attend(RMSNorm()(x))  # tied, as HF's T5Config by default


def loss(model, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(model(batch["inputs"]), batch["targets"])
    return ce.sum(), ce.size


@pytest.fixture(scope="module")
def abstract():
    return mt.abstract_state(from_linen(T5Shaped(), jax.ShapeDtypeStruct((1, T), jnp.int32)), optax.adamw(1e-3))


LAYOUT = mt.BatchLayout.from_example({k: jax.ShapeDtypeStruct((BATCH, T), jnp.int32) for k in ("inputs", "targets")})


def _traced(abstract, recipe_name):
    recipe = mt.get_recipe(recipe_name).with_options(max_replicated_fraction=1.0)
    plan = mt.make_plan(abstract, recipe, recipe.mesh.abstract(8), batch=LAYOUT)
    return recipe, program_cost(plan, loss, compile=False), plan


@pytest.mark.parametrize("recipe_name, divisor", [("fsdp", 1), ("fsdp_tp", 2), ("dp", None)])
def test_first_weight_gradient_is_the_head_at_full_size_where_gradients_are_reduce_scattered(
        abstract, recipe_name, divisor):
    _, cost, _ = _traced(abstract, recipe_name)
    head = VOCAB * DIM * 4  # f32 (VOCAB, DIM): the backward's first weight gradient, the head's dlogits^T · x
    assert cost.gradient == (head // divisor if divisor else 0), cost.to_dict()  # dp: the gradient is the buffer


def test_relu_mask_and_rms_norm_are_kept_as_xla_keeps_them(abstract):
    """ReLU: XLA recomputes the bool mask ``x > 0`` from the f32 pre-activation, which it keeps; RMS norm: the
    normalised ``x / sqrt(…)`` (a broadcast statistic) is kept next to its product with the weight."""
    _, _, plan = _traced(abstract, "fsdp")
    jaxpr = tr._residuals(plan, loss, 1)
    more = tr._residuals(plan, loss, 2)
    picked = [i for i, (x, y) in enumerate(zip(jaxpr.outvars, more.outvars)) if x.aval.shape != y.aval.shape]
    stored = tr._stored_residuals(jaxpr, picked)
    producer = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    hidden = [v for v in stored if v.aval.shape == (1, T, HIDDEN)]
    assert sorted(str(v.aval.dtype) for v in hidden) == ["float32"] * 4, hidden  # 2 layers: pre- and post-ReLU
    assert not any(v.aval.dtype == jnp.bool_ for v in stored)
    normalised = [v for v in stored if v.aval.shape == (1, T, DIM) and producer.get(v) == "div"]
    assert len(normalised) == 3, normalised  # every RMS norm's x / sqrt(mean(x²) + ε)


@pytest.mark.parametrize("recipe_name", ["fsdp", "fsdp_tp"])
def test_traced_estimate_within_10_percent_of_the_compiled_peak(abstract, recipe_name):
    recipe, cost, plan = _traced(abstract, recipe_name)
    traced = estimate_memory(plan, None, cost=cost)
    peak = program_cost(mt.make_plan(abstract, recipe, batch=LAYOUT), loss).memory.peak
    assert abs(traced.total / peak - 1) < 0.10, (traced.to_dict(), peak)


class ScannedMLP(nn.Module):
    """Two ReLU layers scanned over stacked weights (leading logical axis ``layers``), a replicated head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM, embedding_init=lp(nn.initializers.normal(1.0), ("vocab", "embed")))(tokens)
        stack = nn.scan(ScannedLayer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack()(x, None)
        return nn.Dense(16, use_bias=False, kernel_init=lp(nn.initializers.lecun_normal(), (None, None)))(x)


class ScannedLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        init = nn.initializers.lecun_normal()
        h = nn.relu(nn.Dense(HIDDEN, use_bias=False, kernel_init=lp(init, ("embed", "mlp")))(x))
        return x + nn.Dense(DIM, use_bias=False, kernel_init=lp(init, ("mlp", "embed")))(h), None


def test_first_weight_gradient_made_by_a_layer_scan_is_one_layers_slice():
    """The replicated head's gradient is its own buffer (all-reduced, counted with the gradients); the first
    reduce-scattered ones come out of the layer scan, which makes one layer's (DIM, HIDDEN) slice at a time."""
    abstract = mt.abstract_state(from_linen(ScannedMLP(), jax.ShapeDtypeStruct((1, T), jnp.int32)),
                                 optax.adamw(1e-3))
    _, cost, _ = _traced(abstract, "fsdp")
    assert cost.gradient == DIM * HIDDEN * 4, cost.to_dict()  # not the stacked 2 layers
