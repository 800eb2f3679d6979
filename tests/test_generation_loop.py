"""The compiled decode loop (``DecodeLoop.DEVICE``: every decode step in one ``while_loop``, the layer
weights one array per layer) against the per-token loop (``DecodeLoop.HOST``, the engine before it):
the same greedy tokens, log-probabilities within 1e-5, the same seeded samples, the same stops, on
1 device and on the 8-device recipes that generate (fsdp_tp, and fsdp_ep for MoE)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import GENERATION_NEW, assert_same_generations, make_decoder

from meshtrain.generation import Engine, Sampling, load
from meshtrain.generation.loop import DecodeLoop, decode_loop, stop_mask
from meshtrain.generation.weights import LAYERS

#: The generation tests' token count: the compiled device loops of test_generation.py's greedy runs (the
#: same model, recipe, prompts and count) are then the same programs, read from the compilation cache
NEW = GENERATION_NEW


def both_loops(name: str, recipe: str, devices: int):
    """``(device-loop engine, host-loop engine)`` of the same model on the same plan."""
    model = make_decoder(name)
    device = load(model, recipe=recipe, devices=devices).engine
    host = Engine(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), device.plan, loop=DecodeLoop.HOST)
    return device, host


def assert_same(device, host, sampling=Sampling(), stop_ids=(), new=NEW):
    return assert_same_generations(device, host, new, sampling, stop_ids)


@pytest.mark.slow
def test_the_loop_equals_the_per_token_loop_on_one_device_greedy_sampled_and_stopped():
    device, host = both_loops("tiny", "dp", 1)
    assert isinstance(device.params[LAYERS], tuple) and len(device.params[LAYERS]) == device.cfg.n_layers
    assert device.weight_bytes_per_device() == host.weight_bytes_per_device()  # the same bytes, one array per layer
    greedy, loop = assert_same(device, host)
    # one program run for all decode steps, against one per step
    assert len(loop.timing.decode_s) == 1 and loop.timing.decode_steps == NEW - 1 == len(greedy.timing.decode_s)
    assert_same(device, host, Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=3))
    # a stop id the first prompt emits at its 4th new token: that row stops there, the others run on
    stop = greedy.generations[0].new_ids[3]
    _, stopped = assert_same(device, host, stop_ids=(stop,))
    first = stopped.generations[0]
    assert first.stopped and first.new_ids[-1] == stop and len(first.new_ids) <= 4
    # every row stops on its first token: the loop runs no step
    firsts = tuple({g.new_ids[0] for g in greedy.generations})
    _, none = assert_same(device, host, stop_ids=firsts)
    assert none.timing.decode_steps == 0 and all(len(g.new_ids) == 1 for g in none.generations)
    assert_same(device, host, new=1)


def test_each_row_stops_at_its_own_limit_or_stop_id_and_later_tokens_are_not_counted():
    vocab, n_new = 16, 6

    def forward(tokens_bt, cache):  # the next token is the last one + 1: row b emits first_b + i at step i
        return jax.nn.one_hot(tokens_bt + 1, vocab) * 10.0, cache + 1

    first_b = jnp.array([0, 3, 7, 2], jnp.int32)
    limit_b = jnp.array([6, 2, 6, 1], jnp.int32)
    out, steps_seen = jax.jit(lambda f, c, l, s: decode_loop(forward, f, jnp.zeros(4), c, l, s, jax.random.key(0),
                                                             n_new=n_new, sampling=Sampling()))(
        first_b, jnp.int32(0), limit_b, jnp.asarray(stop_mask([9], vocab)))
    # row 0: limit 6; row 1: limit 2; row 2: 7, 8, 9 (stop); row 3: limit 1 (done from the start)
    assert np.asarray(out.length_b).tolist() == [6, 2, 3, 1]
    assert np.asarray(out.new_bn)[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert np.asarray(out.new_bn)[2, :3].tolist() == [7, 8, 9]
    assert int(out.steps) == int(steps_seen) == 5


@pytest.mark.slow
# (tiny-moe on one device is left out: the one-device loop is the tiny test above's, and MoE's routing in
# the loop runs under fsdp_ep here; tests/test_generation.py still generates tiny-moe on one device)
@pytest.mark.parametrize("name, recipe", [("tiny", "fsdp_tp"), ("tiny-moe", "fsdp_ep")])
def test_the_loop_equals_the_per_token_loop_on_the_8_device_recipes(name, recipe):
    device, host = both_loops(name, recipe, 8)
    greedy, _ = assert_same(device, host)
    assert all(len(g.new_ids) == NEW for g in greedy.generations)
    assert_same(device, host, Sampling(temperature=0.8, top_k=10, seed=1), stop_ids=(greedy.generations[1].new_ids[2],))
    # each layer's weights keep the stacked weights' sharding, less the layers axis
    stacked = host.params[LAYERS]
    for l, layer in enumerate(device.params[LAYERS]):
        for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(layer)):
            assert tuple(b.sharding.spec) == tuple(a.sharding.spec)[1:]
            np.testing.assert_array_equal(np.asarray(a[l]), np.asarray(b))


@pytest.mark.parametrize("heads, kv_heads, new", [(8, 2, 1), (8, 2, 3), (4, 4, 1)])
def test_cached_attention_over_grouped_kv_heads_equals_repeated_heads_attention(heads, kv_heads, new):
    # the cache is read as stored (query head i uses KV head i // group): the reference repeats the KV heads
    # per query head and runs jax.nn.dot_product_attention with the same mask
    from meshtrain.models.decoder import cache_attention

    rng = np.random.default_rng(0)
    b, s, h = 3, 16, 8
    q = jnp.asarray(rng.standard_normal((b, new, heads, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv_heads, h)), jnp.float32) for _ in range(2))
    allowed = jnp.asarray(rng.random((b, new, s)) < 0.7).at[:, :, 0].set(True)
    ref = jax.nn.dot_product_attention(q, jnp.repeat(k, heads // kv_heads, axis=2),
                                       jnp.repeat(v, heads // kv_heads, axis=2), mask=allowed[:, None])
    got = cache_attention(q, k, v, allowed)
    assert got.shape == (b, new, heads, h)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5)
