"""LoRA runs out of meshtrain (issue 31, deliverable 5): the adapted model's forward equals a plain model
carrying the merged weights; `meshtrain export RUN --lora merged` loads in transformers and gives the LoRA
run's own logits, `--lora adapters` writes PEFT's names, shapes and config; `meshtrain generate RUN` on the
LoRA run gives the merged export's greedy tokens; LoRA with chat SFT and with an fp8 recipe from --init-from;
the CLI's bad-rank error and `plan --lora-rank --json` figures."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

import meshtrain as mt
from meshtrain.abstract import split_model
from meshtrain.models.lora import LoRABase, LoRAConfig, adapted_weights, lora_factory, merge_adapters

from helpers import rel_diff

TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "head")


def _flat(pure):
    return {"/".join(map(str, k)): np.asarray(v) for k, v in flatten_dict(pure).items()}


def test_adapted_forward_equals_a_plain_model_with_the_merged_weights():
    with nnx.use_eager_sharding(False):  # concrete weights, no mesh: the forward pass itself is compared
        _compare_adapted_and_merged(LoRABase.PARAM)


def test_int8_base_merges_to_the_weight_the_adapted_model_reads():
    """The int8 base (per-output-channel scales) dequantised and merged on the host equals what the adapted
    model computes for each target weight (f32 against the host's f64-then-f32: within 1e-6)."""
    with nnx.use_eager_sharding(False):
        model, lora, _ = _adapted_model(LoRABase.INT8)
        _, params, frozen = split_model(model)
        merged = merge_adapters(_flat(params), _flat(frozen), lora.scale)
        checked = 0
        for path, adapted in adapted_weights(model):
            assert frozen_dtype(frozen, path) == np.int8
            assert rel_diff(np.asarray(adapted[...]), merged[path]) <= 1e-6, path
            checked += 1
        assert checked == 8


def frozen_dtype(frozen, path):
    return _flat(frozen)[path + "/base"].dtype


def _adapted_model(base):
    cfg = mt.models.get_config("tiny")
    lora = LoRAConfig(rank=4, alpha=8.0, targets=TARGETS, base=base)
    model = lora_factory(mt.models.model_factory(cfg), lora)(nnx.Rngs(0))
    key = jax.random.key(1)
    for _, adapted in adapted_weights(model):  # B off zero, so every target's update counts
        key, sub = jax.random.split(key)
        adapted.lora_b[...] = 0.05 * jax.random.normal(sub, adapted.lora_b[...].shape, jnp.float32)
    return model, lora, cfg


def _compare_adapted_and_merged(base):
    model, lora, cfg = _adapted_model(base)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)))
    forward = nnx.jit(lambda m, t: m(t))   # one compiled program per model, not op by op
    adapted_logits = np.asarray(forward(model, tokens))
    _, params, frozen = split_model(model)
    merged = merge_adapters(_flat(params), _flat(frozen), lora.scale)
    plain = mt.models.model_factory(cfg)(nnx.Rngs(7))   # other random weights: all replaced below
    state = nnx.state(plain, nnx.Param)
    wanted = _flat(nnx.to_pure_dict(state))
    assert set(wanted) <= set(merged)
    nnx.replace_by_pure_dict(state, unflatten_dict({tuple(p.split("/")): jnp.asarray(merged[p], wanted[p].dtype)
                                                     for p in wanted}, sep=None))
    nnx.update(plain, state)
    plain_logits = np.asarray(forward(plain, tokens))
    base_only = np.asarray(forward(lora_factory(mt.models.model_factory(cfg), lora)(nnx.Rngs(0)), tokens))
    assert rel_diff(adapted_logits, base_only) > 1e-2   # the adapters change the output ...
    assert rel_diff(adapted_logits, plain_logits) <= 1e-5  # ... exactly as the merged weights do


transformers = pytest.importorskip("transformers")

from test_hf import TOKENS, hf_folder  # noqa: E402  (after the skip: test_hf needs transformers)

from meshtrain.checkpoint import Checkpointer  # noqa: E402
from meshtrain.cli import main  # noqa: E402
from meshtrain.train import TrainConfig, Trainer  # noqa: E402
from meshtrain.train.interop import import_hf  # noqa: E402

