"""The planner's estimate for more devices than exist (an ``AbstractMesh``: the traced program) against a real
compile of the same step on as many simulated CPU devices, for models nobody on this project wrote.

    python tools/bench_plan_any_model.py                       # every model × dp, fsdp, tp, fsdp_tp, 16 devices
    python tools/bench_plan_any_model.py --models lm1b,vit --recipes fsdp_tp --markdown

Models: ``vit`` (meshtrain's NNX ViT), ``lm1b`` (a Linen decoder in flax's lm1b style: ``DenseGeneral`` with
short logical names ``embed``/``joined_kv``/``kv``, bridged with ``from_linen``), ``flax-lm1b`` (flax's own lm1b
Transformer, unedited, when ``python tools/fetch_upstream_models.py`` has fetched it), and, when ``transformers`` is
installed, HuggingFace's Flax ``gpt2``, ``bert`` (masked LM), ``hf-vit`` and ``t5`` (encoder-decoder, untied head),
unedited, and, when
``MESHTRAIN_BIG_VISION`` names a big_vision checkout (``python tools/fetch_upstream_models.py --big-vision``),
big_vision's ViT unedited, ``bv-vit`` and ``bv-vit-scan`` (its own layer scan); the rules files of the unnamed
ones are ``recipes/rules/*.yaml``. Memory error = traced estimate / compiled peak − 1 (bytes per device, f32).

T5 on 64 devices (issue 31), with XLA's buffers at the compiled peak (``tools/xla_live_buffers.py``)::

    MESHTRAIN_BENCH_DEVICES=64 python tools/bench_plan_any_model.py --models t5 --recipes fsdp,fsdp_tp \
        --batch 64 --terms --buffers /tmp/t5-dump
    MESHTRAIN_BENCH_DEVICES=64 python tools/bench_plan_any_model.py --models t5 --recipes fsdp --batch 64 \
        --t5 vocab_size=32128,d_model=512,d_kv=64,d_ff=2048,num_heads=8     # t5-small's widths, 2+2 layers
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax

DEVICES = int(os.environ.get("MESHTRAIN_BENCH_DEVICES", "16"))
jax.config.update("jax_num_cpu_devices", DEVICES)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import meshtrain as mt  # noqa: E402
from meshtrain.analysis import estimate_memory, program_cost  # noqa: E402
from meshtrain.models import ViTConfig, from_linen, model_factory, vit_loss  # noqa: E402

RECIPES = ("dp", "fsdp", "tp", "fsdp_tp")
BATCH, T, VOCAB, DIM, HEADS, HEAD_DIM, HIDDEN, LAYERS = 32, 128, 2064, 256, 16, 16, 1024, 2
lp = nn.with_logical_partitioning
MiB = 2 ** 20


# -- the models (factory, loss, batch example, rules) ----------------------------------------------------------

def _layer_norm():
    return nn.LayerNorm(scale_init=lp(nn.initializers.ones, ("embed",)),
                        bias_init=lp(nn.initializers.zeros, ("embed",)))


class Lm1bBlock(nn.Module):
    """One decoder block as flax's lm1b example names its weights (``DenseGeneral`` kernels of rank 3 with two
    logical names; ``joined_kv`` and ``kv`` unknown to meshtrain, mapped by the rules)."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = _layer_norm()(x)
        q = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, kernel_init=lp(init, ("embed", "joined_kv")))(h)
        k = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, kernel_init=lp(init, ("embed", "joined_kv")))(h)
        v = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, kernel_init=lp(init, ("embed", "joined_kv")))(h)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        attended = nn.dot_product_attention(q, k, v, mask=mask)
        out = nn.DenseGeneral(DIM, axis=(-2, -1), use_bias=False, kernel_init=lp(init, ("joined_kv", "embed")))
        x = x + out(attended)
        h = _layer_norm()(x)
        h = nn.relu(nn.Dense(HIDDEN, use_bias=False, kernel_init=lp(init, ("embed", "mlp")))(h))
        return x + nn.Dense(DIM, use_bias=False, kernel_init=lp(init, ("mlp", "embed")))(h)


