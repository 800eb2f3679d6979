"""Nothing lost: donation right after an async save, damaged steps moved aside (never deleted),
retention that deletes only verified old steps, and the resume inventory (``inventory``,
``require_resumable``)."""

from __future__ import annotations

import json
import shutil
import warnings

import jax
import numpy as np
import pytest
from helpers import (TINY_BATCH, TINY_SEQ, assert_bit_exact, device, host, mesh_for, put, random_state, tiny_abstract,
                     token_batch)

import meshtrain as mt
from meshtrain.checkpoint import (Checkpointer, CheckpointError, CheckpointWarning, NoValidCheckpoint, StepStatus,
                                  Verify, inspect_checkpoint, integrity)


@pytest.fixture(scope="module")
def run():
    recipe, mesh = mesh_for("fsdp", 8)
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(TINY_BATCH, TINY_SEQ))
    return plan, {s: random_state(plan, s) for s in range(1, 7)}


@pytest.fixture(scope="module")
def pristine(run, tmp_path_factory):
    """Good steps 2, 4 and 6 (each test copies the folder before damaging it)."""
    plan, states = run
    d = tmp_path_factory.mktemp("pristine") / "checkpoints"
    with Checkpointer(d, save_every=2, keep_last=5, async_save=False) as ckpt:
        for s in (2, 4, 6):
            ckpt.maybe_save(s, device(plan, states[s]), data_state={"index": s}, metadata={})
    return d


@pytest.fixture
def ckdir(pristine, tmp_path):
    d = tmp_path / "checkpoints"
    shutil.copytree(pristine, d)
    return d


def biggest_state_file(step_dir):
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_byte(step_dir):
    """Same size, different content: passes the quick check, fails the full one."""
    path = biggest_state_file(step_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def truncate(step_dir):
    path = biggest_state_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


# -- donation --------------------------------------------------------------------------------------

def test_every_step_donates_every_buffer_even_right_after_an_async_save(run, tmp_path):
    """The real train step (donating) on 12 steps with an async save every 3: the step right after
    each save deletes every buffer of the state it was given, without waiting for the write. Before
    the fix Orbax's zero-copy host views pinned them and XLA silently kept a second copy."""
    plan, _ = run
    train_step = mt.make_train_step(plan)
    state = mt.init_state(plan, seed=0)
    saved_at, donated, kept = {}, {}, {}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    with Checkpointer(tmp_path / "checkpoints", save_every=3, keep_last=10) as ckpt:
        for i in range(1, 13):
            old = jax.tree.leaves(state)
            state, metrics = train_step(state, put(token_batch(i), plan))
            donated[i] = sum(x.is_deleted() for x in old)
            kept[i] = [p for p, x in zip(paths, old) if not x.is_deleted()]
            del old
            jax.block_until_ready(state)
            if i % 3 == 0:
                saved_at[i] = host(state)          # what the checkpoint must hold
            res = ckpt.maybe_save(i, state, data_state={"i": i}, metadata={})
            assert res.saved == (i % 3 == 0)
        n = len(jax.tree.leaves(state))
        after_save = {i: donated[i] for i in (4, 7, 10)}
        assert after_save == {i: n for i in after_save}, (after_save, n, {i: kept[i][:3] for i in after_save})
        assert donated == {i: n for i in donated}
        ckpt.wait()
        for s in (3, 6, 9, 12):                    # the saves hold the values of their step, bit-exact
            with warnings.catch_warnings():        # "restoring step 3 while newer good steps exist"
                warnings.simplefilter("ignore", CheckpointWarning)
                assert_bit_exact(saved_at[s], ckpt.restore(plan, step=s).state)


def test_blocking_s_includes_the_host_copy(run, tmp_path):
    """maybe_save returns only when Orbax owns a host copy: the saved values survive an in-place
    update of the very buffers that were saved (a donating update dispatched at once)."""
    plan, states = run
    shardings = mt.state_shardings(plan)
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 7, s), in_shardings=(shardings,),
                   out_shardings=shardings, donate_argnums=0)
    state = bump(device(plan, states[1]))        # buffers made by XLA, as in training
    expected = host(state)
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        res = ckpt.maybe_save(1, state, data_state={}, metadata={})
        old = jax.tree.leaves(state)
        state = bump(state)
        assert res.saved and res.blocking_s > 0 and all(x.is_deleted() for x in old)
        ckpt.wait()
        assert_bit_exact(expected, ckpt.restore(plan).state)


# -- moving damaged steps aside ------------------------------------------------------------------------

