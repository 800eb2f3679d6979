"""Models other projects wrote, *unedited*, through the Trainer (issue 22): flax's own lm1b Transformer
(Linen, flax's logical names, ``kv`` among them, which meshtrain does not know) and big_vision's ViT (no
names: path rules; also with its own layer scan). Only glue lines here: a config, the factory, a loss,
rules. Under the layouts its rules decide (``RECIPES_OF``) each matches one device (3 f32 steps, dropout on, max
relative loss difference <= 1e-5).

Their code is not in this repository. ``python tools/fetch_upstream_models.py`` puts flax's lm1b model
(from the sdist of the flax that pyproject.toml pins, hash-checked) in ``.cache/upstream/``; `.ci/run`
runs it first and sets ``MESHTRAIN_REQUIRE_UPSTREAM=1``, under which a missing copy fails instead of
skipping. big_vision is on no package registry: ``python tools/fetch_upstream_models.py --big-vision``
clones it (pinned commit), and ``MESHTRAIN_BIG_VISION=.cache/upstream/big_vision`` runs its tests.
"""

import importlib.util
import json
import os

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshtrain as mt
from meshtrain.models import from_linen
from meshtrain.train import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ["dp", "fsdp", "tp", "fsdp_tp", "zero1", "zero2", "hsdp", "fsdp_tp_sp"]
FAST = [("lm1b", "fsdp_tp")]  # the fast tier's share; the rest are marked slow
STEPS, BATCH = 3, 16


