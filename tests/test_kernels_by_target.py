"""Kernels by the target, not the host: the flash backend follows the platform the step is compiled
for (the mesh's devices), and kernels XLA cannot partition (Pallas splash, cuDNN) run per device
inside ``shard_map`` over the recipe's batch and head split. On CPU the splash kernel runs in the
Pallas interpreter; with libtpu installed the train step compiles for a fake TPU topology with
splash's custom calls in it."""

import contextlib
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshtrain as mt
from meshtrain.annotate import step_context, target_platform
from meshtrain.parallel.resolved import step_context_for
from meshtrain.models import get_config, model_factory
from meshtrain.parallel.attention import reference_attention
from meshtrain.parallel.flash import _splash, per_device
from meshtrain.train.config import TrainConfig, default_optimizer


def _plan(recipe, **options):
    abstract = mt.abstract_state(model_factory("tiny"), default_optimizer(TrainConfig(), {}))
    return mt.make_plan(abstract, mt.get_recipe(recipe).with_options(**options), batch=mt.BatchSpec(8, 256))


def test_target_platform_is_the_meshes():
    assert target_platform() == jax.default_backend()
    with step_context(step_context_for(_plan("fsdp"))):
        assert target_platform() == "cpu"


@pytest.mark.parametrize("recipe", ["dp", "fsdp_tp"])
def test_splash_runs_per_device_under_a_sharded_recipe(recipe):
    plan = _plan(recipe)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (8, 256, 4, 128))
    k, v = (jax.random.normal(kk, (8, 256, 2, 128)) for kk in keys[1:])
    seg = jnp.concatenate([jnp.zeros((8, 100), jnp.int32), jnp.ones((8, 156), jnp.int32)], axis=1)
    splash = lambda q_, k_, v_, s_: _splash(q_, k_, v_, s_, True, interpret=True)  # noqa: E731

    @jax.jit
    def run(q, k, v, seg):
        q = mt.constrain(q, ("batch", "seq", "heads", "head_dim"))
        return per_device(splash, q, k, v, seg)

    with jax.set_mesh(plan.mesh), step_context(step_context_for(plan)):
        out = run(q, k, v, seg)
        text = run.lower(q, k, v, seg).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text  # the kernel runs per device
    assert np.abs(np.asarray(out) - np.asarray(reference_attention(q, k, v, seg))).max() < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (pip install 'meshtrain[tpu]')")
@pytest.mark.parametrize("recipe, options", [("fsdp", {"local_attention": "flash"}),
                                             ("fsdp_tp", {"local_attention": "flash"}),
                                             ("fsdp_cp", {"flash_backend": "splash", "context_kind": "ulysses"})])
def test_flash_compiles_for_tpu_with_splash_inside_a_sharded_step(recipe, options):
    from meshtrain.analysis.lowering import compile_tpu_topology

    cfg = get_config("tiny", max_seq_len=1024, d_model=256, n_heads=4, n_kv_heads=2, head_dim=128, d_ff=512)
    abstract = mt.abstract_state(model_factory(cfg), default_optimizer(TrainConfig(), {}))
    recipe = mt.get_recipe(recipe).with_options(compute_dtype="bfloat16", **options)
    _, compiled = compile_tpu_topology(abstract, recipe, mt.BatchSpec(8, 1024), "v5p:2x2x2")
    assert len(re.findall(r'custom_call_target="tpu_custom_call"', compiled.as_text())) >= 2 * cfg.n_layers


@pytest.mark.parametrize("flags, line", [
    (["--recipe", "fsdp", "--local-attention", "flash", "--hardware", "tpu-v5p"],
     "attention kernel for tpu: splash: Pallas TPU splash-attention kernel; per device under shard_map"),
    (["--recipe", "fsdp_cp", "--context-kind", "ulysses", "--flash-backend", "splash", "--hardware", "tpu-v5p"],
     "attention kernel for tpu: splash (requested); inside the ulysses all-to-all's shard_map"),
    (["--recipe", "fsdp_cp", "--hardware", "h100"], "attention kernel for gpu: ring context attention under shard_map"),
    (["--recipe", "fsdp", "--local-attention", "flash", "--hardware", "cpu"], "attention kernel for cpu: xla: blockwise"),
])
def test_the_plan_names_the_kernel_of_the_target(capsys, flags, line):
    from meshtrain.cli import main

    assert main(["plan", "--model", "tiny", *flags]) == 0
    assert line in capsys.readouterr().out


# -- packed documents on cuDNN: the ragged description, the kernel choice, the fallback -----------