LORA_RUN = dict(recipe="fsdp", steps=3, batch_size=8, seq_len=16, lr=2e-2, warmup_steps=1, eval_every=0,
                ckpt_every=3, lora_rank=4, lora_alpha=8.0, lora_targets="q,v,o,down", progress="none")


def lora_run(tmp_path, **changes):
    """An imported tiny HF Llama (run folder tmp_path/run) fine-tuned with LoRA for 3 steps: (source folder,
    the source's logits of TOKENS, the LoRA run's TrainConfig)."""
    folder, base_logits = hf_folder(tmp_path / "src")
    run = str(tmp_path / "run")
    import_hf(folder, run)
    config = TrainConfig(**{**LORA_RUN, **changes}, model=run, init_from=run, out=str(tmp_path / "ft"))
    Trainer(config).run()
    return folder, base_logits, config


def own_logits(config):
    """The LoRA run's forward (adapted model, its last checkpoint) on TOKENS, under its own plan."""
    plan = Trainer(config).build_plan()
    ckpt = Checkpointer(f"{config.out}/checkpoints", save_every=1, reader=True)
    try:
        state = ckpt.restore(plan).state
    finally:
        ckpt.close()
    model = nnx.merge(plan.abstract.graphdef, state.params, state.model_state)
    with jax.set_mesh(plan.mesh):
        return np.asarray(model(jnp.asarray(TOKENS)))


def generated_ids(capsys, source):
    assert main(["generate", source, "--prompt-ids", "1,5,9,33", "--max-new-tokens", "8", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_ids"]


@pytest.mark.slow
def test_export_merged_and_adapters_and_generate_of_a_lora_run(tmp_path, capsys):
    from safetensors.numpy import load_file

    folder, base_logits, config = lora_run(tmp_path)
    merged, adapters = str(tmp_path / "merged"), str(tmp_path / "adapters")
    assert main(["export", config.out, "--out", merged]) == 0   # --lora merged: the default
    assert main(["export", config.out, "--out", adapters, "--lora", "adapters"]) == 0
    # the merged folder loads in transformers and gives the LoRA run's own logits
    hf_model = transformers.FlaxLlamaForCausalLM.from_pretrained(merged, from_pt=True, dtype=jnp.float32)
    ours = own_logits(config)
    assert np.abs(ours - base_logits).max() > 1e-2   # the adapters moved the output off the base's
    assert np.abs(np.asarray(hf_model(TOKENS).logits) - ours).max() < 1e-4
    # PEFT's folder: its names, shapes (lora_A (r, in), lora_B (out, r)) and the config fields PEFT reads
    peft = load_file(f"{adapters}/adapter_model.safetensors")
    layer0 = "base_model.model.model.layers.0."
    shapes = {"self_attn.q_proj": (32, 32), "self_attn.v_proj": (32, 16), "self_attn.o_proj": (32, 32),
              "mlp.down_proj": (64, 32)}
    assert len(peft) == 2 * 2 * len(shapes)   # A and B, 2 layers
    for module, (n_in, n_out) in shapes.items():
        assert peft[layer0 + module + ".lora_A.weight"].shape == (4, n_in)
        assert peft[layer0 + module + ".lora_B.weight"].shape == (n_out, 4)
    adapter_config = json.loads(open(f"{adapters}/adapter_config.json").read())
    assert {k: adapter_config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "fan_in_fan_out")} == \
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8.0, "fan_in_fan_out": False}
    assert sorted(adapter_config["target_modules"]) == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert adapter_config["base_model_name_or_path"] == str(tmp_path / "run")
    # PEFT's merge on the source's weights = the merged export, bit for bit (f64 product, one f32 rounding)
    base, out = load_file(f"{folder}/model.safetensors"), load_file(f"{merged}/model.safetensors")
    assert sorted(base) == sorted(out)
    moved = 0
    for name, w in out.items():
        stem = "base_model.model." + name[:-len(".weight")]
        if stem + ".lora_A.weight" not in peft:
            assert np.array_equal(w, base[name]), name
            continue
        want = base[name].astype(np.float64) + (8.0 / 4) * (peft[stem + ".lora_B.weight"].astype(np.float64) @
                                                             peft[stem + ".lora_A.weight"].astype(np.float64))
        assert np.array_equal(w, want.astype(np.float32)), name
        moved += not np.array_equal(w, base[name])
    assert moved == 8   # 4 targets × 2 layers: the adapters trained
    # the imported base holds no adapters: --lora adapters is refused in one line, nothing written
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "none"), "--lora", "adapters"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "holds no LoRA adapters" in err, err
    assert not (tmp_path / "none").exists()
    # generate on the LoRA run folder (merged on load) = generate on the merged export: the same greedy tokens
    from_run, from_export = generated_ids(capsys, config.out), generated_ids(capsys, merged)
    assert len(from_run) == 8 and from_run == from_export


