"""Any Flax model, unchanged (issue 22): rules for models nobody on this project wrote.

* A Linen model in flax's lm1b style: ``DenseGeneral`` kernels named with fewer logical names than
  dimensions (the trailing ones stay unsharded) and names meshtrain does not know (``kv``, ``joined_kv``),
  mapped by the rules' ``logical:`` section without editing the model.
* A HuggingFace-style wrapper (an object with a Linen ``.module``, ``.params``, ``.config``) whose tied
  output layer reads ``self.variables`` directly, with path rules on ``from_linen`` or on the Trainer.
* Each under the fsdp / fsdp_tp layouts its rules decide (``CASES``) through the Trainer vs one device
  (5 f32 steps, relative loss difference <= 1e-5); ``list_params`` / ``meshtrain plan --list-params``;
  ``--rules`` errors (exit 2, one line); ``--model path/file.py:fn`` importing its neighbour;
  ``from_linen`` starting no JAX backend.
"""

import dataclasses
import json
import os
import re
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import meshtrain as mt
from meshtrain.models import from_linen
from meshtrain.train import TrainConfig, Trainer

import processes

STEPS, BATCH, SEQ, VOCAB, DIM, HEADS, HEAD_DIM, HIDDEN = 5, 16, 8, 64, 64, 8, 8, 128
RECIPES = ["dp", "fsdp", "tp", "fsdp_tp"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
lp = nn.with_logical_partitioning


# -- the users' models ---------------------------------------------------------------------------

class Lm1bStyle(nn.Module):
    """Logical names as flax's lm1b example writes them: ``DenseGeneral`` kernels of rank 3 named by two
    names (``('embed', 'joined_kv')``), ``kv`` and ``joined_kv`` unknown to meshtrain, a tied output
    (``Embed.attend``)."""

    @nn.compact
    def __call__(self, tokens):
        init = nn.initializers.lecun_normal()
        embed = nn.Embed(VOCAB, DIM, embedding_init=lp(nn.initializers.normal(1.0), ("vocab", "embed")))
        x = embed(tokens)
        q = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, kernel_init=lp(init, ("embed", "joined_kv")))(x)
        k = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, kernel_init=lp(init, ("embed", "kv")))(x)
        v = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, kernel_init=lp(init, ("embed", "kv")))(x)
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM ** 0.5)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + nn.DenseGeneral(DIM, axis=(-2, -1), use_bias=False,
                                kernel_init=lp(init, ("joined_kv", "embed")))(attended)
        x = nn.LayerNorm(scale_init=lp(nn.initializers.ones, ("embed",)),
                         bias_init=lp(nn.initializers.zeros, ("embed",)))(x)
        h = nn.relu(nn.Dense(HIDDEN, use_bias=False, kernel_init=lp(init, ("embed", "mlp")))(x))
        x = x + nn.Dense(DIM, use_bias=False, kernel_init=lp(init, ("mlp", "embed")))(h)
        return embed.attend(x.mean(axis=1))                                   # (batch, vocab)


LM1B_RULES = {"logical": {"kv": None, "joined_kv": "tensor"}}