def test_damaged_step_is_moved_aside_never_deleted(run, ckdir):
    plan, states = run
    (ckdir / "6" / "meshtrain-meta.json").write_text("{}")
    before = sorted(p.relative_to(ckdir / "6").as_posix() for p in (ckdir / "6").rglob("*"))
    with Checkpointer(ckdir, save_every=2, keep_last=5) as ckpt:
        with pytest.warns(CheckpointWarning, match=rf"step 6 .* is corrupt \(.*\); moved {ckdir / '6'} aside to "
                                                   rf"{ckdir / '6.corrupt'} \(kept, not deleted\)"):
            assert ckpt.maybe_save(6, device(plan, states[5]), data_state={"index": 6}, metadata={}).saved
        ckpt.wait()
        assert ckpt.all_steps() == [2, 4, 6] and ckpt.check(6).status is StepStatus.OK
    aside = ckdir / "6.corrupt"
    assert sorted(p.relative_to(aside).as_posix() for p in aside.rglob("*")) == before   # every file kept
    # the new step 6 is damaged too: the second copy goes to 6.corrupt.1, the first stays
    truncate(ckdir / "6")
    with Checkpointer(ckdir, save_every=2, keep_last=5) as ckpt:
        with pytest.warns(CheckpointWarning, match=r"moved .* aside to .*6\.corrupt\.1 "):
            ckpt.maybe_save(6, device(plan, states[6]), data_state={"index": 6}, metadata={})
    assert integrity.aside_dirs(ckdir) == [ckdir / "6.corrupt", ckdir / "6.corrupt.1"]
    # listings, Orbax and a new Checkpointer ignore the folders set aside
    assert list(integrity.step_dirs(ckdir)) == [2, 4, 6] and not integrity.tmp_dirs(ckdir)
    assert [c.step for c in mt.checkpoint.list_checkpoints(ckdir)] == [2, 4, 6]
    assert inspect_checkpoint(ckdir)["set_aside"] == ["6.corrupt", "6.corrupt.1"]
    with Checkpointer(ckdir, save_every=2) as ckpt:
        assert ckpt.all_steps() == [2, 4, 6] and ckpt.require_resumable() == 6
        assert_bit_exact(states[6], ckpt.restore(plan).state)


def test_move_aside_picks_a_free_name(tmp_path):
    for name in ("3", "3.corrupt", "3.corrupt.1"):
        (tmp_path / name).mkdir()
    (tmp_path / "3" / "f").write_text("x")
    moved = integrity.move_aside(tmp_path / "3")
    assert moved == tmp_path / "3.corrupt.2" and (moved / "f").read_text() == "x"
    assert integrity.step_dirs(tmp_path) == {} and len(integrity.aside_dirs(tmp_path)) == 3


# -- retention ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage, reason", [
    (truncate, "truncated"),
    (lambda d: (d / integrity.MANIFEST).write_text("not json"), "meshtrain-manifest.json unreadable"),
    (lambda d: (d / "_CHECKPOINT_METADATA").write_text("{oops"), "_CHECKPOINT_METADATA is not valid JSON"),
    (lambda d: (d / integrity.MANIFEST).unlink(), "no meshtrain-manifest.json"),
])
def test_retention_reports_damaged_steps_and_keeps_them(run, ckdir, damage, reason):
    plan, states = run
    damage(ckdir / "2")
    with Checkpointer(ckdir, save_every=2, keep_last=1) as ckpt:
        with pytest.warns(CheckpointWarning, match=rf"retention leaves checkpoint step 2 .* in place: .*{reason}"):
            ckpt.maybe_save(8, device(plan, states[1]), data_state={}, metadata={})
            ckpt.wait()
        assert ckpt.all_steps() == [2, 8]          # 4 and 6 (good, older) deleted; 2 reported and kept
        with warnings.catch_warnings():            # reported once per Checkpointer
            warnings.simplefilter("error")
            ckpt.maybe_save(10, device(plan, states[2]), data_state={}, metadata={})
            ckpt.wait()
        assert ckpt.all_steps() == [2, 10]
    assert (ckdir / "2").is_dir()


def test_retention_never_deletes_the_newest_valid_step(run, ckdir):
    """Steps 2, 4 good and 6 bit-flipped (passes the quick check) from an earlier run. The resume
    takes 4; saving 5 with keep_last=1 must keep 5 (the newest valid) and leave 6 for a person,
    where the old rule (newest quick-good is 6) deleted 4 and the step just saved."""
    plan, states = run
    flip_byte(ckdir / "6")
    with Checkpointer(ckdir, save_every=1, keep_last=1) as ckpt:
        with pytest.warns(CheckpointWarning, match="skipping checkpoint step 6 .* checksum mismatch"):
            assert ckpt.require_resumable() == 4
        ckpt.restore(plan)
        ckpt.maybe_save(5, device(plan, states[5]), data_state={}, metadata={})
        ckpt.wait()
        assert ckpt.all_steps() == [5, 6]
        assert ckpt.latest_valid_step() == 5
        assert_bit_exact(states[5], ckpt.restore(plan).state)


def test_retention_uses_a_cached_full_verdict(run, ckdir):
    """A full check that failed (cached) beats a passing quick check: such a step is kept."""
    plan, states = run
    flip_byte(ckdir / "2")
    with Checkpointer(ckdir, save_every=1, keep_last=1) as ckpt:
        assert ckpt.check(2, Verify.QUICK).status is StepStatus.OK
        assert [c.status for c in ckpt.inventory()] == [StepStatus.CORRUPT, StepStatus.OK, StepStatus.OK]
        with pytest.warns(CheckpointWarning, match="retention leaves checkpoint step 2 .*checksum mismatch"):
            ckpt.maybe_save(7, device(plan, states[1]), data_state={}, metadata={})
            ckpt.wait()
        assert ckpt.all_steps() == [2, 7]


