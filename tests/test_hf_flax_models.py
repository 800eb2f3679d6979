"""transformers' own Flax GPT-2, unedited, through the Trainer with the glue lines and the rules file the
README shows (``recipes/rules/hf_gpt2.yaml``): it matches one device under its recipes (``RECIPES_OF`` in
tests/hf_models.py; relative loss difference <= 1e-5), its big weights are really sharded, and
``meshtrain plan`` plans it from the CLI. BERT and ViT: tests/test_hf_flax_encoders.py. Skipped without
`transformers` (a test-only dependency)."""

import os
import re

import optax
import pytest

import meshtrain as mt

transformers = pytest.importorskip("transformers")

from hf_models import ROOT, assert_matches_one_device, gpt2, shipped_rules  # noqa: E402  (needs transformers)


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


def test_gpt2_big_weights_are_sharded_by_the_readme_rules(rules_file):
    abstract = mt.abstract_state(gpt2(rules_file), optax.adam(1e-3), annotations=rules_file)
    plan = mt.make_plan(abstract, "fsdp_tp")
    specs = {leaf.path: leaf.spec for leaf in plan.group("params")}
    wte = next(s for p, s in specs.items() if p.endswith("wte/embedding"))
    c_attn = next(s for p, s in specs.items() if p.endswith("h/0/attn/c_attn/kernel"))
    assert "fsdp" in str(wte) and "tensor" in str(c_attn), (wte, c_attn)


@pytest.mark.slow
def test_gpt2_matches_one_device_under_its_recipes(tmp_path):
    assert_matches_one_device("gpt2", tmp_path)


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
def test_meshtrain_plan_plans_gpt2_from_the_cli_on_8_and_64_devices(tmp_path, monkeypatch, capsys):
    """The README's command (64 devices), from the repository's root with the shipped rules file, as a child
    process; the same on the 8 devices that exist (compiled, not traced) through the CLI's entry point
    in-process (a second child would only repeat its ~4 s of imports)."""
    import sys

    import processes
    from meshtrain.cli import main

    model = tmp_path / "gpt2_model.py"
    model.write_text(MODEL_FILE)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    batch = ",".join(f"{k}=64x128:int32" for k in ("inputs", "targets", "mask", "positions"))
    argv = ["plan", "--model", f"{model}:make", "--rules", "recipes/rules/hf_gpt2.yaml", "--batch", batch, "--loss",
            f"{model}:loss", "--recipe", "fsdp_tp"]
    out = processes.run([sys.executable, "-m", "meshtrain", *argv, "--devices", "64"], capture_output=True, text=True,
                        env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(64 devices," in out.stdout and "memory per device" in out.stdout, out.stdout[:2000]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the model file's folder goes on it: not for later tests
    code = main([*argv, "--devices", "8"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    assert "(8 devices," in printed.out and "memory per device" in printed.out, printed.out[:2000]
