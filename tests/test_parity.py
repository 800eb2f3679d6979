"""Every built-in recipe on 8 devices matches one device: 5 f32 steps of losses, and gradients."""

import jax
import numpy as np
import pytest

import meshtrain as mt
from meshtrain.abstract import path_str
from meshtrain.rules import shard_shape

from helpers import mesh_for, put, rel_diff, run_steps, single_device, tiny_abstract, token_batch

RECIPES = ["dp", "fsdp", "zero1", "zero2", "hsdp", "tp", "fsdp_tp", "fsdp_tp_sp"]
#: Steps each recipe trains (compiling costs ~6 s of CPU per recipe, a 16 x 64 step on 8 devices ~0.13 s):
#: enough for a wrong update to show in the losses and for the loss to fall.
STEPS = 5


@pytest.fixture(scope="module")
def baseline():
    recipe, mesh = single_device("dp")
    losses, plan, _ = run_steps(recipe, mesh, steps=STEPS)
    grads = _grads(plan)
    return losses, grads


def _grads(plan):
    state = mt.init_state(plan, seed=0)
    loss, grads = mt.make_grad_fn(plan)(state, put(token_batch(0), plan))
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_matches_single_device(name, baseline):
    base_losses, (base_loss0, base_grads) = baseline
    recipe, mesh = mesh_for(name)
    losses, plan, state = run_steps(recipe, mesh, steps=STEPS)
    assert rel_diff(losses, base_losses) <= 1e-5, (losses, base_losses)
    assert losses[-1] < losses[0]  # it trains

    loss0, grads = _grads(plan)
    assert abs(loss0 - base_loss0) / base_loss0 <= 1e-5
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    base = dict((path_str(k), v) for k, v in jax.tree_util.tree_flatten_with_path(base_grads)[0])
    for keypath, g in flat:
        assert rel_diff(g, base[path_str(keypath)]) <= 1e-5, path_str(keypath)

    # Shard shapes on the devices are what the plan says.
    leaves = {leaf.path: leaf for leaf in plan.group("params")}
    sizes = plan.mesh_sizes
    for keypath, arr in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        leaf = leaves[path_str(keypath)]
        assert arr.sharding.spec == leaf.spec
        assert arr.addressable_shards[0].data.shape == shard_shape(leaf.shape, leaf.spec, sizes)


def test_mesh_override_matches_single_device(baseline):
    recipe, mesh = mesh_for("fsdp_tp", fsdp=2, tensor=4)
    losses, plan, _ = run_steps(recipe, mesh, steps=3)
    assert plan.mesh_sizes == {"data": 1, "fsdp": 2, "tensor": 4}
    assert rel_diff(losses, baseline[0][:3]) <= 1e-5


@pytest.mark.slow
def test_tied_embeddings_match_single_device():
    abstract = tiny_abstract(tie_embeddings=True)
    assert "lm_head_dv" not in abstract.params
    one, one_mesh = single_device("dp")
    base, _, _ = run_steps(one, one_mesh, steps=5, abstract=abstract)
    recipe, mesh = mesh_for("fsdp_tp_sp")
    losses, _, _ = run_steps(recipe, mesh, steps=5, abstract=abstract)
    assert rel_diff(losses, base) <= 1e-5
