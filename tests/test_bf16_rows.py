"""bf16 weights multiplied as stored on CPU (:mod:`meshtrain.kernels.bf16_rows`, ``DecodeMatmul.BF16_ROWS``): the
kernel equals XLA's f32 dot of the same bf16 weights up to summation order; the resolved step chooses it only for
bf16 weights on 1 CPU device with the compiled loop and projections large enough; an engine with it scores and
decodes like the engine on XLA's dot (bf16 both), and training never sees it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import GENERATION_PROMPTS, make_decoder

from meshtrain.errors import ConfigError
from meshtrain.generation import Engine, load
from meshtrain.generation.engine import HEAD
from meshtrain.generation.weights import LAYERS
from meshtrain.kernels import bf16_rows
from meshtrain.parallel.resolved import DecodeMatmul, resolve_step

@pytest.fixture
def row_kernel():
    """Skips a test where the kernel cannot be built (no C++ compiler); built at the first test, not at collection
    (every xdist worker collects every file)."""
    if not bf16_rows.kernel_ready():
        pytest.skip(f"no bf16 row kernel on this host: {bf16_rows.why_not_ready()}")


@pytest.mark.parametrize("x_shape, w_shape, n_in", [
    ((1, 1, 640), (640, 1728), 1),      # a decode step's MLP projection
    ((2, 3, 37), (37, 5, 7), 1),        # odd sizes: K not a multiple of the vector width, a 2-D output
    ((1, 1, 4, 16), (4, 16, 96), 2),    # the attention output (n, h, d): two contracted dims
    ((4, 2, 64), (64, 200), 1),         # 8 rows: MAX_ROWS, still the kernel
    ((3, 40, 64), (64, 200), 1),        # 120 rows > MAX_ROWS: XLA's dot on the stored (out, in) weight
])
def test_the_kernel_equals_xla_f32_dot_of_the_same_bf16_weights(row_kernel, x_shape, w_shape, n_in):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, x_shape, jnp.float32)
    w = (jax.random.normal(kw, w_shape, jnp.float32) * 0.05).astype(jnp.bfloat16)
    stored = bf16_rows.pack(w, n_in, "float32")
    assert stored.wt.dtype == jnp.bfloat16 and stored.wt.shape == (int(np.prod(w_shape[n_in:])),
                                                                   int(np.prod(w_shape[:n_in])))
    got = jax.jit(bf16_rows.project)(x, stored)
    want = jnp.tensordot(x, w.astype(jnp.float32), axes=n_in)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # bf16 activations (a bf16 model's; AVX512-BF16 dot products where the CPU has them): the same products
    x16 = x.astype(jnp.bfloat16)
    got16 = jax.jit(bf16_rows.project)(x16, stored)
    want16 = jnp.tensordot(x16.astype(jnp.float32), w.astype(jnp.float32), axes=n_in)
    np.testing.assert_allclose(np.asarray(got16), np.asarray(want16), rtol=1e-5, atol=1e-5)
    # with a bf16 weight the result is bf16, as x @ w would be
    assert bf16_rows.project(x16, bf16_rows.pack(w, n_in)).dtype == jnp.bfloat16


def test_the_resolved_step_chooses_the_kernel_only_where_it_pays():
    plan = load(make_decoder("tiny"), recipe="dp", devices=1).engine.plan
    step = resolve_step(plan)
    big = 2 * bf16_rows.MIN_ELEMENTS

    def refuse():
        raise AssertionError("the kernel is built only for an eligible step")

    def choice(*args, **kw):
        return step.for_generation(*args, **kw).decode_matmul

    assert choice("bf16", 1, True, lambda: True, largest_matmul=big) is DecodeMatmul.BF16_ROWS
    assert choice("bf16", 1, True, lambda: False, largest_matmul=big) is DecodeMatmul.XLA  # no compiler
    assert choice("bf16", 1, True, lambda: True, "xla", big) is DecodeMatmul.XLA
    for args in [("none", 1, True), ("int8", 1, True), ("bf16", 8, True), ("bf16", 1, False)]:
        assert choice(*args, refuse, largest_matmul=big) is DecodeMatmul.XLA, args
    assert choice("bf16", 1, True, refuse, largest_matmul=bf16_rows.MIN_ELEMENTS - 1) is DecodeMatmul.XLA
    assert step.for_generation().decode_matmul is DecodeMatmul.XLA  # the default: XLA's dot
    with pytest.raises(ConfigError, match="bf16 weights on 1 CPU device"):
        step.for_generation("none", 1, True, lambda: True, "bf16_rows", big)
    with pytest.raises(ConfigError, match="use one of"):
        step.for_generation("bf16", 1, True, lambda: True, "fast", big)


@pytest.mark.slow
def test_an_engine_with_the_kernel_scores_and_decodes_like_xla_dot_in_bf16(row_kernel):
    """``small`` (256 x 768 projections: the kernel's size) in bf16 on 1 device: the kernel's engine stores the
    layers' projections and the head (out, in) in bf16 and gives the same greedy tokens as the engine on XLA's
    dot; its log-probabilities are as close to f32's as XLA's bf16 are (the two differ only in bf16 roundings of
    differently ordered f32 sums)."""
    model = make_decoder("small")
    kernel = load(model, recipe="dp", devices=1, quantize="bf16").engine
    assert kernel.rows_kernel and not kernel.hoist_bf16
    layer = kernel.params[LAYERS][0]
    assert isinstance(layer["mlp"]["gate_df"], bf16_rows.RowsWeight)
    assert layer["mlp"]["gate_df"].wt.shape == (768, 256) and layer["mlp"]["gate_df"].wt.dtype == jnp.bfloat16
    assert isinstance(kernel.params[HEAD], bf16_rows.RowsWeight) and kernel.params[HEAD].dtype == "float32"
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    xla = Engine(model.cfg, params, kernel.plan, weights="bf16", decode_matmul="xla")
    f32 = Engine(model.cfg, params, kernel.plan)
    assert not xla.rows_kernel and not f32.rows_kernel
    # the same bytes: bf16 either way
    assert kernel.weight_bytes_per_device() == xla.weight_bytes_per_device()
    runs = {name: e.run(GENERATION_PROMPTS, 12, prompt_logprobs=True) for name, e in
            (("kernel", kernel), ("xla", xla), ("f32", f32))}

    def gap(a, b, field):
        return max(float(np.max(np.abs(np.array(getattr(x, field)) - np.array(getattr(y, field)))))
                   for x, y in zip(runs[a].generations, runs[b].generations))

    assert [g.new_ids for g in runs["kernel"].generations] == [g.new_ids for g in runs["xla"].generations]
    to_xla, kernel_err, xla_err = (gap("kernel", "xla", "prompt_logprobs"), gap("kernel", "f32", "prompt_logprobs"),
                                   gap("xla", "f32", "prompt_logprobs"))
    print(f"max |prompt logprob| kernel-xla {to_xla:.2e}, kernel-f32 {kernel_err:.2e}, xla-f32 {xla_err:.2e}; "
          f"new: kernel-xla {gap('kernel', 'xla', 'new_logprobs'):.2e}")
    assert kernel_err <= 1.5 * xla_err + 1e-3
    assert to_xla <= 2e-2
