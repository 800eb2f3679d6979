"""The whole decode step in one C++ call (:mod:`meshtrain.kernels.decode_step`, ``DecodeMatmul.FUSED_STEP``): the
resolved step chooses it only for small f32 or bf16 Llama-shaped models on 1 CPU device with the compiled loop; an
engine with it generates what the engine on XLA's step generates (f32: the same greedy and seeded tokens and stops,
``new_logprobs`` within 1e-5; bf16: the same tokens, log-probabilities within bf16's rounding), also for tied heads,
Gemma's norm offset and embedding scale and a tanh-GELU gate."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx
from helpers import assert_same_generations

from meshtrain.errors import ConfigError
from meshtrain.generation import Engine, Sampling, load
from meshtrain.kernels import bf16_rows, decode_step
from meshtrain.models import Decoder, get_config
from meshtrain.parallel.resolved import DecodeMatmul, resolve_step

NEW = 12


@pytest.fixture
def step_kernel():
    """Skips where the kernel cannot be built (no C++ compiler); built at the first test, not at collection."""
    if not decode_step.kernel_ready():
        pytest.skip(f"no decode-step kernel on this host: {decode_step.why_not_ready()}")


def decoder(**changes):
    cfg = dataclasses.replace(get_config("tiny"), **changes)
    with nnx.use_eager_sharding(False):
        return Decoder(cfg, rngs=nnx.Rngs(0))


def fused_and_xla(model, weights="none"):
    fused = load(model, recipe="dp", devices=1, quantize=weights).engine
    xla = Engine(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), fused.plan, weights=weights,
                 decode_matmul="xla")
    assert fused.decode_matmul is DecodeMatmul.FUSED_STEP and xla.decode_matmul is DecodeMatmul.XLA
    return fused, xla


def assert_same(fused, xla, sampling=Sampling(), stop_ids=(), tolerance=1e-5):
    return assert_same_generations(fused, xla, NEW, sampling, stop_ids, tolerance)[0]


def test_the_resolved_step_chooses_the_fused_step_only_for_small_supported_models_on_one_cpu_device():
    plan = load(decoder(), recipe="dp", devices=1).engine.plan
    step = resolve_step(plan)
    small = 64 * 128

    def refuse():
        raise AssertionError("the kernel is built only for an eligible step")

    def choice(weights="none", devices=1, layered=True, prefer=None, largest=small, ready=lambda: True, model=None):
        return step.for_generation(weights, devices, layered, refuse, prefer, largest, ready, model).decode_matmul

    assert choice() is DecodeMatmul.FUSED_STEP and choice("bf16") is DecodeMatmul.FUSED_STEP
    # f32 at any size (a larger model on one thread per core); bf16 from the row kernel's size on: the row kernel
    assert choice(largest=bf16_rows.MIN_ELEMENTS) is DecodeMatmul.FUSED_STEP
    assert step.for_generation("bf16", 1, True, lambda: True, None, bf16_rows.MIN_ELEMENTS, refuse,
                               None).decode_matmul is DecodeMatmul.BF16_ROWS
    assert choice(ready=lambda: False) is DecodeMatmul.XLA  # no compiler
    assert choice(prefer="xla", ready=refuse) is DecodeMatmul.XLA
    for kw in [dict(weights="int8"), dict(devices=8), dict(layered=False), dict(model="a mixture-of-experts MLP")]:
        assert choice(ready=refuse, **kw) is DecodeMatmul.XLA, kw
    assert step.for_generation().decode_matmul is DecodeMatmul.XLA  # no model given: XLA's step
    with pytest.raises(ConfigError, match="fused_step.*mixture-of-experts"):
        choice(prefer="fused_step", model="a mixture-of-experts MLP")
    # what the kernel does not run
    assert decode_step.unsupported(get_config("tiny")) is None
    assert "mixture" in decode_step.unsupported(get_config("tiny-moe"))
    assert "biases" in decode_step.unsupported(dataclasses.replace(get_config("tiny"), qkv_bias=True))
    assert "odd" in decode_step.unsupported(dataclasses.replace(get_config("tiny"), head_dim=7))


def test_the_fused_step_generates_what_the_xla_step_does_greedy_sampled_and_stopped(step_kernel):
    fused, xla = fused_and_xla(decoder())
    greedy = assert_same(fused, xla)
    assert_same(fused, xla, Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=3))
    stop = greedy.generations[0].new_ids[3]  # the first row stops at its 4th token, the others run on
    stopped = assert_same(fused, xla, stop_ids=(stop,)).generations[0]
    assert stopped.stopped and len(stopped.new_ids) <= 4


def test_the_fused_step_runs_tied_heads_gemma_norms_and_gelu_and_bf16_as_xla_does(step_kernel):
    # a tied head (the embedding, scaled), Gemma's norm offset and embedding scale, a tanh-GELU gate, grouped heads
    gemma = decoder(tie_embeddings=True, norm_offset=1.0, embed_scale=8.0, mlp_activation="gelu_tanh", n_heads=8,
                    n_kv_heads=2, head_dim=16, rope_theta=500.0)
    assert_same(*fused_and_xla(gemma))
    # bf16: weights read as stored, the activations rounded where XLA's bf16 step rounds them (an odd head_dim
    # takes the kernel's generic attention)
    llama = decoder(n_heads=8, n_kv_heads=4, head_dim=6)
    assert_same(*fused_and_xla(llama, "bf16"), tolerance=5e-3)


def test_a_larger_model_runs_the_fused_step_on_a_team_of_threads_over_weights_stored_out_in(step_kernel, monkeypatch):
    """From a projection of MIN_ELEMENTS weights on (here d_model 256 × d_ff 512), the engine stores the layers'
    matmul weights and the head ``(out, in)`` and the kernel runs each step on one thread per core: each thread
    takes a share of every projection's outputs and of the KV heads. It generates what XLA's step does (f32,
    within 1e-5), and a team of 2 exactly what one thread does (every output's sum in the same order)."""
    model = decoder(d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, head_dim=64)
    assert decode_step.rows_layout(decode_step.largest_projection(model.cfg))
    monkeypatch.setattr(decode_step, "team_size", lambda largest: 2)
    fused, xla = fused_and_xla(model)
    assert isinstance(fused.params["blocks"][0]["mlp"]["gate_df"], bf16_rows.RowsWeight)
    assert fused.params["blocks"][0]["mlp"]["gate_df"].wt.shape == (512, 256)  # (out, in), f32
    assert_same(fused, xla)
    assert_same(fused, xla, Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=3))
    monkeypatch.setattr(decode_step, "team_size", lambda largest: 1)
    alone = load(model, recipe="dp", devices=1).engine
    one = alone.run([[5, 6, 7, 8]], NEW)
    two = fused.run([[5, 6, 7, 8]], NEW)
    assert one.generations[0].new_ids == two.generations[0].new_ids
    assert list(one.generations[0].new_logprobs) == list(two.generations[0].new_logprobs)
    assert decode_step.team_size(bf16_rows.MIN_ELEMENTS - 1) == 1  # a small model: one thread
