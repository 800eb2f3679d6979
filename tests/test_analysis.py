"""Analysis units: ZeRO accounting, FLOPs, activation formulas, HLO parsing, hardware profiles,
warnings, and the auto planner at pod scale (analytic, no compilation)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import meshtrain as mt
from meshtrain.analysis import (PROFILES, ActivationSplit, Component, Fit, ZeroPartitioning, estimate_memory, get_hardware,
                                hlo_collectives, model_flops_per_token, per_axis, saved_activations, step_flops,
                                zero_model_state)
from meshtrain.analysis.planner import PlanRequest, evaluate, rule_warnings
from meshtrain.recipes import Remat

GB = 1e9


# ---- ZeRO -----------------------------------------------------------------------------------

def test_zero_formulas_reproduce_the_paper_figures():
    # ZeRO (Rajbhandari et al. 2020), Figure 1: Ψ = 7.5B, N_d = 64, K = 12.
    paper = {ZeroPartitioning.DP: 120, ZeroPartitioning.OS: 31.4, ZeroPartitioning.OS_G: 16.6, ZeroPartitioning.OS_G_P: 1.9}
    psi, nd, k = 7.5e9, 64, 12
    by_hand = {ZeroPartitioning.DP: (2 + 2 + k) * psi, ZeroPartitioning.OS: 2 * psi + 2 * psi + k * psi / nd,
               ZeroPartitioning.OS_G: 2 * psi + (2 + k) * psi / nd, ZeroPartitioning.OS_G_P: (2 + 2 + k) * psi / nd}
    for stage, figure in paper.items():
        got = zero_model_state(psi, stage, nd).total
        assert got == pytest.approx(by_hand[stage], rel=1e-12)
        assert round(got / GB, 1) == pytest.approx(figure, abs=0.05), stage


@pytest.fixture(scope="module")
def seven_b():
    """A 7.5B-parameter decoder (Llama-2-7B shape with 36 layers), abstract only."""
    cfg = mt.models.get_config("llama3-8b", vocab_size=32_000, n_layers=36, n_kv_heads=32, d_ff=11_008)
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adam(1e-3))
    return cfg, abstract


@pytest.mark.parametrize("recipe, stage", [("dp", ZeroPartitioning.DP), ("zero1", ZeroPartitioning.OS), ("fsdp", ZeroPartitioning.OS_G_P)])
def test_model_state_per_device_matches_zero_accounting_at_64_devices(seven_b, recipe, stage):
    cfg, abstract = seven_b
    psi = abstract.num_params
    assert 7.4e9 < psi < 7.6e9
    r = mt.get_recipe(recipe)
    plan = mt.make_plan(abstract, r, r.mesh.abstract(64), batch=mt.BatchSpec(64, 512))
    est = estimate_memory(plan, cfg)
    state = est[Component.PARAMS] + est[Component.GRADIENTS] + est[Component.OPTIMIZER]
    # meshtrain keeps f32 parameters (they are the master copy) and f32 Adam moments: 4Ψ + 4Ψ + 8Ψ.
    expected = zero_model_state(psi, stage, 64, param_bytes=4, grad_bytes=4, optimizer_bytes=8).total
    scalars = 16  # Adam's step count (int32) is replicated, not in ZeRO's K
    assert 0 <= state - expected <= scalars, (recipe, state, expected)


# ---- FLOPs ------------------------------------------------------------------------------------

def test_model_flops_per_token_is_six_n_plus_causal_attention():
    cfg = mt.models.get_config("llama3-70b")
    abstract = mt.abstract_state(mt.models.model_factory(cfg))
    n_matmul = abstract.num_params - cfg.vocab_size * cfg.d_model  # the input embedding is a lookup
    T = 8192
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * T / 2  # causal: counted once
    assert model_flops_per_token(cfg, T) == pytest.approx(6 * n_matmul + attention, rel=1e-12)
    full = step_flops(cfg, 4, T, Remat.FULL)
    none = step_flops(cfg, 4, T, Remat.NONE)
    assert full.model == none.model == pytest.approx(model_flops_per_token(cfg, T) * 4 * T)
    assert full.executed == pytest.approx(none.executed * 4 / 3)  # full remat re-runs the forward


# ---- saved activations ----------------------------------------------------------------------

def _traced_residual_bytes(cfg, batch, seq, remat):
    """Bytes of what the real model's loss VJP saves (the reference the formulas must reproduce)."""
    from meshtrain.annotate import StepContext, step_context, unrolled_as_scan
    from meshtrain.rules import AxisRules
    from meshtrain.train.step import next_token_loss

    abstract = mt.abstract_state(mt.models.model_factory(cfg))
    mesh = mt.MeshSpec(ici={"data": 1}).abstract(1)
    ctx = StepContext(mesh, AxisRules.defaults(), frozenset(), Remat(remat))
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    data = {"inputs": ids, "targets": ids, "positions": ids, "segment_ids": ids}

    def residuals(params, data):
        def loss(p):
            with step_context(ctx):
                return next_token_loss(nnx.merge(abstract.graphdef, p, abstract.model_state), data)[0]
        return jax.tree.leaves(jax.vjp(loss, params)[1])

    # the layers as a scan (stacked residuals): unrolled, the per-layer weight slices would read as activations
    with jax.sharding.use_abstract_mesh(mesh), unrolled_as_scan():
        saved = jax.eval_shape(residuals, abstract.params, data)
    params = {(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(abstract.params)}
    return sum(x.size * x.dtype.itemsize for x in saved if (tuple(x.shape), str(x.dtype)) not in params)


@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_no_batch"])
def test_activation_formulas_reproduce_the_traced_residuals_of_another_model(remat):
    cfg = mt.models.get_config("small", n_layers=3, d_model=96, d_ff=320, n_heads=12, n_kv_heads=4, head_dim=8)
    model = saved_activations(remat, "float32")
    formula = model.bytes_per_device(cfg, 6, 40, ActivationSplit())
    assert formula == _traced_residual_bytes(cfg, 6, 40, remat)


def test_activation_split_divides_by_batch_tensor_and_sequence():
    cfg = mt.models.get_config("small")
    model = saved_activations("none", "float32")
    whole = model.bytes_per_device(cfg, 16, 128)
    # everything with a batch dimension splits; a few KiB of broadcast norm scales do not
    assert model.bytes_per_device(cfg, 16, 128, ActivationSplit(batch=8)) == pytest.approx(whole / 8, rel=1e-3)
    tp = model.bytes_per_device(cfg, 16, 128, ActivationSplit(tensor=4))
    sp = model.bytes_per_device(cfg, 16, 128, ActivationSplit(tensor=4, sequence=4))
    assert whole / 4 < sp < tp < whole  # residual-stream tensors are not split by TP alone


# ---- HLO parsing ----------------------------------------------------------------------------

HLO = """HloModule m

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %ar = (f32[3]{0}, f32[], /*index=2*/f32[5,2]{1,0}) all-reduce(%a, %b, %c), replica_groups=[4,2]<=[2,4]T(1,0)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %w = (s32[], f32[8,4]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %s = (f32[16]{0}, f32[64]{0}) all-gather-start(f32[16]{0} %y), replica_groups={{0,1,2,3,4,5,6,7}}
  %d = f32[64]{0} all-gather-done(%s)
}
"""


def test_hlo_parser_counts_loop_trip_counts_tuples_and_async_pairs():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "tensor"))
    ops = hlo_collectives(HLO, mesh)
    by_kind = {(c.kind, c.computation): c for c in ops}
    ag = by_kind[("all-gather", "body")]
    assert (ag.bytes, ag.executions, ag.axes, ag.group_size) == (128, 6, ("tensor",), 4)
    ar = by_kind[("all-reduce", "body")]
    assert (ar.bytes, ar.executions, ar.axes) == ((3 + 1 + 10) * 4, 6, ("data",))
    start = by_kind[("all-gather", "main")]
    assert (start.bytes, start.executions, start.axes) == (256, 1, ("data", "tensor"))
    assert len(ops) == 3  # the -done half is not counted again
    assert per_axis(ops)["tensor"]["all-gather"] == 128 * 6
    assert ag.wire_bytes == pytest.approx(128 * 3 / 4) and ar.wire_bytes == pytest.approx(2 * 56 / 2)