class Lm1b(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, DIM, embedding_init=lp(nn.initializers.normal(1.0), ("vocab", "embed")))
        x = embed(tokens)
        for _ in range(LAYERS):
            x = Lm1bBlock()(x)
        return embed.attend(x)  # tied output, (batch, seq, vocab)


def next_token(model, batch):
    logits = model(batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return ce.sum(), ce.size


def hf_next_token(model, batch):
    logits = model(batch["inputs"], batch["mask"], batch["positions"], deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return ce.sum(), ce.size


def hf_mlm(model, batch):
    logits = model(batch["inputs"], batch["mask"], batch["types"], batch["positions"], None,
                   deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return ce.sum(), ce.size


def hf_vit_loss(model, batch):
    logits = model(batch["images"], deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"])
    return ce.sum(), ce.size


def set_batch(rows: int) -> None:
    """The global batch of every model's example (``--batch``; 64 devices need at least 64 rows)."""
    global BATCH
    BATCH = rows


def tokens(*keys):
    return {k: jax.ShapeDtypeStruct((BATCH, T), jnp.int32) for k in keys}


def images(size: int, channels: int):
    return {"images": jax.ShapeDtypeStruct((BATCH, size, size, channels), jnp.float32),
            "labels": jax.ShapeDtypeStruct((BATCH,), jnp.int32)}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rules_file(name: str) -> str:
    """A rules file shipped in ``recipes/rules/`` (the ones tests/test_hf_flax_models.py trains with)."""
    return os.path.join(ROOT, "recipes", "rules", f"{name}.yaml")


def _lm1b():
    return from_linen(Lm1b(), jax.ShapeDtypeStruct((1, T), jnp.int32)), next_token, tokens("inputs", "targets"), \
        {"logical": {"kv": None, "joined_kv": "tensor"}}


def _vit():
    cfg = ViTConfig("vit-bench", image_size=32, patch_size=4, channels=3, num_classes=10, d_model=DIM,
                    n_layers=LAYERS, n_heads=HEADS, head_dim=HEAD_DIM, d_ff=HIDDEN)
    return model_factory(cfg), vit_loss, images(cfg.image_size, cfg.channels), None


def _gpt2():
    import transformers

    rules = rules_file("hf_gpt2")
    hf = transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=DIM,
                                                                   n_layer=LAYERS, n_head=HEADS))
    ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return (from_linen(hf, ids, ids, ids, rules=rules), hf_next_token,
            tokens("inputs", "targets", "mask", "positions"), rules)


def _bert():
    import transformers

    rules = rules_file("hf_bert")
    hf = transformers.FlaxBertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=HIDDEN, max_position_embeddings=T))
    ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return (from_linen(hf, ids, ids, ids, ids, None, rules=rules), hf_mlm,
            tokens("inputs", "targets", "mask", "types", "positions"), rules)


def _hf_vit():
    import transformers

    rules = rules_file("hf_vit")
    hf = transformers.FlaxViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=DIM, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=HIDDEN, num_labels=10))
    return (from_linen(hf, jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32), rules=rules), hf_vit_loss,
            images(32, 3), rules)


