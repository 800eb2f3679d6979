"""Mixture of experts: routing by hand, parity of every EP recipe (and dropless) with one device,
the all-to-all in the HLO against the planner, expert-weight bytes per device, bad input."""

import json
import math
import os
import processes
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshtrain as mt
from meshtrain.abstract import path_str
from meshtrain.analysis import hlo_collectives
from meshtrain.analysis.comms import analytic_collectives, moe_exchange_bytes
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.models.moe import MoE, MoEConfig, pop_moe_stats
from meshtrain.parallel.moe import capacity_for, route
from meshtrain.state import state_shardings

from helpers import mesh_for, put, rel_diff, single_device, tiny_abstract, token_batch

B, T, STEPS = 16, 32, 10
NO_DROP = 4.0  # capacity factor >= n_experts / top_k = 8 / 2: every expert has a slot for every token


def _abstract(capacity_factor=NO_DROP):
    # AdamW behind a transform that keeps the gradients it is given in its state: the step-0
    # gradients come out of the train step itself (no second compiled program).
    keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda g, s, p=None: (g, g))
    return tiny_abstract(optax.chain(keep, optax.adamw(3e-3)), model="tiny-moe", capacity_factor=capacity_factor)


def _run(recipe, mesh, abstract, steps=STEPS, init=None):
    """Losses and metrics of ``steps`` steps, step-0 loss and gradients, the plan, the compiled step,
    the final state and the initial state (numpy). ``init``: start from these values, placed by the
    plan (saves compiling a sharded init per recipe; sharded init itself is tested in test_plan)."""
    plan = mt.make_plan(abstract, recipe, mesh, batch=mt.BatchSpec(B, T))
    if init is None:
        state = mt.init_state(plan, seed=0)
        init = jax.tree.map(np.asarray, state)
    else:
        state = jax.device_put(init, state_shardings(plan))
    compiled = mt.make_train_step(plan).lower(state, put(token_batch(0, B, T), plan)).compile()
    losses, metrics, grads = [], [], None
    for i in range(steps):
        state, m = compiled(state, put(token_batch(i, B, T), plan))
        losses.append(float(m["loss"]))
        metrics.append({k: float(v) for k, v in m.items()})
        if i == 0:
            grads = jax.tree.map(np.asarray, state.opt_state[0])
    return np.array(losses), metrics, (losses[0], grads), plan, compiled, state, init


@pytest.fixture(scope="module")
def baseline():
    one, mesh = single_device("dp")
    return _run(one, mesh, _abstract())


@pytest.fixture(scope="module")
def ep_run(baseline):
    recipe, mesh = mesh_for("ep")
    return _run(recipe, mesh, _abstract(), init=baseline[-1])


def _check_parity(run, baseline):
    losses, metrics, (loss0, grads), *_ = run
    base_losses, base_metrics, (base_loss0, base_grads), *_ = baseline
    assert rel_diff(losses, base_losses) <= 1e-5, (losses, base_losses)
    assert losses[-1] < losses[0]
    assert all(m["moe_drop_frac"] == 0.0 for m in metrics)
    for key in ("moe_aux_loss", "moe_z_loss", "moe_load_max"):
        assert rel_diff([m[key] for m in metrics], [m[key] for m in base_metrics]) <= 1e-5, key
    assert abs(loss0 - base_loss0) / base_loss0 <= 1e-5
    base = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(base_grads)[0]}
    for keypath, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert rel_diff(g, base[path_str(keypath)]) <= 1e-5, path_str(keypath)


@pytest.mark.slow
def test_ep_matches_single_device(ep_run, baseline):
    _check_parity(ep_run, baseline)


@pytest.mark.slow
@pytest.mark.parametrize("name,capacity_factor", [("fsdp_ep", NO_DROP), ("fsdp_tp_ep", None)],
                         ids=["fsdp_ep", "fsdp_tp_ep-dropless"])
def test_recipe_matches_single_device(name, capacity_factor, baseline):
    # Dropless (the padded exchange on CPU, with FSDP and TP around it) against the capacity baseline:
    # with nothing dropped both compute the same sums.
    recipe, mesh = mesh_for(name)
    _check_parity(_run(recipe, mesh, _abstract(capacity_factor), init=baseline[-1]), baseline)


