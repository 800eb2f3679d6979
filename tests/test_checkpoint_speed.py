"""What the faster save path must keep: a synchronous save takes no host copy yet leaves the caller's
buffers donatable and saves the exact values; the manifest's checksums hashed from the page cache
equal those of plain reads; the default compression is ``none`` and zstd checkpoints still restore.
(Speed itself is measured by tools/bench_checkpoint.py, never asserted here.)"""

from __future__ import annotations

import hashlib
import os

import jax
import pytest
from helpers import TINY_BATCH, TINY_SEQ, mesh_for, put, tiny_abstract, token_batch
from test_checkpoint import assert_bit_exact, device, host, random_state

import meshtrain as mt
from meshtrain.checkpoint import Checkpointer, Compression, StepStatus, Verify, inspect_checkpoint, integrity


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
        assert ckpt._copy_before_sync_save is False
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
        assert ckpt._mapped_hashing is True
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