def _ragged_mask(lengths, offsets, t, causal=True):
    """The (b, t, t) mask cuDNN's ragged layout means: token i sees token j when both lie in one
    described segment ``[offset, offset + length)`` (and ``j <= i``, causal)."""
    pos = jnp.arange(t)
    inside = ((offsets[:, None, :-1] <= pos[None, :, None]) & (pos[None, :, None] < offsets[:, None, :-1]
              + lengths[:, None, :]) & (lengths[:, None, :] > 0))  # (b, t, slots)
    doc = jnp.where(inside.any(-1), jnp.argmax(inside, -1), -1)
    mask = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0)
    return mask & (pos[:, None] >= pos[None, :]) if causal else mask


def _rows(*docs, t=16):
    """Rows of segment ids from their documents' lengths (ids counting up from 0, as meshtrain's packer
    writes them); a negative length is that many tokens of id 0 (padding as other packers write it)."""
    out = []
    for lens in docs:
        ids = np.concatenate([np.full(abs(n), 0 if n < 0 else i + 1) for i, n in enumerate(lens)])
        assert ids.size == t
        out.append(ids)
    return jnp.asarray(np.stack(out), jnp.int32)


ROOM = 4
PACKED_ROWS = {  # segment ids -> whether cuDNN's ragged layout with room for 4 documents takes them
    "one document": (_rows([16]), True),
    "several, per row": (_rows([3, 5, 8], [10, 6]), True),
    "the most that fit": (_rows([4, 4, 4, 4], [1, 13, 1, 1]), True),
    "one-token documents at the ends": (_rows([1, 14, 1]), True),
    "padding id 0 at the end": (_rows([6, 6, -4]), True),
    "one document too many": (_rows([3, 5, 8], [4, 3, 3, 3, 3]), False),
    "an id that recurs": (_rows([6, 6, 4]).at[0, 12:].set(1), False),
}


@pytest.mark.parametrize("name", list(PACKED_ROWS))
def test_ragged_segments_describe_the_segment_mask_exactly(name):
    from meshtrain.parallel.flash import cudnn_segments

    seg, fits = PACKED_ROWS[name]
    lengths, offsets, ok = cudnn_segments(seg, ROOM)
    assert lengths.shape == (seg.shape[0], ROOM) and offsets.shape == (seg.shape[0], ROOM + 1)
    assert bool(ok) is fits
    if fits:
        same = seg[:, :, None] == seg[:, None, :]
        for causal in (True, False):
            want = same & jnp.tril(jnp.ones((16, 16), bool)) if causal else same
            assert (_ragged_mask(lengths, offsets, 16, causal) == want).all()
        runs = np.asarray((lengths >= 0).sum(1))  # unused slots are -1 in both arrays, the last offset always
        assert (np.asarray(offsets)[:, -1] == -1).all()
        assert all((np.asarray(offsets)[r, runs[r]:] == -1).all() for r in range(seg.shape[0]))
    if name == "several, per row":
        assert np.asarray(lengths).tolist() == [[3, 5, 8, -1], [10, 6, -1, -1]]
        assert np.asarray(offsets).tolist() == [[0, 3, 8, -1, -1], [0, 10, -1, -1, -1]]


@pytest.mark.parametrize("platform, dtype, segmented, capability, backend, reason", [
    ("gpu", jnp.bfloat16, False, None, "cudnn", "cudnn: cuDNN fused attention via jax.nn.dot_product_attention"),
    ("gpu", jnp.bfloat16, True, None, "cudnn", "cudnn: cuDNN fused attention, packed documents as ragged segments"),
    ("gpu", jnp.float16, True, (9, 0), "cudnn", "a step with a row of more than 32 documents"),
    ("gpu", jnp.bfloat16, True, (8, 0), "xla", "packed documents need cuDNN's ragged layout, Hopper (sm90) or newer; "
                                               "this GPU is sm80"),
    ("gpu", jnp.bfloat16, False, (8, 0), "cudnn", "via jax.nn.dot_product_attention"),
    ("gpu", jnp.float32, True, (9, 0), "xla", "(float32 on gpu)"),
    ("cpu", jnp.bfloat16, True, None, "xla", "(bfloat16 on cpu)"),
    ("tpu", jnp.bfloat16, True, None, "splash", "splash: Pallas TPU splash-attention kernel"),
])
def test_flash_backend_takes_packed_documents_to_cudnn_on_hopper(platform, dtype, segmented, capability, backend,
                                                                 reason):
    from meshtrain.parallel.flash import flash_backend

    chosen, why = flash_backend("auto", platform=platform, dtype=dtype, segmented=segmented,
                                compute_capability=capability)
    assert chosen.value == backend and reason in why, why


@pytest.mark.parametrize("text, capability", [("9.0", (9, 0)), ("10.3", (10, 3)), ("8.6", (8, 6)),
                                              ("gfx90a", None), (None, None)])
def test_compute_capability_is_read_from_the_devices_string(text, capability):
    from meshtrain.parallel.flash import parse_capability

    assert parse_capability(text) == capability