def test_ep_hlo_all_to_all_and_expert_bytes(ep_run):
    *_, plan, compiled, state, _ = ep_run
    cfg = mt.models.get_config("tiny-moe", capacity_factor=NO_DROP)
    ops = [c for c in hlo_collectives(compiled.as_text(), plan.mesh) if c.kind == "all-to-all"]
    assert ops and all(c.axes == ("expert",) for c in ops)
    hlo_bytes = sum(c.bytes_per_step for c in ops) / cfg.n_layers
    x = moe_exchange_bytes(plan, cfg, "cpu")
    # (b=2 rows, E=8, C=ceil(4·32·2/8)=32, d=64) f32 per all-to-all, 4 per layer (dispatch + combine, fwd + bwd)
    assert x["per_op"] == 2 * 8 * 32 * 64 * 4 and x["ops_per_layer_step"] == 4
    assert abs(hlo_bytes - x["per_layer_step"]) <= 0.1 * x["per_layer_step"], (hlo_bytes, x)
    est = [e for e in analytic_collectives(plan, cfg, "cpu") if e.kind == "all-to-all"]
    assert abs(sum(e.bytes_per_step for e in est) - sum(c.bytes_per_step for c in ops)) <= 0.1 * sum(
        c.bytes_per_step for c in ops)
    # Expert weights: each device holds 1/ep of them (plan and the arrays on the devices).
    ep = plan.mesh_sizes["expert"]
    experts = [l for l in plan.group("params") if "expert" in (l.logical_axes or ())]
    assert len(experts) == 3
    for leaf in experts:
        assert leaf.bytes_per_device == leaf.bytes_total // ep
    arrays = {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    for leaf in experts:
        shard = arrays[leaf.path].addressable_shards[0].data
        assert shard.nbytes == arrays[leaf.path].nbytes // ep


def _hand_routed_layer(capacity_factor):
    """E=4 experts, k=2, d=4; router = identity, so token ``x = 10·e1 + 5·e2`` picks e1 then e2."""
    cfg = MoEConfig(d_model=4, n_experts=4, top_k=2, d_expert=8, capacity_factor=capacity_factor, norm_topk=True)
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, nnx.Rngs(0))
    layer.router_de[...] = jnp.eye(4)
    first = [0, 0, 0, 0, 0, 1, 1, 2]
    second = [1, 1, 1, 2, 3, 2, 0, 3]
    x = 10.0 * jax.nn.one_hot(jnp.array(first), 4) + 5.0 * jax.nn.one_hot(jnp.array(second), 4)
    return layer, jnp.stack([x, x[::-1]])  # row 2: the same tokens in reverse order