# XLA:TPU's shape (measured on llama3-8b, v5p:2x2x2): no known_trip_count; a layer loop counting
# 0..4 holds a windowed-einsum (collective matmul) loop that counts 0..4 in steps of 2 with two
# collective-permutes (both ring directions) per iteration.
TPU_LOOPS = """HloModule m

%win_cond (p: (bf16[512,64], u32[])) -> pred[] {
  %c4 = u32[]{:T(128)} constant(4), metadata={op_name="dot_general"}
  %p = (bf16[512,64], u32[]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=1
  ROOT %lt = pred[]{:T(512)} compare(%i, %c4), direction=LT
}

%win_body (p: (bf16[512,64], u32[])) -> (bf16[512,64], u32[]) {
  %p = (bf16[512,64], u32[]) parameter(0)
  %x = bf16[512,64]{1,0} get-tuple-element(%p), index=0
  %i = u32[]{:T(128)} get-tuple-element(%p), index=1
  %cp0 = bf16[512,64]{1,0} collective-permute(%x), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp1 = bf16[512,64]{1,0} collective-permute(%x), channel_id=4, source_target_pairs={{1,0},{2,1},{3,2},{0,3}}
  %two = u32[]{:T(128)} constant(2)
  %next = u32[]{:T(128)} add(%i, %two)
  ROOT %t = (bf16[512,64], u32[]) tuple(%cp0, %next)
}

%layer_cond (p: (s32[], bf16[512,64])) -> pred[] {
  %p = (s32[], bf16[512,64]) parameter(0)
  %n = s32[]{:T(128)} constant(4)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %gt = pred[]{:T(512)} compare(%n, %i), direction=GT
}

%layer_body (p: (s32[], bf16[512,64])) -> (s32[], bf16[512,64]) {
  %p = (s32[], bf16[512,64]) parameter(0)
  %x = bf16[512,64]{1,0} get-tuple-element(%p), index=1
  %zero = u32[]{:T(128)} constant(0)
  %wt = (bf16[512,64], u32[]) tuple(%x, %zero)
  %w = (bf16[512,64], u32[]) while(%wt), condition=%win_cond, body=%win_body
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %y = bf16[512,64]{1,0} get-tuple-element(%w), index=0
  ROOT %t = (s32[], bf16[512,64]) tuple(%next, %y)
}

ENTRY %main (a: bf16[512,64]) -> bf16[512,64] {
  %a = bf16[512,64]{1,0} parameter(0)
  %z = s32[]{:T(128)} constant(0)
  %t = (s32[], bf16[512,64]) tuple(%z, %a)
  %l = (s32[], bf16[512,64]) while(%t), condition=%layer_cond, body=%layer_body
}
"""


