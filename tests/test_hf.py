"""HuggingFace checkpoints in and out: transformers' own Flax Llama and Mistral (tiny random configs
saved in HF's PyTorch naming) against meshtrain's decoder after `meshtrain import`, under dp and
fsdp_tp; import -> export bit-exact; export loadable by transformers; bad folders refused with
nothing written; fine-tuning from an imported run."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict
from safetensors.numpy import load_file, save_file

import meshtrain as mt
from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.hf import load_params, model_config
from meshtrain.train import TrainConfig, Trainer
from meshtrain.train.config import default_optimizer
from meshtrain.train.interop import export_hf, import_hf

transformers = pytest.importorskip("transformers")

TOKENS = np.array([[1, 5, 9, 33, 2, 70, 11, 4, 250, 17, 3, 99]])
SHAPE = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def pytorch_naming(flax_params, dtype=np.float32):
    """transformers' Flax parameter tree as the tensors its PyTorch models save (Linear: (out, in))."""
    out = {}
    for key, value in flatten_dict(flax_params).items():
        name, leaf, value = ".".join(key[:-1]), key[-1], np.asarray(value)
        tensor = value.T if leaf == "kernel" else value
        out[name + (".weight" if leaf in ("kernel", "embedding") else "." + leaf)] = \
            np.ascontiguousarray(tensor).astype(dtype)
    return out