def test_asking_for_cudnn_on_packed_documents_below_hopper_names_the_fix():
    from meshtrain.errors import ConfigError
    from meshtrain.parallel.flash import flash_backend

    with pytest.raises(ConfigError, match=r"^flash backend 'cudnn' on packed documents \(segment ids\) needs cuDNN's "
                                          r"ragged layout, Hopper \(sm90\) or newer; this GPU is sm80: use "
                                          r"flash_backend 'auto' or 'xla'$"):
        flash_backend("cudnn", platform="gpu", dtype=jnp.bfloat16, segmented=True, compute_capability=(8, 0))
    assert flash_backend("cudnn", platform="gpu", dtype=jnp.bfloat16, segmented=True,
                         compute_capability=(9, 0))[0].value == "cudnn"


@pytest.mark.parametrize("room", [0, -3, 2.5, True])
def test_a_bad_room_for_packed_documents_is_refused_in_one_line(room):
    from meshtrain.errors import ConfigError
    from meshtrain.parallel.flash import flash_attention

    q = jnp.zeros((2, 16, 4, 16))
    with pytest.raises(ConfigError, match=rf"^flash attention max_segments \(flash.CUDNN_MAX_SEGMENTS\) is "
                                          rf"{re.escape(repr(room))}; give a whole number ≥ 1 of packed documents per "
                                          rf"row$"):
        flash_attention(q, q, q, PACKED_ROWS["several, per row"][0], max_segments=room)


def _fake_cudnn(calls):
    """JAX's cuDNN attention as this host can run it: dense attention under the mask its ragged
    arguments describe (the ragged layout's meaning, not cuDNN's numerics)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    def attend(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type):
        calls.append((k.shape[2], q_seqlen.shape, q_offsets.shape, mask_type))
        assert k.shape[2] == q.shape[2]  # K/V at the query heads (JAX 0.10's ragged K/V stride)
        assert (q_seqlen is kv_seqlen) and (q_offsets is kv_offsets)
        mask = _ragged_mask(q_seqlen, q_offsets, q.shape[1], mask_type is MaskType.PADDING_CAUSAL)
        s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
        p = jax.nn.softmax(jnp.where(mask[:, None], s, -jnp.inf), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", jnp.nan_to_num(p), v.astype(jnp.float32)).astype(q.dtype)

    return attend


@pytest.mark.parametrize("recipe", [None, "fsdp_tp"])
@pytest.mark.parametrize("name", ["several, per row", "one document too many", "an id that recurs"])
def test_packed_cudnn_path_matches_the_reference_and_falls_back_to_blockwise(monkeypatch, recipe, name):
    """The packed path's plumbing on CPU with cuDNN replaced by the mask its arguments mean: output and
    gradients equal the reference attention, whether the rows fit the layout (cuDNN's branch) or not
    (the blockwise branch), on one device and per device under a sharded recipe."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from meshtrain.parallel.flash import _cudnn_packed, cudnn_segments

    calls = []
    monkeypatch.setattr(fused, "dot_product_attention", _fake_cudnn(calls))
    seg, fits = PACKED_ROWS[name]
    seg = jnp.tile(seg, (8 // seg.shape[0], 1))  # 8 rows: the batch splits over the recipe's devices
    keys = jax.random.split(jax.random.key(1), 4)
    q, w = (jax.random.normal(kk, (8, 16, 4, 16)) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (8, 16, 2, 16)) for kk in keys[2:])

    def loss(q, k, v):
        return jnp.sum(per_device(lambda *a: _cudnn_packed(*a, True, ROOM), q, k, v, seg) * w)

    def ref(q, k, v):
        return jnp.sum(reference_attention(q, k, v, seg) * w)

    with contextlib.ExitStack() as stack:
        if recipe:
            plan = _plan(recipe)
            stack.enter_context(jax.set_mesh(plan.mesh))
            stack.enter_context(step_context(step_context_for(plan)))
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(ref, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-4 * max(1.0, np.abs(np.asarray(b)).max())
    assert calls and all(c[1][1] == ROOM and c[2][1] == ROOM + 1 for c in calls)  # traced in either case
    assert bool(cudnn_segments(seg, ROOM)[2]) is fits


@pytest.mark.parametrize("args, code, line", [
    ([], 2, "check_cudnn_packed: needs an NVIDIA GPU (JAX's backend here is 'cpu'); --dry-run checks the ragged "
            "description only\n"),
    (["--dry-run"], 0, "dry run: 4 rows of 2048 tokens, [1, 5, 32, 4] documents, room 32: fits True, ragged mask == "
                       "segment mask: True; unfit rows fit: False\n"),
])
def test_the_gpu_check_of_packed_cudnn_refuses_a_cpu_host_in_one_line(args, code, line):
    import os
    import sys

    import processes

    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "check_cudnn_packed.py")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out = processes.run([sys.executable, tool, *args], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == code, out.stderr[-2000:]
    assert (out.stderr if code else out.stdout).endswith(line)  # after any JAX plugin log lines
