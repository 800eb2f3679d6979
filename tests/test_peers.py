"""In-memory peer checkpoints (``--peer-every``, :mod:`meshtrain.checkpoint.peers`): the copies restore
bit for bit when intact, a damaged own copy is replaced by the held one, and anything else (both
copies damaged, a lost process folder, another run's copies, another mesh) falls back to the older
step or to disk. The must-show: SIGKILLs of one of 2 processes under ``launch --max-restarts``, each restart
losing at most the peer interval."""

import importlib.util
import json
import os
import re
import shutil
import sys

import jax
import numpy as np
import pytest

import processes
from launch_jobs import STEPS, TRAIN, env as launch_env, losses
from meshtrain.checkpoint import peers
from meshtrain.state import init_state
from meshtrain.train import TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(__file__))


def plan_on(devices):
    return Trainer(TrainConfig(model="tiny", batch_size=8, seq_len=32)).build_plan(jax.devices()[:devices])


@pytest.fixture(scope="module")
def saved():
    """A tiny model's train state, fsdp over 8 devices, and its plan."""
    plan = plan_on(8)
    return plan, init_state(plan, seed=0)


def leaves(state):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(state)]


def damage(path):
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF   # a flipped bit in the data: the checksum must catch it
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("harm, step", [
    (None, 6),          # intact: the newest step, bit for bit
    ("own", 6),         # own copy damaged: the held copy of it (its peer's) restores
    ("both", 3),        # both copies of step 6 damaged: step 3
    ("lost", None),     # the process's folder is gone (a lost host): nothing; the disk restores
    ("token", None),    # another run's copies at this path: never used
    ("mesh", 6),        # intact, but the plan has 4 devices: restore says no; the disk restores
])
def test_peer_copies_restore_bit_exact_or_fall_back(harm, step, saved, tmp_path):
    plan, state = saved
    ckpt_dir = tmp_path / "run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    store = peers.PeerStore(ckpt_dir, 3, root=tmp_path / "shm")
    for s in (3, 6):
        store.save(s, state, data_state={"samples_seen": 8 * s}, metadata={"seed": 0})
    folder = store.folder / "6"
    if harm in ("own", "both"):
        damage(folder / "own.bin")
    if harm == "both":
        damage(folder / "held.bin")
    if harm == "lost":
        shutil.rmtree(store.folder)
    if harm == "token":
        (ckpt_dir / peers.TOKEN_FILE).write_text(json.dumps({"token": 12345}))
    fresh = peers.PeerStore(ckpt_dir, 3, root=tmp_path / "shm")   # a restarted process
    with pytest.warns(Warning) if harm in ("own", "both", "token") else _nothing():
        assert fresh.latest() == step
    if step is None:
        return
    restored = fresh.restore(plan_on(4) if harm == "mesh" else plan, step)
    if harm == "mesh":
        assert restored is None
        return
    assert restored.step == step and restored.data_state == {"samples_seen": 8 * step}
    assert all(np.array_equal(a, b) for a, b in zip(leaves(restored.state), leaves(state)))
    assert [x.sharding for x in jax.tree.leaves(restored.state)] == [x.sharding for x in jax.tree.leaves(state)]
    fresh.save(9, restored.state, data_state={}, metadata={})
    assert fresh.steps() == [6, 9]   # the newest KEEP steps stay


def test_a_copy_that_cannot_be_written_is_said_and_training_goes_on(saved, tmp_path):
    """A full or unusable RAM folder (here: a file where the process's folder goes) warns; nothing is kept."""
    plan, state = saved
    (tmp_path / "checkpoints").mkdir()
    store = peers.PeerStore(tmp_path / "checkpoints", 3, root=tmp_path / "shm")
    store.folder.parent.mkdir(parents=True)
    store.folder.write_text("in the way")
    with pytest.warns(Warning, match="cannot keep the in-memory peer copies of step 3 in .*; a restart uses older"):
        store.save(3, state, data_state={}, metadata={})
    assert store.latest() is None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_copy_checks_itself():
    buf = peers.encode({"a": jax.numpy.arange(4.0)}, step=2, process=0, processes=1, token=7, data_state={},
                       metadata={})
    copy, why = peers.decode(np.concatenate([buf, np.zeros(100, np.uint8)]))   # padding from the exchange
    assert why == "" and copy.header["step"] == 2 and np.array_equal(copy.shards()[("a", ((0, 4),))], np.arange(4.0))
    bad = buf.copy()
    bad[-1] ^= 1
    assert peers.decode(bad) == (None, "checksum mismatch")
    assert peers.decode(buf[:-3])[1].startswith("truncated")


