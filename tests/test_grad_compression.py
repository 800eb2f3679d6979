"""Compressed gradient reduction across DCN (issue 33, item 3): ``grad_compression: none | int8 | onebit`` on
``dp`` / ``hsdp`` with ``data`` the DCN axis (8 simulated devices as 2 slices x 4)."""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import meshtrain as mt
from helpers import assert_bit_exact, assert_on_mesh, host, kill_then_resume, put, token_batch
from meshtrain.analysis.collectives import hlo_collectives, wire_bytes
from meshtrain.analysis.comms import Backend, analytic_collectives
from meshtrain.analysis.compiled import step_inputs
from meshtrain.checkpoint import Checkpointer
from meshtrain.cli import main
from meshtrain.errors import ConfigError, RecipeError
from meshtrain.parallel import grad_compression as gc
from meshtrain.parallel import onebit_adam as oba
from meshtrain.parallel.resolved import resolve_step
from meshtrain.train.step import WarmupStep

ROOT = os.path.dirname(os.path.dirname(__file__))
RECIPE_FILE = os.path.join(ROOT, "recipes", "hsdp_dcn_onebit.yaml")


def _recipe(kind: str):
    return mt.get_recipe("hsdp").with_mesh(dcn={"data": 2}, data=1).with_options(grad_compression=kind)


def _plan(kind: str, fsdp: int = 4, warmup: int = 1, tx=None):
    """tiny on 2 slices x ``fsdp``; 1-bit Adam (:func:`oba.onebit_adamw`, variance frozen after ``warmup`` exact
    steps) unless ``tx`` is given."""
    recipe = _recipe(kind).with_mesh(dcn={"data": 2}, data=1, fsdp=fsdp).with_options(grad_compression_warmup=warmup)
    mesh = recipe.mesh.build(jax.devices()[:2 * fsdp])
    factory = gc.feedback_factory(mt.models.model_factory(mt.models.get_config("tiny")), recipe)
    abstract = mt.abstract_state(factory, tx or oba.onebit_adamw(3e-3, weight_decay=0.1, clip_norm=1.0))
    return mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(8, 32))


# ---- the codecs (fast) -------------------------------------------------------------------------------------

def test_int8_round_trip_is_within_half_a_step_of_each_block():
    x = jax.random.normal(jax.random.key(0), (3, 300)) * jnp.arange(1, 301)   # blocks of very different ranges
    q, scale = gc.compress_int8(x)
    assert q.dtype == jnp.int8 and q.shape == (4, gc.BLOCK) and scale.shape == (4,)
    back = gc._unblock(gc.decompress_int8(q, scale), x)
    step = gc._unblock(jnp.broadcast_to(scale[:, None], q.shape), x)
    assert float(jnp.max(jnp.abs(back - x) / step)) <= 0.5 + 1e-5


