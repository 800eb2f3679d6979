"""Integrity: byte flips, truncation, missing files, empty / unverified steps, stale temporary folders,
and a full disk (a real tmpfs when this process may mount one, an injected write error always)."""

from __future__ import annotations

import errno
import os
import random
import shutil
import processes
import time
import warnings

import jax
import pytest
from helpers import (TINY_BATCH, TINY_SEQ, assert_bit_exact, assert_on_mesh, device, mesh_for, random_state,
                     tiny_abstract)

import meshtrain as mt
from meshtrain.checkpoint import (Checkpointer, CheckpointError, CheckpointWarning, StepStatus, Verify, integrity,
                                  saving)


@pytest.fixture(scope="module")
def run():
    recipe, mesh = mesh_for("fsdp", 8)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    return plan, {s: random_state(plan, s) for s in range(1, 4)}


@pytest.fixture(scope="module")
def pristine(run, tmp_path_factory):
    """A checkpoint folder with good steps 1 and 2 (copied by each test before damaging it)."""
    plan, states = run
    d = tmp_path_factory.mktemp("pristine") / "checkpoints"
    with Checkpointer(d, save_every=1, keep_last=5) as ckpt:
        for s in (1, 2):
            ckpt.maybe_save(s, device(plan, states[s]), data_state={"index": s}, metadata={"model": "tiny"})
    return d


@pytest.fixture
def ckdir(pristine, tmp_path):
    d = tmp_path / "checkpoints"
    shutil.copytree(pristine, d)
    return d


def state_files(step_dir):
    return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file())


def expect_fallback(plan, states, ckdir, match):
    """A new Checkpointer skips step 2 with a warning matching ``match`` and restores step 1 bit-exact;
    the same Checkpointer does not repeat the warning, a new one does."""
    ckpt = Checkpointer(ckdir, save_every=1)
    with pytest.warns(CheckpointWarning, match=match):
        assert ckpt.latest_valid_step() == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = ckpt.restore(plan)
    assert r.step == 1 and r.data_state == {"index": 1}
    assert_bit_exact(states[1], r.state)
    ckpt.close()
    with Checkpointer(ckdir, save_every=1) as again, pytest.warns(CheckpointWarning, match=match):
        assert again.restore(plan).step == 1
    return r


def test_twenty_random_byte_flips_are_all_detected(run, ckdir):
    plan, states = run
    rng = random.Random(1234)
    files = state_files(ckdir / "2")
    detected = 0
    for trial in range(20):
        path = rng.choice(files)
        data = bytearray(path.read_bytes())
        offset = rng.randrange(len(data))
        original = data[offset]
        data[offset] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(data))
        rel = path.relative_to(ckdir / "2").as_posix()
        ckpt = Checkpointer(ckdir, save_every=1)
        with pytest.warns(CheckpointWarning, match=f"step 2 .*checksum mismatch: {rel}"):
            step = ckpt.latest_valid_step()
        detected += step == 1
        if trial % 5 == 0:   # the fallback restore is bit-exact (a few times: restores cost ~0.1 s)
            assert_bit_exact(states[1], ckpt.restore(plan).state)
        ckpt.close()
        data[offset] = original
        path.write_bytes(bytes(data))
    assert detected == 20
    with Checkpointer(ckdir, save_every=1) as ckpt:
        assert ckpt.latest_valid_step() == 2                            # all flips undone: step 2 is good


