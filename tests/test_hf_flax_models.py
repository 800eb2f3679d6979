"""transformers' own Flax GPT-2, BERT (masked LM, dropout on) and ViT (dropout on), unedited, through
the Trainer with glue lines and the rules files meshtrain ships (``recipes/rules/hf_*.yaml``; GPT-2's is in
the README): every data/FSDP/ZeRO/TP recipe matches one device (GPT-2 under all eight, BERT and ViT under
four each by default: ``RECIPES_OF``) (relative loss difference <= 1e-5), and the
big weights are really sharded. Skipped without `transformers` (a test-only dependency)."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshtrain as mt
from meshtrain.models import from_linen
from meshtrain.train import TrainConfig, Trainer

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ["dp", "fsdp", "tp", "fsdp_tp", "zero1", "zero2", "hsdp", "fsdp_tp_sp"]
#: GPT-2 (the cheapest) runs every recipe; BERT and ViT half each, together every recipe again, each
#: with an FSDP and a tensor-parallel layout. MESHTRAIN_FULL_PARITY=1 runs all eight on all three.
FULL = os.environ.get("MESHTRAIN_FULL_PARITY", "") not in ("", "0")
RECIPES_OF = {"gpt2": RECIPES,
              "bert": RECIPES if FULL else ["fsdp", "fsdp_tp", "zero2", "hsdp"],
              "vit": RECIPES if FULL else ["dp", "tp", "zero1", "fsdp_tp_sp"]}
STEPS, BATCH, T = 3, 16, 64


def shipped_rules(name: str) -> str:
    """A rules file meshtrain ships for a HF model (``recipes/rules/hf_<name>.yaml``; the bench loads them too)."""
    return os.path.join(ROOT, "recipes", "rules", f"hf_{name}.yaml")


@pytest.fixture(scope="module")
def rules_file():
    return shipped_rules("gpt2")


def test_the_readme_shows_the_shipped_gpt2_rules():
    """The README's GPT-2 rules block is recipes/rules/hf_gpt2.yaml (same sections, same entries)."""
    import yaml

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```yaml\n# recipes/rules/hf_gpt2.yaml[^\n]*\n(.*?)```", readme, re.S).group(1)
    with open(shipped_rules("gpt2")) as f:
        assert yaml.safe_load(block) == yaml.safe_load(f)


def gpt2(rules):
    """The README's glue lines: the HF object, sample inputs of its module's call, the rules file."""
    hf = transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=T, n_embd=64,
                                                                   n_layer=2, n_head=4))
    ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return from_linen(hf, ids, ids, ids, rules=rules)


def loss(model, batch):
    logits = model(batch["inputs"], batch["mask"], batch["positions"], deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return ce.sum(), ce.size


def batches():
    rng = np.random.default_rng(0)
    while True:
        x = rng.integers(0, 256, (BATCH, T + 1)).astype(np.int32)
        yield {"inputs": x[:, :-1], "targets": x[:, 1:], "mask": np.ones((BATCH, T), np.int32),
               "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (BATCH, T)).copy()}


BERT_RULES = shipped_rules("bert")
VIT_RULES = shipped_rules("vit")


def bert(rules):
    hf = transformers.FlaxBertForMaskedLM(transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=T))
    ids = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return from_linen(hf, ids, ids, ids, ids, None, rules=rules)  # input_ids, mask, types, positions, head_mask


def bert_loss(model, batch):  # masked LM on 15 % of the tokens, dropout on
    logits = model(batch["inputs"], batch["mask"], batch["types"], batch["positions"], None,
                   deterministic=False).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]) * batch["weights"]
    return ce.sum(), batch["weights"].sum()


def bert_batches():
    rng = np.random.default_rng(0)
    while True:
        x = rng.integers(5, 256, (BATCH, T)).astype(np.int32)
        w = (rng.random((BATCH, T)) < 0.15).astype(np.float32)
        yield {"inputs": np.where(w > 0, 4, x).astype(np.int32), "targets": x, "weights": w,
               "mask": np.ones((BATCH, T), np.int32), "types": np.zeros((BATCH, T), np.int32),
               "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (BATCH, T)).copy()}


def vit(rules):
    hf = transformers.FlaxViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=10))
    return from_linen(hf, jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32), rules=rules)