def test_onebit_residual_is_exactly_what_was_not_sent():
    g = jax.random.normal(jax.random.key(1), (1000,))
    residual = jax.random.normal(jax.random.key(2), (1000,)) * 0.1
    bits, scale = gc.compress_onebit(g + residual)
    assert bits.dtype == jnp.uint8 and bits.shape == (4, gc.BLOCK // 8)
    sent = gc._unblock(gc.decompress_onebit(bits, scale), g)
    assert np.array_equal(np.sign(np.asarray(sent)), np.where(np.asarray(g + residual) >= 0, 1.0, -1.0))
    # error feedback: what is sent plus the new residual is the corrected gradient (to f32 rounding)
    new_residual = (g + residual) - sent
    np.testing.assert_allclose(sent + new_residual, g + residual, rtol=0, atol=1e-6)


def test_onebit_exchange_keeps_what_it_did_not_send():
    """Two replicas exchange through :func:`gc.exchange` (onebit): every replica gets the same average, and that
    average plus the replicas' mean new residual is the mean of what they meant to send (their values plus old
    residuals): error feedback loses nothing, it delays it."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    x_rn = jax.random.normal(jax.random.key(3), (2, 3 * gc.BLOCK + 5)) * jnp.linspace(0.01, 2.0, 3 * gc.BLOCK + 5)
    old_rn = jax.random.normal(jax.random.key(4), x_rn.shape) * 0.1

    def body(x, old):
        total, residual = gc.exchange(gc.GradCompression.ONEBIT, x[0], old[0])
        return total[None], residual[None]
    total_rn, new_rn = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                     out_specs=(P("data"), P("data")), check_vma=False)(x_rn, old_rn)
    assert np.array_equal(np.asarray(total_rn[0]), np.asarray(total_rn[1]))
    np.testing.assert_allclose(total_rn[0] / 2 + jnp.mean(new_rn, axis=0), jnp.mean(x_rn + old_rn, axis=0),
                               rtol=0, atol=1e-5)
    assert float(jnp.max(jnp.abs(new_rn))) > 0.01   # something was held back


# ---- 1-bit Adam's optimizer (fast) ------------------------------------------------------------------------

def _params():
    return {"w": jax.random.normal(jax.random.key(5), (4, 8)), "b": jnp.linspace(-1.0, 1.0, 8)}


def test_onebit_adamw_is_optax_adamw_with_clipping_until_frozen():
    params = _params()
    schedule = optax.linear_schedule(1e-3, 3e-3, 5)
    ours = oba.onebit_adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, clip_norm=1.0)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    s_ours, s_ref = ours.init(params), ref.init(params)
    for i in range(4):   # gradients large enough that clipping acts on some steps
        g = jax.tree.map(lambda p: jax.random.normal(jax.random.key(10 + i), p.shape) * (0.2 + i), params)
        u_ours, s_ours = ours.update(g, s_ours, params)
        u_ref, s_ref = ref.update(g, s_ref, params)
        for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_ref)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    adam = oba.find_state(s_ours)
    assert int(adam.count) == 4 and int(adam.nu_count) == 4 and not bool(adam.frozen)


def test_frozen_onebit_adamw_takes_the_momentum_and_the_steps_variance():
    params = _params()
    lr, b1, b2, eps, wd = 2e-3, 0.9, 0.95, 1e-8, 0.1
    tx = oba.onebit_adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, clip_norm=1.0)
    state = tx.init(params)
    for i in range(3):   # the warm-up: exact Adam learns nu
        _, state = tx.update(jax.tree.map(lambda p: p * (i + 1.0), params), state, params)
    before = oba.find_state(state)
    momentum = jax.tree.map(lambda p: 5.0 * jnp.cos(p), params)   # the replicas' averaged momentum (norm > clip)
    tracked = jax.tree.map(lambda v: v * 1.5, before.nu)   # the variance the step tracked (track_variance)
    updates, state = tx.update(momentum, oba.frozen(state, tracked), params)
    after = oba.find_state(state)
    assert bool(after.frozen) and int(after.count) == 4 and int(after.nu_count) == 3
    for new, m in zip(jax.tree.leaves(after.mu), jax.tree.leaves(momentum)):
        assert np.array_equal(np.asarray(new), np.asarray(m))       # mu is the momentum, not clipped or mixed
    for new, old in zip(jax.tree.leaves(after.nu), jax.tree.leaves(tracked)):
        assert np.array_equal(np.asarray(new), np.asarray(old))     # the step's variance, no Adam update of it
    for key in params:   # AdamW's update with that variance, bias-corrected as at the freeze (decay on both leaves)
        m_hat = momentum[key] / (1 - b1 ** 4)
        v_hat = tracked[key] / (1 - b2 ** 3)
        expected = -lr * (m_hat / (jnp.sqrt(v_hat) + eps) + wd * params[key])
        np.testing.assert_allclose(updates[key], expected, rtol=1e-6, atol=1e-9)


def _track(g_rv, nu_hat_v, seeds, b2=0.95):
    """:func:`oba.track_variance` for replicas ``g_rv`` (a vmapped ``data`` axis stands in for shard_map's), per
    seed: ``(seeds, replicas, values)`` factors."""
    one = lambda g, seed: oba.track_variance(g, nu_hat_v, b2, seed, "data", g_rv.shape[0])  # noqa: E731
    per_seed = jax.vmap(lambda seed: jax.vmap(lambda g: one(g, seed), axis_name="data")(g_rv))
    return per_seed(seeds)


def test_variance_tracking_estimates_the_global_gradients_block_energy_not_the_local_ones():
    """Two replicas whose local gradients are the global one +- a larger noise: the tracked level (the factor's
    step, ``(factor - b2) / (1 - b2) * sum(nu_hat)`` per block) averages over steps (seeds) to the *global* mean
    gradient's block energy, not the replicas' mean local energy (5x larger here); one factor per block, the
    same on both replicas."""
    block = oba.VARIANCE_BLOCK
    n = 2 * block + 40   # two full blocks and a padded one
    key_g, key_e = jax.random.split(jax.random.key(0))
    global_v = jax.random.normal(key_g, (n,)) * jnp.where(jnp.arange(n) < block, 1.0, 0.3)
    noise_v = 2.0 * jax.random.normal(key_e, (n,))
    g_rv = jnp.stack([global_v + noise_v, global_v - noise_v])
    nu_hat_v = jnp.full((n,), 0.5)
    b2 = 0.95
    factors = _track(g_rv, nu_hat_v, jnp.arange(4000), b2)
    np.testing.assert_array_equal(factors[:, 0], factors[:, 1])   # the replicas agree
    starts = [0, block, 2 * block]
    for s in starts:   # one factor per block
        assert bool(jnp.all(factors[:, 0, s:s + block] == factors[:, 0, s:s + 1]))
    for s in starts:
        level = (factors[:, 0, s] - b2) / (1 - b2) * float(jnp.sum(nu_hat_v[s:s + block]))
        want = float(jnp.sum(jnp.square(global_v[s:s + block])))
        local = float(jnp.mean(jnp.sum(jnp.square(g_rv[:, s:s + block]), axis=1)))
        assert local > 4 * want
        assert abs(float(jnp.mean(level)) - want) < 0.1 * want, (s, float(jnp.mean(level)), want)
    # the projection's signs change with the step: two steps, different factors
    assert not np.array_equal(np.asarray(factors[0, 0]), np.asarray(factors[1, 0]))


def test_what_onebit_sends_depends_on_the_optimizer():
    params = _params()
    onebit = gc.CompressionChoice(gc.GradCompression.ONEBIT, 2, warmup=5)
    assert gc.sent_quantity(onebit, oba.onebit_adamw(1e-3).init(params)) is gc.Sent.MOMENTUM
    assert gc.sent_quantity(onebit, optax.sgd(1e-3, momentum=0.9).init(params)) is gc.Sent.GRADIENT
    int8 = gc.CompressionChoice(gc.GradCompression.INT8, 2)
    assert gc.sent_quantity(int8, optax.adamw(1e-3).init(params)) is gc.Sent.GRADIENT
    with pytest.raises(ConfigError, match="not optax's Adam"):
        gc.sent_quantity(onebit, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)).init(params))
    with pytest.raises(ConfigError, match="--grad-compression-warmup K"):
        gc.sent_quantity(gc.CompressionChoice(gc.GradCompression.ONEBIT, 2), oba.onebit_adamw(1e-3).init(params))


# ---- refusals: typed errors, and through the CLI one line, no traceback (fast) ------------------------------

def test_refused_where_it_cannot_apply():
    with pytest.raises(ConfigError, match="no data-parallel axis across DCN"):
        gc.resolve(mt.get_recipe("hsdp").with_options(grad_compression="int8"))   # data on ICI only
    with pytest.raises(ConfigError, match="spans 2 devices inside a slice"):
        gc.resolve(mt.get_recipe("hsdp").with_mesh(dcn={"data": 2}).with_options(grad_compression="onebit"))
    with pytest.raises(RecipeError, match="belongs to the 'hsdp' dimension"):
        mt.get_recipe("fsdp").with_options(grad_compression="int8")             # no data parallelism at all
    assert not gc.resolve(mt.get_recipe("hsdp")).active


@pytest.mark.parametrize("argv, fragment", [
    (["plan", "--model", "tiny", "--recipe", "hsdp", "--grad-compression", "int8"],
     "no data-parallel axis across DCN"),
    (["plan", "--model", "tiny", "--recipe", "fsdp", "--grad-compression", "onebit"],
     "belongs to the 'hsdp' dimension"),
])
def test_cli_refuses_with_one_line(argv, fragment, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0 and fragment in err and "Traceback" not in err


# ---- the compiled program: what crosses DCN (slow: three compiles) -------------------------------------------

def _dcn_ops(plan, compiled_text):
    return [c for c in hlo_collectives(compiled_text, plan.mesh) if "data" in c.axes]


def _wire(ops):
    return sum(wire_bytes(c.kind, c.bytes, c.group_size) * c.executions for c in ops)


@pytest.mark.slow
def test_dcn_reduction_bytes_drop_4x_int8_and_16x_onebit():
    wire, reduction, payload_kinds = {}, {}, {}
    for kind in ("none", "int8", "onebit"):
        plan = _plan(kind)
        # lowered from shapes: nothing to initialise for a compile that is only read
        step = mt.make_train_step(plan)
        step = getattr(step, "compressed", step)   # past the warm-up: the program that crosses DCN compressed
        text = step.lower(*step_inputs(plan)).compile().as_text()
        ops = _dcn_ops(plan, text)
        wire[kind] = _wire(ops)
        # the gradient reduction proper: the all-reduces over `data` (uncompressed) or the payload gathers
        reduction[kind] = _wire([c for c in ops if c.kind in ("all-reduce", "reduce-scatter")
                                 or (c.kind == "all-gather" and kind != "none")])
        payload_kinds[kind] = {s.split("[")[0] for c in ops if c.kind == "all-gather" for s in c.shapes}
        if kind != "none":   # the planner's DCN gather equals the compiled one within 10 %
            est = sum(e.bytes_per_step for e in analytic_collectives(plan, None, Backend.CPU)
                      if e.axes == ("data",) and e.kind == "all-gather")
            got = sum(c.bytes * c.executions for c in ops if c.kind == "all-gather")
            assert abs(est - got) <= 0.1 * got, (kind, est, got)
        if kind == "onebit":   # 1-bit Adam's variance projections: the planner's rows against the compiled
            est = sum(e.bytes_per_step for e in analytic_collectives(plan, None, Backend.CPU)
                      if e.axes == ("data",) and e.kind == "all-reduce")
            got = sum(c.bytes * c.executions for c in ops if c.kind == "all-reduce")   # + the loss sums' few bytes
            assert est > 0 and abs(est - got) <= 0.1 * got, (est, got)
    assert "s8" in payload_kinds["int8"] and "u8" in payload_kinds["onebit"], payload_kinds
    # every collective whose replica groups cross the slice boundary, per step and device
    assert wire["none"] >= 4 * wire["int8"], wire
    assert wire["none"] >= 16 * wire["onebit"], wire
    # the gradient reduction alone: 8 of 32 bits plus one f32 scale per BLOCK values (4x is the ceiling
    # of 8-bit values against f32; the scales cost 1.6 %)
    assert reduction["none"] >= 4 / (1 + 4 / gc.BLOCK) * 0.97 * reduction["int8"], reduction
    assert reduction["none"] >= 16 * reduction["onebit"], reduction


@pytest.mark.slow
def test_onebit_error_feedback_is_model_state_and_changes_with_steps():
    plan = _plan("onebit")
    leaves = [l for l in plan.group("model_state") if l.path.startswith(gc.FEEDBACK_ATTR)]
    assert len(leaves) == len(jax.tree.leaves(plan.abstract.params))
    assert all(l.spec[0] == "data" for l in leaves)   # one residual per replica, planned on `data`
    state = mt.init_state(plan, seed=0)
    step = mt.make_train_step(plan)
    for i in range(2):
        state, metrics = step(state, put(token_batch(i, 8, 32), plan))
    residuals = gc.feedback_of(state.model_state)
    assert np.isfinite(float(metrics["loss"]))
    assert all(float(jnp.max(jnp.abs(r))) > 0 for r in residuals)
    # the two replicas compress different gradients, so their residuals differ
    assert not np.array_equal(np.asarray(residuals[0][0]), np.asarray(residuals[0][1]))


@pytest.mark.slow
def test_warmup_steps_are_exact_then_onebit_takes_over():
    """``grad_compression_warmup=2``: steps 1-2 run the full-precision program (the same loss and parameters as
    ``none``, the error feedback untouched, Adam's variance learnt), step 3 the compressed one (1-bit Adam: the
    variance frozen, the averaged momentum Adam's first moment); ``lower`` is the compressed program."""
    plan, exact = _plan("onebit", warmup=2), _plan("none")
    step, exact_step = mt.make_train_step(plan), mt.make_train_step(exact)
    assert isinstance(step, WarmupStep) and resolve_step(plan).grad_compression.warmup == 2
    state, ref = mt.init_state(plan, seed=0), mt.init_state(exact, seed=0)
    compiled = step.lower(state, put(token_batch(0, 8, 32), plan)).compile()
    assert "u8[" in compiled.as_text()   # the packed sign bits' all-gather
    for i in range(3):
        state, metrics = compiled(state, put(token_batch(i, 8, 32), plan))
        residual = float(max(jnp.max(jnp.abs(r)) for r in gc.feedback_of(state.model_state)))
        if i < 2:
            ref, ref_metrics = exact_step(ref, put(token_batch(i, 8, 32), exact))
            assert residual == 0.0 and float(metrics["loss"]) == float(ref_metrics["loss"])
            for a, b in zip(jax.tree.leaves(host(state.params)), jax.tree.leaves(host(ref.params))):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        else:
            assert residual > 0.0
        adam = oba.find_state(state.opt_state)
        assert bool(adam.frozen) == (i == 2) and int(adam.nu_count) == min(i + 1, 2)
        if i == 1:
            nu_at_freeze = host(adam.nu)
    # frozen: no Adam update of the variance, only each block's level rescaled (track_variance's factor >= b2)
    for old, new in zip(jax.tree.leaves(nu_at_freeze), jax.tree.leaves(host(adam.nu))):
        ratio = new[old > 0] / old[old > 0]
        assert np.all(ratio >= 0.95 * (1 - 1e-6)) and not np.allclose(ratio, 1.0)


@pytest.mark.slow
def test_resume_across_the_warmup_boundary_is_bit_exact(tmp_path):
    """Saved after the first (exact) step of a 2-step warm-up, restored, run on into the compressed steps: the same
    state, bit for bit, as the run that never stopped (the program is picked by the step, the freeze is state)."""
    plan = _plan("onebit", warmup=2)
    step = mt.make_train_step(plan, donate=False)
    batches = [put(token_batch(i, 8, 32), plan) for i in range(4)]
    straight = mt.init_state(plan, seed=0)
    for i, b in enumerate(batches):
        straight, _ = step(straight, b)
        if i == 1:   # the last exact step: the variance at the freeze
            nu_at_freeze = host(oba.find_state(straight.opt_state).nu)
    state, _ = step(mt.init_state(plan, seed=0), batches[0])
    with Checkpointer(tmp_path / "ckpt", save_every=1) as ckpt:
        ckpt.maybe_save(1, state, data_state={"next_batch": 1}, metadata={"recipe": plan.recipe.to_dict()})
    with Checkpointer(tmp_path / "ckpt", save_every=1) as ckpt:
        resumed = ckpt.restore(plan).state
    for b in batches[1:]:
        resumed, _ = step(resumed, b)
    assert bool(oba.find_state(resumed.opt_state).frozen)
    # the compressed steps moved the variance's block levels (track_variance): resumed bit-exact with the rest
    assert not np.array_equal(np.asarray(jax.tree.leaves(nu_at_freeze)[0]),
                              np.asarray(jax.tree.leaves(host(oba.find_state(resumed.opt_state).nu))[0]))
    assert max(float(jnp.max(jnp.abs(r))) for r in gc.feedback_of(resumed.model_state)) > 0
    assert_bit_exact(host(straight), resumed)


@pytest.mark.slow
def test_error_feedback_restores_resharded_onto_another_slice_layout(tmp_path):
    """Saved with 4 devices per slice (fsdp=4), restored with 2 (fsdp=2): the residuals come back bit-exact,
    laid out on the new mesh, and the next step matches the same step run without the checkpoint."""
    src, dst = _plan("onebit", fsdp=4), _plan("onebit", fsdp=2)
    state = mt.init_state(src, seed=0)
    step = mt.make_train_step(src)
    for i in range(2):
        state, _ = step(state, put(token_batch(i, 8, 32), src))
    saved = host(state)
    with Checkpointer(tmp_path / "ckpt", save_every=2) as ckpt:
        ckpt.maybe_save(2, state, data_state={"next_batch": 2}, metadata={"recipe": src.recipe.to_dict()})
    with Checkpointer(tmp_path / "ckpt", save_every=2) as ckpt:
        restored = ckpt.restore(dst).state
    assert_bit_exact(saved, restored)
    assert_on_mesh(restored, dst)
    direct = jax.device_put(saved, mt.state_shardings(dst))
    dst_step = mt.make_train_step(dst, donate=False)
    a, ma = dst_step(restored, put(token_batch(2, 8, 32), dst))
    b, mb = dst_step(direct, put(token_batch(2, 8, 32), dst))
    assert float(ma["loss"]) == float(mb["loss"])
    assert_bit_exact(host(b.model_state), a.model_state)


# ---- SIGKILL + resume with the error-feedback state (slow: three CLI runs) ----------------------------------

STEPS, EVERY = 12, 3
DATA = os.path.join(os.path.dirname(json.__file__))


def _command(out, *extra):
    return [sys.executable, "-m", "meshtrain", "train", "--model", "tiny", "--recipe", RECIPE_FILE, "--steps",
            str(STEPS), "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--progress", "none", "--data",
            DATA, "--ckpt-every", str(EVERY), "--warmup-steps", "1", "--grad-compression-warmup", str(EVERY + 1),
            "--out", str(out), *extra]


@pytest.mark.slow
def test_sigkill_and_resume_is_bit_exact_with_error_feedback(tmp_path):
    expected, got, out = kill_then_resume(_command, tmp_path, 2 * EVERY + 2, cwd=ROOT)
    restarts = [json.loads(line) for line in open(out / "metrics.jsonl") if '"restart"' in line]
    assert restarts and restarts[-1]["restored_step"] >= EVERY, restarts
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == [expected[s] for s in sorted(expected)]   # bit-identical


def test_train_refuses_onebit_adam_without_a_warmup(tmp_path, capsys):
    """1-bit Adam must learn Adam's variance before freezing it: no warm-up is one line naming the flag."""
    code = main(["train", "--model", "tiny", "--recipe", RECIPE_FILE, "--steps", "2", "--batch-size", "8",
                 "--seq-len", "32", "--warmup-steps", "1", "--eval-every", "0", "--progress", "none", "--data", DATA,
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code != 0 and "--grad-compression-warmup K" in err and "Traceback" not in err, err