class TinyGPTModule(nn.Module):
    """GPT-2's shape in miniature, no logical names; the head is tied the way HF's Flax GPT-2 ties it:
    it reads the embedding from ``self.variables``."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM, name="wte")(tokens) + nn.Embed(SEQ, DIM, name="wpe")(jnp.arange(tokens.shape[1]))
        h = nn.LayerNorm(name="ln_1")(x)
        x = x + nn.Dense(DIM, name="c_proj")(nn.gelu(nn.Dense(HIDDEN, name="c_fc")(h)))
        x = nn.LayerNorm(name="ln_f")(x).mean(axis=1)
        return x @ self.variables["params"]["wte"]["embedding"].T          # a tied head, like HF's


@dataclasses.dataclass(frozen=True)
class TinyGPTConfig:
    vocab_size: int = VOCAB
    n_embd: int = DIM


class TinyHFModel:
    """What ``transformers``' ``FlaxGPT2LMHeadModel(config)`` is to meshtrain: a Linen ``.module``, its
    initialised ``.params`` and a ``.config``."""

    def __init__(self, config: TinyGPTConfig, seed: int = 0):
        self.config = config
        self.module = TinyGPTModule()
        self.params = self.module.init(jax.random.key(seed), jnp.zeros((1, SEQ), jnp.int32))["params"]


GPT_RULES = {"paths": {"wte/embedding": ["vocab", "embed"], "wpe/embedding": [None, "embed"],
                       "c_fc/kernel": ["embed", "mlp"], "c_fc/bias": ["mlp"], "c_proj/kernel": ["mlp", "embed"],
                       ".*/(bias|scale)": [None]}}
SAMPLE = jax.ShapeDtypeStruct((1, SEQ), jnp.int32)


def classify(model, batch):
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return ce.sum(), ce.size


def batches():
    for i in range(10 ** 6):
        rng = np.random.default_rng([7, i])
        yield {"x": rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32),
               "y": rng.integers(0, VOCAB, size=(BATCH,)).astype(np.int32)}


#: name -> Trainer keyword arguments (fresh per run)
MODELS = {
    "lm1b": lambda: dict(model=from_linen(Lm1bStyle(), SAMPLE), rules=LM1B_RULES),
    "hf_rules_on_factory": lambda: dict(model=from_linen(TinyHFModel(TinyGPTConfig()), SAMPLE, rules=GPT_RULES)),
    "hf_rules_on_trainer": lambda: dict(model=from_linen(TinyHFModel(TinyGPTConfig()), SAMPLE), rules=GPT_RULES),
}


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return np.array([r["loss"] for r in records if "loss" in r])


def _train(out, recipe, devices=None, **kw):
    cfg = TrainConfig(recipe=recipe, steps=STEPS, batch_size=BATCH, eval_every=0, progress="none", out=str(out),
                      devices=devices, recipe_options={"compute_dtype": "float32"})
    return _losses(Trainer(cfg, loss_fn=classify, data=batches(), **kw).run().run_dir)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = _train(tmp_path_factory.mktemp(f"one-{model}") / "run", "dp", 1, **MODELS[model]())
        return cache[model]

    return get


#: Cut from the 4 recipes x 3 models product (MESHTRAIN_FULL_PARITY=1 runs all of it): every built-in recipe
#: runs against one device on the tiny decoder (test_parity.py); here each model runs the layouts its rules
#: decide. lm1b: fsdp (its `joined_kv` -> tensor left out on a mesh without `tensor`, `kv: null`) and fsdp_tp
#: (`joined_kv` on tensor, `embed` on fsdp, the short kernels' trailing dimension whole); the HF-style
#: wrapper: fsdp_tp (its path rules onto both axes, the tied head reading ``self.variables``), once with the
#: rules on ``from_linen`` and once on the Trainer (the same program: the second compiles from the cache).
#: dp and pure tp add nothing model-specific: the data split is fsdp's batch split, tp's layout is fsdp_tp's
#: tensor half.
FULL = os.environ.get("MESHTRAIN_FULL_PARITY", "") not in ("", "0")
CASES = [(r, m) for m in MODELS for r in RECIPES] if FULL else [
    ("fsdp", "lm1b"), ("fsdp_tp", "lm1b"), ("fsdp_tp", "hf_rules_on_factory"), ("fsdp_tp", "hf_rules_on_trainer")]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, model", CASES)
def test_recipe_matches_one_device(recipe, model, one_device, tmp_path):
    base = one_device(model)
    got = _train(tmp_path / "run", recipe, **MODELS[model]())
    assert len(base) == STEPS and np.all(np.isfinite(base))
    rel = float(np.max(np.abs(got - base) / np.abs(base)))
    assert rel <= 1e-5, (model, recipe, got, base)


# -- fast: names, rules, listings -------------------------------------------------------------------

def test_short_and_unknown_logical_names_plan_without_editing_the_model():
    factory = from_linen(Lm1bStyle(), SAMPLE)
    abstract = mt.abstract_state(factory, optax.adam(1e-3), annotations=LM1B_RULES)
    assert abstract.param_axes["DenseGeneral_0/kernel"] == ("embed", "joined_kv", None)
    assert abstract.short_axes["DenseGeneral_0/kernel"] == 2
    recipe = mt.get_recipe("fsdp_tp").with_mesh(fsdp=4, tensor=2)
    plan = mt.make_plan(abstract, recipe)
    leaf = {l.path: l for l in plan.group("params")}
    assert leaf["DenseGeneral_0/kernel"].spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert "2 logical names for 3 dimensions: the trailing 1 unsharded" in leaf["DenseGeneral_0/kernel"].rule
    assert leaf["DenseGeneral_1/kernel"].spec == jax.sharding.PartitionSpec("fsdp")            # kv: null
    assert "joined_kv→tensor [model rules]" in leaf["DenseGeneral_3/kernel"].rule
    # a mesh axis the recipe's mesh lacks is left out: joined_kv is not split under fsdp
    assert mt.make_plan(abstract, "fsdp").param_shardings["DenseGeneral_0"]["kernel"].spec == \
        jax.sharding.PartitionSpec("fsdp")
    # without the logical: section, every parameter using each unknown name is listed
    bare = mt.abstract_state(factory, optax.adam(1e-3))
    with pytest.raises(mt.RulesError) as err:
        mt.make_plan(bare, recipe)
    assert ("'joined_kv' (used by 2: DenseGeneral_0/kernel, DenseGeneral_3/kernel); 'kv' (used by 2: "
            "DenseGeneral_1/kernel, DenseGeneral_2/kernel)") in str(err.value)
    assert "\n" not in str(err.value)


def test_hf_style_wrapper_with_tied_weights():
    hf = TinyHFModel(TinyGPTConfig(), seed=3)
    factory = from_linen(hf, SAMPLE, rules=GPT_RULES)
    assert factory.config == TinyGPTConfig()
    abstract = mt.abstract_state(factory)
    assert abstract.param_axes["wte/embedding"] == ("vocab", "embed")
    tokens = jnp.arange(2 * SEQ, dtype=jnp.int32).reshape(2, SEQ) % VOCAB
    model = factory(nnx_rngs())
    expected = hf.module.apply({"params": hf.params}, tokens)                  # the pretrained weights
    np.testing.assert_allclose(model(tokens), expected, rtol=1e-6)
    fresh = from_linen(hf, SAMPLE, rules=GPT_RULES, weights="init")(nnx_rngs())
    assert not np.allclose(fresh(tokens), expected)
    with pytest.raises(TypeError, match=r"a flax.linen Module or a HuggingFace Flax model .*got str"):
        from_linen("gpt2", SAMPLE)


def test_linen_activations_keep_the_batch_split_so_the_traced_estimate_holds():
    """Without activation constraints XLA split this Linen model's activations over fsdp by their feature
    dimension and kept the whole batch on every device: the compiled step needed 11x the traced estimate
    (45.7 MB vs 4.1 MB per device). The Linen adapter keeps the batch dimension of its submodules' outputs
    on the batch mesh axes inside a step: 1.33x (the rest is XLA's working buffers)."""
    from meshtrain.analysis import estimate_memory, program_cost

    abstract = mt.abstract_state(from_linen(Lm1bStyle(), SAMPLE), optax.adamw(1e-3), annotations=LM1B_RULES)
    layout = mt.BatchLayout.from_example({"x": jax.ShapeDtypeStruct((64, 64), jnp.int32),
                                          "y": jax.ShapeDtypeStruct((64,), jnp.int32)})
    recipe = mt.get_recipe("fsdp")
    compiled = program_cost(mt.make_plan(abstract, recipe, batch=layout), classify)
    on_abstract_mesh = mt.make_plan(abstract, recipe, recipe.mesh.abstract(8), batch=layout)
    traced = estimate_memory(on_abstract_mesh, None, cost=program_cost(on_abstract_mesh, classify, compile=False))
    assert compiled.memory.peak < 1.5 * traced.total, (compiled.memory.peak, traced.total)


def nnx_rngs():
    from flax import nnx

    return nnx.Rngs(0)


def test_list_params_and_every_missing_parameter_named():
    factory = from_linen(TinyHFModel(TinyGPTConfig()), SAMPLE)
    infos = mt.list_params(factory)
    lines = [i.line() for i in infos]
    assert "wte/embedding  (64, 64)  float32  (none)  [none]" in lines
    assert "c_fc/kernel  (64, 128)  float32  (none)  [none]" in lines
    assert len(infos) == 10
    with pytest.raises(mt.RulesError) as err:
        mt.abstract_state(factory)
    assert str(err.value).startswith("10 parameters without logical axes: ")
    assert all(i.path in str(err.value) for i in infos)
    ruled = {i.path: i for i in mt.list_params(factory, GPT_RULES)}
    assert ruled["wpe/embedding"].names == (None, "embed") and ruled["wpe/embedding"].source == "rules"


@pytest.mark.parametrize("text, message", [
    ("pathz: {}\n", "rules {f}: top level: unknown section 'pathz'; the sections are paths, logical"),
    ("paths:\n  '(': [embed]\n", "rules {f}: paths: bad regular expression '(': missing ), unterminated subpattern"),
    ("logical:\n  kv: tensr\n", "rules {f}: logical.kv: 'tensr' is not a mesh axis, a list of mesh axes or null"),
    ("paths:\n  '.*': [null]\n", "logical names that no rule maps: 'joined_kv' (used by 2: DenseGeneral_0/kernel, "
                                 "DenseGeneral_3/kernel); 'kv' (used by 2:"),
])
def test_rules_file_errors_from_the_cli(text, message, tmp_path, monkeypatch, capsys):
    """The first case as a child process (the exit status and stderr a shell sees); the others through the CLI's
    entry point in-process (``main`` returns the status and prints the line), a child's ~2 s of imports saved."""
    (tmp_path / "lm1b_parts.py").write_text(textwrap.dedent(LM1B_FILE_PARTS))
    (tmp_path / "model.py").write_text(textwrap.dedent(LM1B_FILE))
    rules = tmp_path / "rules.yaml"
    rules.write_text(text)
    argv = ["plan", "--model", str(tmp_path / "model.py:make"), "--rules", str(rules), "--recipe", "fsdp",
            "--batch", f"x={BATCH}x{SEQ}:int32"]
    if text.startswith("pathz"):
        out = _cli(argv)
        code, stdout, stderr = out.returncode, out.stdout, out.stderr
    else:
        from meshtrain.cli import main
        monkeypatch.setattr(sys, "path", list(sys.path))   # the model file's folder goes on it: not for later tests
        code = main(argv)
        stdout, stderr = capsys.readouterr()
    assert code == 2, stdout + stderr
    assert stderr.startswith("error: " + message.format(f=rules)), stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def _cli(argv, code=None, cwd="/"):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    args = [sys.executable, "-c", code] if code else [sys.executable, "-m", "meshtrain", *argv]
    return processes.run(args, timeout=300, env=env, text=True, cwd=str(cwd))


#: a model file that imports a module next to it (``--model path/file.py:fn``)
LM1B_FILE_PARTS = """
import sys

sys.path[:0] = [{root!r}, {tests!r}]
from test_any_model_rules import Lm1bStyle, SAMPLE
""".replace("{root!r}", repr(ROOT)).replace("{tests!r}", repr(os.path.join(ROOT, "tests")))
LM1B_FILE = """
from lm1b_parts import Lm1bStyle, SAMPLE
from meshtrain.models import from_linen

make = from_linen(Lm1bStyle(), SAMPLE)
"""


def test_list_params_cli_and_model_file_next_to_its_modules(tmp_path):
    (tmp_path / "lm1b_parts.py").write_text(textwrap.dedent(LM1B_FILE_PARTS))
    (tmp_path / "model.py").write_text(textwrap.dedent(LM1B_FILE))
    out = _cli(["plan", "--model", str(tmp_path / "model.py:make"), "--list-params"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"# 9 parameters of --model {tmp_path / 'model.py:make'}: path  shape  dtype  " \
                       f"(logical names)  [from]"
    assert "DenseGeneral_0/kernel  (64, 8, 8)  float32  (embed, joined_kv)  [model]" in lines
    assert "# 0 without logical axes" in lines
    state = lines[lines.index("# 0 without logical axes") + 1:]  # then the model state: the wrapper's RNG streams
    assert state[0].startswith("# 4 model state variables") and len(state) == 5, state
    assert "to_nnx__rngs/dropout/key  ()  key<fry>  (none)  [rng stream: replicated]" in state


def test_from_linen_starts_no_jax_backend():
    """A model module may be imported (and from_linen called) before the device count is set."""
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
        import jax
        from test_any_model_rules import Lm1bStyle, SAMPLE
        from meshtrain.models import from_linen
        factory = from_linen(Lm1bStyle(), SAMPLE, rules={{"logical": {{"kv": None}}}})
        jax.config.update("jax_num_cpu_devices", 3)
        print(len(jax.devices()))
    """)
    out = _cli(None, code)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stdout + out.stderr


def _readme_block(kind, name, lang):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    m = re.search(rf"<!-- readme-{kind}: {re.escape(name)} -->\s*```{lang}\n(.*?)```", readme, re.S)
    assert m, f"README block {kind} {name!r} not found"
    return m.group(1)


@pytest.mark.slow
def test_readme_rules_example_commands_work(tmp_path, monkeypatch, capsys):
    """The README's Linen model, rules file and commands, as written: list, plan on 8 devices and on an
    AbstractMesh of 16."""
    (tmp_path / "mymodel.py").write_text(_readme_block("example", "linen-rules", "python"))
    (tmp_path / "rules.yaml").write_text(_readme_block("file", "rules.yaml", "yaml"))
    commands = [c.split() for c in _readme_block("commands", "linen-rules", "bash").strip().splitlines()]
    assert len(commands) == 3 and all(c[0] == "meshtrain" for c in commands)
    # The compiled plan on 8 devices as a child process, as a shell runs it; the listing and the traced plan on 16
    # through the same entry point in-process (a child each would only repeat ~2 s of imports).
    from meshtrain.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))   # the model file's folder goes on it: not for later tests
    outs = []
    for i, c in enumerate(commands):
        if i == 1:
            outs.append(_cli(c[1:], cwd=tmp_path))
        else:
            code = main(c[1:])
            printed = capsys.readouterr()
            outs.append(processes.CompletedProcess(c, code, printed.out, printed.err))
    for out in outs:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "DenseGeneral_3/kernel  (8, 8, 64)  float32  (joined_kv, embed)  [model]" in outs[0].stdout
    assert "# 4 without logical axes" in outs[0].stdout
    assert "joined_kv→tensor [model rules]; 2 logical names for 3 dimensions: the trailing 1 unsharded" \
        in outs[1].stdout
    assert "(16 devices" in outs[2].stdout