def t5_loss(model, batch):
    logits = model(batch["inputs"], batch["mask"], batch["decoder_inputs"], batch["decoder_mask"],
                   deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return ce.sum(), ce.size


def _t5_clip_keywords():
    """transformers 4.57's Flax T5 calls ``jnp.clip(x, a_max=...)``, a keyword JAX 0.10 no longer takes: its
    module sees a ``jnp`` whose ``clip`` accepts it (this process only; the model is otherwise unedited)."""
    import types

    from transformers.models.t5 import modeling_flax_t5

    class Jnp(types.ModuleType):
        def __getattr__(self, name):
            return getattr(jnp, name)

        @staticmethod
        def clip(x, a_min=None, a_max=None, **kwargs):
            return jnp.clip(x, kwargs.get("min", a_min), kwargs.get("max", a_max))

    modeling_flax_t5.jnp = Jnp("jnp")


#: ``T5Config`` fields that replace the bench's sizes (``--t5 vocab_size=32128,d_model=512,...``)
T5_OVERRIDES: dict = {}


def _t5():
    import transformers

    _t5_clip_keywords()
    rules = rules_file("hf_t5")
    sizes = dict(vocab_size=VOCAB, d_model=DIM, d_kv=HEAD_DIM, d_ff=HIDDEN, num_layers=LAYERS, num_heads=HEADS)
    hf = transformers.FlaxT5ForConditionalGeneration(transformers.T5Config(
        **{**sizes, **T5_OVERRIDES}, dropout_rate=0.0))
    ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return (from_linen(hf, ids, ids, ids, ids, rules=rules), t5_loss,
            tokens("inputs", "mask", "decoder_inputs", "decoder_mask", "targets"), rules)


def _flax_lm1b_path() -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fetch_upstream_models",
                                                  os.path.join(os.path.dirname(__file__), "fetch_upstream_models.py"))
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    return fetch.lm1b_models_path()


def lm1b_own_loss(model, batch):
    """flax's lm1b objective: the model shifts its input right, so logits[t] predicts inputs[t]."""
    logits = model(batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["inputs"])
    return ce.sum(), ce.size


def _flax_lm1b():
    """flax's own lm1b Transformer (examples/lm1b/models.py as it ships; ``python tools/fetch_upstream_models.py``
    puts it in .cache/upstream/), at the bench's sizes, with the rules of tests/test_upstream_models.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lm1b_models", _flax_lm1b_path())
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    config = models.TransformerConfig(vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=DIM, num_heads=HEADS,
                                      qkv_dim=DIM, num_layers=LAYERS, mlp_dim=HIDDEN, max_len=T, deterministic=True)
    return (from_linen(models.TransformerLM(config), jax.ShapeDtypeStruct((1, T), jnp.int32)), lm1b_own_loss,
            tokens("inputs"), {"logical": {"kv": "tensor"}})


def _big_vision_module():
    """big_vision/models/vit.py as it ships, from the checkout ``MESHTRAIN_BIG_VISION`` names (imported as
    tests/test_upstream_models.py does: ``fetch_upstream_models.import_big_vision_vit``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from fetch_upstream_models import import_big_vision_vit

    return import_big_vision_vit(os.environ["MESHTRAIN_BIG_VISION"])


def bv_vit_loss(model, batch):
    logits, _ = model(batch["images"], train=False)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"])
    return ce.sum(), ce.size


def _big_vision(scan: bool):
    """big_vision's ViT, unedited, at the bench's sizes (its own layer scan with ``scan``), rules from
    ``recipes/rules/``."""
    vit = _big_vision_module()
    model = vit.Model(10, patch_size=(4, 4), width=DIM, depth=LAYERS, mlp_dim=HIDDEN, num_heads=HEADS,
                      head_zeroinit=False, scan=scan)
    rules = rules_file("big_vision_vit_scan" if scan else "big_vision_vit")
    return (from_linen(model, jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)), bv_vit_loss, images(32, 3),
            rules)


MODELS = {"vit": _vit, "lm1b": _lm1b, "flax-lm1b": _flax_lm1b, "gpt2": _gpt2, "bert": _bert, "hf-vit": _hf_vit,
          "t5": _t5, "bv-vit": lambda: _big_vision(False), "bv-vit-scan": lambda: _big_vision(True)}
HF = ("gpt2", "bert", "hf-vit", "t5")
BIG_VISION = ("bv-vit", "bv-vit-scan")


