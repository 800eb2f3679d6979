"""Per-op cost of a compiled program (meshtrain/analysis/hlo_cost.py) and the forecast it feeds:
dot FLOPs exact on hand-made programs, while bodies × their trip count, a small model within a stated
bound of XLA's cost analysis, GPU/TPU custom calls on HLO text snippets, and the forecast's ``source``."""

import jax
import jax.numpy as jnp
import optax
import pytest

import meshtrain as mt
from meshtrain.analysis.forecast import forecast_step, with_forecast
from meshtrain.analysis.hlo_cost import HloCost, hlo_cost
from meshtrain.analysis.lowering import compile_local
from meshtrain.models import get_config, model_factory


def _text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_matmul_counts_exactly_2mnk_and_a_batched_one_its_batch():
    M, K, N, B = 8, 16, 32, 3
    a, b = jnp.ones((M, K)), jnp.ones((K, N))
    cost = hlo_cost(_text(lambda x, y: x @ y, a, b))
    assert cost.matmul_flops == 2 * M * N * K and cost.attention_flops == 0
    x, y = jnp.ones((B, M, K)), jnp.ones((B, K, N))
    assert hlo_cost(_text(lambda p, q: jnp.einsum("bmk,bkn->bmn", p, q), x, y)).matmul_flops == 2 * B * M * N * K


def test_a_scanned_stack_counts_its_body_times_the_trip_count():
    L, M = 5, 16
    w = jnp.ones((L, M, M))

    def stack(w_lmm, x_mm):
        return jax.lax.scan(lambda h, w_mm: (jnp.tanh(h @ w_mm), None), x_mm, w_lmm)[0]

    text = _text(stack, w, jnp.ones((M, M)))
    cost = hlo_cost(text)
    assert cost.matmul_flops == L * 2 * M ** 3
    assert [(lp.trips, lp.how) for lp in cost.loops] == [(L, "xla")]
    # without XLA's stated count the condition's bound is read; with neither the body counts once, said so
    bare = text.replace('"known_trip_count":{"n":"5"}', '"x":{}')
    assert hlo_cost(bare).matmul_flops == L * 2 * M ** 3 and hlo_cost(bare).loops[0].how == "condition"


WHILE_UNKNOWN = """HloModule m
%body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %p = (s32[], f32[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %d = f32[4,4]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,4]{1,0}) tuple(%i, %d)
}
%cond (q: (s32[], f32[4,4])) -> pred[] {
  %q = (s32[], f32[4,4]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %k = s32[] get-tuple-element(%q), index=0
  ROOT %c = pred[] compare(%j, %k), direction=LT
}
ENTRY %main (a: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %a = (s32[], f32[4,4]{1,0}) parameter(0)
  ROOT %w = (s32[], f32[4,4]{1,0}) while(%a), condition=%cond, body=%body
}
"""


def test_a_loop_without_a_known_count_counts_once_and_says_so():
    cost = hlo_cost(WHILE_UNKNOWN)
    assert cost.matmul_flops == 2 * 4 ** 3 and [(lp.trips, lp.how) for lp in cost.loops] == [(1, "unknown")]


GPU_SNIPPET = """HloModule gpu
ENTRY %main (q: bf16[2,128,4,64], k: bf16[2,128,4,64], v: bf16[2,128,4,64], a: bf16[256,512], b: bf16[512,1024]) -> f32[] {
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(0)
  %k = bf16[2,128,4,64]{3,2,1,0} parameter(1)
  %v = bf16[2,128,4,64]{3,2,1,0} parameter(2)
  %a = bf16[256,512]{1,0} parameter(3)
  %b = bf16[512,1024]{1,0} parameter(4)
  %g = (bf16[256,1024]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %f = (bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}
  %bw = (bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}, bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}
  %ags = (bf16[256,512]{1,0}, bf16[2048,512]{1,0}) all-gather-start(%a), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = bf16[2048,512]{1,0} all-gather-done(%ags)
  %s = bf16[256,512]{1,0} add(%a, %a)
  ROOT %r = f32[] constant(0)
}
"""


