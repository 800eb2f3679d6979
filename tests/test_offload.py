"""Optimizer-state host offload: the plan's bytes, the same losses, host memory in the program,
checkpoints that move between offloaded and not."""

import re

import jax
import numpy as np
import pytest
from helpers import mesh_for, put, tiny_abstract, token_batch

import meshtrain as mt
from meshtrain.checkpoint import Checkpointer
from meshtrain.offload import HOST_MEMORY


@pytest.fixture(scope="module")
def plans():
    recipe, mesh = mesh_for("fsdp")
    batch = mt.BatchSpec(16, 64)
    return (mt.make_plan(tiny_abstract(), recipe, mesh, batch=batch),
            mt.make_plan(tiny_abstract(), recipe.with_options(offload="optimizer"), mesh, batch=batch))


def test_plan_moves_the_optimizer_state_to_host_memory(plans):
    base, off = plans
    assert all(s.memory_kind == HOST_MEMORY for s in jax.tree.leaves(off.opt_shardings))
    assert all(s.memory_kind != HOST_MEMORY for s in jax.tree.leaves(off.param_shardings))
    b, o = base.per_device_bytes(), off.per_device_bytes()
    assert o["optimizer"] == 0 and o["optimizer_host"] == b["optimizer"] > 0
    assert b["total"] - o["total"] == b["optimizer"]           # device bytes fall by the optimizer state
    assert off.recipe.to_dict()["offload"] == "optimizer" and base.recipe.to_dict()["offload"] == "none"
    assert mt.Recipe.from_dict(off.recipe.to_dict()) == off.recipe


@pytest.mark.slow
def test_offloaded_training_matches_and_checkpoints_move_between_layouts(plans, tmp_path):
    base, off = plans
    steps = [mt.make_train_step(p) for p in plans]
    states = [mt.init_state(p, seed=0) for p in plans]
    for i in range(3):
        losses = []
        for k, p in enumerate(plans):
            states[k], m = steps[k](states[k], put(token_batch(i), p))
            losses.append(float(m["loss"]))
        assert losses[0] == losses[1], (i, losses)   # the same program up to where the moments live
    assert all(x.sharding.memory_kind == HOST_MEMORY for x in jax.tree.leaves(states[1].opt_state))
    # The program reads and writes the moments in host memory (memory space S(5) in its entry layout).
    hlo = steps[1].lower(states[1], put(token_batch(0), off)).compile().as_text()
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo).group(1)
    n_opt = sum(1 for x in jax.tree.leaves(states[1].opt_state) if x.ndim > 0)
    assert layout.count("S(5)") >= n_opt, layout[:400]
    # Checkpoints hold the same tree: offloaded -> plain -> offloaded, bit-exact.
    with Checkpointer(tmp_path / "ck", save_every=1, async_save=False) as ckpt:
        ckpt.maybe_save(3, states[1], data_state={}, metadata={})
        plain = ckpt.restore(base).state
        again = ckpt.restore(off).state
    for a, b in ((states[0], plain), (states[1], again)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert all(x.sharding.memory_kind == HOST_MEMORY for x in jax.tree.leaves(again.opt_state))