def compare(model: str, recipe_name: str, devices: int = DEVICES):
    """``(traced estimate, compiled peak)`` bytes per device of ``model``'s step under ``recipe_name``: planned on
    an ``AbstractMesh`` of ``devices`` and compiled on ``devices`` simulated CPU devices."""
    factory, loss_fn, example, rules = MODELS[model]()
    abstract = mt.abstract_state(factory, optax.adamw(1e-3), annotations=rules)
    layout = mt.BatchLayout.from_example(example)
    recipe = mt.get_recipe(recipe_name).with_options(max_replicated_fraction=1.0)
    traced_plan = mt.make_plan(abstract, recipe, recipe.mesh.abstract(devices), batch=layout)
    traced = estimate_memory(traced_plan, None, cost=program_cost(traced_plan, loss_fn, compile=False))
    real_plan = mt.make_plan(abstract, recipe, recipe.mesh.build(jax.devices()[:devices]), batch=layout)
    compiled = program_cost(real_plan, loss_fn)
    return traced, compiled.memory.peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--terms", action="store_true", help="print each estimate's components")
    ap.add_argument("--batch", type=int, default=BATCH, help="global batch (a multiple of the data-parallel size)")
    ap.add_argument("--buffers", metavar="DIR", help="dump each compile to DIR and print XLA's buffers live at "
                                                      "its peak (tools/xla_live_buffers.py)")
    ap.add_argument("--t5", default="", metavar="FIELD=INT,...",
                    help="T5Config sizes instead of the bench's, e.g. vocab_size=32128,d_model=512,d_kv=64,d_ff=2048,"
                         "num_heads=8")
    args = ap.parse_args(argv)
    set_batch(args.batch)
    T5_OVERRIDES.update({k: int(v) for k, v in (f.split("=") for f in args.t5.split(",") if f)})
    if args.buffers:  # read when the CPU backend starts, at the first compile below
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.buffers} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*jit_step.*")
    models = args.models.split(",")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"transformers is not installed: skipping {', '.join(m for m in models if m in HF)}")
        models = [m for m in models if m not in HF]
    if "flax-lm1b" in models and not os.path.exists(_flax_lm1b_path()):
        print("flax's lm1b example is not fetched (python tools/fetch_upstream_models.py): skipping flax-lm1b")
        models = [m for m in models if m != "flax-lm1b"]
    if not os.environ.get("MESHTRAIN_BIG_VISION") and any(m in BIG_VISION for m in models):
        print("MESHTRAIN_BIG_VISION is not set (big_vision is on no package registry: python "
              "tools/fetch_upstream_models.py --big-vision, then MESHTRAIN_BIG_VISION=.cache/upstream/big_vision): "
              f"skipping {', '.join(m for m in models if m in BIG_VISION)}")
        models = [m for m in models if m not in BIG_VISION]
    rows = []
    for model in models:
        for recipe in args.recipes.split(","):
            start = time.perf_counter()
            traced, peak = compare(model, recipe)
            err = traced.total / peak - 1
            rows.append([model, recipe, f"{traced.total / MiB:,.2f} MiB", f"{peak / MiB:,.2f} MiB", f"{err:+.1%}"])
            print("  ".join(rows[-1]), f"({time.perf_counter() - start:.0f} s)", flush=True)
            if args.terms:
                for c, b in traced.components:
                    print(f"    {c.value}: {b / MiB:,.2f} MiB ({b:,} B)")
                print(f"    compiled peak: {peak:,} B; estimate - peak: {traced.total - peak:+,} B")
            if args.buffers:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                from xla_live_buffers import newest_module, report

                print(report(newest_module(args.buffers), top=12))
    print(f"\nbatch {BATCH}, sequence {T} (ViTs: images), f32, {DEVICES} devices: AbstractMesh estimate vs compile")
    if args.markdown:
        print(f"| model | recipe | AbstractMesh estimate | compiled peak ({DEVICES} CPU devices) | error |\n"
              "|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
