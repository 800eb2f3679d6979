"""The Trainer with the user's data: a grain iterator's position goes into the checkpoint and a
resumed run continues bit-exact; a plain iterable that ends stops the run with a clear error and
keeps its committed checkpoint; built-in image and masked-LM tasks report their metrics."""

import json
import os

import numpy as np
import optax
import pytest
from flax import nnx

from meshtrain.errors import MeshtrainError
from meshtrain.train import TrainConfig, Trainer

grain = pytest.importorskip("grain")


class Regressor(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (8, 32)), out_sharding=("embed", "mlp"))
        self.w2 = nnx.Param(init(rngs.params(), (32, 8)), out_sharding=("mlp", "embed"))

    def __call__(self, x):
        return np.float32(0.5) * (x @ self.w1[...]) @ self.w2[...]


def loss_fn(model, batch):
    err = (model(batch["x"]) - batch["y"]) ** 2
    return err.sum(), err.size, {"max_err": err.max() * err.size}


ADAM = optax.adam(1e-2)  # no schedule: a 3-step run and the first 3 steps of a 6-step run match


def grain_batches():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(256, 8)).astype(np.float32)
    ds = (grain.MapDataset.source(np.arange(256)).shuffle(seed=1)
          .map(lambda i: {"x": xs[i], "y": np.roll(xs[i], 1)}).batch(16).repeat())
    return iter(ds.to_iter_dataset())


def config(out, **kw):
    base = dict(recipe="fsdp", steps=6, lr=1e-2, warmup_steps=0, eval_every=0, progress="none", out=str(out))
    base.update(kw)
    return TrainConfig(**base)


def losses(run):
    recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.mark.slow
def test_grain_position_is_checkpointed_and_resume_is_bit_exact(tmp_path):
    whole = Trainer(config(tmp_path / "whole"), model=Regressor, loss_fn=loss_fn, data=grain_batches(), tx=ADAM).run()
    first = Trainer(config(tmp_path / "split", steps=3, ckpt_every=3), model=Regressor, loss_fn=loss_fn,
                    data=grain_batches(), tx=ADAM).run()
    assert first.steps == 3
    meta = json.load(open(tmp_path / "split" / "checkpoints" / "3" / "meshtrain-meta.json"))
    assert meta["data_state"]["kind"] == "grain" and meta["data_state"]["batches"] == 3
    Trainer(config(tmp_path / "split", ckpt_every=3, resume="latest"), model=Regressor, loss_fn=loss_fn,
            data=grain_batches(), tx=ADAM).run()
    assert losses(tmp_path / "split") == losses(whole.run_dir)  # bit-exact, steps 1..6
    rec = [json.loads(l) for l in open(tmp_path / "split" / "metrics.jsonl") if '"max_err"' in l][0]
    assert rec["max_err"] >= rec["loss"] > 0  # the loss function's own metric, ÷ the global weight


def test_a_source_that_ends_stops_with_a_clear_error_and_keeps_checkpoints(tmp_path):
    data = [next(grain_batches()) for _ in range(1)]
    finite = iter(data * 4)   # 4 batches, then StopIteration
    with pytest.raises(MeshtrainError, match="ended after 4 batches.*lower --steps"):
        Trainer(config(tmp_path / "short", steps=6, ckpt_every=2), model=Regressor, loss_fn=loss_fn,
                data=finite).run()
    assert sorted(n for n in os.listdir(tmp_path / "short" / "checkpoints") if n.isdigit()) == ["2", "4"]
