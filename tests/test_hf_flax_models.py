"""transformers' own Flax GPT-2, unedited, through the Trainer with the README's glue lines and rules
file: every data/FSDP/ZeRO/TP recipe matches one device (relative loss difference <= 1e-5), and the
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

ROOT = os.path.dirname(os.path.dirname(__file__))
RECIPES = ["dp", "fsdp", "tp", "fsdp_tp", "zero1", "zero2", "hsdp", "fsdp_tp_sp"]
STEPS, BATCH, T = 3, 16, 64


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory):
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"```yaml\n# gpt2-rules.yaml[^\n]*\n(.*?)```", readme, re.S).group(1)
    path = tmp_path_factory.mktemp("rules") / "gpt2-rules.yaml"
    path.write_text(block)
    return str(path)


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


def train(out, recipe, rules, devices=None):
    cfg = TrainConfig(recipe=recipe, steps=STEPS, batch_size=BATCH, eval_every=0, progress="none", out=str(out),
                      devices=devices, rules=rules, recipe_options={"compute_dtype": "float32"})
    run_dir = Trainer(cfg, model=gpt2(rules), loss_fn=loss, data=batches()).run().run_dir
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return np.array([r["loss"] for r in map(json.loads, f) if "loss" in r])


def test_gpt2_big_weights_are_sharded_by_the_readme_rules(rules_file):
    abstract = mt.abstract_state(gpt2(rules_file), optax.adam(1e-3), annotations=rules_file)
    plan = mt.make_plan(abstract, "fsdp_tp")
    specs = {leaf.path: leaf.spec for leaf in plan.group("params")}
    wte = next(s for p, s in specs.items() if p.endswith("wte/embedding"))
    c_attn = next(s for p, s in specs.items() if p.endswith("h/0/attn/c_attn/kernel"))
    assert "fsdp" in str(wte) and "tensor" in str(c_attn), (wte, c_attn)


def test_gpt2_matches_one_device_under_every_recipe(rules_file, tmp_path):
    base = train(tmp_path / "one", "dp", rules_file, devices=1)
    assert len(base) == STEPS and np.all(np.isfinite(base))
    for recipe in RECIPES:
        got = train(tmp_path / recipe, recipe, rules_file)
        rel = float(np.max(np.abs(got - base) / np.abs(base)))
        assert rel <= 1e-5, (recipe, got, base)


MODEL_FILE = '''
import jax, jax.numpy as jnp, optax
from transformers import FlaxGPT2LMHeadModel, GPT2Config
from meshtrain.models import from_linen

_hf = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4), _do_init=False)
_ids = jax.ShapeDtypeStruct((1, 128), jnp.int32)
make = from_linen(_hf, _ids, _ids, _ids, rules="gpt2-rules.yaml", weights="init")


def loss(model, batch):
    logits = model(batch["inputs"], batch["mask"], batch["positions"], deterministic=True).logits
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return ce.sum(), ce.size
'''


def test_meshtrain_plan_plans_gpt2_from_the_cli_on_8_and_64_devices(rules_file, tmp_path):
    import shutil
    import sys

    import processes

    shutil.copy(rules_file, tmp_path / "gpt2-rules.yaml")
    (tmp_path / "gpt2_model.py").write_text(MODEL_FILE)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    batch = ",".join(f"{k}=64x128:int32" for k in ("inputs", "targets", "mask", "positions"))
    for devices in (8, 64):
        out = processes.run([sys.executable, "-m", "meshtrain", "plan", "--model", "gpt2_model.py:make", "--rules",
                             "gpt2-rules.yaml", "--batch", batch, "--loss", "gpt2_model.py:loss", "--recipe", "fsdp_tp",
                             "--devices", str(devices)], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"({devices} devices," in out.stdout and "memory per device" in out.stdout, out.stdout[:2000]