@pytest.mark.slow
def test_constructed_routing_drops_exactly_the_expected_tokens():
    # C = ceil(1.0 · 8 tokens · 2 / 4) = 4 slots per expert per row. Priority: first choices in token
    # order, then second choices. Row 1: e0 gets first choices t0..t4 (t4 dropped) and t6's second
    # (dropped): 2 drops; e1 gets t5, t6 first, then t0, t1, t2 second (t2 dropped): 1 drop; e2 (t7; t3,
    # t5) and e3 (t4, t7) fit. Row 2 (reversed): e0 first choices t3..t7 -> one dropped, t1's second
    # dropped; e1 first t1, t2 then second t5, t6, t7 -> one dropped. 3 + 3 drops of 32 assignments.
    layer, x = _hand_routed_layer(1.0)
    assert capacity_for(1.0, 8, 2, 4) == 4
    r = jax.jit(lambda lg: route(lg, 2, capacity=4))(jnp.einsum("btd,de->bte", x, layer.router_de[...]))
    np.testing.assert_array_equal(r.counts_e, [12, 10, 6, 4])
    np.testing.assert_array_equal(r.dropped_e, [4, 2, 0, 0])
    assert float(r.stats["drop_frac"]) == 6 / 32
    assert float(r.stats["load_max"]) == 12 / 8
    kept = np.asarray(r.kept[0])
    assert not kept[4, 0] and not kept[6, 1] and not kept[2, 1] and kept.sum() == 13
    # A dropped assignment adds nothing: the layer output is the kept experts' weighted sum.
    call = nnx.jit(lambda m, x: m(x))
    y = call(layer, x)
    stats = pop_moe_stats(layer)
    assert float(stats["drop_frac"]) == 6 / 32
    g, u, dn = layer.gate_edf[...], layer.up_edf[...], layer.down_efd[...]
    out = jnp.stack([(jax.nn.silu(x @ g[e]) * (x @ u[e])) @ dn[e] for e in range(4)], axis=2)  # (b, t, e, d)
    picked = jnp.take_along_axis(out, r.expert[..., None], axis=2)
    want = jnp.einsum("btkd,btk->btd", picked, r.weight * r.kept)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    # Dropless keeps everything.
    dl, _ = _hand_routed_layer(None)
    dl.router_de[...] = jnp.eye(4)
    for name in ("gate_edf", "up_edf", "down_efd"):
        getattr(dl, name)[...] = getattr(layer, name)[...]
    full = jnp.einsum("btkd,btk->btd", picked, r.weight)
    np.testing.assert_allclose(call(dl, x), full, rtol=1e-5, atol=1e-6)
    assert float(pop_moe_stats(dl)["drop_frac"]) == 0.0


def test_bad_input_names_the_fix():
    with pytest.raises(ConfigError, match=r"top_k=9 with 8 experts.*1 <= top_k <= n_experts"):
        mt.models.get_config("tiny-moe", experts_per_token=9)
    for bad in (0, -1.0):
        with pytest.raises(ConfigError, match=r"capacity_factor.*> 0.*None for dropless"):
            mt.models.get_config("tiny-moe", capacity_factor=bad)
    recipe, mesh = mesh_for("ep")
    with pytest.raises(MeshtrainError, match=r"expert.*size 6.*not divisible.*expert=8.*change the mesh sizes"):
        mt.make_plan(tiny_abstract(model="tiny-moe", n_experts=6), recipe, mesh, batch=mt.BatchSpec(B, T))


def test_published_parameter_counts():
    # Published totals / active: Mixtral 8x7B 46.7B / 12.9B; Qwen3-30B-A3B 30.5B / 3.3B;
    # Qwen1.5-MoE-A2.7B 14.3B / 2.7B (4 shared experts of 1408, 60 routed, top-4).
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9)):
        cfg = mt.models.get_config(name)
        assert math.isclose(cfg.num_params(), total, rel_tol=0.01), (name, cfg.num_params())
        assert math.isclose(cfg.num_active_params(), active, rel_tol=0.02), (name, cfg.num_active_params())
    dense = mt.models.get_config("tiny")
    assert dense.num_active_params() == dense.num_params() and dense.moe() is None
    abstract = _abstract()
    assert abstract.num_params == mt.models.get_config("tiny-moe").num_params()