def test_gpu_custom_calls_and_async_collectives_are_classified():
    cost = hlo_cost(GPU_SNIPPET)
    assert cost.matmul_flops == 2 * 256 * 1024 * 512  # cuBLASLt: 2·M·N·K
    fwd = 4 * (2 * 128 * 4 * 64) * 128 / 2  # 4·B·N·T·S·H, causal
    assert cost.attention_flops == fwd * 3 and cost.attention_calls == 2  # backward: 2× forward
    assert cost.collective_ops == 1 and cost.collective_bytes == 2048 * 512 * 2  # the gathered result
    assert cost.memory_bytes == 3 * 256 * 512 * 2  # the add: two operands + its result


def test_a_splash_call_is_attention_with_unknown_flops():
    text = GPU_SNIPPET.replace('custom_call_target="__cudnn$fmhaSoftmax"',
                               'custom_call_target="tpu_custom_call", backend_config="splash_mha_fwd"', 1)
    cost = hlo_cost(text)
    assert cost.attention_calls == 2 and not cost.attention_flops_known


def _tiny_plan(recipe="dp", devices=2, **opts):
    cfg = get_config("tiny")
    r = mt.get_recipe(recipe).with_options(**opts)
    abstract = mt.abstract_state(model_factory(cfg), optax.adamw(1e-4))
    return cfg, mt.make_plan(abstract, r, r.mesh.build(jax.devices()[:devices]), batch=mt.BatchSpec(8, 32))


def test_a_small_models_dot_flops_are_within_10_percent_below_cost_analysis_and_feed_the_forecast():
    cfg, plan = _tiny_plan()
    compiled = compile_local(plan)
    xla = compiled.cost_analysis()
    xla = (xla[0] if isinstance(xla, (list, tuple)) else xla)["flops"]
    cost = hlo_cost(compiled.as_text())
    # unrolled (no loop): XLA counts the same dots plus element-wise FLOPs (measured 0.909 for tiny, dp)
    assert 0.85 <= cost.dot_flops / xla <= 1.0, (cost.dot_flops, xla)
    assert 0.05 < cost.attention_flops / cost.dot_flops < 0.25  # dense attention's score dots, tagged
    analytic, compiled_fc = forecast_step(plan, cfg, "h100"), forecast_step(plan, cfg, "h100", hlo=cost)
    assert (analytic.source, compiled_fc.source) == ("analytic", "compiled")
    terms = {t.name: t for t in compiled_fc.terms}
    assert f"{cost.matmul_flops * plan.num_devices:.3g} FLOPs" in terms["matmul"].detail
    assert compiled_fc.to_dict()["source"] == "compiled"
    out = with_forecast({}, plan, cfg, type("A", (), {"hardware": "h100"})(), hlo=HloCost.from_dict(cost.to_dict()))
    assert out["forecast"]["source"] == "compiled" and out["forecast"]["step_s"] == pytest.approx(compiled_fc.step_s)


@pytest.mark.slow
def test_plan_json_check_compile_forecast_says_compiled(capsys):
    import json
    import os
    import sys

    import processes

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "meshtrain", "plan", "--model", "tiny", "--recipe", "fsdp", "--devices", "2",
            "--batch-size", "8", "--seq-len", "32", "--json"]
    out = processes.run(argv + ["--check", "compile"], text=True, env=env, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["forecast"]["source"] == "compiled" and got["hlo_cost"]["matmul_flops"] > 0
    # without --check: the analytic forecast, through the CLI's entry point in this process (the run above is
    # the real process; a second interpreter and JAX start would only repeat it)
    from meshtrain.cli import main

    capsys.readouterr()
    assert main(argv[3:]) == 0
    assert json.loads(capsys.readouterr().out)["forecast"]["source"] == "analytic"
