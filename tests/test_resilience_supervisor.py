"""``meshtrain launch --max-restarts``: a killed or hung process restarts the whole job from its last
checkpoint, the run ends like an uninterrupted one (bit for bit), every attempt is in events.jsonl and
no process outlives the launcher. Faults are injected deterministically (``MESHTRAIN_FAULT``)."""

import dataclasses
import importlib.util
import json
import os
import re
import sys

import pytest

import processes
from meshtrain.cli import main
from meshtrain.commands import launch_fit
from meshtrain.errors import ConfigError
from meshtrain.supervisor import Layout, Supervisor, describe, elastic_layouts, with_option, with_resume

ROOT = os.path.dirname(os.path.dirname(__file__))
#: HANG_S: the hang bound that holds on an idle machine; the runs get it scaled to the machine's speed
#: (:func:`hang_s`), so that a slow step on a busy host is not taken for a hang.
STEPS, HANG_S = 6, 6
TRAIN = ["train", "--model", "tiny", "--recipe", "fsdp", "--steps", str(STEPS), "--batch-size", "8", "--seq-len",
         "32", "--eval-every", "0", "--progress", "lines", "--log-every", "1", "--ckpt-every", "1"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_resilience", os.path.join(ROOT, "tools", "bench_resilience.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env(fault=None):
    e = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "MESHTRAIN_FAULT")}
    e["JAX_PLATFORMS"] = "cpu"
    if fault:
        e["MESHTRAIN_FAULT"] = fault
    return e


def launch(out, *extra, fault=None, hang=None):
    """The tiny job under the launcher; ``hang``: its --hang-timeout (default: the watchdog's own bound,
    minutes: a job whose faults are kills needs none)."""
    watch = ["--hang-timeout", str(hang)] if hang else []
    return processes.run([sys.executable, "-m", "meshtrain", "launch", "--processes", "2", "--devices-per-process",
                          "2", "--grace", "2", *extra, "--", *TRAIN, *watch, "--out", str(out)], env=env(fault),
                         timeout=900, cwd=ROOT)


