"""Step knobs: remat policies, precision, gradient accumulation, non-finite policy, donation; the
dimensions' options (issue 19) from recipe files and flags to the kernels, the plan and the errors."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshtrain as mt
from meshtrain.cli import main

from helpers import mesh_for, put, rel_diff, run_steps, run_steps_with_grads, tiny_abstract, token_batch


def _loss_grads(recipe, mesh, batch=16, seq=64):
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(batch, seq))
    state = mt.init_state(plan)
    loss, grads = mt.make_grad_fn(plan)(state, put(token_batch(0, batch, seq), plan))
    return float(loss), jax.tree.leaves(jax.tree.map(np.asarray, grads)), plan, state


@pytest.mark.slow
def test_remat_policies_same_numbers_less_memory():
    recipe, mesh = mesh_for("fsdp")
    base_loss, base_grads, _, _ = _loss_grads(recipe, mesh)
    temps = {}
    for policy in mt.Remat:
        r = recipe.with_options(remat=policy)
        loss, grads, plan, state = _loss_grads(r, mesh)
        assert abs(loss - base_loss) <= 1e-6 * base_loss, policy
        assert max(rel_diff(a, b) for a, b in zip(grads, base_grads)) <= 1e-5, policy
    # Memory: measured on a longer sequence, where activations dominate, all in a layer scan (the
    # default loop unrolls a 2-layer model without remat; unrolled it also holds less: 47 vs 69 MB).
    for policy in (mt.Remat.NONE, mt.Remat.FULL, mt.Remat.DOTS_NO_BATCH):
        r = recipe.with_options(remat=policy, layer_loop="scan")
        plan = mt.make_plan(tiny_abstract(), r, mesh, batch=mt.BatchSpec(16, 256))
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=plan.batch_shardings[k])
                 for k, v in plan.batch.abstract().items()}   # abstract inputs: nothing initialised
        compiled = mt.make_train_step(plan).lower(mt.abstract_train_state(plan), batch).compile()
        temps[policy] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[mt.Remat.FULL] < 0.75 * temps[mt.Remat.NONE], temps
    assert temps[mt.Remat.DOTS_NO_BATCH] < temps[mt.Remat.NONE], temps


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch():
    # The batch of test_parity.py (16 x 64): the one-batch program is its fsdp program, compiled once per
    # session (conftest's compilation cache); 2 micro-batches of 8 rows, one per fsdp device. The gradients are
    # the first train step's, kept by the optimizer (helpers.run_steps_with_grads): the accumulated ones the
    # update uses, from the same program as the losses (make_grad_fn's own: the remat test above).
    recipe, mesh = mesh_for("fsdp")
    l1, grads1, _, _ = run_steps_with_grads(recipe, mesh, steps=3, batch=16)
    l2, grads2, _, _ = run_steps_with_grads(recipe.with_options(grad_accum=2), mesh, steps=3, batch=16)
    assert abs(l2[0] - l1[0]) <= 1e-5 * l1[0]
    assert max(rel_diff(a, b) for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads1))) <= 1e-5
    assert rel_diff(l2, l1) <= 1e-5


@pytest.mark.slow
def test_bfloat16_compute_and_storage():
    recipe, mesh = mesh_for("fsdp_tp")
    # with the first step's gradients kept: test_parity's program, compiled once per session
    f32 = run_steps_with_grads(recipe, mesh, steps=5)[0]
    bf16, plan, state = run_steps(recipe.with_options(compute_dtype="bfloat16"), mesh, steps=5)
    assert state.params["embedding_vd"].dtype == jnp.float32  # master weights stay f32
    assert rel_diff(bf16, f32) <= 2e-2 and bf16[-1] < bf16[0]
    stored, plan16, state16 = run_steps(recipe.with_options(param_dtype="bfloat16", compute_dtype="bfloat16"),
                                        mesh, steps=5)
    assert state16.params["embedding_vd"].dtype == jnp.bfloat16
    assert plan16.per_device_bytes()["params"] * 2 == plan.per_device_bytes()["params"]
    assert stored[-1] < stored[0]


@pytest.mark.slow
def test_nonfinite_skip_keeps_state_and_raise_reports():
    recipe, mesh = mesh_for("fsdp")
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(16, 64))
    state = mt.init_state(plan)
    before = jax.tree.map(np.asarray, state.params)
    poisoned = jax.tree.map(lambda x: x * jnp.nan if x.ndim == 2 else x, state.params)
    state = mt.TrainState(state.step, poisoned, state.opt_state, state.model_state)
    step = mt.make_train_step(plan, nonfinite=mt.NonFinite.SKIP)
    new, metrics = step(state, put(token_batch(0), plan))
    assert not bool(metrics["finite"])
    # Skipped: the (poisoned) params and the optimizer moments are exactly what went in.
    assert int(new.step) == 1
    mu = jax.tree.leaves(new.opt_state[0].mu) if hasattr(new.opt_state[0], "mu") else []
    assert all(float(jnp.abs(m).max()) == 0.0 for m in mu)
    assert jnp.array_equal(new.params["blocks"]["mlp"]["up_df"], before["blocks"]["mlp"]["up_df"])


# ---- dimension options (issue 19): set in a recipe file, read by the kernels from the step context ----

LB_NONE = ("name: ring_plain\nstrategies: [dp, fsdp, {cp: {kind: ring, load_balance: none, flash_backend: xla}}]\n"
           "mesh: {ici: {data: 1, fsdp: -1, context: 4}}\n")


def test_context_options_from_yaml_change_the_order_and_still_match_one_device(tmp_path):
    path = tmp_path / "ring_plain.yaml"
    path.write_text(LB_NONE)
    recipe = mt.get_recipe(str(path))
    assert recipe.dimension(mt.Context) == mt.Context(kind="ring", load_balance="none", flash_backend="xla")
    assert mt.Recipe.from_dict(recipe.to_dict()) == recipe   # written and read back alike
    recipe, mesh = mesh_for(recipe)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(16, 64))
    zigzag = mt.make_plan(tiny_abstract(), mt.get_recipe("fsdp_cp"), mesh, batch=mt.BatchSpec(16, 64))
    assert mt.sequence_permutation(plan, 64) is None            # natural order: the kernel's order changed
    assert mt.sequence_permutation(zigzag, 64) is not None
    # with the first step's gradients kept: test_parity's program, compiled once per session
    ref = run_steps_with_grads(*mesh_for("dp", n_devices=1), steps=3, batch=16, seq=64)[0]
    got, _, _ = run_steps(recipe, mesh, steps=3, batch=16, seq=64)
    assert rel_diff(got, ref) <= 1e-5


@pytest.mark.parametrize("argv,fragment", [
    (["--recipe", "fsdp_cp", "--load-balance", "none", "--flash-backend", "xla"],
     {"cp": {"load_balance": "none", "flash_backend": "xla"}}),
    (["--recipe", "fsdp_cp", "--context-kind", "ulysses"], {"cp": {"kind": "ulysses"}}),
    (["--recipe", "fsdp_tp", "--sequence-parallel", "on"], {"tp": {"sequence_parallel": True}}),
    (["--recipe", "pp", "--micro-batches", "8"], {"pp": {"micro_batches": 8}}),
])
def test_plan_json_shows_dimension_options_from_flags(argv, fragment, capsys):
    assert main(["plan", "--model", "tiny", "--json"] + argv) == 0
    settings = json.loads(capsys.readouterr().out)["recipe_settings"]
    assert fragment in settings["strategies"], settings["strategies"]


def test_plan_text_shows_the_context_options(capsys):
    assert main(["plan", "--model", "tiny", "--recipe", "fsdp_cp", "--load-balance", "none",
                 "--flash-backend", "xla"]) == 0
    assert "recipe fsdp_cp: dp + fsdp + cp(load_balance=none, flash_backend=xla)" in capsys.readouterr().out


@pytest.mark.parametrize("text,expected", [
    (LB_NONE.replace("load_balance: none", "load_balance: sideways"),
     r"strategies\[2\]\.cp\.load_balance='sideways': use one of \['zigzag', 'none'\]"),
    (LB_NONE.replace("flash_backend: xla", "flash_backend: fast"),
     r"cp\.flash_backend='fast': use one of \['auto', 'xla', 'cudnn', 'splash'\]"),
    (LB_NONE.replace("load_balance: none", "balance: none"), r"strategies\[2\]\.cp: unknown keys \['balance'\]"),
    (LB_NONE + "grad_accum: two\n", r"grad_accum='two': use an integer >= 1"),
    (LB_NONE.replace("[dp, fsdp,", "[dp, fsdp, {pp: {repeats: 0}},"), r"pp\.repeats=0: use an integer >= 1"),
])
def test_bad_dimension_options_name_the_key_and_the_allowed_values(tmp_path, text, expected, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert main(["plan", "--model", "tiny", "--recipe", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(expected, err[0]), err


def test_train_runs_a_recipe_file_with_context_options(tmp_path, capsys):
    path = tmp_path / "ring_plain.yaml"
    path.write_text(LB_NONE)
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--recipe", str(path), "--steps", "3", "--eval-every", "0",
                 "--progress", "none", "--out", str(out)]) == 0
    settings = json.loads((out / "plan.json").read_text())["recipe_settings"]
    assert {"cp": {"load_balance": "none", "flash_backend": "xla"}} in settings["strategies"]
    header = next(r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "start")
    assert {"cp": {"load_balance": "none", "flash_backend": "xla"}} in header["recipe_settings"]["strategies"]
    assert header["recipe"] == "ring_plain"


def test_train_flags_reach_the_run_header(tmp_path):
    # The run above with the recipe file, from flags instead: fsdp_cp is ring_plain's recipe (ring, context 4),
    # so the same 3 steps are the same program (compiled once: conftest's compilation cache).
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny", "--recipe", "fsdp_cp", "--load-balance", "none", "--flash-backend", "xla",
                 "--steps", "3", "--eval-every", "0", "--progress", "none", "--out", str(out)]) == 0
    header = next(r for r in map(json.loads, open(out / "metrics.jsonl")) if r.get("event") == "start")
    cp = [s["cp"] for s in header["recipe_settings"]["strategies"] if isinstance(s, dict) and "cp" in s]
    assert cp and cp[0]["load_balance"] == "none" and cp[0]["flash_backend"] == "xla", header
