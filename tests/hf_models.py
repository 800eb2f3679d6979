"""transformers' Flax GPT-2, BERT (masked LM) and ViT with the glue lines the README shows (the HF object,
sample inputs of its module's call, the rules file meshtrain ships), their losses and batches, and a short
Trainer run: tests/test_hf_flax_models.py and tests/test_hf_flax_encoders.py. Import only where
``transformers`` is installed (the tests skip first)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import transformers

from meshtrain.models import from_linen
from meshtrain.train import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ["dp", "fsdp", "tp", "fsdp_tp", "zero1", "zero2", "hsdp", "fsdp_tp_sp"]
#: Cut from the 3 models x 8 recipes product (MESHTRAIN_FULL_PARITY=1 runs all eight on all three). Every
#: built-in recipe runs against one device on the tiny decoder (test_parity.py: losses, gradients, shard
#: shapes); what these runs add is the shipped rules files on transformers' own modules, so each model runs
#: the layouts its rules file decides. GPT-2 (the README's example, whose fused c_attn and (out, in) Conv1D
#: kernels are what its rules file shards): tp (tensor alone, `embed` replicated) and fsdp_tp_sp (FSDP x
#: tensor x sequence). BERT: fsdp_tp (its attention and MLP kernels on fsdp and tensor, dropout on); ViT:
#: fsdp_tp_sp (the same with its patch sequence split too, dropout on). Left out: dp, zero1, zero2 and hsdp
#: (the rules' fsdp half on other batch and optimizer layouts, none of them model-specific) and, for the
#: encoders, pure tp and fsdp (halves of the composed layout they run).
FULL = os.environ.get("MESHTRAIN_FULL_PARITY", "") not in ("", "0")
RECIPES_OF = {"gpt2": RECIPES if FULL else ["tp", "fsdp_tp_sp"],
              "bert": RECIPES if FULL else ["fsdp_tp"],
              "vit": RECIPES if FULL else ["fsdp_tp_sp"]}
STEPS, BATCH, T = 3, 16, 64


def shipped_rules(name: str) -> str:
    """A rules file meshtrain ships for a HF model (``recipes/rules/hf_<name>.yaml``; the bench loads them too)."""
    return os.path.join(ROOT, "recipes", "rules", f"hf_{name}.yaml")


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


def assert_matches_one_device(name: str, tmp_path) -> None:
    """``name``'s losses under each of its recipes (``RECIPES_OF``) equal one device's within 1e-5."""
    model, loss_fn, data, rules = {"gpt2": (gpt2, loss, batches, shipped_rules("gpt2")),
                                   "bert": (bert, bert_loss, bert_batches, BERT_RULES),
                                   "vit": (vit, vit_loss, vit_batches, VIT_RULES)}[name]
    base = train(tmp_path / "one", "dp", rules, devices=1, model=model, loss_fn=loss_fn, data=data)
    assert len(base) == STEPS and np.all(np.isfinite(base))
    for recipe in RECIPES_OF[name]:
        got = train(tmp_path / recipe, recipe, rules, model=model, loss_fn=loss_fn, data=data)
        rel = float(np.max(np.abs(got - base) / np.abs(base)))
        assert rel <= 1e-5, (name, recipe, got, base)