# -- the must-show: 2 processes, SIGKILLs, launch --max-restarts -------------------------------------------
#: The tiny job of tests/launch_jobs.py (6 steps; its uninterrupted run, conftest's session fixture, is the
#: reference), with in-memory peer copies every PEER_EVERY steps and the disk only at the end: a restart that
#: missed the peer copies would restore step 0 and lose the whole of a kill's step (4 or 5), past PEER_EVERY.
PEER_EVERY, CKPT_EVERY = 2, STEPS
#: (kind, step, process), one per attempt. Cut: five kills at random steps (three ``lose``, two ``kill``) of a
#: 24-step job with a reference launch of its own became one of each kind, of different processes, on the
#: session's tiny job: the two restore paths (a process's own in-memory copy; its shards from the copy its peer
#: held, after ``lose`` deleted its own) each still bound the RPO, for the coordinator and for the other process.
FAULTS = (("lose", 4, 1), ("kill", 5, 0))


def launch(out, fault):
    train = [a if prev != "--ckpt-every" else str(CKPT_EVERY) for prev, a in zip([None, *TRAIN], TRAIN)]
    return processes.run([sys.executable, "-m", "meshtrain", "launch", "--processes", "2", "--devices-per-process",
                          "2", "--grace", "2", "--restart-backoff", "0", "--max-restarts", str(len(FAULTS)), "--",
                          *train, "--peer-every", str(PEER_EVERY), "--out", str(out)],
                         env=dict(launch_env(fault), MESHTRAIN_PEER_DIR=str(out) + "-shm"), timeout=900, cwd=ROOT)


def records(path):
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


@pytest.mark.slow
def test_sigkills_of_one_of_two_processes_lose_at_most_the_peer_interval(uninterrupted, tmp_path):
    """A kill that also loses that process's host memory (``lose``: its own copies and the peer copy it held),
    so its shards come back from its peer; then a kill of the other process, which restores its own copy."""
    bench = _bench()
    fault = ";".join(f"{kind}@step={step},process={process},attempt={i}"
                     for i, (kind, step, process) in enumerate(FAULTS))
    out = tmp_path / "run"
    done = launch(out, fault)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--ckpt-every" in TRAIN and f"--ckpt-every {CKPT_EVERY}" in " ".join(map(str, done.args))
    events = records(out / "events.jsonl")
    faults = [e for e in events if e["event"] == "fault"]
    firsts = [e for e in events if e["event"] == "first_step"][1:]   # the first step of each restart
    assert [(f["kind"], f["step"], f["process"]) for f in faults] == list(FAULTS) and len(firsts) == len(FAULTS)
    rpo = [f["step"] - n["resumed_from"] for f, n in zip(faults, firsts)]
    assert all(0 <= r <= PEER_EVERY for r in rpo), (rpo, fault)   # the disk has nothing before the last step
    assert losses(out) == losses(uninterrupted)
    assert bench.same_arrays(bench.final_arrays(str(out), STEPS), bench.final_arrays(str(uninterrupted), STEPS))
    pids = [int(p) for line in re.findall(r"\[launch\] 2 processes: pids ([\d ]+)", done.stderr) for p in line.split()]
    assert len(pids) == 2 * (len(FAULTS) + 1) and not [p for p in pids if _alive(p)]
    assert not os.listdir(str(out) + "-shm"), "the copies outlived the finished run"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_resilience",
                                                  os.path.join(ROOT, "tools", "bench_resilience.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"