def test_hlo_parser_reads_trip_counts_from_unannotated_loops():
    ops = hlo_collectives(TPU_LOOPS, jax.sharding.AbstractMesh((4,), ("fsdp",)))
    assert [c.kind for c in ops] == ["collective-permute"] * 2
    # 4 layers x 2 windowed iterations: each permute runs 8 times per step
    assert all(c.executions == 8 and c.axes == ("fsdp",) for c in ops)
    assert per_axis(ops)["fsdp"]["collective-permute"] == 2 * 8 * 512 * 64 * 2


# ---- hardware -------------------------------------------------------------------------------

FIGURES = ("peak_flops", "hbm_bytes", "hbm_bytes_per_s", "fast_link_bytes_per_s", "slow_link_bytes_per_s",
           "fast_domain", "fast_latency_s", "slow_latency_s")


def test_every_hardware_figure_has_a_source():
    assert {"h100", "h200", "a100", "b200", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"} <= set(PROFILES)
    for hw in PROFILES.values():
        missing = [f for f in FIGURES if not hw.sources.get(f)]
        assert not missing, (hw.name, missing)
        assert all(getattr(hw, f) > 0 for f in FIGURES), hw.name


def test_cpu_profile_is_measured_not_invented():
    hw = get_hardware("cpu", num_devices=8)
    assert hw.peak_flops > 0 and hw.hbm_bytes_per_s > 0 and hw.fast_latency_s > 0
    assert "measured" in hw.sources["peak_flops"] and "timed" in hw.sources["peak_flops"]
    assert get_hardware("cpu", num_devices=4).peak_flops == pytest.approx(2 * hw.peak_flops)


def test_unknown_hardware_is_a_clear_error():
    with pytest.raises(mt.ConfigError, match="unknown hardware 'tpu-v9'.*h100"):
        get_hardware("tpu-v9")


# ---- warnings and the planner ---------------------------------------------------------------

def _plan(cfg, recipe, n, batch, seq, **mesh):
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    r = mt.get_recipe(recipe).with_mesh(**mesh) if mesh else mt.get_recipe(recipe)
    r = r.with_options(compute_dtype="bfloat16")
    return mt.make_plan(abstract, r, r.mesh.abstract(n), batch=mt.BatchSpec(batch, seq))


def test_warns_when_tensor_parallelism_leaves_the_nvlink_domain():
    cfg = mt.models.get_config("llama3-8b", n_kv_heads=16)
    plan = _plan(cfg, "fsdp_tp", 64, 64, 4096, fsdp=4, tensor=16)
    assert any("fast-link domain" in w for w in rule_warnings(cfg, plan, get_hardware("h100")))
    assert not any("fast-link domain" in w for w in rule_warnings(cfg, plan, get_hardware("tpu-v5p")))
    plan8 = _plan(cfg, "fsdp_tp", 64, 64, 4096, fsdp=8, tensor=8)
    assert not any("fast-link domain" in w for w in rule_warnings(cfg, plan8, get_hardware("h100")))


def test_warns_when_fsdp_has_too_few_tokens_per_device():
    cfg = mt.models.get_config("llama3-8b")
    short = _plan(cfg, "fsdp", 256, 256, 512)
    assert any("FSDP" in w and "tokens per device" in w for w in rule_warnings(cfg, short, get_hardware("h100")))
    long = _plan(cfg, "fsdp", 256, 256, 8192)
    assert not any("FSDP" in w for w in rule_warnings(cfg, long, get_hardware("tpu-v5p")))


def test_warns_when_heads_do_not_divide_tensor_times_context():
    cfg = mt.models.get_config("llama3-8b")  # 8 kv heads
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    r = mt.get_recipe("tp").with_mesh(tensor=16).with_options(replicate_indivisible=("kv_heads",),
                                                              max_replicated_fraction=0.05)
    plan = mt.make_plan(abstract, r, r.mesh.abstract(16), batch=mt.BatchSpec(16, 1024))
    warnings = rule_warnings(cfg, plan, get_hardware("tpu-v5p"))
    assert any("kv heads (8) not divisible by tensor × context = 16 × 1" in w for w in warnings)


# The 70B/256-chip searches (h100 and tpu-v5p) run once, in notebook 04 (tests/test_notebooks.py), which asserts
# what this file did for h100: each winner fits, no fitting layout is faster, rejections say why, `why` names it.
# The CLI's --recipe auto JSON is checked on 8B/32 chips in test_plan_cli.py.


def test_evaluate_rejects_a_layout_that_does_not_fit_and_names_the_largest_parts():
    cfg = mt.models.get_config("llama3-70b")
    req = PlanRequest(cfg, 8, "h100", batch_size=8, seq_len=2048)
    cand = evaluate(req, mt.get_recipe("dp"))
    assert cand.fit is Fit.DOES_NOT_FIT and "does not fit" in cand.rejected and "GiB" in cand.rejected


def test_more_devices_never_raise_the_fsdp_model_state():
    cfg = mt.models.get_config("llama3-8b")
    sizes = []
    for n in (16, 64, 256):
        est = estimate_memory(_plan(cfg, "fsdp", n, n, 1024), cfg)
        sizes.append(est[Component.PARAMS] + est[Component.OPTIMIZER])
    assert sizes[0] > sizes[1] > sizes[2]
    assert sizes[0] / sizes[2] == pytest.approx(16, rel=0.01)


def test_micro_batches_shrink_activations_but_add_an_accumulator():
    cfg = mt.models.get_config("llama3-8b")
    one = _plan(cfg, "fsdp", 64, 256, 2048)
    four = dataclasses.replace(one, recipe=one.recipe.with_options(grad_accum=4))
    a1, a4 = estimate_memory(one, cfg), estimate_memory(four, cfg)
    # per micro-batch activations are a quarter; the bf16 weight copies saved for the backward are not
    assert a4[Component.ACTIVATIONS] == pytest.approx(a1[Component.ACTIVATIONS] / 4, rel=0.01)
    elems = sum(math.prod(l.shape) for l in one.group("params")) / 64
    assert a4[Component.GRADIENTS] - a1[Component.GRADIENTS] == pytest.approx(4 * elems, rel=1e-3)


def test_memory_estimate_follows_the_layer_loop_the_step_runs():
    """``auto`` is resolved as the step resolves it (recipes.resolve_layer_loop): unrolled for a shallow
    stack without remat, scanned with remat or deep stacks. Unrolled, remat saves nothing and the weights
    as multiplied stay live; a partially unrolled scan holds k layers' working sets."""
    cfg = mt.models.get_config("small")

    def est(n_layers=4, **options):
        c = dataclasses.replace(cfg, n_layers=n_layers)
        plan = _plan(c, "fsdp", 8, 16, 128)
        return estimate_memory(dataclasses.replace(plan, recipe=plan.recipe.with_options(**options)), c)

    assert est().total == est(layer_loop="unrolled").total != est(layer_loop="scan").total
    assert est(remat="full").total == est(layer_loop="scan", remat="full").total
    assert est(layer_loop="unrolled", remat="full").total == est(layer_loop="unrolled").total
    deep = mt.recipes.AUTO_UNROLL_LAYERS + 1
    assert est(deep).total == est(deep, layer_loop="scan").total
    one, two = est(layer_loop="scan"), est(layer_loop="scan", scan_unroll=2)
    assert two[Component.TEMPORARIES] > one[Component.TEMPORARIES] and \
        two[Component.ACTIVATIONS] == one[Component.ACTIVATIONS]
    assert est(layer_loop="scan", scan_unroll=4).total == est(layer_loop="unrolled").total  # unroll ≥ L: unrolled