def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name, axis_index_groups=None):
    """``jax.lax.ragged_all_to_all`` semantics from all-gathers (XLA:CPU does not implement it)."""
    ops = jax.lax.all_gather(operand, axis_name)
    ins, sends, outs = (jax.lax.all_gather(v, axis_name) for v in (input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis_name)
    rows = jnp.arange(output.shape[0])
    for i in range(ops.shape[0]):
        idx = rows - outs[i, me]
        valid = (idx >= 0) & (idx < sends[i, me])
        src = ops[i][jnp.clip(ins[i, me] + idx, 0, operand.shape[0] - 1)]
        output = jnp.where(valid.reshape((-1,) + (1,) * (output.ndim - 1)), src, output)
    return output


@pytest.mark.slow
def test_ragged_dropless_exchange_offsets(monkeypatch):
    """The GPU/TPU dropless kernel's offsets, run on CPU with an emulated ragged_all_to_all: the same
    output and gradients as one device's sort + ragged_dot."""
    from meshtrain.parallel import moe as kernels

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_emulated)
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    b, t, d, e, k, f = 8, 6, 8, 8, 2, 4
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (b, t, d))
    r = route(jax.random.normal(keys[1], (b, t, e)) * 3, k)  # uneven loads
    w = [jax.random.normal(kk, s) * 0.3 for kk, s in zip(keys[2:], [(e, d, f), (e, d, f), (e, f, d)])]
    row, ex = jax.sharding.PartitionSpec("expert", None, None), jax.sharding.PartitionSpec("expert")

    def sharded(x, *w):
        body = lambda x, ei, wt, *w: kernels._ragged_kernel(x, ei, ei, ei, wt, *w, capacity=None,  # noqa: E731
                                                            expert_axes=("expert",), ep=4)
        y = jax.shard_map(body, mesh=mesh, in_specs=(row, row, row, ex, ex, ex), out_specs=row)(x, r.expert,
                                                                                             r.weight, *w)
        return jnp.sum(jnp.sin(y))

    def local(x, *w):
        y = kernels.dropless_local(x.reshape(b * t, d), r.expert.reshape(b * t, k), r.weight.reshape(b * t, k), *w)
        return jnp.sum(jnp.sin(y))

    got = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2, 3)))(x, *w)
    want = jax.jit(jax.value_and_grad(local, argnums=(0, 1, 2, 3)))(x, *w)
    assert rel_diff(got[0], want[0]) <= 1e-5
    for g, h in zip(got[1], want[1]):
        assert rel_diff(g, h) <= 1e-5


def test_bench_moe_summarizes_a_run(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 11):
            f.write(json.dumps({"step": step, "loss": 6.0 / step, "moe_load_max": 3.0 - 0.1 * step,
                                "moe_aux_loss": 1.5, "moe_drop_frac": 0.1}) + "\n")
    tool = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools", "bench_moe.py")
    out = processes.run([sys.executable, tool, "--summarize", str(tmp_path)], capture_output=True, text=True,
                         check=True).stdout
    got = json.loads(out)
    assert got["steps"] == 10 and got["loss_last"] == 0.6
    assert got["load_max_first_fifth"] == pytest.approx(2.85) and got["load_max_last_fifth"] == pytest.approx(2.05)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_expert_order_permutations_match_a_sort(layout):
    """expert_order's block arithmetic (no sort, no scatter: what XLA:TPU compiles quickly) gives the
    permutation a stable sort by (local expert, source) would, padding rows last in buffer order."""
    from meshtrain.parallel.moe import expert_order

    # one compiled program per shape, as inside the train step (run eagerly, each of its ops compiles apart)
    order = jax.jit(expert_order, static_argnums=2)
    rng = np.random.default_rng(0)
    # every shape is a compile: a grid of 12 shapes (one source / expert / row, odd and even counts) with 5 random
    # fills each, rather than 60 random shapes (~40 distinct compiles) with one fill each
    shapes = [(ep, n_local, a) for ep in (1, 3, 4) for n_local in (1, 2) for a in (1, 4)]
    for ep, n_local, a in (shape for shape in shapes for _ in range(5)):
        counts = np.stack([np.bincount(rng.integers(0, n_local, rng.integers(0, a + 1)), minlength=n_local)
                           for _ in range(ep)])
        if layout == "ragged":  # chunks back to back, then the unused rest of an ep·a buffer
            starts, rows = np.concatenate([[0], np.cumsum(counts.sum(1))[:-1]]), ep * a
        else:                   # a chunks of a rows each, each padded after its rows
            starts, rows = np.arange(ep) * a, ep * a
        key = np.full(rows, np.iinfo(np.int64).max)
        for i in range(ep):
            block_experts = np.repeat(np.arange(n_local), counts[i])
            key[starts[i]:starts[i] + len(block_experts)] = block_experts * ep + i
        want = np.argsort(key, kind="stable")
        idx, inv, sizes = order(jnp.asarray(counts), jnp.asarray(starts, jnp.int32), rows)
        np.testing.assert_array_equal(np.asarray(idx), want)
        np.testing.assert_array_equal(np.asarray(inv)[want], np.arange(rows))
        np.testing.assert_array_equal(np.asarray(sizes), counts.sum(0))
