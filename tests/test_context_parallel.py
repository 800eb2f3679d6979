"""Long-sequence attention kinds: flash (blockwise, custom VJP), all_gather, ring (zig-zag load
balance, ringing backward), ulysses (all-to-all, GQA by repeating K/V heads) and usp (ulysses ×
ring); their HLO facts, load balance from the ring schedule, bad input, and training parity of the
CP recipes against one device."""

from __future__ import annotations

import json
import os
import re
import processes
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY_TRAINER_RUN

import meshtrain as mt
from meshtrain.annotate import StepContext, step_context
from meshtrain.errors import ConfigError
from meshtrain.parallel.attention import AttentionKind, attention, reference_attention
from meshtrain.parallel.context import context_layout, ring_work
from meshtrain.parallel.flash import flash_backend
from meshtrain.rules import AxisRules
from meshtrain.train import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(__file__))

B, T, N, KV, H = 2, 64, 16, 4, 8


def _inputs(t=T, n=N, kv=KV, h=H, b=B):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    seg = np.zeros((b, t), np.int32)  # 3 and 2 packed documents; their edges cross shard boundaries
    seg[0, int(t * 0.31):] = 1
    seg[0, int(t * 0.7):] = 2
    seg[-1, int(t * 0.52):] = 1
    return q, k, v, w, jnp.asarray(seg)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _ctx(kind, sizes, seq_axes, **options):
    n = int(np.prod(list(sizes.values())))
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(jax.sharding.AxisType.Auto,) * len(sizes),
                         devices=jax.devices()[:n])
    rules = AxisRules.defaults().merged(AxisRules.of(activations={"seq": seq_axes}, source="test"))
    # the options are the cp dimension's (load_balance, flash_backend), as a recipe's step context carries them
    return StepContext(mesh, rules, attention=AttentionKind(kind), strategies=(mt.Context(**options),))


def _run(ctx, q, k, v, seg, w, causal=True):
    """Output and (dq, dk, dv) of ``sum(attention * w)`` in natural order, one compile."""
    layout = context_layout(ctx.attention, ctx.rules, dict(ctx.mesh.shape)) if ctx else None
    perm = layout.permutation(q.shape[1]) if layout and layout.sharded else np.arange(q.shape[1])
    inv = np.argsort(perm)

    def fwd(q, k, v):
        if ctx is None:
            return attention(q, k, v, segment_ids_bt=seg, causal=causal, kind="flash")
        with step_context(ctx):  # the data arrive in the layout's order; undo it to compare
            o = attention(q[:, perm], k[:, perm], v[:, perm], segment_ids_bt=seg[:, perm], causal=causal)
        return o[:, inv]

    def both(q, k, v):
        o, vjp = jax.vjp(fwd, q, k, v)
        return o, vjp(w)

    if ctx is None:
        compiled = jax.jit(both).lower(q, k, v).compile()
        return compiled(q, k, v), compiled.as_text()
    with jax.set_mesh(ctx.mesh):
        compiled = jax.jit(both).lower(q, k, v).compile()
        return compiled(q, k, v), compiled.as_text()


@pytest.fixture(scope="module")
def reference():
    q, k, v, w, seg = _inputs()
    ref = lambda q, k, v: reference_attention(q, k, v, seg, True)  # noqa: E731
    o, vjp = jax.vjp(ref, q, k, v)
    return (q, k, v, w, seg), o, vjp(w)


