"""One model source (issue 31): ``--model NAME | HF_DIR | RUN | file.py:fn`` resolved by
:mod:`meshtrain.model_source` for plan, train and generate; ``plan --model RUN|HF_DIR`` gives the
plan that ``train`` writes to its ``plan.json`` for the same recipe."""

import json
import os
import sys

import pytest

from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.model_source import RUN_HEADER_FILE, SourceKind, model_source, short_name, source_kind
from meshtrain.train.interop import import_hf
from meshtrain.train.rundir import METRICS_FILE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from probe_groups.hf import tiny_hf  # noqa: E402  (a tiny Llama-shaped HF folder: numpy + safetensors)

FACTORY = """
from meshtrain.models import model_factory, get_config

def make(rngs):
    return model_factory(get_config("tiny"))(rngs)
"""
#: the plan's own fields that `plan --json` and train's plan.json share (the rest of `plan --json` is analysis)
PLAN_KEYS = ("recipe", "recipe_settings", "mesh", "rules", "params", "optimizer", "batch", "per_device_bytes",
             "num_params", "replicated_params")


def test_each_kind_is_told_apart_without_reading_weights(tmp_path):
    assert RUN_HEADER_FILE == METRICS_FILE
    hf, run, empty = tmp_path / "hf", tmp_path / "run", tmp_path / "empty"
    for folder in (hf, run, empty):
        folder.mkdir()
    (hf / "config.json").write_text("{}")
    (run / METRICS_FILE).write_text("")
    assert source_kind(str(hf)) is SourceKind.HF_FOLDER and source_kind(str(run)) is SourceKind.RUN
    assert source_kind("tiny") is SourceKind.BUILTIN and source_kind("models.py:make") is SourceKind.FACTORY
    with pytest.raises(ConfigError, match="neither a HuggingFace config.json nor a run header"):
        source_kind(str(empty))
    with pytest.raises(ConfigError, match="no such folder"):
        source_kind(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="unknown model 'gpt9'.*HuggingFace folder.*built-in: tiny"):
        model_source("gpt9")
    with pytest.raises(ConfigError, match="names no model config"):
        model_source(str(run))
    assert (short_name("runs/base/"), short_name("m/models.py:make_mlp"), short_name("tiny")) == \
        ("base", "make_mlp", "tiny")


@pytest.mark.slow
def test_a_factory_file_is_the_same_model_for_plan_and_train(tmp_path, capsys):
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    source = model_source(f"{path}:make")
    assert source.kind is SourceKind.FACTORY and source.config is None and callable(source.factory())
    out = str(tmp_path / "ft")
    assert main(["train", "--model", f"{path}:make", "--steps", "1", "--batch-size", "8", "--seq-len", "16",
                 "--eval-every", "0", "--progress", "none", "--out", out]) == 0
    trained = json.load(open(os.path.join(out, "plan.json")))
    assert main(["plan", "--model", f"{path}:make", "--list-params", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(p["path"] for p in listed if p["group"] == "params") == sorted(p["path"] for p in trained["params"])


@pytest.mark.slow
def test_plan_of_a_run_or_hf_folder_is_train_plan_json(tmp_path, capsys):
    """Must show (issue 31): `plan --model RUN` and `plan --model HF_DIR` give train's plan.json."""
    src, run = str(tmp_path / "src"), str(tmp_path / "run")
    tiny_hf(src, vocab=300)
    import_hf(src, run, devices=1)
    shape = ["--recipe", "fsdp_tp", "--batch-size", "8", "--seq-len", "16"]
    for model, out in ((run, "ft_run"), (src, "ft_hf")):
        assert main(["train", "--model", model, "--init-from", model, *shape, "--steps", "1", "--eval-every", "0",
                     "--progress", "none", "--out", str(tmp_path / out)]) == 0
        trained = json.load(open(tmp_path / out / "plan.json"))
        assert trained["num_params"] == 35232 + 2 * 40 * 32  # the imported decoder (vocabulary 300), not a built-in
        capsys.readouterr()
        assert main(["plan", "--model", model, *shape, "--json"]) == 0
        planned = json.loads(capsys.readouterr().out)
        assert {k: planned[k] for k in PLAN_KEYS} == {k: trained[k] for k in PLAN_KEYS}, model
    assert main(["plan", "--model", run, "--recipe", "auto", "--top", "1", "--devices", "8"]) == 0
    assert "searched" in capsys.readouterr().out


def test_generate_reads_an_hf_folder_as_its_import(tmp_path, capsys):
    """`generate HF_DIR` gives the tokens and log-probabilities of `generate RUN` for the run `import` made."""
    src, run = str(tmp_path / "src"), str(tmp_path / "run")
    tiny_hf(src)
    import_hf(src, run, devices=1)
    outputs = []
    for folder in (src, run):
        capsys.readouterr()
        assert main(["generate", folder, "--prompt-ids", "1,5,9,33", "--max-new-tokens", "4", "--json",
                     "--devices", "2"]) == 0
        outputs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outputs[0]["new_ids"] == outputs[1]["new_ids"] and len(outputs[0]["new_ids"]) == 4
    assert outputs[0]["new_logprobs"] == pytest.approx(outputs[1]["new_logprobs"], abs=1e-5)
    for args, says in (([src, "--step", "3"], "is a HuggingFace folder (one set of weights, no steps)"),
                       (["tiny"], "'tiny' is a built-in config, which holds no trained weights"),
                       (["models.py:make"], "is a model factory, which holds no trained weights")):
        assert main(["generate", *args, "--prompt-ids", "1", "--max-new-tokens", "1"]) == 2
        assert says in capsys.readouterr().err
