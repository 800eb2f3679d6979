"""`meshtrain import` / `export` hardening (issues 35 and 31), in process: config.json fields checked
by type and range, the tensors audited, run headers read as a decoder's or refused, the output
folder's failures typed, the special token ids carried to the export. The CLI's side of the same
cases (exit codes, no traceback, nothing left behind) is tests/test_probe_hf.py."""

import dataclasses
import errno
import json
import os
import signal
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from meshtrain.errors import ConfigError, DiskError
from meshtrain.hf import model_config
from meshtrain.hf.output import output_folder
from meshtrain.hf.run_config import run_decoder_config
from meshtrain.models import get_config
from meshtrain.hf.validate import check_config, special_token_ids
from meshtrain.train.interop import export_hf, import_hf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from probe_groups.hf import tiny_hf  # noqa: E402  (the probe's HF folder writer: numpy + safetensors)

GOOD = {"model_type": "llama", "vocab_size": 260, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": None, "head_dim": None, "sliding_window": None,
        "max_position_embeddings": 64, "rope_theta": 1e4, "rms_norm_eps": 1e-5, "rope_scaling": None}


@pytest.mark.parametrize("field, value, says", [
    ("head_dim", "8", "head_dim='8'"),
    ("num_key_value_heads", 0, "num_key_value_heads=0"),
    ("intermediate_size", 2.5, "intermediate_size=2.5"),
    ("hidden_size", "32", "hidden_size='32'"),
    ("vocab_size", True, "vocab_size=True"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan"),
    ("rope_theta", -1, "rope_theta=-1"),
    ("attention_bias", "no", "attention_bias='no'"),
    ("hidden_act", 3, "hidden_act=3"),
    ("rope_scaling", {"rope_type": "llama3", "factor": "8"}, "rope_scaling.factor='8'"),
    ("rope_scaling", [8.0], "rope_scaling=[8.0]"),
    ("hidden_size", 30, "hidden_size=30 is not a multiple of num_attention_heads=4"),
])
def test_every_field_read_is_checked_by_type_and_range(field, value, says):
    with pytest.raises(ConfigError) as err:
        check_config({**GOOD, field: value}, "models/x")
    assert says in str(err.value) and "models/x/config.json" in str(err.value)


def test_nulls_that_mean_the_default_pass_and_mixtral_counts_are_checked():
    from meshtrain.hf import decoder_config

    check_config(GOOD, "x")
    with pytest.raises(ConfigError, match="model_type \\['llama'\\] is not supported"):
        decoder_config({**GOOD, "model_type": ["llama"]}, folder="x")
    mixtral = {**GOOD, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5}
    with pytest.raises(ConfigError, match="num_experts_per_tok=5 .* at most num_local_experts=4"):
        check_config(mixtral, "x")


def test_special_token_ids_keep_only_ids_of_the_vocabulary():
    assert special_token_ids({"vocab_size": 10, "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": -1}) == \
        {"bos_token_id": 1, "eos_token_id": [2, 3]}
    assert special_token_ids({"vocab_size": 10, "bos_token_id": 10, "eos_token_id": "2"}) == {}


def test_unread_tensors_are_reported_and_more_experts_refused(tmp_path, recwarn):
    from meshtrain.hf.audit import audit
    from meshtrain.hf.weights import SafetensorsFolder

    folder = str(tmp_path / "src")
    tiny_hf(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32) for i in range(2)})
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    cfg = model_config(folder)
    shapes = {"embedding_vd": (260, 32), "final_norm/scale": (32,), "lm_head_dv": (32, 260),
              "blocks/attn/wq_dnh": (2, 32, 4, 8), "blocks/attn/wk_dkh": (2, 32, 2, 8),
              "blocks/attn/wv_dkh": (2, 32, 2, 8), "blocks/attn/wo_nhd": (2, 4, 8, 32),
              "blocks/attn_norm/scale": (2, 32), "blocks/mlp_norm/scale": (2, 32), "blocks/mlp/gate_df": (2, 32, 64),
              "blocks/mlp/up_df": (2, 32, 64), "blocks/mlp/down_fd": (2, 64, 32)}
    [note] = audit(SafetensorsFolder(folder), cfg, shapes)
    assert "2 tensor(s)" in note and "model.layers.0.self_attn.rotary_emb.inv_freq" in note

    moe = str(tmp_path / "moe")
    tiny_hf(moe, kind="mixtral")
    config = json.load(open(os.path.join(moe, "config.json")))
    config["num_local_experts"] = 3  # the file holds 4 experts per layer
    json.dump(config, open(os.path.join(moe, "config.json"), "w"))
    with pytest.raises(ConfigError, match=r"gate.weight' has shape \(4, 32\); config.json implies \(3, 32\)"):
        import_hf(moe, str(tmp_path / "run"), devices=1)
    assert not os.path.exists(tmp_path / "run")