@pytest.mark.slow
def test_lora_with_fp8_from_init_from_trains_on_the_loaded_base(tmp_path):
    """The fp8 recipe wraps the LoRA factory (its scales are built with the model): --init-from's weights still
    go onto the base, which stays bit-identical to the source's after training; the fp8 meta is model state."""
    from safetensors.numpy import load_file

    from meshtrain.hf.weights import hf_tensors

    folder, _, config = lora_run(tmp_path, recipe_options={"fp8": "delayed"}, steps=2, ckpt_every=2)
    plan = Trainer(config).build_plan()
    assert plan.recipe.fp8.value == "delayed"
    ckpt = Checkpointer(f"{config.out}/checkpoints", save_every=1, reader=True)
    try:
        state = ckpt.restore(plan).state
    finally:
        ckpt.close()
    flat = {mt.abstract.path_str(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state.model_state)[0]}
    assert any(p.endswith("amax_history") for p in flat)   # fp8 scaling state, carried beside the base
    base = {p[:-len("/base")] if p.endswith("/base") else p: x for p, x in flat.items() if p in plan.abstract.frozen_paths}
    source = load_file(f"{folder}/model.safetensors")
    cfg = mt.hf.model_config(folder)
    for name, tensor in hf_tensors(cfg, base):
        assert np.array_equal(tensor, source[name]), name
    assert np.all(np.isfinite([json.loads(l)["loss"] for l in open(f"{config.out}/metrics.jsonl")
                               if '"loss"' in l and '"step"' in l]))


@pytest.mark.slow
def test_lora_chat_sft_lowers_the_held_out_assistant_loss(tmp_path, capsys):
    """`data prepare --chat` + `train --init-from BASE --lora-rank 4`: the step counts the assistant's tokens
    only (the data's loss mask), and the held-out conversations' eval loss falls; the base stays frozen."""
    from test_chat_sft import chats, prepare, write_jsonl
    from test_chat_template import CHATML, tokenizer_folder

    from meshtrain.data.loader import BatchIterator
    from meshtrain.data.sources import prepared_source

    folder = tokenizer_folder(tmp_path / "src", CHATML)
    vocab = len(transformers.AutoTokenizer.from_pretrained(folder))
    hf_folder(tmp_path / "src", "llama", vocab_size=vocab, max_position_embeddings=64)
    run = str(tmp_path / "run")
    import_hf(folder, run)
    assert prepare(capsys, run, write_jsonl(tmp_path / "c.jsonl", chats(96)), tmp_path / "data")[0] == 0
    config = TrainConfig(model=run, init_from=run, data=str(tmp_path / "data"), recipe="fsdp", steps=12,
                         batch_size=8, seq_len=32, lr=3e-2, warmup_steps=2, val_fraction=0.25, eval_every=1,
                         eval_batches=2, lora_rank=4, lora_targets="q,k,v,o,gate,up,down,head",
                         out=str(tmp_path / "ft"), progress="none")
    summary = Trainer(config).run()
    records = [json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "step" in r]
    train, _ = prepared_source(str(tmp_path / "data")).split(0.25)
    first = BatchIterator(train, 8, 32, seed=0, prefetch=0).local_batch(0)
    assistant = int((first["targets"] >= 0).sum())
    assert 0 < assistant < first["targets"].size // 2 and steps[0]["weight"] == assistant
    evals = [r["eval_loss"] for r in steps if "eval_loss" in r]
    assert summary.steps == 12 and evals[-1] < evals[0] - 1.0, evals  # measured: 5.89 -> 2.65
