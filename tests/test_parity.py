"""Every built-in recipe on 8 devices matches one device: 5 f32 steps of losses, and gradients."""

import jax
import pytest

from meshtrain.abstract import path_str
from meshtrain.rules import shard_shape

from helpers import mesh_for, rel_diff, run_steps, run_steps_with_grads, single_device, tiny_abstract

RECIPES = ["dp", "fsdp", "zero1", "zero2", "hsdp", "tp", "fsdp_tp", "fsdp_tp_sp"]
#: Steps each recipe trains (compiling costs ~6 s of CPU per recipe, a 16 x 64 step on 8 devices ~0.13 s):
#: enough for a wrong update to show in the losses and for the loss to fall.
STEPS = 5


@pytest.fixture(scope="module")
def baseline():
    recipe, mesh = single_device("dp")
    losses, grads, _, _ = run_steps_with_grads(recipe, mesh, steps=STEPS)
    return losses, grads


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_matches_single_device(name, baseline):
    # The gradients are the first train step's (kept by the optimizer: helpers.run_steps_with_grads), at the
    # seed's initial state on batch 0: one compiled program and one initialisation per recipe. make_grad_fn's own
    # gradients under 8-device recipes: test_odd_heads, test_step_options, test_pipeline (steps=0).
    base_losses, base_grads = baseline
    recipe, mesh = mesh_for(name)
    losses, grads, plan, state = run_steps_with_grads(recipe, mesh, steps=STEPS)
    assert rel_diff(losses, base_losses) <= 1e-5, (losses, base_losses)
    assert losses[-1] < losses[0]  # it trains

    assert abs(losses[0] - base_losses[0]) / base_losses[0] <= 1e-5   # the loss the gradients are of
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
