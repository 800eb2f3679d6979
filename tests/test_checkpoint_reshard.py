"""Reshard matrix: a state saved under each recipe/mesh restores under every other one bit-exact, every
leaf on the new mesh, and training continues with the same losses as without the round trip."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import (TINY_BATCH, TINY_SEQ, assert_bit_exact, assert_on_mesh, host, mesh_for, put, tiny_abstract,
                     token_batch)

import meshtrain as mt
from meshtrain.checkpoint import Checkpointer

#: name -> (recipe, devices, mesh sizes)
MESHES = {
    "fsdp8": ("fsdp", 8, {}),                          # (8,)  fsdp
    "fsdp2xtp4": ("fsdp_tp", 8, dict(fsdp=2, tensor=4)),  # (2, 4) fsdp × tensor
    "fsdp4xtp2": ("fsdp_tp", 8, dict(fsdp=4, tensor=2)),  # (4, 2)
    "dp2": ("dp", 2, {}),                              # 2 devices, replicated
    "single": ("dp", 1, {}),                           # (1,)  one device
}
SAVE_AT, MORE = 3, 2


@pytest.fixture(scope="module")
def setups():
    abstract = tiny_abstract()
    out = {}
    for name, (recipe, n, sizes) in MESHES.items():
        recipe, mesh = mesh_for(recipe, n, **sizes)
        plan = mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
        out[name] = (plan, mt.make_train_step(plan))
    return out


@pytest.fixture(scope="module")
def trained(setups):
    """Host copy of the state after SAVE_AT steps on the first mesh, and the losses of the steps after
    it in the same uninterrupted run."""
    plan, step_fn = setups["fsdp8"]
    state = mt.init_state(plan, seed=0)
    losses = []
    for i in range(SAVE_AT + MORE):
        state, metrics = step_fn(state, put(token_batch(i), plan))
        losses.append(float(metrics["loss"]))
        if i + 1 == SAVE_AT:
            expected = host(state)
    return expected, np.array(losses[SAVE_AT:])


@pytest.fixture(scope="module")
def saved(setups, trained, tmp_path_factory):
    """Per source mesh: a checkpoint folder with step SAVE_AT written (async) from that mesh's shardings."""
    expected, _ = trained
    out = {}
    for name, (plan, _) in setups.items():
        d = tmp_path_factory.mktemp(name) / "checkpoints"
        with Checkpointer(d, save_every=SAVE_AT) as ckpt:
            ckpt.maybe_save(SAVE_AT, jax.device_put(expected, mt.state_shardings(plan)),
                            data_state={"next_batch": SAVE_AT}, metadata={"recipe": plan.recipe.to_dict()})
        out[name] = d
    return out


@pytest.fixture(scope="module")
def direct(setups, trained):
    """Per target mesh: losses and final state continuing from the same values without a checkpoint."""
    expected, _ = trained
    out = {}
    for name, (plan, step_fn) in setups.items():
        losses, state = continue_training(jax.device_put(expected, mt.state_shardings(plan)), plan, step_fn)
        out[name] = (losses, host(state))
    return out


def continue_training(state, plan, step_fn):
    losses = []
    for i in range(SAVE_AT, SAVE_AT + MORE):
        state, metrics = step_fn(state, put(token_batch(i), plan))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


@pytest.mark.parametrize("dst", list(MESHES))
@pytest.mark.parametrize("src", list(MESHES))
def test_restore_on_another_mesh_and_continue(setups, trained, saved, direct, src, dst):
    plan, step_fn = setups[dst]
    expected, uninterrupted = trained
    with Checkpointer(saved[src], save_every=SAVE_AT) as ckpt:
        r = ckpt.restore(plan)
    assert r.step == SAVE_AT and r.data_state == {"next_batch": SAVE_AT}
    assert r.metadata["recipe"]["name"] == setups[src][0].recipe.name
    assert_bit_exact(expected, r.state)
    assert_on_mesh(r.state, plan)                      # every leaf, scalars too, on the target mesh
    resumed, resumed_state = continue_training(r.state, plan, step_fn)
    direct_losses, direct_state = direct[dst]
    np.testing.assert_array_equal(resumed, direct_losses)
    assert_bit_exact(direct_state, resumed_state)
    if dst == "fsdp8":                                 # the mesh of the run that never stopped
        np.testing.assert_array_equal(resumed, uninterrupted)
