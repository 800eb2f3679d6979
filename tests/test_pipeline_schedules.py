"""Pipeline schedules (meshtrain.parallel.pipeline): the schedule tables, the bubble read from compiled
FLOPs (GPipe, circular, 1F1B), bad input naming the fix, and ViT / BERT through the pipeline contract
against one device. Parity of the decoder and the stage traffic: tests/test_pipeline.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import rel_diff, tiny_abstract
from jax.sharding import Mesh

import meshtrain as mt
from meshtrain.annotate import StepContext, step_context
from meshtrain.errors import ConfigError, RulesError
from meshtrain.parallel import pipeline as pipe
from meshtrain.rules import AxisRules

B, T = 16, 16


D_FLOPS, B_FLOPS = 256, 128


def _layer(w, x, side):
    return jnp.tanh(x @ w["w"])


@functools.lru_cache(maxsize=None)
def _stack_flops(cfg=None, layers=None):
    """Per-step FLOPs of the gradient of a matmul stack, summed over stages (ticks unrolled so
    every tick is counted)."""
    w = {"w": jnp.ones((layers, D_FLOPS, D_FLOPS))}
    x = jnp.ones((B_FLOPS, D_FLOPS))
    if cfg is None:
        def plain(w, x):
            return jnp.sum(jax.lax.scan(lambda h, wl: (_layer(wl, h, None), None), x, w, unroll=layers)[0] ** 2)
        return jax.jit(jax.grad(plain, argnums=(0, 1))).lower(w, x).compile().cost_analysis()["flops"]
    mesh = Mesh(np.array(jax.devices()[:cfg.stages]), ("stage",))

    def piped(w, x):
        with step_context(StepContext(mesh, AxisRules.defaults())):
            y = pipe.run_stack(_layer, w, pipe.split_micro(x, cfg.micro_batches), {}, cfg, unroll=True)
        return jnp.sum(y ** 2)

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(piped, argnums=(0, 1))).lower(w, x).compile()
    return compiled.cost_analysis()["flops"] * cfg.stages


@pytest.mark.parametrize("schedule,p,m,r", [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1),
                                            ("circular", 2, 4, 2), ("circular", 4, 4, 2)])
def test_bubble_from_compiled_flops(schedule, p, m, r):
    cfg = pipe.PipelineConfig(pipe.Schedule(schedule), p, m, r)
    ratio = _stack_flops(cfg, layers=p * r) / _stack_flops(layers=p * r)
    expected = 1 / (1 - cfg.bubble)  # (r·m + p - 1) / (r·m)
    print(f"{schedule} p={p} m={m} r={r}: compiled FLOPs ratio {ratio:.4f}, formula {expected:.4f}")
    assert abs(ratio / expected - 1) <= 0.05


def _plain_forward_flops(layers):
    w = {"w": jnp.ones((layers, D_FLOPS, D_FLOPS))}
    x = jnp.ones((B_FLOPS, D_FLOPS))

    def plain(w, x):
        return jnp.sum(jax.lax.scan(lambda h, wl: (_layer(wl, h, None), None), x, w, unroll=layers)[0] ** 2)

    return jax.jit(plain).lower(w, x).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_1f1b_bubble_from_compiled_flops(p, m):
    """1F1B skips the backward in warm-up, the forward in drain and the head outside the m ticks that
    have a micro-batch: compiled FLOPs = (m+p-1)/m × (forward + recompute + backward) of the stack,
    not the (m+2p-2)/m of running every slot of every tick."""
    cfg = pipe.PipelineConfig(pipe.Schedule.ONE_F_ONE_B, p, m)
    mesh = Mesh(np.array(jax.devices()[:p]), ("stage",))
    w = {"w": jnp.ones((p, D_FLOPS, D_FLOPS))}
    x = jnp.ones((B_FLOPS, D_FLOPS))

    def head(hp, y, values, i):
        return jnp.sum(y.astype(jnp.float32) ** 2), {}

    def piped(w, x):
        with step_context(StepContext(mesh, AxisRules.defaults())):
            _, _, dw, _, dx = pipe.one_f_one_b(lambda wl, h, side: (_layer(wl, h, side), {}), w,
                                               pipe.split_micro(x, m), {}, head, {}, cfg, unroll=True)
        return dw, dx

    with jax.set_mesh(mesh):
        flops = jax.jit(piped).lower(w, x).compile().cost_analysis()["flops"] * p
    ratio = flops / (_plain_forward_flops(p) + _stack_flops(layers=p))  # + recompute: one more forward
    expected = 1 / (1 - cfg.bubble)  # (m + p - 1) / m
    print(f"1f1b p={p} m={m}: compiled FLOPs ratio {ratio:.4f}, formula {expected:.4f}")
    assert abs(ratio / expected - 1) <= 0.05


def test_schedule_tables():
    for p, m in [(2, 4), (4, 8), (3, 5)]:
        t = pipe.schedule_table("gpipe", p, m)
        assert t.ticks == m + p - 1
        for s in range(p):  # every micro-batch once per stage, in order, one tick after the previous stage
            assert list(t.forward[s:s + m, s]) == list(range(m))
        c = pipe.schedule_table("circular", p, m, 2)
        assert c.ticks == 2 * m + p - 1 and (c.group[:, 0] >= 0).sum() == 2 * m
        f = pipe.schedule_table("1f1b", p, m)
        for s in range(p):
            done = np.cumsum(f.forward[:, s] >= 0) - np.cumsum(f.backward[:, s] >= 0)
            assert done.max() <= 2 * (p - 1 - s) + 1 <= 2 * p - 1  # in flight on stage s
            assert sorted(f.backward[f.backward[:, s] >= 0, s]) == list(range(m))
        assert pipe.bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1))
        assert pipe.bubble_fraction("circular", p, m, 2) == pytest.approx((p - 1) / (2 * m + p - 1))
        assert pipe.bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))  # warm-up/drain: half ticks
    chart = pipe.timeline(pipe.schedule_table("1f1b", 2, 4))
    assert chart.shape == (2, 2 * (4 + 2)) and chart[1, 2] == "F0" and chart[1, 3] == "B0"


# ---- bad input -----------------------------------------------------------------------------------

class _NoParts(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((4, 4)), out_sharding=("embed", "mlp"))

    def __call__(self, x, *_):
        return x


def _plan(recipe, abstract):
    return mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()), batch=mt.BatchSpec(B, T))


def test_bad_input_names_the_fix():
    with pytest.raises(RulesError, match=r"'layers', size 3\) is not divisible by mesh axes stage=2"):
        _plan(mt.get_recipe("pp"), tiny_abstract(n_layers=3))  # the plan already names it
    with pytest.raises(ConfigError, match=r"not divisible by stages × repeats = 2 × 2"):
        mt.make_train_step(_plan(mt.get_recipe("pp").with_options(schedule="circular", repeats=2), tiny_abstract()))
    with pytest.raises(ConfigError, match=r"needs micro_batches >= 4 \(got 2\).*--pipeline-micro-batches"):
        mt.make_train_step(_plan(mt.get_recipe("pp").with_mesh(stage=4, data=2).with_options(pipeline_micro_batches=2),
                                 tiny_abstract(n_layers=4)))
    abstract = mt.abstract_state(lambda rngs: _NoParts(rngs), None)
    recipe = mt.get_recipe("pp").with_options(max_replicated_fraction=1.0)
    with pytest.raises(ConfigError, match=r"_NoParts does not implement the pipeline contract: add a method "
                                          r"pipeline_parts"):
        mt.make_grad_fn(_plan(recipe, abstract))


def test_bubble_warning():
    assert pipe.bubble_warning(pipe.PipelineConfig(pipe.Schedule.GPIPE, 4, 16)) is None
    msg = pipe.bubble_warning(pipe.PipelineConfig(pipe.Schedule.GPIPE, 4, 4))
    assert "43%" in msg and "--pipeline-micro-batches" in msg


# ---- the other reference models implement the contract -------------------------------------------

def _model_grads(abstract, recipe, n, batch, loss_fn, init):
    plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()[:n]),
                        batch=mt.BatchLayout.from_example(batch))
    if not init:
        init.append(mt.init_state(plan, seed=0))  # kept on its device (a PRNG key leaf has no host copy)
    state = jax.device_put(init[0], mt.state_shardings(plan))
    put_b = {k: jax.device_put(v, plan.batch_shardings[k]) for k, v in batch.items()}
    loss, grads = mt.make_grad_fn(plan, loss_fn=loss_fn)(state, put_b)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.slow
@pytest.mark.parametrize("model,schedule", [("vit-tiny", "gpipe"), ("bert-tiny", "1f1b")])
def test_vit_and_bert_pipeline_parity(model, schedule):
    import optax

    cfg = mt.models.get_config(model, dropout=0.0)
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    rng = np.random.default_rng(0)
    if model.startswith("vit"):
        batch = {"images": rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
                 "labels": rng.integers(0, 10, (16,)).astype(np.int32)}
        loss_fn = mt.models.vit_loss
    else:
        tok = rng.integers(0, cfg.vocab_size, (16, 16)).astype(np.int32)
        batch = {"input_ids": tok, "targets": np.where(rng.random((16, 16)) < 0.3, tok, -1).astype(np.int32),
                 "segment_ids": np.zeros((16, 16), np.int32)}
        loss_fn = mt.models.mlm_loss
    init = []
    l1, g1 = _model_grads(abstract, mt.get_recipe("dp"), 1, batch, loss_fn, init)
    l2, g2 = _model_grads(abstract, mt.get_recipe("pp").with_options(schedule=schedule), 8, batch, loss_fn, init)
    assert abs(l2 - l1) <= 1e-5 * abs(l1)
    # the key bias has a zero gradient (softmax is shift-invariant): compare leaves with a real gradient
    worst = jax.tree.map(lambda a, b: rel_diff(a, b) if np.abs(b).max() > 1e-6 else 0.0, g2, g1)
    assert max(jax.tree.leaves(worst)) <= 1e-5, worst
