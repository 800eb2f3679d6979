"""Several processes (issue 6), each case in subprocesses on 127.0.0.1 with simulated CPU devices.

2 processes × 2 devices must train exactly like 1 process × 4 devices; checkpoints move between
process counts and meshes; SIGTERM to one process stops both at the same step; an unreachable
coordinator fails in time with its address. Runs share the suite's persistent compilation cache (a
fresh folder per test session) so identical programs compile once. The 2-process fsdp run is the
session's uninterrupted launch of tests/launch_jobs.py's job (conftest.py), the same 6 steps of the tiny
model on 8 × 32 tokens in float32 that these runs train: it is launched once for the resilience tests and
this file, and this file's own 2-process fsdp run (the preempted one) loads its programs from the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import processes
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import cache_every_process
from launch_jobs import STEPS   # the uninterrupted launch's steps: 6
from meshtrain.distributed import free_port

RTOL = 1e-5  # f32 parity (DESIGN.md)
CKPT_AT = STEPS // 2
TRAIN = ["train", "--model", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--seed", "0",
         "--eval-every", "0", "--progress", "none", "--compute-dtype", "float32"]
TIMEOUT_S = 600  # a hung run fails the test instead of the suite


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MESHTRAIN_", "JAX_", "SLURM_", "OMPI_"))}
    # the suite's compilation cache (conftest), shared with the other files' children; a folder of this
    # module's own where none is set; every process writes and reads it (helpers.cache_every_process)
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax-cache"))
    base.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=cache,
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return cache_every_process(base)


def meshtrain(env, *args, check=True):
    """``python -m meshtrain ARGS`` in a subprocess; returns the CompletedProcess."""
    proc = processes.run([sys.executable, "-m", "meshtrain", *args], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if check and proc.returncode != 0:
        raise AssertionError(f"meshtrain {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return proc


def launch(env, *args, processes=2, devices=2, check=True):
    return meshtrain(env, "launch", "--processes", str(processes), "--devices-per-process", str(devices),
                     "--init-timeout", "120", "--", *args, check=check)


def records(run_dir: Path):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(run_dir: Path):
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def events(run_dir: Path, name: str):
    return [r for r in records(run_dir) if r.get("event") == name]


def assert_same_losses(got: dict, want: dict, steps):
    assert steps and set(steps) <= set(got), f"steps {sorted(steps)} missing from {sorted(got)}"
    bad = {s: (got[s], want[s]) for s in steps if abs(got[s] - want[s]) > RTOL * abs(want[s])}
    assert not bad, f"losses differ beyond rtol {RTOL} (step: got, want): {bad}"


def copy_step(src_run: Path, step: int, dst_run: Path) -> None:
    """A fresh run folder holding only checkpoint ``step`` of ``src_run``."""
    shutil.copytree(src_run / "checkpoints" / str(step), dst_run / "checkpoints" / str(step))


@pytest.fixture(scope="module")
def baseline(env, tmp_path_factory):
    """1 process × 4 devices, fsdp, checkpoints every 3 steps."""
    out = tmp_path_factory.mktemp("one") / "run"
    meshtrain(env, *TRAIN, "--recipe", "fsdp", "--devices", "4", "--ckpt-every", str(CKPT_AT), "--out", str(out))
    return out


@pytest.mark.slow
def test_two_processes_train_like_one(env, baseline, uninterrupted):
    """2 processes × 2 devices (the session's uninterrupted launch, fsdp): the same losses as 1 process × 4.

    Cut: an hsdp case here launched the whole run again on 2 processes; hsdp across the 2 processes (data=2 on
    DCN × fsdp=2) is still trained and compared with the one-process run in
    test_checkpoint_from_one_process_resumes_in_two (steps 4-6), and the fresh start on 2 processes (init,
    steps from 1) is this fsdp case."""
    run = uninterrupted
    want = losses(baseline)
    assert sorted(want) == list(range(1, STEPS + 1))
    assert_same_losses(losses(run), want, range(1, STEPS + 1))
    assert json.loads((run / "plan.json").read_text())["recipe"] == "fsdp"
    assert events(run, "summary")[-1]["steps"] == STEPS


@pytest.mark.slow
def test_checkpoint_from_one_process_resumes_in_two(env, baseline, tmp_path):
    """Saved by 1 process on fsdp=4, restored by 2 processes on hsdp (data=2 × fsdp=2)."""
    run = tmp_path / "run"
    copy_step(baseline, CKPT_AT, run)
    launch(env, *TRAIN, "--recipe", "hsdp", "--resume", "--out", str(run))
    assert [e["restored_step"] for e in events(run, "restart")] == [CKPT_AT]
    got = losses(run)
    assert sorted(got) == list(range(CKPT_AT + 1, STEPS + 1))
    assert_same_losses(got, losses(baseline), range(CKPT_AT + 1, STEPS + 1))


def _spawn_two(env, args, port, logs: Path):
    """Two processes started the cluster way: MESHTRAIN_* variables, no launcher."""
    procs = []
    for i in range(2):
        child = dict(env, MESHTRAIN_COORDINATOR=f"127.0.0.1:{port}", MESHTRAIN_NUM_PROCESSES="2",
                     MESHTRAIN_PROCESS_ID=str(i), MESHTRAIN_INIT_TIMEOUT="120", JAX_NUM_CPU_DEVICES="2")
        procs.append(processes.start([sys.executable, "-m", "meshtrain", *args], env=child,
                                      stdout=open(logs / f"out{i}.txt", "w"), stderr=open(logs / f"err{i}.txt", "w")))
    return procs


def _tail(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("*.txt")))


@pytest.fixture(scope="module")
def preempted(env, tmp_path_factory):
    """2 processes on fsdp; SIGTERM to process 1 only, once the plan is built (training under way)."""
    root = tmp_path_factory.mktemp("sigterm")
    run = root / "run"
    procs = _spawn_two(env, [*TRAIN, "--recipe", "fsdp", "--ckpt-every", str(10 * STEPS), "--out", str(run)],
                       free_port(), root)
    deadline = time.monotonic() + TIMEOUT_S
    while not (run / "plan.json").exists():
        assert all(p.poll() is None for p in procs), f"a process ended before training:\n{_tail(root)}"
        assert time.monotonic() < deadline, f"no plan.json after {TIMEOUT_S} s:\n{_tail(root)}"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    try:
        codes = [processes.wait(p, timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            processes.kill(p)
    return run, codes, root


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step(preempted):
    run, codes, logs = preempted
    assert codes == [0, 0], f"exit codes {codes}\n{_tail(logs)}"
    stops = events(run, "preempted")
    assert len(stops) == 1, f"no preemption recorded (the run finished first?):\n{_tail(logs)}"
    step = stops[0]["step"]
    assert 1 <= step < STEPS
    assert sorted(losses(run)) == list(range(1, step + 1))
    # One complete checkpoint at that step, written by both processes (one shard folder each).
    ckpts = run / "checkpoints"
    assert sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [step]
    assert sorted(p.name for p in (ckpts / str(step) / "state").glob("ocdbt.process_*")) == \
        ["ocdbt.process_0", "ocdbt.process_1"]
    assert (ckpts / str(step) / "commit_success.txt").exists()


@pytest.mark.slow
def test_preempted_two_process_checkpoint_resumes_in_one_process(env, preempted, baseline):
    """``--resume`` continues the preempted 2-process run in 1 process on another mesh (hsdp
    data=2 × fsdp=2 instead of fsdp 2×2) with the losses of the uninterrupted run."""
    run, codes, logs = preempted
    stops = events(run, "preempted")
    assert codes == [0, 0] and stops, f"the preempted run failed:\n{_tail(logs)}"
    step = stops[0]["step"]
    meshtrain(env, *TRAIN, "--recipe", "hsdp", "--devices", "4", "--resume", "--out", str(run))
    assert [e["restored_step"] for e in events(run, "restart")] == [step]
    got = losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_same_losses(got, losses(baseline), range(1, STEPS + 1))


@pytest.mark.parametrize("process_id, expect", [("1", "cannot reach the coordinator"),
                                                 ("0", "not all 2 processes joined")])
def test_missing_coordinator_or_peers_fail_in_time_naming_the_address(process_id, expect, env, tmp_path):
    """Process 1 with nobody listening at the coordinator address, and process 0 whose peer never
    comes: both stop after the timeout with exit 2 and a message naming the address and timeout."""
    port = free_port()
    timeout_s = 2.0
    child = dict(env, MESHTRAIN_COORDINATOR=f"127.0.0.1:{port}", MESHTRAIN_NUM_PROCESSES="2",
                 MESHTRAIN_PROCESS_ID=process_id, MESHTRAIN_INIT_TIMEOUT=str(timeout_s), JAX_NUM_CPU_DEVICES="4")
    t0 = time.monotonic()
    proc = meshtrain(child, *TRAIN, "--out", str(tmp_path / "run"), check=False)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expect in proc.stderr, proc.stderr[-3000:]
    assert f"127.0.0.1:{port}" in proc.stderr and f"within {timeout_s:g} s" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert elapsed >= timeout_s   # (no upper bound: start-up on a busy host takes what it takes; TIMEOUT_S bounds it)
    assert not (tmp_path / "run").exists()


#: The two in-process checks below run in one pair of processes (one start-up, one distributed init for both).
TWO_CHECKS = textwrap.dedent("""
    import json
    import numpy as np
    from meshtrain import distributed
    info = distributed.initialize()
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from meshtrain import get_recipe
    from meshtrain.data import BatchIterator, load_source
    from meshtrain.data.loader import KEYS
    # the per-process loader
    mine = lambda p: [d for d in jax.devices() if d.process_index == p]
    layouts = {"contiguous": mine(0) + mine(1),                               # process p: rows 4p..4p+3
               "interleaved": mine(0)[:2] + mine(1)[:2] + mine(0)[2:] + mine(1)[2:]}  # process 0: 0,1,4,5
    source, data = load_source(None), {}
    for name, order in layouts.items():
        mesh = Mesh(np.array(order), ("data",))
        shardings = {k: NamedSharding(mesh, PartitionSpec("data")) for k in KEYS}
        it = BatchIterator(source, 8, 16, seed=3, shardings=shardings, prefetch=0)
        ref = BatchIterator(source, 8, 16, seed=3, prefetch=0)  # one process, numpy: the whole batch
        equal = []
        for _ in range(3):
            got, want = next(it), next(ref)
            equal += [bool((np.asarray(multihost_utils.process_allgather(got[k], tiled=True)) == want[k]).all())
                      for k in KEYS]
        data[name] = {"rows": it._rows.tolist(), "equal": all(equal), "samples_seen": it.state()["samples_seen"]}
    # the hybrid mesh
    devices = jax.devices()
    spec = distributed.auto_dcn(get_recipe("hsdp").mesh, devices)
    mesh = spec.build(devices)
    explicit = distributed.split_dcn(get_recipe("hsdp").mesh, len(devices), {"data": 2}).build(devices)
    hybrid = {"granules": distributed.granules(devices), "dcn": dict(spec.dcn), "ici": dict(spec.ici),
              "shape": dict(mesh.shape), "same": (mesh.devices == explicit.devices).all().item(),
              "rows": [sorted({d.process_index for d in row.flat}) for row in mesh.devices]}
    print(json.dumps({"process": info.process_id, "data": data, "hybrid": hybrid}))
""")


def _run_script(env, script, tmp_path):
    """Run ``script`` as 2 processes × 4 CPU devices; returns each process's last stdout line as JSON."""
    path = tmp_path / "script.py"
    path.write_text(script)
    port = free_port()
    procs = []
    for i in range(2):
        child = dict(env, MESHTRAIN_COORDINATOR=f"127.0.0.1:{port}", MESHTRAIN_NUM_PROCESSES="2",
                     MESHTRAIN_PROCESS_ID=str(i), MESHTRAIN_INIT_TIMEOUT="120", JAX_NUM_CPU_DEVICES="4")
        procs.append(processes.start([sys.executable, str(path)], env=child, stdout=processes.PIPE,
                                      stderr=processes.PIPE))
    try:
        outs = [processes.finish(p, timeout=TIMEOUT_S)[1:] for p in procs]
    finally:
        for p in procs:
            processes.kill(p)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


@pytest.fixture(scope="module")
def two_checks(env, tmp_path_factory):
    """TWO_CHECKS' results of processes 0 and 1."""
    return _run_script(env, TWO_CHECKS, tmp_path_factory.mktemp("two-checks"))


def test_each_process_reads_only_its_rows_and_the_global_batch_is_whole(two_checks):
    """The per-process loader: each process packs only the rows its devices hold (contiguous or
    not), and the assembled global arrays equal the one-process batches; the position is global."""
    results = [r["data"] for r in two_checks]
    assert results[0]["contiguous"]["rows"] == [0, 1, 2, 3] and results[1]["contiguous"]["rows"] == [4, 5, 6, 7]
    assert results[0]["interleaved"]["rows"] == [0, 1, 4, 5] and results[1]["interleaved"]["rows"] == [2, 3, 6, 7]
    for process, r in enumerate(results):
        for layout in ("contiguous", "interleaved"):
            assert r[layout]["equal"], (process, layout)
            assert r[layout]["samples_seen"] == 3 * 8


def test_hsdp_replicas_across_processes_fsdp_within(two_checks):
    """``auto_dcn``: with 2 processes, hsdp puts ``data`` on DCN (one replica per process) and
    ``fsdp`` within each process; ``MeshSpec.build`` groups the CPU devices by process."""
    for i, result in enumerate(two_checks):
        r = result["hybrid"]
        assert result["process"] == i and r["granules"] == 2
        assert r["dcn"] == {"data": 2} and r["ici"] == {"data": 1, "fsdp": 4}
        assert r["shape"] == {"data": 2, "fsdp": 4}
        assert r["rows"] == [[0], [1]]  # replica p lives on process p
        assert r["same"]


LATE = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from meshtrain import distributed
    info = distributed.initialize()
    import jax
    from jax.experimental import multihost_utils
    if info.process_id == 1:
        time.sleep(LATE_S)   # a slow restore or compile on a loaded host, before this process's first collective
    gathered = multihost_utils.process_allgather(np.int32(info.process_id))
    total = multihost_utils.broadcast_one_to_all(np.int32(7 + info.process_id))
    print(json.dumps({"process": info.process_id, "gathered": np.asarray(gathered).tolist(), "total": int(total)}))
""")


@pytest.mark.slow
def test_a_process_late_to_its_first_collective_by_more_than_gloos_30_s_still_joins(env, tmp_path):
    """XLA:CPU's gloo rendezvous at a device group's first collective waits a fixed 30 s; meshtrain connects the
    groups at start-up, at a barrier bounded by --init-timeout, so a peer 35 s late no longer fails the run
    (before: ``Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out``)."""
    results = _run_script(env, LATE.replace("LATE_S", "35"), tmp_path)
    assert [(r["process"], r["gathered"], r["total"]) for r in results] == [(0, [0, 1], 7), (1, [0, 1], 7)]
