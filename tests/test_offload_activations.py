"""Activation offload (``remat=offload``): the same losses as ``remat=none``, the offloaded bytes leave the
plan's device total for a ``host memory`` line, the program places the named activations in ``pinned_host``
(lowered for XLA:GPU here; compiled for H100 with the ``gpu-aot`` extra: device→host copies and the planned
drop of the device peak)."""

import re

import jax
import numpy as np
import optax
import pytest
from helpers import mesh_for, run_steps, tiny_abstract

import meshtrain as mt
import meshtrain.annotate as annotate
from meshtrain.analysis import gpu_aot
from meshtrain.analysis.activations import saved_activations
from meshtrain.analysis.compiled import MeasuredMemory, step_inputs
from meshtrain.analysis.memory import estimate_memory
from meshtrain.models import get_config
from meshtrain.remat_policies import ACTIVATION_NAMES, Remat, checkpoint_policy

BATCH, SEQ = 16, 64


def _named_bytes_per_device(cfg, rows: int, seq: int, names=ACTIVATION_NAMES) -> int:
    """The named activations of every layer, f32, for ``rows`` sequences on one device (independent of the
    planner's traced model: the decoder's shapes by hand)."""
    nh, kh, f = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    width = {"q_proj": nh, "k_proj": kh, "v_proj": kh, "attn_context": nh, "mlp_hidden": f}
    return cfg.n_layers * rows * seq * sum(width[n] for n in names) * 4


@pytest.fixture
def on_device_policy(monkeypatch):
    """``remat=offload`` with its names saved in device memory instead (the baseline the offload saves
    against); the planner's cached traces are dropped before and after."""
    def policy(remat, names):
        if Remat(remat) is Remat.OFFLOAD:
            return jax.checkpoint_policies.save_only_these_names(*names)
        return checkpoint_policy(remat, names)

    saved_activations.cache_clear()
    monkeypatch.setattr(annotate, "checkpoint_policy", policy)
    yield
    saved_activations.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("recipe, n_devices", [("fsdp", 8), ("dp", 1)])
def test_offload_losses_are_bit_identical_to_remat_none(recipe, n_devices):
    sizes = {} if n_devices == 8 else {"data": 1}
    base, mesh = mesh_for(recipe, n_devices, **sizes)
    none, _, _ = run_steps(base, mesh, steps=3)
    off, plan, _ = run_steps(base.with_options(remat="offload"), mesh, steps=3)
    assert plan.recipe.remat is Remat.OFFLOAD
    np.testing.assert_array_equal(off, none)


def test_recipe_names_what_is_offloaded_and_refuses_unknown_names():
    recipe = mt.get_recipe("fsdp").with_options(remat="offload", offload_activations="mlp_hidden, attn_context")
    assert recipe.offload_activations == "mlp_hidden,attn_context"
    assert mt.Recipe.from_dict(recipe.to_dict()) == recipe
    assert mt.get_recipe("fsdp").offload_activations == ",".join(ACTIVATION_NAMES)
    assert any(s.name == "offload_activations" and s.cli for s in mt.recipes.recipe_settings())
    with pytest.raises(mt.RecipeError, match="unknown: mlp_out.*|.*q_proj"):
        mt.get_recipe("fsdp").with_options(offload_activations="mlp_out")


@pytest.mark.parametrize("names", [ACTIVATION_NAMES, ("mlp_hidden",)])
def test_plan_moves_the_offloaded_bytes_from_device_to_host(names, on_device_policy):
    cfg = get_config("tiny")
    recipe, mesh = mesh_for("fsdp")
    recipe = recipe.with_options(remat="offload", offload_activations=",".join(names))
    batch = mt.BatchSpec(BATCH, SEQ)
    # baseline first (the fixture's policy keeps the same names on the device), then the real offload
    kept = estimate_memory(mt.make_plan(tiny_abstract(), recipe, mesh, batch=batch), cfg)
    saved_activations.cache_clear()
    annotate.checkpoint_policy = checkpoint_policy
    off = estimate_memory(mt.make_plan(tiny_abstract(), recipe, mesh, batch=batch), cfg)
    host = _named_bytes_per_device(cfg, BATCH // 8, SEQ, names)
    assert kept.host == 0 and off.host == host > 0
    assert kept.total - off.total == host                      # device bytes fall by exactly the offloaded bytes
    assert off.total == sum(b for c, b in off.components if c.value != "host memory")
    assert [t.name for t in off.terms if t.component.value == "host memory"] == ["offloaded activations"]
    assert off.to_dict()["components"]["host memory"]["bytes"] == host


@pytest.mark.parametrize("names", [ACTIVATION_NAMES, ("mlp_hidden",)])
def test_program_places_each_named_activation_in_pinned_host(names):
    """Lowered for XLA:GPU on this host (no plugin needed): one ``pinned_host`` placement per offloaded
    name in the forward pass. XLA:CPU has one memory: JAX lowers the same copy to nothing there."""
    recipe, mesh = mesh_for("fsdp")
    plan = mt.make_plan(tiny_abstract(), recipe.with_options(remat="offload", offload_activations=",".join(names)),
                        mesh, batch=mt.BatchSpec(BATCH, SEQ))
    step, args = mt.make_train_step(plan), step_inputs(plan)
    gpu = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert gpu.count('_xla_buffer_placement = "pinned_host"') == len(names)
    assert gpu.count('_xla_buffer_placement = "device"') >= len(names)   # brought back for the backward
    assert "pinned_host" not in step.lower(*args).as_text()


needs_plugin = pytest.mark.skipif(not gpu_aot.available(),
                                  reason="needs the XLA:GPU plugin (pip install 'meshtrain[gpu-aot]')")


def _gpu_step(recipe, cfg):
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    return gpu_aot.compile_gpu_topology(abstract, recipe, mt.BatchSpec(8, 256), gpu_aot.parse_topology("1xH100"))


@pytest.mark.slow
@needs_plugin
def test_xla_gpu_copies_to_host_and_the_device_peak_drops_as_planned(on_device_policy):
    cfg = get_config("tiny", n_layers=8)   # deep enough that one layer's copy in flight is a small part
    recipe = mt.get_recipe("dp").with_mesh(data=1).with_options(remat="offload")
    _, kept = _gpu_step(recipe, cfg)
    saved_activations.cache_clear()
    annotate.checkpoint_policy = checkpoint_policy
    plan, off = _gpu_step(recipe, cfg)
    hlo = off.as_text()
    # every layer's named activations are written into host memory (S(5)) and read back for the backward
    to_host = re.findall(r"dynamic-update-slice-start\S* = \(\(\w+\[[\d,]+\]\{[\d,]+:S\(5\)\}", hlo)
    assert len(to_host) >= len(ACTIVATION_NAMES), hlo[:2000]
    assert "S(5)" not in kept.as_text()
    planned = estimate_memory(plan, cfg, backend="gpu").host
    assert planned == _named_bytes_per_device(cfg, 8, 256)
    drop = MeasuredMemory.of(kept).peak - MeasuredMemory.of(off).peak
    assert abs(drop / planned - 1) <= 0.10, (drop, planned)