def _run_header(tmp_path, model_config):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    header = {"event": "start", "run_settings": {"model": "m"}, "model_config": model_config}
    (run / "metrics.jsonl").write_text(json.dumps(header) + "\n")
    return str(run)


def test_run_decoder_config_names_the_file_and_field(tmp_path):
    decoder = {"name": "d", "vocab_size": 16, "d_model": 8, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
               "head_dim": 4, "d_ff": 16, "max_seq_len": 8, "rope_scaling": [8.0, 1.0, 4.0, 8]}
    assert run_decoder_config(_run_header(tmp_path, decoder), "export").rope_scaling == (8.0, 1.0, 4.0, 8)
    for broken, says in [({**decoder, "n_kv_heads": None}, "field 'n_kv_heads' is None"),
                         ({**decoder, "rope_theta": "big"}, "field 'rope_theta' is 'big'"),
                         ({**decoder, "n_heads": 3, "n_kv_heads": 2}, "n_heads=3 of model 'd' is not a multiple of "
                                                                      "n_kv_heads=2"),
                         ({k: v for k, v in decoder.items() if k != "d_ff"}, "lacks the field 'd_ff'"),
                         (dataclasses.asdict(get_config("vit-tiny")), "not a decoder"),
                         ({"image_size": 32, "patch_size": 4}, "lacks the field"),
                         (None, "model_config is a NoneType")]:
        with pytest.raises(ConfigError) as err:
            run_decoder_config(_run_header(tmp_path, broken), "generate")
        assert says in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="not a run folder"):
        run_decoder_config(str(tmp_path / "nothing"), "export")


@pytest.mark.parametrize("code, error", [(errno.ENOSPC, DiskError), (errno.EROFS, ConfigError)])
def test_output_folder_types_write_errors_and_leaves_nothing(tmp_path, code, error):
    out = str(tmp_path / "out")
    with pytest.raises(error, match="--out"):
        with output_folder(out) as partial:
            open(os.path.join(partial, "a"), "w").write("x")
            raise OSError(code, os.strerror(code), partial)
    assert os.listdir(tmp_path) == []


def test_a_swallowed_ctrl_c_stops_before_the_rename(tmp_path):
    out = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        with output_folder(out) as partial:
            open(os.path.join(partial, "a"), "w").write("x")
            try:  # where a library swallows it (a garbage-collector callback, a thread)
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass
    assert os.listdir(tmp_path) == []


def test_export_carries_the_special_token_ids(tmp_path):
    """Issue 31: ids from the imported config.json; else from the run's tokenizer files."""
    from tokenizers import Tokenizer, models

    src = str(tmp_path / "src")
    tiny_hf(src, pad_token_id=0)
    import_hf(src, str(tmp_path / "run"), devices=1)
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"), devices=1)
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert {k: config[k] for k in ids} == ids
    assert json.load(open(tmp_path / "hf" / "generation_config.json")) == {**ids, "_from_model_config": True}

    plain = str(tmp_path / "plain")
    tiny_hf(plain, bos_token_id=None, eos_token_id=None)
    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 5, "</s>": 6}, unk_token="<unk>")).save(
        os.path.join(plain, "tokenizer.json"))
    json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}}, open(os.path.join(plain, "tokenizer_config.json"),
                                                                          "w"))
    import_hf(plain, str(tmp_path / "run2"), devices=1)
    export_hf(str(tmp_path / "run2"), str(tmp_path / "hf2"), devices=1)
    assert json.load(open(tmp_path / "hf2" / "generation_config.json")) == \
        {"bos_token_id": 5, "eos_token_id": 6, "_from_model_config": True}


def test_a_ctrl_c_inside_a_deferred_block_waits_for_its_end(tmp_path):
    """The import's checkpoint save runs deferred: a Ctrl-C inside Orbax would leave its threads
    writing into the partial folder being removed."""
    from meshtrain.hf.output import Interrupts

    guard, finished = Interrupts(), []
    try:
        with pytest.raises(KeyboardInterrupt):
            with output_folder(str(tmp_path / "out"), guard=guard) as partial:
                with guard.deferred():
                    signal.raise_signal(signal.SIGINT)
                    finished.append(partial)  # reached: the interrupt waited
    finally:
        guard.restore()
    assert finished and os.listdir(tmp_path) == []


def test_export_leaves_the_run_as_it_was(tmp_path):
    """Export reads the checkpoint as a reader: the run's lock file keeps its bytes and a save in
    flight (a live run's temporary step folder) is not cleaned away."""
    src = str(tmp_path / "src")
    tiny_hf(src)
    import_hf(src, str(tmp_path / "run"), devices=1)
    checkpoints = tmp_path / "run" / "checkpoints"
    lock = checkpoints / ".meshtrain-writer.lock"
    before = lock.read_bytes()
    (checkpoints / "5.orbax-checkpoint-tmp").mkdir()
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"), devices=1)
    assert lock.read_bytes() == before and (checkpoints / "5.orbax-checkpoint-tmp").is_dir()
