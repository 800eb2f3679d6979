"""What the faster save path must keep: a synchronous save takes no host copy yet leaves the caller's
buffers donatable and saves the exact values; the manifest's checksums hashed from the page cache
equal those of plain reads; the default compression is ``none`` and zstd checkpoints still restore;
``background_start`` (Orbax's blocking part in a worker thread) writes the values of the saved step
while the loop donates, and reports a failed start at the next call.
(Speed itself is measured by tools/bench_checkpoint.py, never asserted here.)"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import warnings

import jax
import numpy as np
import pytest
from helpers import (TINY_BATCH, TINY_SEQ, assert_bit_exact, device, host, mesh_for, put, random_state, tiny_abstract,
                     token_batch)

import meshtrain as mt
from meshtrain.checkpoint import (Checkpointer, CheckpointError, CheckpointWarning, Compression, StepStatus, Verify,
                                  inspect_checkpoint, integrity)
from meshtrain.checkpoint.saving import SaveTuning


@pytest.fixture(scope="module")
def run():
    recipe, mesh = mesh_for("fsdp", 8)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    return plan, random_state(plan, 1)


def test_step_after_a_sync_save_donates_every_buffer(run, tmp_path):
    """A synchronous save hands Orbax the caller's buffers (no copy): once it returns, nothing may
    still reference them, or the next donating step silently keeps a second copy of the state."""
    plan, _ = run
    train_step = mt.make_train_step(plan)
    state = mt.init_state(plan, seed=0)
    saved_at, donated = {}, {}
    with Checkpointer(tmp_path / "checkpoints", save_every=2, keep_last=10, async_save=False) as ckpt:
        assert ckpt._saver.tuning == SaveTuning() and not SaveTuning().copy_before_sync_save
        for i in range(1, 7):
            old = jax.tree.leaves(state)
            state, _ = train_step(state, put(token_batch(i), plan))
            donated[i] = sum(x.is_deleted() for x in old)
            del old
            jax.block_until_ready(state)
            if i % 2 == 0:
                saved_at[i] = host(state)
            res = ckpt.maybe_save(i, state, data_state={}, metadata={})
            assert res.saved == (i % 2 == 0) and ckpt.pending_step is None
        n = len(jax.tree.leaves(state))
        assert donated == {i: n for i in donated}, donated          # steps 3 and 5 follow a sync save
        for s in (2, 4, 6):
            assert ckpt.check(s).status is StepStatus.OK
        assert_bit_exact(saved_at[6], ckpt.restore(plan, step=6).state)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 5 << 20])
def test_mapped_hash_equals_read_hash(tmp_path, monkeypatch, size):
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 2 << 20)   # several blocks, offsets not page multiples
    monkeypatch.setattr(integrity, "_CHUNK", 1 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    files = {"f.bin": (path, size)}
    mapped, read = integrity.hash_files(files, mapped=True), integrity.hash_files(files, mapped=False)
    assert mapped == read
    assert len(read["f.bin"]) == max(1, -(-size // (2 << 20)))
    assert read["f.bin"][0] == hashlib.sha256(path.read_bytes()[:2 << 20]).hexdigest()
    for offset, length in ((0, size), (size // 3, size // 2), (4097 if size > 4097 else 0, size // 4)):
        assert integrity.sha256_range(path, offset, length, mapped=True) == \
            integrity.sha256_range(path, offset, length, mapped=False)
    # a range past the end hashes what is there, in both modes (verification then reports the size)
    assert integrity.sha256_range(path, 0, size + 10, mapped=True) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_of_the_fast_path_verifies_and_detects_a_flip(run, tmp_path):
    """The manifest is written from the page cache (mmap) and verified with reads: they must agree,
    and a byte flip in the largest data file must still be caught."""
    plan, state = run
    with Checkpointer(tmp_path, save_every=1, async_save=False) as ckpt:
        assert ckpt._saver.tuning == SaveTuning() and SaveTuning().mapped_hashing
        ckpt.maybe_save(1, device(plan, state), data_state={}, metadata={})
    step_dir = tmp_path / "1"
    assert integrity.check_step(step_dir, 1, Verify.FULL).status is StepStatus.OK
    biggest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    data[len(data) // 3] ^= 0x01
    biggest.write_bytes(bytes(data))
    check = integrity.check_step(step_dir, 1, Verify.FULL)
    assert check.status is StepStatus.CORRUPT and "checksum mismatch" in check.reason


def test_default_compression_is_none_and_zstd_still_restores(run, tmp_path):
    plan, state = run
    on_mesh = device(plan, state)
    with Checkpointer(tmp_path / "default", save_every=1, async_save=False) as ckpt:
        assert ckpt.compression is Compression.NONE
        ckpt.maybe_save(1, on_mesh, data_state={}, metadata={})
    assert inspect_checkpoint(tmp_path / "default")["compression"] == "none"
    with Checkpointer(tmp_path / "zstd", save_every=1, async_save=False, compression=Compression.ZSTD) as ckpt:
        ckpt.maybe_save(1, on_mesh, data_state={}, metadata={})
    with Checkpointer(tmp_path / "zstd", save_every=1) as reader:       # default reader, zstd chunks
        assert_bit_exact(state, reader.restore(plan).state)


# -- background_start: Orbax's blocking part in a worker thread --------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fsdp", "dp"])       # sharded leaves; every leaf replicated 8 times
def test_background_start_saves_the_values_of_its_step_while_the_loop_donates(recipe, tmp_path):
    """maybe_save returns once the shards are copied into the run's host buffers (HostStaging, refilled
    at every save). Orbax is held back here until the next step
    has donated the saved buffers (the worst order): the step must still donate every buffer, and
    the checkpoint must hold the values of its own step, whatever the replication of the leaves."""
    r, mesh = mesh_for(recipe, 8)
    plan = mt.make_plan(tiny_abstract(), r, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    train_step = mt.make_train_step(plan)
    state = mt.init_state(plan, seed=0)
    n = len(jax.tree.leaves(state))
    saved_at, donated, gates = {}, {}, {}
    with Checkpointer(tmp_path, save_every=2, keep_last=10, background_start=True) as ckpt:
        assert ckpt._saver.in_background
        real_start = ckpt._saver.worker.save

        def gated(step, args):           # Orbax starts only once the next step donated the state
            assert gates[step].wait(120)
            real_start(step, args)

        ckpt._saver.worker.save = gated
        for i in range(1, 10):
            old = jax.tree.leaves(state)
            state, _ = train_step(state, put(token_batch(i), plan))   # dispatched, not waited for
            donated[i] = sum(x.is_deleted() for x in old)
            del old
            if i - 1 in gates:
                gates[i - 1].set()
            if i % 2 == 0:
                saved_at[i] = host(state)
                gates[i] = threading.Event()
            assert ckpt.maybe_save(i, state, data_state={"i": i}, metadata={}).saved == (i % 2 == 0)
        assert donated == {i: n for i in donated}, donated           # 3, 5, 7, 9 follow a save
        gates[8].set()
        ckpt.wait()
        for s in (2, 4, 6, 8):
            assert ckpt.check(s).status is StepStatus.OK
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CheckpointWarning)    # "newer good steps exist"
                restored = ckpt.restore(plan, step=s)
            assert_bit_exact(saved_at[s], restored.state)
            assert restored.data_state == {"i": s}


def test_background_start_reports_a_failed_start_at_the_next_call(run, tmp_path, monkeypatch):
    """An error inside Orbax's save() on the worker surfaces like a write error: at the next call,
    as a CheckpointError naming the step, with the temporary folder removed and the next save working."""
    plan, state = run
    on_mesh = device(plan, state)
    ckpt = Checkpointer(tmp_path, save_every=1, keep_last=5, background_start=True)
    ckpt.maybe_save(1, on_mesh, data_state={}, metadata={})
    ckpt.wait()
    real_save = ckpt._manager.save

    def broken(step, *args, **kwargs):
        (tmp_path / f"{step}.orbax-checkpoint-tmp-9").mkdir()
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ckpt._manager, "save", broken)
    assert ckpt.maybe_save(2, on_mesh, data_state={}, metadata={}).saved
    with pytest.raises(CheckpointError, match=r"saving step 2 .* failed: OSError.*steps \[1\] are intact"):
        with pytest.warns(CheckpointWarning, match="removed temporary"):
            ckpt.wait()
    assert not integrity.tmp_dirs(tmp_path) and ckpt.pending_step is None
    monkeypatch.setattr(ckpt._manager, "save", real_save)
    assert ckpt.maybe_save(3, on_mesh, data_state={}, metadata={}).saved
    ckpt.close()
    assert ckpt.all_steps() == [1, 3]
    assert_bit_exact(state, Checkpointer(tmp_path, save_every=1).restore(plan).state)


def test_background_start_is_off_by_default_and_for_sync_saves(tmp_path):
    assert not Checkpointer(tmp_path / "a", save_every=1)._saver.in_background
    assert not Checkpointer(tmp_path / "b", save_every=1, async_save=False,
                            background_start=True)._saver.in_background
    assert "background_start=True" in repr(Checkpointer(tmp_path / "c", save_every=1, background_start=True))


@pytest.mark.parametrize("recipe", ["fsdp", "dp"])       # sharded leaves; every leaf replicated 8 times
def test_host_staging_copies_replica_zero_into_the_same_buffers_at_every_save(recipe):
    """HostStaging (CPU): the staged tree equals the state; its replica-0 shards are new arrays over the
    run's host buffers (the same memory at every save, so no page is faulted in again), other replicas
    are the state's own; a state of another layout gets buffers of its own."""
    from meshtrain.checkpoint.staging import HostStaging

    r, mesh = mesh_for(recipe, 8)
    plan = mt.make_plan(tiny_abstract(), r, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    staging = HostStaging()
    staging.prepare(device(plan, random_state(plan, 1)))
    pointers = []
    for seed in (1, 2):
        state = device(plan, random_state(plan, seed))
        staged = staging.stage(state)
        assert_bit_exact(host(state), staged)
        ptrs = []
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(staged)):
            for sa, sb in zip(a.addressable_shards, b.addressable_shards):
                same = sa.data.unsafe_buffer_pointer() == sb.data.unsafe_buffer_pointer()
                assert same == (sa.replica_id != 0), (recipe, sa.index, sa.replica_id)
                if sa.replica_id == 0:
                    ptrs.append(sb.data.unsafe_buffer_pointer())
        pointers.append(ptrs)
    assert pointers[0] == pointers[1]                          # refilled in place, not reallocated
    other = mt.make_plan(tiny_abstract(), r, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    smaller = jax.tree.map(lambda x: x[..., :1] if x.ndim else x, device(other, random_state(other, 3)))
    assert_bit_exact(host(smaller), staging.stage(smaller))    # a new layout: new buffers, right values


def test_replica_zero_registry_writes_replica_zero_only():
    """The worker may read only the copies of the replica-0 shards: replica-parallel slicing is off."""
    from meshtrain.checkpoint import donation
    reg = donation.replica_zero_registry()
    handler = reg.get(jax.Array)
    assert handler._use_replica_parallel is False
    assert type(reg.get(np.ndarray)).__name__ == "NumpyHandler" and reg.get(int) is reg.get(float)