def hf_folder(path, kind="llama", dtype=np.float32, **changes):
    """A tiny random HF model folder; returns (folder, transformers' logits of TOKENS in f32)."""
    config_cls, model_cls = {"llama": ("LlamaConfig", "FlaxLlamaForCausalLM"),
                             "qwen2": ("LlamaConfig", "FlaxLlamaForCausalLM"),
                             "mistral": ("MistralConfig", "FlaxMistralForCausalLM"),
                             "gemma": ("GemmaConfig", "FlaxGemmaForCausalLM")}[kind]
    if kind == "qwen2":  # Qwen2 = Llama with q/k/v biases and none on o_proj: Llama's biased attention, o's bias 0
        changes = {"attention_bias": True, **changes}
    if kind == "gemma":
        changes = {"head_dim": 16, "hidden_act": "gelu_pytorch_tanh", **changes}
    config = getattr(transformers, config_cls)(**{**SHAPE, **changes})
    model = getattr(transformers, model_cls)(config, seed=0)
    if kind == "qwen2":
        model.params = jax.tree_util.tree_map_with_path(
            lambda p, x: 0 * x if "o_proj" in jax.tree_util.keystr(p) and "bias" in jax.tree_util.keystr(p) else
            (x + 0.1 if "bias" in jax.tree_util.keystr(p) else x), model.params)  # nonzero q/k/v biases
    tensors = pytorch_naming(model.params, dtype)
    os.makedirs(path, exist_ok=True)
    config.torch_dtype = "bfloat16" if dtype != np.float32 else "float32"
    if kind == "qwen2":
        tensors = {k: v for k, v in tensors.items() if not k.endswith("o_proj.bias")}
        config.save_pretrained(path)
        saved = json.loads(open(os.path.join(path, "config.json")).read())
        saved.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], attention_bias=False,
                     use_sliding_window=False, sliding_window=4096)
        open(os.path.join(path, "config.json"), "w").write(json.dumps(saved))
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return str(path), np.asarray(model(TOKENS).logits, np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    # the reference reads the stored values back (bf16 files: the rounded ones), as meshtrain will
    reloaded = getattr(transformers, model_cls).from_pretrained(path, from_pt=True, dtype=jax.numpy.float32)
    return str(path), np.asarray(reloaded(TOKENS).logits, np.float32)


def meshtrain_logits(folder, recipe):
    cfg = model_config(folder)
    factory = mt.models.model_factory(cfg)
    abstract = mt.abstract_state(factory, default_optimizer(TrainConfig(), {}))
    plan = mt.make_plan(abstract, recipe, batch=mt.BatchSpec(8, TOKENS.shape[1]))
    params = load_params(folder, plan, cfg)
    model = nnx.merge(abstract.graphdef, params)
    with jax.set_mesh(plan.mesh):
        return np.asarray(model(jax.numpy.asarray(TOKENS)))


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma", "qwen2"])
def test_logits_match_transformers(tmp_path, kind):
    folder, reference = hf_folder(tmp_path / kind, kind)
    for recipe in ("dp", "fsdp_tp"):
        ours = meshtrain_logits(folder, recipe)
        assert np.abs(ours - reference).max() < 1e-4, (kind, recipe, np.abs(ours - reference).max())


def test_llama3_rope_scaling_matches_hf_formula():
    """Llama 3.1's frequency scaling against a numpy transcription of HuggingFace's
    ``_compute_llama3_parameters`` (transformers' Flax Llama has no rope scaling to compare with)."""
    from meshtrain.models.decoder import rope_frequencies

    factor, low, high, original, head_dim, theta = 8.0, 1.0, 4.0, 8192, 128, 500000.0
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv_freq
    llama = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    expected = np.where(medium, smoothed, llama)
    ours = np.asarray(rope_frequencies(head_dim, theta, (factor, low, high, original)))
    assert np.allclose(ours, expected, rtol=1e-5) and (ours != inv_freq.astype(np.float32)).sum() > 10


def test_import_export_is_bit_exact_and_transformers_loads_it(tmp_path):
    folder, reference = hf_folder(tmp_path / "src", dtype=jax.numpy.bfloat16)
    assert main(["import", folder, "--out", str(tmp_path / "run")]) == 0
    header = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert header["source_dtype"] == "bfloat16" and header["model_config"]["vocab_size"] == 260
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    before, after = load_file(os.path.join(folder, "model.safetensors")), load_file(str(tmp_path / "back" /
                                                                                      "model.safetensors"))
    assert sorted(before) == sorted(after) and len(before) == 21
    for name in before:
        assert before[name].dtype == after[name].dtype and before[name].tobytes() == after[name].tobytes(), name
    model = transformers.FlaxLlamaForCausalLM.from_pretrained(str(tmp_path / "back"), from_pt=True,
                                                             dtype=jax.numpy.float32)
    assert np.abs(np.asarray(model(TOKENS).logits) - reference).max() < 1e-4


def mixtral_folder(path, scale=1.0):
    """A Mixtral-shaped HF folder of random tensors (HF's names and shapes); returns (folder, tensors, config)."""
    rng = np.random.default_rng(0)
    config = {**SHAPE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
              "num_experts_per_tok": 2, "sliding_window": None, "hidden_act": "silu", "torch_dtype": "float32",
              "rope_theta": 10000.0}
    d, f, v, kv = 32, 64, 260, 16
    tensors = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        tensors.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                        p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                        p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                        p + "block_sparse_moe.gate.weight": (4, d)})
        for e in range(4):
            q = p + f"block_sparse_moe.experts.{e}."
            tensors.update({q + "w1.weight": (f, d), q + "w3.weight": (f, d), q + "w2.weight": (d, f)})
    arrays = {k: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else scale * rng.standard_normal(s))
              .astype(np.float32) for k, s in tensors.items()}
    os.makedirs(path, exist_ok=True)
    save_file(arrays, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    return str(path), arrays, config


def mixtral_reference(w, config, tokens):
    """HuggingFace's Mixtral forward pass, transcribed in numpy (f64): RMSNorm, rotate-half RoPE, GQA
    causal attention, softmax router -> top-k -> renormalised weights over SwiGLU experts."""
    d, n, kv, hd = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], 8
    norm = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + config["rms_norm_eps"]) * g  # noqa: E731
    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    t = len(tokens)
    inv = 1.0 / config["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(t)[:, None] * np.concatenate([inv, inv])[None]
    rot = lambda x: x * np.cos(ang)[:, None] + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * \
        np.sin(ang)[:, None]  # noqa: E731
    x = w["model.embed_tokens.weight"][tokens].astype(np.float64)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rot((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, n, hd))
        k = np.repeat(rot((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv, hd)), n // kv, axis=1)
        v = np.repeat((h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv, hd), n // kv, axis=1)
        scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("nts,snh->tnh", probs, v).reshape(t, n * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        logits = h @ w[p + "block_sparse_moe.gate.weight"].T
        router = np.exp(logits - logits.max(-1, keepdims=True))
        router /= router.sum(-1, keepdims=True)
        top = np.argsort(-router, -1)[:, :config["num_experts_per_tok"]]
        out = np.zeros_like(x)
        for i in range(t):
            chosen = router[i, top[i]] / router[i, top[i]].sum()
            for weight, e in zip(chosen, top[i]):
                q_ = p + f"block_sparse_moe.experts.{e}."
                out[i] += weight * ((silu(h[i] @ w[q_ + "w1.weight"].T) * (h[i] @ w[q_ + "w3.weight"].T))
                                    @ w[q_ + "w2.weight"].T)
        x = x + out
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_mixtral_matches_hf_formulas_and_round_trips(tmp_path):
    """A Mixtral-shaped checkpoint (HF's names and shapes) against a numpy transcription of HF's
    Mixtral, under fsdp_ep; every expert, router and attention tensor comes back unchanged."""
    folder, arrays, config = mixtral_folder(tmp_path / "mixtral", scale=0.2)
    reference = mixtral_reference(arrays, config, TOKENS[0])
    for recipe in ("dp", "fsdp_ep"):
        ours = meshtrain_logits(folder, recipe)[0]
        assert np.abs(ours - reference).max() < 1e-4 * max(1.0, np.abs(reference).max()), recipe
    import_hf(folder, str(tmp_path / "run"), recipe="fsdp_ep")
    export_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(arrays)
    assert all(np.array_equal(back[k], arrays[k]) for k in arrays)


def _index_with_missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weights = load_file(str(folder / "model-00001-of-00002.safetensors"))
    names = sorted(weights)
    index = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names}}
    index["weight_map"][names[-1]] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _wrong_shape(folder):
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = np.ones(31, np.float32)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _unsupported_field(folder):
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("break_it, message", [
    (_index_with_missing_shard, "model-00002-of-00002.safetensors' is missing"),
    (_wrong_shape, "tensor 'model.norm.weight' has shape (31,); config.json implies (32,)"),
    (_unsupported_field, "rope_scaling={'rope_type': 'yarn', 'factor': 4.0} is not supported"),
])
def test_bad_folders_are_refused_and_nothing_is_written(tmp_path, capsys, break_it, message):
    folder, _ = hf_folder(tmp_path / "src")
    break_it(tmp_path / "src")
    assert main(["import", folder, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not [p for p in os.listdir(tmp_path) if p.startswith("run")]


def test_fine_tune_from_an_imported_run(tmp_path):
    folder, _ = hf_folder(tmp_path / "src")
    import_hf(folder, str(tmp_path / "imported"))
    config = TrainConfig(model=str(tmp_path / "imported"), init_from=str(tmp_path / "imported"), recipe="fsdp_tp",
                         steps=2, batch_size=8, seq_len=16, eval_every=0, out=str(tmp_path / "ft"), progress="none")
    summary = Trainer(config).run()
    first = json.loads((tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()[1])
    assert summary.steps == 2 and abs(first["loss"] - np.log(260)) < 0.2  # random HF init: about ln(vocab)
    with pytest.raises(ConfigError, match="neither a HuggingFace folder"):
        Trainer(TrainConfig(model="tiny", init_from=str(tmp_path), steps=1, out=str(tmp_path / "x"),
                            progress="none")).run()


def test_each_device_reads_only_its_blocks(tmp_path, monkeypatch):
    """Bytes read from the safetensors files, summed over devices, equal the plan's parameter bytes
    per device × devices: no device reads a tensor it does not hold (fsdp_tp on 8 devices)."""
    from meshtrain.hf import weights

    folder, _ = hf_folder(tmp_path / "src")
    read = []
    original = weights.SafetensorsFolder.slice

    class Counting:
        def __init__(self, view):
            self.view = view

        def __getitem__(self, index):
            block = self.view[index]
            read.append(block.nbytes)
            return block

    monkeypatch.setattr(weights.SafetensorsFolder, "slice", lambda self, name, shape: Counting(original(self, name,
                                                                                                      shape)))
    cfg = model_config(folder)
    plan = mt.make_plan(mt.abstract_state(mt.models.model_factory(cfg), default_optimizer(TrainConfig(), {})),
                        "fsdp_tp", batch=mt.BatchSpec(8, 16))
    jax.block_until_ready(load_params(folder, plan, cfg))
    assert sum(read) == plan.per_device_bytes()["params"] * plan.num_devices


@pytest.mark.parametrize("kind", ["gemma", "qwen2"])
def test_gemma_and_qwen2_round_trip(tmp_path, kind):
    folder, _ = hf_folder(tmp_path / "src", kind)
    import_hf(folder, str(tmp_path / "run"))
    export_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    before, after = load_file(os.path.join(folder, "model.safetensors")), load_file(str(tmp_path / "back" /
                                                                                      "model.safetensors"))
    assert sorted(before) == sorted(after) and all(np.array_equal(before[k], after[k]) for k in before)
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == kind and config["tie_word_embeddings"] == (kind == "gemma")


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma"])
def test_generate_scores_an_import_as_transformers_does(tmp_path, kind, capsys):
    """The import checked through generation: `meshtrain generate RUN --prompt-ids ... --max-new-tokens 0
    --prompt-logprobs --json` gives transformers' log-probabilities of the same tokens (f32), under dp
    and fsdp_tp."""
    folder, logits = hf_folder(tmp_path / "src", kind)
    import_hf(folder, str(tmp_path / "run"))
    ids = TOKENS[0]
    logp = logits[0] - np.log(np.exp(logits[0] - logits[0].max(-1, keepdims=True)).sum(-1, keepdims=True)) - \
        logits[0].max(-1, keepdims=True)
    expected = logp[np.arange(len(ids) - 1), ids[1:]]
    for recipe in ("dp", "fsdp_tp"):
        assert main(["generate", str(tmp_path / "run"), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens",
                     "0", "--prompt-logprobs", "--json", "--recipe", recipe]) == 0
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert np.abs(np.array(record["prompt_logprobs"]) - expected).max() < 1e-4, (kind, recipe)
