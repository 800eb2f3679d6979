"""Kernels by the target, not the host: the flash backend follows the platform the step is compiled
for (the mesh's devices), and kernels XLA cannot partition (Pallas splash, cuDNN) run per device
inside ``shard_map`` over the recipe's batch and head split. On CPU the splash kernel runs in the
Pallas interpreter; with libtpu installed the train step compiles for a fake TPU topology with
splash's custom calls in it."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshtrain as mt
from meshtrain.annotate import step_context, step_context_for, target_platform
from meshtrain.models import get_config, model_factory
from meshtrain.parallel.attention import reference_attention
from meshtrain.parallel.flash import _splash, per_device
from meshtrain.train.config import TrainConfig, default_optimizer


def _plan(recipe, **options):
    abstract = mt.abstract_state(model_factory("tiny"), default_optimizer(TrainConfig(), {}))
    return mt.make_plan(abstract, mt.get_recipe(recipe).with_options(**options), batch=mt.BatchSpec(8, 256))


def test_target_platform_is_the_meshes():
    assert target_platform() == jax.default_backend()
    with step_context(step_context_for(_plan("fsdp"))):
        assert target_platform() == "cpu"


@pytest.mark.parametrize("recipe", ["dp", "fsdp_tp"])
def test_splash_runs_per_device_under_a_sharded_recipe(recipe):
    plan = _plan(recipe)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (8, 256, 4, 128))
    k, v = (jax.random.normal(kk, (8, 256, 2, 128)) for kk in keys[1:])
    seg = jnp.concatenate([jnp.zeros((8, 100), jnp.int32), jnp.ones((8, 156), jnp.int32)], axis=1)
    splash = lambda q_, k_, v_, s_: _splash(q_, k_, v_, s_, True, interpret=True)  # noqa: E731

    @jax.jit
    def run(q, k, v, seg):
        q = mt.constrain(q, ("batch", "seq", "heads", "head_dim"))
        return per_device(splash, q, k, v, seg)

    with jax.set_mesh(plan.mesh), step_context(step_context_for(plan)):
        out = run(q, k, v, seg)
        text = run.lower(q, k, v, seg).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text  # the kernel runs per device
    assert np.abs(np.asarray(out) - np.asarray(reference_attention(q, k, v, seg))).max() < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install 'meshtrain[tpu]')")
@pytest.mark.parametrize("recipe, options", [("fsdp", {"local_attention": "flash"}),
                                             ("fsdp_tp", {"local_attention": "flash"}),
                                             ("fsdp_cp", {"flash_backend": "splash", "context_kind": "ulysses"})])
def test_flash_compiles_for_tpu_with_splash_inside_a_sharded_step(recipe, options):
    from meshtrain.analysis.lowering import compile_tpu_topology

    cfg = get_config("tiny", max_seq_len=1024, d_model=256, n_heads=4, n_kv_heads=2, head_dim=128, d_ff=512)
    abstract = mt.abstract_state(model_factory(cfg), default_optimizer(TrainConfig(), {}))
    recipe = mt.get_recipe(recipe).with_options(compute_dtype="bfloat16", **options)
    _, compiled = compile_tpu_topology(abstract, recipe, mt.BatchSpec(8, 1024), "v5p:2x2x2")
    assert len(re.findall(r'custom_call_target="tpu_custom_call"', compiled.as_text())) >= 2 * cfg.n_layers


@pytest.mark.parametrize("flags, line", [
    (["--recipe", "fsdp", "--local-attention", "flash", "--hardware", "tpu-v5p"],
     "attention kernel for tpu: splash: Pallas TPU splash-attention kernel; per device under shard_map"),
    (["--recipe", "fsdp_cp", "--context-kind", "ulysses", "--flash-backend", "splash", "--hardware", "tpu-v5p"],
     "attention kernel for tpu: splash (requested); inside the ulysses all-to-all's shard_map"),
    (["--recipe", "fsdp_cp", "--hardware", "h100"], "attention kernel for gpu: ring context attention under shard_map"),
    (["--recipe", "fsdp", "--local-attention", "flash", "--hardware", "cpu"], "attention kernel for cpu: xla: blockwise"),
])
def test_the_plan_names_the_kernel_of_the_target(capsys, flags, line):
    from meshtrain.cli import main

    assert main(["plan", "--model", "tiny", *flags]) == 0
    assert line in capsys.readouterr().out