def _fetch_tool():
    spec = importlib.util.spec_from_file_location("fetch_upstream_models",
                                                  os.path.join(ROOT, "tools", "fetch_upstream_models.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


FETCH = _fetch_tool()


def _missing(what: str, how: str):
    """Skip, or fail where CI said the upstream code must be there (a failed fetch must not pass as a skip)."""
    if os.environ.get("MESHTRAIN_REQUIRE_UPSTREAM") == "1":
        pytest.fail(f"{what} missing under MESHTRAIN_REQUIRE_UPSTREAM=1; {how}")
    pytest.skip(f"{what} not fetched; {how}")


# -- glue: flax's lm1b Transformer, as a user would write it --------------------------------------
# flax-0.12.8/examples/lm1b/models.py, imported as it ships. Its kernels carry flax's logical names:
# DenseGeneral's q/k/v kernels (embed, heads, head_dim) are named ('embed', 'kv') (the trailing dimension
# stays unsharded), and `kv` is lm1b's own name, mapped by the rules' logical: section (here onto
# `tensor`, so tp splits attention by heads; `kv: null` would replicate it). embed/mlp/vocab are
# meshtrain's own names already.

LM1B_RULES = {"logical": {"kv": "tensor"}}
LM1B_VOCAB, LM1B_LEN = 256, 32


def lm1b_models():
    path = FETCH.lm1b_models_path()
    if not os.path.exists(path):
        _missing(f"flax's lm1b example ({os.path.relpath(path, ROOT)})", "run: python tools/fetch_upstream_models.py")
    spec = importlib.util.spec_from_file_location("lm1b_models", path)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    return models


def lm1b():
    models = lm1b_models()
    config = models.TransformerConfig(vocab_size=LM1B_VOCAB, output_vocab_size=LM1B_VOCAB, emb_dim=64, num_heads=8,
                                      qkv_dim=64, num_layers=2, mlp_dim=128, max_len=LM1B_LEN,
                                      deterministic=False)                           # dropout 0.1 on
    return from_linen(models.TransformerLM(config), jax.ShapeDtypeStruct((1, LM1B_LEN), jnp.int32))


def lm1b_loss(model, batch):
    """lm1b's own objective: the model shifts its input right, so logits[t] predicts inputs[t]; padding
    (token 0) weighs nothing."""
    logits = model(batch["inputs"])
    weights = (batch["inputs"] > 0).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["inputs"]) * weights
    return ce.sum(), weights.sum()


def lm1b_batches():
    rng = np.random.default_rng(0)
    while True:
        tokens = rng.integers(1, LM1B_VOCAB, (BATCH, LM1B_LEN)).astype(np.int32)
        lengths = rng.integers(LM1B_LEN // 2, LM1B_LEN + 1, (BATCH, 1))
        yield {"inputs": np.where(np.arange(LM1B_LEN) < lengths, tokens, 0).astype(np.int32)}


# -- glue: big_vision's ViT ----------------------------------------------------------------------------
# big_vision/models/vit.py as it ships. Its parameters have no logical names: the rules files meshtrain ships
# (recipes/rules/big_vision_vit{,_scan}.yaml, which tools/bench_plan_any_model.py reads too) name them in their
# paths: section, one list per dimension; the scanned variant stacks its layers on a leading `layers` axis.
# vit.py imports big_vision.utils only to load checkpoints (vit.load); that module needs tensorflow, so
# where it does not import an empty module stands in for it (the model never touches it).


def big_vision_rules(scan: bool) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(root, "recipes", "rules", "big_vision_vit_scan.yaml" if scan else "big_vision_vit.yaml")


def big_vision_vit_module():
    root = os.environ.get("MESHTRAIN_BIG_VISION")
    if not root:
        pytest.skip("MESHTRAIN_BIG_VISION is not set (big_vision is on no package registry): run "
                    "python tools/fetch_upstream_models.py --big-vision, then "
                    "MESHTRAIN_BIG_VISION=.cache/upstream/big_vision")
    if not os.path.exists(os.path.join(root, "big_vision", "models", "vit.py")):
        pytest.fail(f"MESHTRAIN_BIG_VISION={root}: no big_vision/models/vit.py there")
    return FETCH.import_big_vision_vit(root)


def big_vision_vit(scan: bool):
    vit = big_vision_vit_module()
    model = vit.Model(10, patch_size=(2, 2), width=64, depth=2, mlp_dim=128, num_heads=8, dropout=0.1,
                      head_zeroinit=False, scan=scan)
    return from_linen(model, jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32))


def vit_loss(model, batch):
    logits, _ = model(batch["images"], train=True)                              # dropout on
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return ce.sum(), ce.size


def vit_batches():
    rng = np.random.default_rng(0)
    while True:
        yield {"images": rng.standard_normal((BATCH, 8, 8, 1)).astype(np.float32),
               "labels": rng.integers(0, 10, (BATCH,)).astype(np.int32)}


#: name -> (factory maker, loss, batches, rules)
MODELS = {
    "lm1b": (lm1b, lm1b_loss, lm1b_batches, LM1B_RULES),
    "big_vision_vit": (lambda: big_vision_vit(False), vit_loss, vit_batches, big_vision_rules(False)),
    "big_vision_vit_scan": (lambda: big_vision_vit(True), vit_loss, vit_batches, big_vision_rules(True)),
}
#: Cut from the 3 models x 8 recipes product (each run ~5-15 s of CPU): each model runs the layouts its rules
#: decide; every recipe runs against one device on the built-in models (test_parity.py: losses, gradients,
#: shard shapes). lm1b (its own logical names; the one CI fetches) runs FAST's fsdp_tp (`kv` on tensor,
#: `embed` on fsdp) and tp (`kv` on tensor with every `embed` weight whole); left out for it are fsdp (the
#: fsdp half), fsdp_tp_sp (fsdp_tp with the activations' sequence split, which the tiny decoder runs) and dp,
#: zero1, zero2, hsdp (batch and optimizer layouts of the same weights). big_vision's ViT runs dp, zero1,
#: hsdp, fsdp_tp; its scanned variant (a stacked layer axis) fsdp, tp, zero2, fsdp_tp_sp.
FULL = os.environ.get("MESHTRAIN_FULL_PARITY", "") not in ("", "0")
RECIPES_OF = {"lm1b": ["tp"], "big_vision_vit": ["dp", "zero1", "hsdp", "fsdp_tp"],
              "big_vision_vit_scan": ["fsdp", "tp", "zero2", "fsdp_tp_sp"]}
SLOW = [(m, r) for m in MODELS for r in RECIPES if (m, r) not in FAST and (FULL or r in RECIPES_OF[m])]


def train(out, recipe, name, devices=None):
    make, loss_fn, data, rules = MODELS[name]
    cfg = TrainConfig(recipe=recipe, steps=STEPS, batch_size=BATCH, eval_every=0, progress="none", out=str(out),
                      devices=devices, recipe_options={"compute_dtype": "float32"})
    run_dir = Trainer(cfg, model=make(), loss_fn=loss_fn, data=data(), rules=rules).run().run_dir
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return np.array([r["loss"] for r in map(json.loads, f) if "loss" in r])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = train(tmp_path_factory.mktemp(f"one-{name}") / "run", "dp", name, devices=1)
        return cache[name]

    return get


def check_matches_one_device(name, recipe, one_device, out):
    base = one_device(name)
    assert len(base) == STEPS and np.all(np.isfinite(base)), base
    got = train(out, recipe, name)
    rel = float(np.max(np.abs(got - base) / np.abs(base)))
    print(f"{name} {recipe}: max relative loss difference {rel:.2e}")  # BENCHMARKS.md's table (pytest -s)
    assert rel <= 1e-5, (name, recipe, got, base)


@pytest.mark.parametrize("name,recipe", FAST)
def test_upstream_model_matches_one_device(name, recipe, one_device, tmp_path):
    check_matches_one_device(name, recipe, one_device, tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("name,recipe", SLOW)
def test_upstream_model_matches_one_device_under_every_recipe(name, recipe, one_device, tmp_path):
    check_matches_one_device(name, recipe, one_device, tmp_path / "run")


@pytest.mark.parametrize("name", list(MODELS))
def test_upstream_model_big_weights_are_sharded(name):
    make, _, _, rules = MODELS[name]
    plan = mt.make_plan(mt.abstract_state(make(), optax.adam(1e-3), annotations=rules), "fsdp_tp")
    specs = {leaf.path: str(leaf.spec) for leaf in plan.group("params")}
    query = next(s for p, s in specs.items() if "MultiHeadDotProductAttention_0/query/kernel" in p)
    mlp = next(s for p, s in specs.items() if "MlpBlock_0/Dense_0/kernel" in p)
    assert "fsdp" in query and "tensor" in query and "fsdp" in mlp and "tensor" in mlp, specs


def test_fetch_tool_pins_the_flax_pyproject_pins():
    """A flax upgrade in pyproject.toml fails here until the tool's version and sdist hash follow it."""
    assert FETCH.pinned_flax_version() == FETCH.FLAX_VERSION == flax.__version__