def test_truncated_file_is_skipped(run, ckdir):
    plan, states = run
    biggest = max(state_files(ckdir / "2"), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    expect_fallback(plan, states, ckdir, f"step 2 .*corrupt: truncated: {biggest.relative_to(ckdir / '2').as_posix()}")


@pytest.mark.parametrize("missing", ["meshtrain-meta.json", "state/_METADATA", "_CHECKPOINT_METADATA"])
def test_missing_metadata_file_is_skipped(run, ckdir, missing):
    plan, states = run
    (ckdir / "2" / missing).unlink()
    expect_fallback(plan, states, ckdir, f"step 2 .*incomplete: missing 1 file\\(s\\): {missing}")


def test_empty_step_folder_is_skipped(run, ckdir):
    plan, states = run
    shutil.rmtree(ckdir / "1")
    (ckdir / "3").mkdir()
    ckpt = Checkpointer(ckdir, save_every=1)
    with pytest.warns(CheckpointWarning, match="step 3 .*empty: empty folder"):
        r = ckpt.restore(plan)
    assert r.step == 2
    assert_bit_exact(states[2], r.state)
    assert_on_mesh(r.state, plan)
    # saving step 3 moves the empty folder aside instead of silently doing nothing
    with pytest.warns(CheckpointWarning, match=r"step 3 .* is empty .* moved .* aside to .*3\.corrupt"):
        assert ckpt.maybe_save(3, device(plan, states[3]), data_state={"index": 3}, metadata={}).saved
    ckpt.wait()
    assert ckpt.check(3).status is StepStatus.OK
    ckpt.close()


def test_step_without_manifest_is_unverified_and_skipped(run, ckdir):
    plan, states = run
    (ckdir / "2" / integrity.MANIFEST).unlink()
    expect_fallback(plan, states, ckdir, "step 2 .*unverified: no meshtrain-manifest.json")


def test_stale_temporary_folders_are_cleaned(run, ckdir):
    plan, states = run
    stale = ckdir / "3.orbax-checkpoint-tmp"
    (stale / "state").mkdir(parents=True)
    (stale / "state" / "junk").write_bytes(b"x" * 1000)
    half_deleted = ckdir / "0.meshtrain-deleting-123"        # retention's rename, then a crash
    (half_deleted / "state").mkdir(parents=True)
    with pytest.warns(CheckpointWarning, match="removed temporary checkpoint folder .*3.orbax-checkpoint-tmp"):
        ckpt = Checkpointer(ckdir, save_every=1)
    assert not stale.exists() and not half_deleted.exists() and ckpt.latest_valid_step() == 2
    assert ckpt.maybe_save(3, device(plan, states[3]), data_state={}, metadata={}).saved
    ckpt.close()
    assert ckpt.all_steps() == [1, 2, 3] and not integrity.tmp_dirs(ckdir)


def wait_idle(ckpt, limit=600.0):
    """Stand-in for the training step that runs while the background write fails."""
    deadline = time.monotonic() + limit
    while ckpt.busy and time.monotonic() < deadline:
        time.sleep(0.02)


def test_injected_write_error_surfaces_at_next_call(run, ckdir, monkeypatch):
    """A disk-full error while writing (injected into the manifest write, the last write before the
    commit) is reported by the next maybe_save; the failed folder is removed; older steps restore."""
    plan, states = run

    def full(step_dir, step):
        (step_dir / "filler").write_bytes(b"0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device", str(step_dir / integrity.MANIFEST))

    ckpt = Checkpointer(ckdir, save_every=2, keep_last=5)
    monkeypatch.setattr(integrity, "write_manifest", full)
    assert ckpt.maybe_save(4, device(plan, states[3]), data_state={}, metadata={}).saved
    wait_idle(ckpt)
    with pytest.raises(CheckpointError, match=r"saving step 4 .* failed: the disk is full .* steps \[1, 2\] are "
                                              r"intact") as err:
        with pytest.warns(CheckpointWarning, match="removed temporary checkpoint folder .*4.orbax-checkpoint-tmp"):
            ckpt.maybe_save(5, device(plan, states[3]), data_state={}, metadata={})
    assert "Traceback" not in str(err.value)
    assert not integrity.tmp_dirs(ckdir) and ckpt.all_steps() == [1, 2]
    assert_bit_exact(states[2], ckpt.restore(plan).state)
    monkeypatch.undo()
    assert ckpt.maybe_save(6, device(plan, states[3]), data_state={}, metadata={}).saved   # the retry works
    ckpt.close()
    assert ckpt.all_steps() == [1, 2, 6]


def test_ctrl_c_inside_the_blocking_save_leaves_older_steps_and_closes_quietly(run, ckdir):
    """Ctrl-C landing in Orbax's blocking part of a save: the partial folder goes, close() does not turn
    the interrupt into a save error, and the older steps still restore (the CI race of stop 15)."""
    plan, states = run
    ckpt = Checkpointer(ckdir, save_every=3, keep_last=5)
    real_save = ckpt._manager.save

    def interrupted(step, *args, **kwargs):
        (ckdir / f"{step}.orbax-checkpoint-tmp-123").mkdir()
        raise KeyboardInterrupt

    ckpt._manager.save = interrupted
    with pytest.raises(KeyboardInterrupt), pytest.warns(CheckpointWarning, match="removed temporary"):
        ckpt.maybe_save(3, device(plan, states[3]), data_state={}, metadata={})
    ckpt._manager.save = real_save
    ckpt.close()   # nothing in flight: no error
    assert not integrity.tmp_dirs(ckdir) and ckpt.all_steps() == [1, 2]
    with Checkpointer(ckdir, save_every=3) as again:
        assert_bit_exact(states[2], again.restore(plan).state)


def test_preflight_space_check(run, ckdir, monkeypatch):
    plan, states = run
    monkeypatch.setattr(saving, "free_bytes", lambda path: 1000)
    need = saving.fmt_bytes(sum(x.nbytes for x in jax.tree.leaves(states[3])) + saving.FREE_MARGIN)
    with Checkpointer(ckdir, save_every=1) as ckpt:
        with pytest.raises(CheckpointError, match=rf"not enough disk space to save step 3: the state needs ~{need} "
                                                  r"but .* has 1000 B free.*steps \[1, 2\] are intact"):
            ckpt.maybe_save(3, device(plan, states[3]), data_state={}, metadata={})
        assert ckpt.all_steps() == [1, 2] and not integrity.tmp_dirs(ckdir)


# Orbax's failed write leaves a tensorstore callback on a closed event loop (harmless, inside Orbax).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_full_disk_on_tmpfs(run, small_disk, monkeypatch):
    """A real ENOSPC from the array writer: reported within one call, failed folder removed so the
    disk is usable again, older steps restore bit-exact, the pre-save check then names the shortfall."""
    plan, states = run
    d = small_disk / "checkpoints"
    monkeypatch.setattr(saving, "free_bytes", lambda path: 1 << 40)   # let the write itself hit the wall
    ckpt = Checkpointer(d, save_every=2, keep_last=3)
    for s in (2, 4):
        ckpt.maybe_save(s, device(plan, states[s // 2]), data_state={"s": s}, metadata={})
        ckpt.wait()
    assert ckpt.maybe_save(6, device(plan, states[3]), data_state={"s": 6}, metadata={}).saved
    wait_idle(ckpt)
    with pytest.raises(CheckpointError, match=r"saving step 6 .* failed: the disk is full .*steps \[2, 4\] are intact"):
        with pytest.warns(CheckpointWarning, match="removed temporary checkpoint folder"):
            ckpt.maybe_save(7, device(plan, states[3]), data_state={}, metadata={})
    assert not integrity.tmp_dirs(d) and ckpt.all_steps() == [2, 4]
    assert_bit_exact(states[2], ckpt.restore(plan, step=4).state)
    with pytest.warns(CheckpointWarning, match=r"restoring step 2 while newer good steps \[4\] exist"):
        assert_bit_exact(states[1], ckpt.restore(plan, step=2).state)
    monkeypatch.undo()                                                   # the real free space now
    with pytest.raises(CheckpointError, match="not enough disk space to save step 8"):
        ckpt.maybe_save(8, device(plan, states[3]), data_state={}, metadata={})
    shutil.rmtree(d / "2")                                               # the user frees space
    assert ckpt.maybe_save(8, device(plan, states[3]), data_state={"s": 8}, metadata={}).saved
    ckpt.close()
    assert ckpt.all_steps() == [4, 8]
    with Checkpointer(d, save_every=2) as again:
        assert_bit_exact(states[3], again.restore(plan).state)


def test_block_checksums_name_the_corrupt_range(tmp_path, monkeypatch):
    """Files are hashed in blocks (in parallel); a flip is reported with the byte range of its block."""
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1000)
    step_dir = tmp_path / "7"
    (step_dir / "state").mkdir(parents=True)
    data = bytes(random.Random(0).randrange(256) for _ in range(4500))
    (step_dir / "state" / "big").write_bytes(data)
    (step_dir / "small").write_bytes(b"abc")
    (step_dir / "empty").write_bytes(b"")
    manifest = integrity.write_manifest(step_dir, 7)
    assert len(manifest["files"]["state/big"]["sha256"]) == 5 and manifest["total_bytes"] == 4503
    assert integrity.check_step(step_dir, 7).status is StepStatus.OK
    flipped = bytearray(data)
    flipped[2345] ^= 0x10
    (step_dir / "state" / "big").write_bytes(bytes(flipped))
    check = integrity.check_step(step_dir, 7)
    assert check.status is StepStatus.CORRUPT and "state/big (bytes 2000-2999 differ" in check.reason
    assert integrity.check_step(step_dir, 7, Verify.QUICK).status is StepStatus.OK   # sizes only
