"""Fine-tuning defaults (issue 31): a run that starts from trained weights (``--init-from``) gets a
small learning rate and a warmup relative to ``--steps``; flags, ``--set`` and ``--config`` still win;
``--help`` and the run header say so; a warmup longer than half the run is warned about. The README's
import → fine-tune example lowers the eval loss on held-out text of the fine-tune data."""

import json
import os
import sys

import numpy as np
import pytest

from meshtrain.cli import main
from meshtrain.train.config import FINE_TUNING, FROM_SCRATCH, TrainConfig, lr_schedule
from meshtrain.train.interop import import_hf
from meshtrain.train.run_config import RunConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from probe_groups.hf import tiny_hf  # noqa: E402  (a tiny Llama-shaped HF folder: numpy + safetensors)


def test_defaults_follow_init_from_and_given_values_win(tmp_path):
    scratch, tuned = TrainConfig(steps=200), TrainConfig(steps=200, init_from="runs/base")
    assert (scratch.peak_lr, scratch.warmup) == (FROM_SCRATCH.lr, 20) == (3e-3, 20)
    assert (tuned.peak_lr, tuned.warmup) == (FINE_TUNING.lr, 10) == (1e-4, 10)   # 1/20 of --steps
    assert TrainConfig(steps=20, init_from="x").warmup == 1 and TrainConfig(steps=5, init_from="x").warmup == 1
    given = TrainConfig(steps=200, init_from="x", lr=3e-4, warmup_steps=0)
    assert (given.peak_lr, given.warmup) == (3e-4, 0) and "defaults" not in given.schedule_text()
    assert "fine-tuning defaults: --init-from" in tuned.schedule_text()
    schedule = lr_schedule(tuned)
    assert float(schedule(10)) == pytest.approx(1e-4) and float(schedule(200)) == pytest.approx(1e-5)
    # --set and --config give values as any flag does
    path = tmp_path / "run.yaml"
    path.write_text("model: {init_from: runs/base}\noptimizer: {lr: 2.0e-4}\n")
    cfg = RunConfig.from_yaml_file(str(path)).with_values({"optimizer.warmup_steps": "3"}).train_config()
    assert (cfg.peak_lr, cfg.warmup) == (2e-4, 3)
    # the warning: warmup longer than half the run
    assert TrainConfig(steps=30).warmup_warning() is not None            # 20 of 30 steps from scratch
    assert TrainConfig(steps=30, init_from="x").warmup_warning() is None  # 2 of 30 when fine-tuning
    assert "--warmup-steps 1" in TrainConfig(steps=20, warmup_steps=15).warmup_warning()


def test_help_names_both_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: 3e-3 from scratch; 1e-4 with --init-from: fine-tuning" in text
    assert "default: 20 from scratch; 1/20 of --steps, at least 1, with --init-from" in text


def _text(path, words: str, sentences=3000, seed=0):
    """English-like text: sentences drawn from a small vocabulary."""
    rng = np.random.default_rng(seed)
    words = words.split()
    lines = [" ".join(rng.choice(words, size=rng.integers(4, 10))).capitalize() + "." for _ in range(sentences)]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_readme_fine_tune_lowers_eval_loss_under_the_defaults(tmp_path, capsys, recwarn, monkeypatch):
    """README: `meshtrain import HF_DIR --out runs/base`, then `train --model runs/base --init-from
    runs/base --data notes.txt --steps 100` without --lr / --warmup-steps: the eval loss on the held-out
    share of notes.txt falls. The "published" model is a tiny Llama-shaped folder trained here on other
    text (from scratch: 60 steps) and exported, so the fine-tune starts from weights that know something."""
    monkeypatch.chdir(tmp_path)
    tiny_hf("src")
    _text(tmp_path / "a.txt", "the a model data train layer weight token shard mesh device step loss")
    _text(tmp_path / "notes.txt", "we fine tune small chat answers kindly with short replies about gardens and rivers",
          seed=1)
    common = ["--batch-size", "8", "--seq-len", "32", "--val-fraction", "0.1", "--eval-batches", "2", "--progress",
              "none"]
    assert main(["train", "--model", "src", "--data", "a.txt", "--steps", "60", "--eval-every", "0", "--ckpt-every",
                 "60", "--out", "pre", *common]) == 0
    assert main(["export", "pre", "--out", "published"]) == 0
    assert main(["import", "published", "--out", "runs/base"]) == 0
    capsys.readouterr()
    assert main(["train", "--model", "runs/base", "--init-from", "runs/base", "--data", "notes.txt", "--steps", "100",
                 "--eval-every", "1", "--out", "runs/ft", *common]) == 0
    out = capsys.readouterr().out
    assert "AdamW lr 0.0001, warmup 5 of 100 steps, cosine to 1e-05 (fine-tuning defaults: --init-from" in out
    records = [json.loads(line) for line in (tmp_path / "runs" / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["optimizer"] == {"lr": 1e-4, "warmup_steps": 5, "min_lr": pytest.approx(1e-5),
                                       "defaults": "fine-tuning"}
    evals = [r["eval_loss"] for r in records if r.get("step") and "eval_loss" in r]
    # step 1's update has lr 0 (the warmup starts there): its eval is the imported model's (3.74 measured)
    assert len(evals) == 100 and evals[-1] < evals[0] - 0.2, (evals[0], evals[-1])   # 3.27 measured
    assert not [w for w in recwarn.list if "warmup" in str(w.message)]