def vit_loss(model, batch):  # dropout on
    logits = model(batch["images"], deterministic=False).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return ce.sum(), ce.size


def vit_batches():
    rng = np.random.default_rng(0)
    while True:
        yield {"images": rng.standard_normal((BATCH, 8, 8, 1)).astype(np.float32),
               "labels": rng.integers(0, 10, (BATCH,)).astype(np.int32)}


def train(out, recipe, rules, devices=None, model=gpt2, loss_fn=loss, data=batches):
    cfg = TrainConfig(recipe=recipe, steps=STEPS, batch_size=BATCH, eval_every=0, progress="none", out=str(out),
                      devices=devices, recipe_options={"compute_dtype": "float32"})
    run_dir = Trainer(cfg, model=model(rules), loss_fn=loss_fn, data=data(), rules=rules).run().run_dir
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return np.array([r["loss"] for r in map(json.loads, f) if "loss" in r])


def test_gpt2_big_weights_are_sharded_by_the_readme_rules(rules_file):
    abstract = mt.abstract_state(gpt2(rules_file), optax.adam(1e-3), annotations=rules_file)
    plan = mt.make_plan(abstract, "fsdp_tp")
    specs = {leaf.path: leaf.spec for leaf in plan.group("params")}
    wte = next(s for p, s in specs.items() if p.endswith("wte/embedding"))
    c_attn = next(s for p, s in specs.items() if p.endswith("h/0/attn/c_attn/kernel"))
    assert "fsdp" in str(wte) and "tensor" in str(c_attn), (wte, c_attn)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert", "vit"])
def test_hf_model_matches_one_device_under_every_recipe(name, rules_file, tmp_path):
    model, loss_fn, data, rules = {"gpt2": (gpt2, loss, batches, rules_file),
                                   "bert": (bert, bert_loss, bert_batches, BERT_RULES),
                                   "vit": (vit, vit_loss, vit_batches, VIT_RULES)}[name]
    base = train(tmp_path / "one", "dp", rules, devices=1, model=model, loss_fn=loss_fn, data=data)
    assert len(base) == STEPS and np.all(np.isfinite(base))
    for recipe in RECIPES_OF[name]:
        got = train(tmp_path / recipe, recipe, rules, model=model, loss_fn=loss_fn, data=data)
        rel = float(np.max(np.abs(got - base) / np.abs(base)))
        assert rel <= 1e-5, (name, recipe, got, base)


MODEL_FILE = '''
import jax, jax.numpy as jnp, optax
from transformers import FlaxGPT2LMHeadModel, GPT2Config
from meshtrain.models import from_linen

_hf = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4), _do_init=False)
_ids = jax.ShapeDtypeStruct((1, 128), jnp.int32)
make = from_linen(_hf, _ids, _ids, _ids, rules="recipes/rules/hf_gpt2.yaml", weights="init")


def loss(model, batch):
    logits = model(batch["inputs"], batch["mask"], batch["positions"], deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return ce.sum(), ce.size
'''


@pytest.mark.slow
def test_meshtrain_plan_plans_gpt2_from_the_cli_on_8_and_64_devices(tmp_path):
    """The README's command, from the repository's root with the shipped rules file."""
    import sys

    import processes

    model = tmp_path / "gpt2_model.py"
    model.write_text(MODEL_FILE)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    batch = ",".join(f"{k}=64x128:int32" for k in ("inputs", "targets", "mask", "positions"))
    for devices in (8, 64):
        out = processes.run([sys.executable, "-m", "meshtrain", "plan", "--model", f"{model}:make", "--rules",
                             "recipes/rules/hf_gpt2.yaml", "--batch", batch, "--loss", f"{model}:loss", "--recipe",
                             "fsdp_tp", "--devices", str(devices)], capture_output=True, text=True, env=env, cwd=ROOT,
                            timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"({devices} devices," in out.stdout and "memory per device" in out.stdout, out.stdout[:2000]