KINDS = {
    "flash": None,
    "all_gather": ({"context": 8}, "context"),
    "ring": ({"context": 4}, "context"),
    "ulysses": ({"context": 8}, "context"),  # 4 kv heads < 8 devices: K/V heads repeated (GQA strategy)
    "usp": ({"context": 2, "ulysses": 2}, ("context", "ulysses")),
}
COLLECTIVE = {"all_gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all", "usp": "all-to-all"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_kind_matches_reference_forward_and_gradients(kind, reference):
    (q, k, v, w, seg), o_ref, g_ref = reference
    ctx = _ctx(kind, *KINDS[kind]) if KINDS[kind] else None
    (o, grads), hlo = _run(ctx, q, k, v, seg, w)
    errors = [_rel(o, o_ref)] + [_rel(a, b) for a, b in zip(grads, g_ref)]
    print(kind, "max rel error (o, dq, dk, dv):", ["%.2e" % e for e in errors])
    assert max(errors) <= 1e-5, errors
    if kind in COLLECTIVE:
        assert COLLECTIVE[kind] in hlo, f"{kind}: no {COLLECTIVE[kind]} in the compiled HLO"
    if kind == "usp":
        assert "collective-permute" in hlo


def _square_buffers(hlo: str, t: int):
    """HLO buffers with at least ``t × t`` elements (a scores buffer, whole or as stacked blocks)."""
    return [dims for dims in re.findall(r"\w+\[([\d,]+)\]", hlo)
            if np.prod([int(d) for d in dims.split(",") if d]) >= t * t]


def _layers_grad_hlo(ctx, q, seg, kind=None):
    """Compiled HLO of the gradient of two scanned "layers" of attention (like the decoder's stack:
    a differentiated scan is where saved residuals would pile up)."""
    def loss(x):
        def layer(x, _):
            return x + attention(x, x[:, :, :1], x[:, :, 1:2], segment_ids_bt=seg, kind=kind), None
        return jax.lax.scan(layer, x, None, length=2)[0].sum()

    if ctx is None:
        return jax.jit(jax.grad(loss)).lower(q).compile().as_text()
    with jax.set_mesh(ctx.mesh), step_context(ctx):
        return jax.jit(jax.grad(loss)).lower(q).compile().as_text()


@pytest.mark.slow
def test_no_t_by_t_buffer_in_flash_and_ring():
    t = 2048
    q, _, _, _, seg = _inputs(t=t, n=2, kv=1, h=8, b=1)
    assert _square_buffers(_layers_grad_hlo(None, q, seg, "dense"), t), "the detector must see dense's T×T scores"
    for kind, ctx in (("flash", None), ("ring", _ctx("ring", {"context": 4}, "context"))):
        found = _square_buffers(_layers_grad_hlo(ctx, q, seg, kind), t)
        assert not found, (kind, found[:3])


def test_zigzag_balances_causal_work_counted_from_the_schedule():
    zig, plain = ring_work(4096, 8, True), ring_work(4096, 8, False)
    print("ring work per device, zig-zag:", zig.tolist(), "contiguous:", plain.tolist())
    assert zig.max() / zig.min() <= 1.1
    assert 1.7 <= plain.max() / plain.mean() <= 2.1 and plain.max() / plain.min() >= 7
    assert zig.sum() < plain.sum() * 1.01  # the same total causal work, only spread evenly


def test_bad_input_errors_name_the_fix():
    q, k, v, w, seg = _inputs(t=36)
    ctx = _ctx("ring", {"context": 4}, "context")
    with pytest.raises(ConfigError, match=r"2 × context ways = 8.*--seq-len a multiple of 8"):
        with jax.set_mesh(ctx.mesh), step_context(ctx):
            jax.eval_shape(lambda q, k, v: attention(q, k, v, segment_ids_bt=seg), q, k, v)
    q, k, v, w, seg = _inputs(t=32, n=6, kv=2)
    ctx = _ctx("ulysses", {"context": 4}, "context")
    with pytest.raises(ConfigError, match=r"6 query heads per device are not divisible by the ulysses axis size 4"):
        with jax.set_mesh(ctx.mesh), step_context(ctx):
            jax.eval_shape(lambda q, k, v: attention(q, k, v, segment_ids_bt=seg), q, k, v)
    with pytest.raises(ConfigError, match=r"'cudnn' needs an NVIDIA GPU.*use flash_backend 'auto' or 'xla'"):
        flash_backend("cudnn", platform="cpu")
    with pytest.raises(ConfigError, match=r"'splash'.*needs a TPU"):
        flash_backend("splash", platform="cpu")
    ctx = _ctx("flash", {"context": 1}, "context", flash_backend="cudnn")
    with pytest.raises(ConfigError, match="needs an NVIDIA GPU"):
        with step_context(ctx):
            attention(q, k, v, segment_ids_bt=seg)
    # usp with one of its two axes of size 1 is the other kind alone (the planner searches such meshes)
    assert context_layout("usp", _ctx("usp", {"context": 4}, "context").rules, {"context": 4}).kind.value == "ring"
    assert flash_backend("auto", platform="cpu")[0].value == "xla"
    assert flash_backend("auto", platform="gpu", dtype=jnp.bfloat16)[0].value == "cudnn"
    assert flash_backend("auto", platform="tpu")[0].value == "splash"


# -- training parity through the Trainer and the CLI --------------------------------------------

def _losses(run_dir):
    by_step = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        rec = json.loads(line)
        if "loss" in rec:
            by_step[rec["step"]] = rec["loss"]
    return np.array([by_step[s] for s in sorted(by_step)])


def _config(tmp, name, **kw):
    return TrainConfig(**{**TINY_TRAINER_RUN, "out": str(tmp / name), **kw})   # conftest's reference run


@pytest.fixture(scope="module")
def one_device_losses(tiny_one_device_losses):
    return tiny_one_device_losses   # _config's run on one device, once per session (shared with test_trainer.py)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fsdp_cp", "fsdp_cp_usp"])  # ring; ulysses × ring (fsdp_tp_cp: the CLI test)
def test_cp_recipes_train_like_one_device(recipe, one_device_losses, tmp_path):
    run = Trainer(_config(tmp_path, recipe, recipe=recipe)).run()
    got = _losses(run.run_dir)
    diff = float(np.max(np.abs(got - one_device_losses) / one_device_losses))
    print(recipe, "max rel loss diff over 10 steps:", f"{diff:.2e}")
    assert len(got) == 10 and diff <= 1e-4, (got, one_device_losses)


@pytest.mark.slow
def test_cli_cp_recipe_with_attention_flag_trains_like_one_device(one_device_losses, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    # TP × CP with the attention kind swapped on the command line (the recipe's own is all_gather)
    out = processes.run([sys.executable, "-m", "meshtrain", "train", "--model", "tiny", "--recipe", "fsdp_tp_cp",
                          "--attention", "ulysses", "--steps", "10", "--batch-size", "16", "--seq-len", "64",
                          "--eval-every", "0", "--progress", "none", "--out", str(tmp_path / "cli")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "context=2 × tensor=2" in out.stdout and "recipe fsdp_tp_cp (cp.kind ulysses)" in out.stdout
    got = _losses(tmp_path / "cli")
    diff = float(np.max(np.abs(got - one_device_losses) / one_device_losses))
    print("fsdp_tp_cp --attention ulysses (CLI) max rel loss diff:", f"{diff:.2e}")
    assert diff <= 1e-4, (got, one_device_losses)


def test_token_data_arrive_in_zigzag_order_with_positions_and_segments():
    from meshtrain.data import load_source
    from meshtrain.train.tasks import _OrderedBatches

    source = load_source(None)
    perm = context_layout("ring", mt.get_recipe("cp").axis_rules(), {"context": 4}).permutation(64)
    plain = _OrderedBatches(source, 4, 64, 0, prefetch=0).local_batch(0)
    zig = _OrderedBatches(source, 4, 64, 0, prefetch=0, seq_order=perm).local_batch(0)
    assert perm[:8].tolist() == list(range(8)) and perm[8:16].tolist() == list(range(56, 64))
    for key in ("inputs", "targets", "positions", "segment_ids"):
        np.testing.assert_array_equal(zig[key], plain[key][:, perm])


# -- planner ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_planner_memory_and_ring_bytes_match_the_compiled_step():
    from meshtrain.analysis.collectives import hlo_collectives
    from meshtrain.analysis.compiled import MeasuredMemory, step_inputs
    from meshtrain.analysis.context_comms import context_collectives
    from meshtrain.analysis.memory import Component, estimate_memory

    cfg = mt.models.get_config("tiny")
    abstract = mt.abstract_state(mt.models.model_factory(cfg), __import__("optax").adamw(1e-3))
    recipe = mt.get_recipe("cp")
    plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()), batch=mt.BatchSpec(2, 256))
    one = recipe.with_mesh(context=1)  # ring attention on one device (the kind is the cp dimension's)
    plan1 = mt.make_plan(abstract, one, one.mesh.build(jax.devices()[:1]), batch=mt.BatchSpec(2, 256))
    acts, acts1 = (estimate_memory(p, cfg)[Component.ACTIVATIONS] for p in (plan, plan1))
    assert acts * 8 == pytest.approx(acts1, rel=0.02)  # saved activations ~ 1/cp
    state, batch = step_inputs(plan)
    compiled = mt.make_train_step(plan).lower(state, batch).compile()
    measured, est = MeasuredMemory.of(compiled), estimate_memory(plan, cfg)
    print("cp ring T=256: estimate", est.total, "compiled peak", measured.peak)
    assert 0.7 <= est.total / measured.peak <= 1.4
    hlo = sum(c.bytes_per_step for c in hlo_collectives(compiled.as_text(), plan.mesh)
              if c.kind == "collective-permute" and set(c.axes) <= {"context"})
    planned = sum(r["bytes_per_step"] for r in context_collectives(plan, cfg) if r["kind"] == "collective-permute")
    print("ring collective-permute bytes per step: HLO", hlo, "planned", planned)
    assert planned == pytest.approx(hlo, rel=0.05)
