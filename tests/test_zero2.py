"""ZeRO-2 (``zero2``): gradients kept sharded like the optimizer state between the backward pass and
the update, the same numbers as one device, and the DDP-vs-ZeRO benchmark runs."""

import json
import math
import os
import re
import processes
import sys

import jax
import pytest

import meshtrain as mt
from meshtrain.abstract import path_str
from meshtrain.train.step import gradient_shardings

from helpers import mesh_for, put, rel_diff, run_steps, run_steps_with_grads, single_device, tiny_abstract, \
    token_batch

ROOT = os.path.dirname(os.path.dirname(__file__))
CONSTRAINT = re.compile(r"sdy\.sharding_constraint %\S+ <@mesh, \[(.*?)\]> : tensor<([0-9x]+)x(f32|bf16)>")


def _lower(name, **options):
    recipe, mesh = mesh_for(name)
    # In a layer scan the backward's gradient buffers are whole tensors XLA must keep: what zero2 shards.
    recipe = recipe.with_options(**{"layer_loop": "scan", **options})
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(16, 64))
    state = mt.init_state(plan)
    return plan, mt.make_train_step(plan).lower(state, put(token_batch(0), plan))


def _gradient_constraints(plan, lowered, every=False):
    """The step's gradient constraint: the run of ``sharding_constraint``s, one per parameter in pytree
    order, right before the update. Returns ``[(shape, [mesh axes per dim])]`` (``every``: all such
    runs, e.g. the micro-batch accumulator's too)."""
    found = []
    for dims, shape, _ in CONSTRAINT.findall(lowered.as_text()):
        axes = [re.findall(r'"(\w+)"', d) for d in re.findall(r"\{[^}]*\}", dims)]
        found.append((tuple(int(x) for x in shape.split("x")), axes))
    shapes = [tuple(p.shape) for p in jax.tree.leaves(plan.abstract.params)]
    runs = [found[i:i + len(shapes)] for i in range(len(found) - len(shapes) + 1)
            if [s for s, _ in found[i:i + len(shapes)]] == shapes]
    assert runs, "no gradient constraint (one per parameter, in pytree order) in the lowered step"
    return runs if every else runs[-1]


def _bytes_per_device(shape, axes, sizes):
    shards = math.prod(sizes[a] for dim in axes for a in dim)
    return math.prod(shape) * 4 // shards


def test_zero2_recipe_is_zero_stage_2_and_matches_its_yaml():
    r = mt.get_recipe("zero2")
    assert r.strategies == (mt.ZeRO(stage=2),) and "zero2" in r.strategies and r.shard_gradients
    assert not mt.get_recipe("zero1").shard_gradients and not mt.get_recipe("fsdp").shard_gradients
    assert mt.get_recipe(os.path.join(ROOT, "recipes", "zero2.yaml")) == r
    # zero2's rules are zero1's: only the step differs.
    assert r.axis_rules().to_dict() == mt.get_recipe("zero1").axis_rules().to_dict()
    with pytest.raises(mt.RecipeError, match="claimed by both 'zero1' and 'zero2'"):
        mt.Recipe("bad", "", ("zero1", "zero2"), mt.MeshSpec(ici={"data": -1}))
    assert mt.get_recipe("zero1").with_options(zero_stage=2) == r.with_options(name="zero1", description=
                                                                              mt.get_recipe("zero1").description)
    with pytest.raises(mt.RecipeError, match=r"zero\.stage=3: use one of \[1, 2\]"):
        mt.ZeRO(stage=3)


@pytest.mark.slow
def test_gradients_are_sharded_one_eighth_per_device_in_the_lowered_step():
    sizes = {"data": 8}
    total = sum(math.prod(p.shape) * 4 for p in jax.tree.leaves(tiny_abstract().params))
    plan2, lowered2 = _lower("zero2")
    grads2 = _gradient_constraints(plan2, lowered2)
    # Every gradient carries its parameter's optimizer-state sharding: `data` on the `embed` dimension.
    opt = {leaf.path: leaf for leaf in plan2.group("optimizer")}
    flat = jax.tree_util.tree_flatten_with_path(plan2.abstract.params)[0]
    for (keypath, _), (shape, axes), sh in zip(flat, grads2, jax.tree.leaves(gradient_shardings(plan2))):
        path = path_str(keypath)
        embed = plan2.abstract.param_axes[path].index("embed")
        assert axes[embed] == ["data"] and sum(map(len, axes)) == 1, (path, axes)
        assert sh.spec == opt[f"0/mu/{path}"].spec == opt[f"0/nu/{path}"].spec, path
    assert sum(_bytes_per_device(s, a, sizes) for s, a in grads2) == total // 8
    # zero1 keeps them whole (all-reduced): 8 × the bytes.
    plan1, lowered1 = _lower("zero1")
    grads1 = _gradient_constraints(plan1, lowered1)
    assert all(sum(map(len, a)) == 0 for _, a in grads1)
    assert sum(_bytes_per_device(s, a, sizes) for s, a in grads1) == total
    # Parameters stay replicated in the state (all-gathered after the update), as under zero1.
    assert plan2.per_device_bytes() == plan1.per_device_bytes()
    # The compiled step keeps fewer temporary bytes: (on CPU the reduce-scatter is an all-reduce +
    # dynamic-slice, so allow XLA half of the 7/8 gradient bytes it could save).
    temp1 = lowered1.compile().memory_analysis().temp_size_in_bytes
    temp2 = lowered2.compile().memory_analysis().temp_size_in_bytes
    assert temp1 - temp2 >= 0.5 * (total - total // 8), (temp1, temp2)


@pytest.mark.slow
def test_zero2_with_micro_batches_accumulates_sharded_gradients_and_matches_one_device():
    plan, lowered = _lower("zero2", grad_accum=2)
    runs = _gradient_constraints(plan, lowered, every=True)
    assert len(runs) >= 3  # accumulator init, the sum per micro-batch, the gradients before the update
    assert all(sum(map(len, axes)) == 1 for run in runs for _, axes in run)
    one, one_mesh = single_device("dp")
    # with the first step's gradients kept: test_parity's program, compiled once per session
    base = run_steps_with_grads(one, one_mesh, steps=3)[0]
    recipe, mesh = mesh_for("zero2")
    losses, _, _ = run_steps(recipe.with_options(grad_accum=2), mesh, steps=3)
    assert rel_diff(losses, base) <= 1e-5, (losses, base)


@pytest.mark.slow
def test_bench_zero_runs_and_prints_its_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out_json = tmp_path / "zero.json"
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "bench_zero.py"), "--steps", "2", "--layers", "1",
                          "--batch-size", "8", "--seq-len", "32", "--recipes", "single,zero2",
                          "--json", str(out_json)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert re.search(r"recipe\s+ZeRO\s+params\s+grads\s+optimizer\s+activations", out.stdout), out.stdout
    assert re.search(r"^zero2\s+2\s", out.stdout, re.M) and "checks: ok" in out.stdout
    assert re.search(r"^fsdp\s+3\s.*fits", out.stdout, re.M)  # the distilbert-base plan on 8 × A100-40GB
    data = json.loads(out_json.read_text())
    z2 = data["recipes"]["zero2"]
    assert z2["memory"]["grads"] * 8 == pytest.approx(data["recipes"]["single"]["memory"]["grads"], rel=0.05)
    assert len(z2["losses"]) == 3 and len(z2["times"]) == 2 and data["loss_max_rel_diff"]["zero2"] <= 1e-4
