"""Checkpointer API: save/restore round trip, async saves with donation, interval and retention,
mismatch errors, JSON validation, re-saving steps, the ``meshtrain ckpt`` command."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (TINY_BATCH, TINY_SEQ, assert_bit_exact, assert_on_mesh, device, mesh_for, random_state,
                     tiny_abstract)

import meshtrain as mt
from meshtrain.checkpoint import (Checkpointer, CheckpointError, CheckpointWarning, Compression, Restored,
                                  SaveResult, StepStatus, inspect_checkpoint, integrity)


@pytest.fixture(scope="module")
def run():
    """A tiny fsdp plan on 8 devices, a donating update step, and host states for steps 1..4."""
    recipe, mesh = mesh_for("fsdp", 8)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    shardings = mt.state_shardings(plan)
    update = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), in_shardings=(shardings,),
                     out_shardings=shardings, donate_argnums=0)
    return plan, update, {s: random_state(plan, s) for s in range(1, 5)}


META = {"recipe": {"name": "fsdp"}, "model": "tiny", "seed": 0}


def test_async_save_survives_donation_and_restores_bit_exact(run, tmp_path):
    plan, update, states = run
    state = device(plan, states[2])
    with Checkpointer(tmp_path / "checkpoints", save_every=2) as ckpt:
        res = ckpt.maybe_save(2, state, data_state={"index": 2 * TINY_BATCH}, metadata=META)
        assert isinstance(res, SaveResult) and res.saved and res.step == 2 and res.blocking_s >= 0
        # the very next step donates every saved buffer, however far the background write got
        # (maybe_save returns once Orbax holds its own host copy, so nothing pins the device buffers)
        saved_buffers = jax.tree.leaves(state)
        state = update(state)
        assert all(x.is_deleted() for x in saved_buffers)
        state = update(state)
        assert not ckpt.maybe_save(3, state, data_state={}, metadata=META).saved
        ckpt.wait()
        assert ckpt.all_steps() == [2] and ckpt.latest_valid_step() == 2
        r = ckpt.restore(plan)
    assert isinstance(r, Restored) and r.step == 2
    assert r.data_state == {"index": 2 * TINY_BATCH} and r.metadata == META
    assert_bit_exact(states[2], r.state)
    assert_on_mesh(r.state, plan)
    assert r.state.step.sharding.spec == jax.sharding.PartitionSpec() and int(r.state.step) == 2
    assert int(state.step) == 4      # the donating updates ran on the live state


def test_sync_save_commits_before_returning(run, tmp_path):
    plan, _, states = run
    ckpt = Checkpointer(tmp_path, save_every=1, async_save=False)
    assert ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata={}).saved
    assert ckpt.pending_step is None and ckpt.check(1).status is StepStatus.OK
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.maybe_save(2, device(plan, states[2]), data_state={}, metadata={})


def test_uncompressed_checkpoints_restore_either_way(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path / "raw", save_every=1, compression=Compression.NONE) as raw, \
            Checkpointer(tmp_path / "zstd", save_every=1, compression=Compression.ZSTD) as zstd:
        for ckpt in (raw, zstd):
            ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata={})
            ckpt.wait()
        assert inspect_checkpoint(tmp_path / "raw")["compression"] == "none"
        assert_bit_exact(states[1], raw.restore(plan).state)
        assert_bit_exact(states[1], zstd.restore(plan).state)
    with Checkpointer(tmp_path / "zstd", save_every=1, compression="none") as reader:   # reads zstd chunks
        assert_bit_exact(states[1], reader.restore(plan).state)
    with pytest.raises(CheckpointError, match="compression='lz4': use one of"):
        Checkpointer(tmp_path / "x", save_every=1, compression="lz4")


def test_interval_and_retention_keep_last_plus_every_kth(run, tmp_path):
    plan, _, states = run
    state = device(plan, states[1])
    ckpt = Checkpointer(tmp_path, save_every=2, keep_last=2, keep_every=4)
    saved = [s for s in range(1, 13) if ckpt.maybe_save(s, state, data_state={"s": s}, metadata={}).saved]
    ckpt.wait()
    assert saved == [2, 4, 6, 8, 10, 12]
    assert ckpt.all_steps() == [4, 8, 10, 12]        # last 2 plus the multiples of 4
    forced = ckpt.maybe_save(13, state, data_state={"s": 13}, metadata={}, force=True)
    again = ckpt.maybe_save(13, state, data_state={"s": 13}, metadata={}, force=True)
    ckpt.close()
    assert forced.saved and not again.saved and "already saved" in again.note
    assert not integrity.trash_dirs(tmp_path)              # retention's background deletes finished
    with Checkpointer(tmp_path, save_every=2, keep_last=2, keep_every=4) as again:
        assert again.all_steps() == [4, 8, 12, 13]


@pytest.mark.parametrize("kwargs, match", [
    (dict(save_every=0), "save_every=0"), (dict(save_every=1, keep_last=0), "keep_last=0"),
    (dict(save_every=1, keep_every=0), "keep_every=0")])
def test_bad_settings(tmp_path, kwargs, match):
    with pytest.raises(CheckpointError, match=match):
        Checkpointer(tmp_path, **kwargs)


def test_metadata_must_be_json(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        with pytest.raises(CheckpointError, match=r"metadata\['seed'\] is a int64"):
            ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata={"seed": np.int64(3)})
        assert ckpt.all_steps() == []


def test_shape_and_tree_mismatch_lists_paths(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata=META)
        other = mt.make_plan(tiny_abstract(d_ff=96), plan.recipe, plan.mesh)
        with pytest.raises(CheckpointError) as err:
            ckpt.restore(other)
        text = str(err.value)
        assert "shape: params/blocks/mlp/up_df saved (2, 64, 128), the plan has (2, 64, 96)" in text
        assert "opt_state/0/mu/blocks/mlp/down_fd" in text and "model='tiny'" in text
        sgd = mt.make_plan(tiny_abstract(tx=optax.sgd(0.1)), plan.recipe, plan.mesh)
        with pytest.raises(CheckpointError, match="not in the plan: opt_state/0/mu/embedding_vd"):
            ckpt.restore(sgd)


def test_dtype_mismatch_needs_allow_cast(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata={})
        mu16 = mt.make_plan(tiny_abstract(tx=optax.adamw(1e-3, mu_dtype=jnp.bfloat16)), plan.recipe, plan.mesh)
        with pytest.raises(CheckpointError, match=r"dtype: opt_state/0/mu/embedding_vd saved float32, the plan has "
                                                  r"bfloat16 \(pass allow_cast=True"):
            ckpt.restore(mu16)
        r = ckpt.restore(mu16, allow_cast=True)
    mu = r.state.opt_state[0].mu["embedding_vd"]
    assert mu.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(mu), states[1].opt_state[0].mu["embedding_vd"].astype(jnp.bfloat16))
    assert_on_mesh(r.state, mu16)


def test_f32_checkpoint_restores_into_bf16_master_weights_and_back(run, tmp_path):
    """Changing param_dtype between runs loses nothing: the f32 parameters become the f32 master copy
    (bit-exact) and come back from it."""
    plan, _, states = run
    bf16 = mt.make_plan(tiny_abstract(), plan.recipe.with_options(param_dtype="bfloat16"), plan.mesh)
    with Checkpointer(tmp_path / "a", save_every=1, async_save=False) as ckpt:
        ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata={})
        r = ckpt.restore(bf16)                      # lossless: no allow_cast needed
    saved = states[1]
    assert r.state.params["embedding_vd"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(r.state.params["embedding_vd"]),
                                  saved.params["embedding_vd"].astype(jnp.bfloat16))
    assert_bit_exact(saved.params, r.state.opt_state.master)
    assert_bit_exact(saved.opt_state, r.state.opt_state.inner)
    assert_on_mesh(r.state, bf16)
    with Checkpointer(tmp_path / "b", save_every=1, async_save=False) as ckpt:
        ckpt.maybe_save(2, r.state, data_state={}, metadata={})
        back = ckpt.restore(plan)
    assert_bit_exact(saved.params, back.state.params)
    assert_bit_exact(saved.opt_state, back.state.opt_state)
    assert_on_mesh(back.state, plan)


def test_resaving_a_step(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata={})
        ckpt.maybe_save(2, device(plan, states[2]), data_state={}, metadata={})
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        with pytest.raises(CheckpointError, match="step 2 already exists .* does not overwrite"):
            ckpt.maybe_save(2, device(plan, states[3]), data_state={}, metadata={})
        with pytest.warns(CheckpointWarning, match="restoring step 1 while newer good steps"):
            ckpt.restore(plan, step=1)
    (tmp_path / "2" / "meshtrain-meta.json").write_text("{}")   # a damaged step is replaced
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        with pytest.warns(CheckpointWarning, match=r"step 2 .* is corrupt .* moved .*/2 aside to .*/2\.corrupt "
                                                   r"\(kept, not deleted\)"):
            assert ckpt.maybe_save(2, device(plan, states[3]), data_state={}, metadata={}).saved
        assert_bit_exact(states[3], ckpt.restore(plan).state)
    aside = tmp_path / "2.corrupt"
    assert (aside / "meshtrain-meta.json").read_text() == "{}" and integrity.aside_dirs(tmp_path) == [aside]


def test_restore_without_checkpoints_and_bad_step(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path / "ck", save_every=1) as ckpt:
        assert ckpt.latest_valid_step() is None
        with pytest.raises(CheckpointError, match="no valid checkpoint to restore"):
            ckpt.restore(plan)
        ckpt.maybe_save(1, device(plan, states[1]), data_state={}, metadata={})
        with pytest.raises(CheckpointError, match="step 7 .* cannot be restored"):
            ckpt.restore(plan, step=7)


def test_cli_list_and_inspect(run, tmp_path, capsys):
    from meshtrain.cli import main

    plan, _, states = run
    with Checkpointer(tmp_path / "checkpoints", save_every=1) as ckpt:
        for s in (1, 2):
            ckpt.maybe_save(s, device(plan, states[s]), data_state={"index": s},
                            metadata={"recipe": plan.recipe.to_dict(), "model": "tiny", "seed": 0})
    (tmp_path / "checkpoints" / "3").mkdir()
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "latest valid step: 2" in out and "empty folder" in out and "fsdp" in out
    assert main(["ckpt", "inspect", str(tmp_path / "checkpoints"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 2 and info["integrity"]["status"] == "ok" and info["data_state"] == {"index": 2}
    assert info["recipe"]["name"] == "fsdp" and info["model"] == "tiny"
    row = next(r for r in info["tree"] if r["path"] == "params/embedding_vd")
    assert row["shape"] == [256, 64] and row["dtype"] == "float32" and row["bytes"] == 256 * 64 * 4
    assert row["sharding"] == {"spec": [None, "fsdp"], "mesh": {"fsdp": 8}}
    assert main(["ckpt", "inspect", str(tmp_path), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "step 1: ok" in out and "params/embedding_vd" in out and "P(None, 'fsdp') on fsdp=8" in out
    assert main(["ckpt", "inspect", str(tmp_path), "--step", "3"]) == 1   # the empty folder
    capsys.readouterr()
    a_file = str(tmp_path / "checkpoints" / "1" / "meshtrain-meta.json")
    for argv in (["ckpt", "inspect", str(tmp_path / "nope")], ["ckpt", "list", a_file],
                 ["ckpt", "inspect", str(tmp_path), "--step", "9"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err


def test_inspect_function_matches_saved_layout(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.maybe_save(4, device(plan, states[4]), data_state={}, metadata=META)
    info = inspect_checkpoint(tmp_path)
    assert info["step"] == 4 and info["seed"] == 0
    assert info["state_bytes"] == sum(x.nbytes for x in jax.tree.leaves(states[4]))
    assert {r["path"] for r in info["tree"]} >= {"step", "opt_state/0/count", "params/lm_head_dv"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # a clean folder raises no warning
        with Checkpointer(tmp_path, save_every=1) as again:
            assert again.latest_valid_step() == 4


def test_second_checkpointer_on_a_live_folder_only_reads(run, tmp_path):
    plan, _, states = run
    with Checkpointer(tmp_path, save_every=1) as writer:
        writer.maybe_save(1, device(plan, states[1]), data_state={}, metadata={})
        writer.wait()
        in_flight = tmp_path / "2.orbax-checkpoint-tmp"      # what the writer's next save looks like
        in_flight.mkdir()
        with pytest.warns(CheckpointWarning, match="is being written by pid"):
            reader = Checkpointer(tmp_path, save_every=1)
        assert in_flight.exists()                               # the reader cleans nothing
        assert_bit_exact(states[1], reader.restore(plan).state)
        with pytest.raises(CheckpointError, match="cannot save step 3: .* is being written by pid"):
            reader.maybe_save(3, device(plan, states[3]), data_state={}, metadata={})
        reader.close()
        in_flight.rmdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # the writer closed: the lock is free again
        Checkpointer(tmp_path, save_every=1).close()