# -- inventory and require_resumable ---------------------------------------------------------------

def test_require_resumable_on_an_empty_folder(tmp_path):
    with Checkpointer(tmp_path / "new", save_every=1) as ckpt:
        assert ckpt.inventory() == [] and ckpt.require_resumable() is None


def test_require_resumable_refuses_when_no_step_is_valid(run, ckdir):
    truncate(ckdir / "2")
    flip_byte(ckdir / "4")
    (ckdir / "6" / integrity.MANIFEST).unlink()
    (ckdir / "8").mkdir()
    (ckdir / "4.corrupt").mkdir()
    with Checkpointer(ckdir, save_every=1) as ckpt:
        inv = ckpt.inventory()
        assert [(c.step, c.status) for c in inv] == [(2, StepStatus.CORRUPT), (4, StepStatus.CORRUPT),
                                                     (6, StepStatus.UNVERIFIED), (8, StepStatus.EMPTY)]
        with pytest.raises(NoValidCheckpoint) as err:
            ckpt.require_resumable()
    msg = str(err.value)
    assert isinstance(err.value, CheckpointError) and err.value.checks == inv
    assert "holds 4 checkpoint step(s) and none is valid" in msg and "Nothing was deleted" in msg
    for line in ("step 2: corrupt: truncated", "step 4: corrupt: checksum mismatch", "step 6: unverified: no ",
                 "step 8: empty: empty folder", "moved aside earlier: 4.corrupt"):
        assert line in msg, line
    assert sorted(p.name for p in ckdir.iterdir() if not p.name.startswith(".")) == ["2", "4", "4.corrupt", "6", "8"]


def test_require_resumable_returns_the_latest_valid_step(run, ckdir):
    flip_byte(ckdir / "6")
    with Checkpointer(ckdir, save_every=1) as ckpt:
        with pytest.warns(CheckpointWarning, match="skipping checkpoint step 6"):
            assert ckpt.require_resumable() == 4
        assert [c.to_dict()["status"] for c in ckpt.inventory()] == ["ok", "ok", "corrupt"]
        assert json.loads(json.dumps([c.to_dict() for c in ckpt.inventory()]))[2]["step"] == 6
        assert np.all([c.verify is Verify.FULL for c in ckpt.inventory()])


@pytest.mark.parametrize("lands", ["after the hand-off", "in the wait"])
def test_ctrl_c_around_a_background_save_leaves_no_orphan_save(run, tmp_path, monkeypatch, caplog, lands):
    """A Ctrl-C right after ``maybe_save`` handed the step to its worker used to make the Checkpointer
    forget the step (and remove its folder) while the worker went on writing it: Orbax then logged
    tracebacks ("internal: a save finished but no step is in flight", missing metadata). One in
    Orbax's own wait logged a KeyboardInterrupt traceback and forgot the step."""
    import logging
    from concurrent.futures import Future, ThreadPoolExecutor

    from meshtrain.checkpoint import donation

    plan, states = run
    if lands == "after the hand-off":
        class Pool(ThreadPoolExecutor):
            def submit(self, fn, *args, **kwargs):
                future = super().submit(fn, *args, **kwargs)
                if 4 in args[:2]:
                    raise KeyboardInterrupt   # the signal lands just after the job was queued
                return future
        monkeypatch.setattr(donation, "ThreadPoolExecutor", Pool)
    caplog.set_level(logging.ERROR)
    ckdir = tmp_path / "checkpoints"
    ckpt = Checkpointer(ckdir, save_every=2, keep_last=5, background_start=True)
    ckpt.maybe_save(2, device(plan, states[2]), data_state={}, metadata={})
    ckpt.wait()
    if lands == "in the wait":
        ckpt.maybe_save(4, device(plan, states[4]), data_state={}, metadata={})
        result = Future.result
        calls = []

        def interrupted_once(self, *args, **kwargs):
            if self is ckpt._saver.worker._finalized and not calls:   # in the wait for Orbax's commit
                calls.append(1)
                raise KeyboardInterrupt
            return result(self, *args, **kwargs)
        monkeypatch.setattr(Future, "result", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            ckpt.wait()
    else:
        with pytest.raises(KeyboardInterrupt):
            ckpt.maybe_save(4, device(plan, states[4]), data_state={}, metadata={})
    ckpt.close()   # waits for a step the worker claimed; raises nothing
    steps = ckpt.all_steps()
    assert steps in ([2], [2, 4]) and all(ckpt.check(s).status is StepStatus.OK for s in steps)
    if lands == "in the wait":
        assert steps == [2, 4]   # the step stayed in flight and committed
    assert not integrity.tmp_dirs(ckdir)
    assert [r.getMessage()[:200] for r in caplog.records if r.levelno >= logging.ERROR] == []