def records(path):
    return [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []


def losses(run_dir):
    return {r["step"]: r["loss"] for r in records(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie is not running; only its parent can reap it
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.parametrize("extra, message", [
    (["--max-restarts", "2", "--", "train", "--steps", "3"], "--max-restarts needs the launched command's --out"),
    (["--max-restarts", "-1", "--", "train", "--out", "x"], "--max-restarts -1: give the number of restarts"),
    (["--max-restarts", "1", "--restart-backoff", "-1", "--", "train", "--out", "x"], "--restart-backoff -1"),
    (["--max-restarts", "1", "--", "plan", "--model", "tiny"], "--max-restarts restarts training runs"),
    (["--elastic", "--", "train", "--out", "x"], "--elastic applies to restarts: add --max-restarts K"),
    (["--elastic", "--max-restarts", "1", "--", "train", "--out", "x"], "--elastic needs the command's --batch-size"),
    (["--elastic", "--max-restarts", "1", "--", "train", "--batch-size", "8", "--mesh", "fsdp=4", "--out", "x"],
     "--elastic: remove --mesh from the command"),
])
def test_restart_flags_are_checked_before_anything_starts(extra, message, capsys, tmp_path):
    assert main(["launch", "--processes", "2", *extra]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if not line.startswith("[launch] ")]   # its notes
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], err


@pytest.mark.parametrize("cmd, want", [
    (["train", "--out", "r"], ["train", "--out", "r", "--resume", "latest"]),
    (["train", "--resume", "--out", "r"], ["train", "--out", "r", "--resume", "latest"]),
    (["train", "--resume", "no", "--out", "r"], ["train", "--out", "r", "--resume", "latest"]),
    (["train", "--resume=latest"], ["train", "--resume", "latest"]),
])
def test_restarts_resume_and_causes_are_named(cmd, want):
    assert with_resume(cmd) == want
    assert with_option(["train", "--grad-accum", "2", "--out", "r"], "--grad-accum", "4") == \
        ["train", "--out", "r", "--grad-accum", "4"]
    assert elastic_layouts(["train", "--batch-size", "8"], 2) == [Layout(2, 1), Layout(1, 2)]
    assert elastic_layouts(["train", "--batch-size", "8", "--grad-accum=2"], 6) == \
        [Layout(6, 2), Layout(3, 4), Layout(2, 6), Layout(1, 12)]
    assert describe(1, 137) == "process 1 killed by SIGKILL"
    assert describe(0, 134) == "coordinator (process 0) lost: killed by SIGABRT"
    assert describe(0, 75) == "process 0 found a hang (watchdog, exit 75)"
    assert describe(1, 1) == "process 1 exited with status 1"


@pytest.mark.parametrize("outcomes, restarts, status, ends", [
    ([(137, 1, False), (75, 0, False), (0, None, False)], 2, 0, "done"),     # two failures, then success
    ([(137, 1, False), (137, 1, False)], 1, 137, "gave_up"),                   # K used up: the last status
    ([(2, 0, False)], 3, 2, "gave_up"),                                        # bad input: no restart
    ([(143, 0, True)], 3, 143, "gave_up"),                                     # the launcher was signalled
])
def test_supervisor_restarts_until_done_or_given_up(outcomes, restarts, status, ends, tmp_path):
    said, calls = [], []

    def attempt(k):
        calls.append(k)
        return outcomes[k]

    assert Supervisor(attempt, str(tmp_path), restarts, 0.0, said.append).run() == status
    events = records(tmp_path / "events.jsonl")
    assert calls == list(range(len(outcomes))) and events[-1]["event"] == ends
    assert [e["attempt"] for e in events if e["event"] == "attempt"] == calls
    assert [e["status"] for e in events if e["event"] == "failed"] == [o[0] for o in outcomes if o[0]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = launch(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def hang_s(uninterrupted):
    """The hang bound for this machine now: HANG_S times its measured slowdown (x2), and at least 5 times the
    longest step interval (step, data, checkpoint) of the uninterrupted run beside the same load."""
    steps = [r for r in records(os.path.join(uninterrupted, "metrics.jsonl")) if "loss" in r][1:]   # 1: compiles
    longest = max((r["step_time_s"] + r.get("data_wait_s", 0) + r.get("ckpt_block_s", 0) for r in steps), default=0)
    return max(processes.scaled(HANG_S), int(5 * longest) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("fault, process", [("kill", 1), ("stop", 1), ("kill", 0), ("full", 1)])
def test_a_killed_or_hung_process_restarts_the_job_which_ends_bit_identical(fault, process, uninterrupted, hang_s,
                                                                             tmp_path):
    """SIGKILL of process 1, SIGSTOP of process 1 (a hang), SIGKILL of process 0 (the coordinator), a full
    disk on process 1 (its save of step 3 fails with ENOSPC: exit 74; process 0 waits in the save)."""
    out = tmp_path / "run"
    done = launch(out, "--max-restarts", "2", "--restart-backoff", "0", fault=f"{fault}@step=3,process={process}",
                  hang=hang_s)
    assert done.returncode == 0, done.stderr[-3000:]
    events = records(out / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds == ["attempt", "first_step", "fault", "failed", "restart", "attempt", "first_step", "done"], events
    failed = events[3]
    if fault == "kill":
        cause = "process 1 killed by SIGKILL" if process else "coordinator (process 0) lost: killed by SIGKILL"
        assert (failed["process"], failed["status"], failed["cause"]) == (process, 137, cause)
    elif fault == "full":   # process 1 exits 74, unless process 0, held in Orbax's save barrier, finds the hang first
        assert (failed["process"], failed["status"]) in ((1, 74), (0, 75)), failed
        # (whether that hang report already names process 1 depends on the load: its heartbeat may still be fresh)
        assert failed["status"] == 74 or "found a hang (watchdog, exit 75)" in failed["cause"], failed
        assert "[1] error: [process 1] saving step 3 to" in done.stderr and "failed: the disk is full" in done.stderr
        assert (events[2]["kind"], events[2]["step"], events[2]["process"]) == ("full", 3, 1)
    else:   # process 0 waits in the step's collective; its watchdog names process 1 and the frame
        assert (failed["process"], failed["status"]) == (0, 75), failed
        head = (out / "hang-0.txt").read_text()
        first = head.splitlines()[0]
        assert "slow: process 1 (not running" in first and "in train_steps" in first, first
        elapsed, bound = map(float, re.search(r"no step for (\d+) s \(bound (\S+) s\)", first).groups())
        assert bound == hang_s and elapsed >= bound, first   # fired past its bound (how far past: the load's doing)
        assert "all threads (faulthandler)" in head and "meshtrain-watchdog" not in first
        assert first in failed["cause"]
    assert events[6]["resumed_from"] <= 3 and events[6]["step"] == events[6]["resumed_from"] + 1
    # the same losses at every step and the same parameters and optimizer state, bit for bit
    assert losses(out) == losses(uninterrupted)
    bench = _bench()
    assert bench.same_arrays(bench.final_arrays(str(out), STEPS), bench.final_arrays(str(uninterrupted), STEPS))
    pids = [int(p) for line in re.findall(r"\[launch\] 2 processes: pids ([\d ]+)", done.stderr)
            for p in line.split()]
    assert len(pids) == 4 and not [p for p in pids if alive(p)], done.stderr[-2000:]


@pytest.mark.slow
def test_elastic_restart_finishes_on_one_process_with_the_same_global_batch(uninterrupted, tmp_path):
    """A 2-process run loses process 1; the restart runs on 1 process (2 devices instead of 4) with
    --grad-accum 2: the same batch per device and globally, the loss curve within f32 rounding."""
    out = tmp_path / "run"
    done = launch(out, "--max-restarts", "1", "--restart-backoff", "0", "--elastic", fault="kill@step=3,process=1")
    assert done.returncode == 0, done.stderr[-3000:]
    attempts = [e for e in records(out / "events.jsonl") if e["event"] == "attempt"]
    assert [(a["processes"], a["grad_accum"]) for a in attempts] == [(2, 1), (1, 2)]
    starts = [r for r in records(out / "metrics.jsonl") if r.get("event") == "start"]
    assert [(r["mesh"], r["recipe_settings"]["grad_accum"]) for r in starts] == [({"fsdp": 4}, 1), ({"fsdp": 2}, 2)]
    assert [r["run_settings"]["batch_size"] for r in starts] == [8, 8]
    got, want = losses(out), losses(uninterrupted)
    assert got.keys() == want.keys()
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), (got, want)
    assert "on 1 process(es) with --grad-accum 2" in done.stderr


@pytest.mark.slow
def test_a_shrunk_run_grows_back_when_relaunched_on_more_processes(uninterrupted, tmp_path):
    """Elastic growth: a 2-process run shrinks to 1 process (--elastic), loses that one too and stops; relaunched
    on 2 processes with --resume it continues on more processes than its last segment had: 3 meshes in the run
    header, the same global batch, the loss curve within f32 rounding of the uninterrupted one."""
    out = tmp_path / "run"
    shrink = launch(out, "--max-restarts", "1", "--restart-backoff", "0", "--elastic",
                    fault="kill@step=2,process=1,attempt=0;kill@step=4,process=0,attempt=1")
    assert shrink.returncode == 137, shrink.stderr[-3000:]
    grow = processes.run([sys.executable, "-m", "meshtrain", "launch", "--processes", "2", "--devices-per-process",
                          "2", "--grace", "2", "--", *TRAIN, "--out", str(out), "--resume"], env=env(), timeout=900,
                         cwd=ROOT)
    assert grow.returncode == 0, grow.stderr[-3000:]
    starts = [r for r in records(out / "metrics.jsonl") if r.get("event") == "start"]
    assert [(r["mesh"], r["recipe_settings"]["grad_accum"]) for r in starts] == \
        [({"fsdp": 4}, 1), ({"fsdp": 2}, 2), ({"fsdp": 4}, 1)]
    assert [r["run_settings"]["batch_size"] for r in starts] == [8, 8, 8]
    got, want = losses(out), losses(uninterrupted)
    assert got.keys() == want.keys()
    assert all(abs(got[s] - want[s]) <= 1e-5 * abs(want[s]) for s in want), (got, want)


@pytest.mark.slow
def test_restarts_stop_after_k_failures_with_the_last_error(tmp_path):
    """Every attempt is killed (the fault fires in each): after --max-restarts 1 the launcher gives up."""
    out = tmp_path / "run"
    fault = "kill@step=1,process=1,attempt=0;kill@step=2,process=1,attempt=1"
    done = launch(out, "--max-restarts", "1", "--restart-backoff", "0", fault=fault)
    assert done.returncode == 137, done.stderr[-3000:]
    events = records(out / "events.jsonl")
    assert [e["event"] for e in events if e["event"] in ("attempt", "failed", "gave_up")] == \
        ["attempt", "failed", "attempt", "failed", "gave_up"]
    assert events[-1]["reason"] == "1 restart(s) used"
    assert "giving up after 2 attempt(s): process 1 killed by SIGKILL; exit status 137" in done.stderr


@pytest.mark.slow
def test_chaos_benchmark_reports_its_figures(tmp_path):
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "bench_resilience.py"), "--model", "tiny",
                         "--steps", "8", "--seq-len", "32", "--mixes", "kill", "kill,elastic",
                         "--work", str(tmp_path)], env=env(), timeout=1200, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert re.search(r"kill of process \d at step \d+: RPO \d+ steps, RTO [0-9.]+ s", out.stdout), out.stdout
    assert re.search(r"mix kill: RPO [0-9.]+ steps, RTO [0-9.]+ s, goodput [0-9.]+%, slowdown [0-9.]+x, jitter "
                     r"[0-9.]+, elastic overhead 1.00, resilience 1.00, RS [0-9.]+, attempts 2, .*final state bit-identical", out.stdout)
    assert re.search(r"mix kill,elastic: .*elastic overhead [0-9.]+, resilience 1.00, .*attempts 2", out.stdout)
    assert "load average" in out.stdout and "'w3': 0.2" in out.stdout
    assert re.search(r"--hang-timeout \d+ \(scaled: ", out.stdout), out.stdout   # measured, not a fixed 6 s


@pytest.fixture(scope="module")
def tiny_fits():
    """The pre-flight estimate of the tiny fsdp job on 2 × 2 and 1 × 2 devices (planned in a child process)."""
    layouts = [Layout(2, 1), Layout(1, 2)]
    fits = launch_fit.check_layouts(TRAIN + ["--out", "x"], layouts, 2, 2 ** 40)
    assert [(f.processes, f.devices) for f in fits] == [(2, 4), (1, 2)] and fits[0].needs < fits[1].needs
    return layouts, fits


@pytest.mark.parametrize("host, want", [
    ("plenty", None),                                              # fits: the exit 2 had another cause
    ("between", "the smallest device count that fits is 4 (2 process(es) × 2 devices)"),
    ("none", "no layout of this job fits"),
])
def test_an_elastic_shrink_that_does_not_fit_names_the_smallest_device_count(host, want, tiny_fits, tmp_path):
    layouts, fits = tiny_fits
    per_device = {"plenty": 2 ** 40, "between": int(fits[0].needs / 0.9) + 1, "none": fits[0].needs // 2}[host]
    fits = [dataclasses.replace(f, limit=per_device) for f in fits]
    told = launch_fit.explain(fits, layouts[1], 2)
    if want is None:
        assert told is None and launch_fit.explain(fits, layouts[0], 2) is None
        return
    assert told.startswith("--elastic: the run does not fit on 2 devices (1 process(es) × 2, --grad-accum 2): the "
                           "plan needs ~") and want in told, told
    said = []
    sup = Supervisor(lambda k: [(137, 1, False), (2, 0, False)][k], str(tmp_path), 3, 0.0, said.append,
                     layout=lambda k: layouts[min(k, 1)], explain=lambda k, status: told if k else None)
    assert sup.run() == 2 and said[-1] == f"error: {told}"
    assert records(tmp_path / "events.jsonl")[-1]["reason"] == f"status 2 is not retried: {told}"
