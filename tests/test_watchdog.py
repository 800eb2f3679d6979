"""The watchdog hook: its bound, the fault specs tests inject, a hang → stacks + exit 75, stragglers
reported without stopping the run."""

import json
import os
import sys

import pytest

import processes
from helpers import cache_every_process
from launch_jobs import STEPS
from meshtrain.cli import main
from meshtrain.errors import EXIT_HANG, ConfigError
from meshtrain.train.watchdog import (FLOOR_S, MULTIPLE, STARTUP_S, WARMUP_STEPS, Fault, FaultKind, hang_bound,
                                      parse_faults)

ROOT = os.path.dirname(os.path.dirname(__file__))
TINY = ["train", "--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0", "--progress", "lines",
        "--log-every", "1"]


def env(fault):
    e = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    e.update(JAX_PLATFORMS="cpu", MESHTRAIN_FAULT=fault)
    return cache_every_process(e)   # a launch's process 1 loads its programs from the cache too


def test_default_bound_is_a_multiple_of_the_median_step_with_floors():
    assert hang_bound([], None) == STARTUP_S == 1800
    assert hang_bound([1.0] * (WARMUP_STEPS - 1), None) == STARTUP_S
    assert hang_bound([0.1] * WARMUP_STEPS, None) == FLOOR_S == 300   # 10 × 0.1 s < the floor
    assert hang_bound([50.0, 60.0, 70.0, 80.0, 90.0], None) == MULTIPLE * 70.0 == 700
    assert hang_bound([50.0] * WARMUP_STEPS, 5.0) == 5.0                # --hang-timeout wins after the first step


@pytest.mark.parametrize("text, want", [
    ("kill@step=3,process=1", [Fault(FaultKind.KILL, 3, 1, 0)]),
    ("stop@step=5;slow@step=2,process=1,seconds=0.25", [Fault(FaultKind.STOP, 5, 0, 0),
                                                       Fault(FaultKind.SLOW, 2, 1, 1, 0.25)]),
    ("kill@step=1,attempt=3", [Fault(FaultKind.KILL, 1, 0, 3)]),
    ("", []),
    ("boom@step=1", "cannot read 'boom@step=1'"),
    ("kill@process=1", "cannot read 'kill@process=1'"),
    ("kill@step=1,when=now", "unknown key(s) ['when']"),
])
def test_fault_specs_for_tests_are_read_or_refused(text, want):
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=None) as exc:
            parse_faults(text)
        assert want in str(exc.value) and "MESHTRAIN_FAULT" in str(exc.value)
    else:
        assert parse_faults(text) == want


@pytest.mark.parametrize("flag, message", [(["--hang-timeout", "0"], "--hang-timeout 0: give a positive number"),
                                           (["--straggler-fraction", "-1"], "--straggler-fraction -1")])
def test_bad_watchdog_settings_exit_2(flag, message, capsys, tmp_path):
    assert main([*TINY, "--steps", "2", "--out", str(tmp_path / "r"), *flag]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_hang_dumps_every_stack_names_the_frame_and_exits_75(tmp_path):
    out = tmp_path / "run"
    hang = processes.scaled(3)   # 3 s on an idle machine: no ordinary step of the tiny model comes near it
    done = processes.run([sys.executable, "-m", "meshtrain", *TINY, "--steps", "6", "--devices", "2",
                          "--hang-timeout", str(hang), "--out", str(out)], env=env("slow@step=3,seconds=3600"),
                         timeout=600, cwd=ROOT)
    assert done.returncode == EXIT_HANG == 75, done.stderr[-3000:]
    dump = (out / "hang-0.txt").read_text()
    first = dump.splitlines()[0]
    assert "completed no step for" in first and f"(bound {hang} s) after step 3" in first, first
    assert "main thread stuck at" in first and "watchdog.py" in first and "in _inject" in first, first
    assert "all threads (faulthandler)" in dump and "time.sleep" in dump
    assert f"error: {first}" in done.stderr
    beat = json.loads((out / "watchdog" / "process-0.json").read_text())
    assert beat["step"] == 3 and beat["process"] == 0


@pytest.mark.slow
def test_a_slow_process_is_reported_as_a_straggler_and_the_run_goes_on(tmp_path):
    out = tmp_path / "run"
    # 0.5 s on an idle machine; scaled, so that the sleep stays large beside steps slowed by a busy host
    slow = 0.5 * processes.slowdown() * 2
    # the 6 steps of tests/launch_jobs.py's job (its train step is compiled once per session, not again here):
    # the report comes at the last step (and every STRAGGLER_EVERY = 10 steps, which a 6-step run never reaches)
    done = processes.run([sys.executable, "-m", "meshtrain", "launch", "--processes", "2", "--devices-per-process",
                          "2", "--", *TINY, "--recipe", "fsdp", "--steps", str(STEPS), "--out", str(out)],
                         env=env(f"slow@step=1,process=1,seconds={slow:.2f}"), timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    stragglers = [r for r in recs if r.get("event") == "stragglers"]
    assert [(r["step"], r["processes"]) for r in stragglers] == [(STEPS, [1])], stragglers
    assert stragglers[0]["host_s_per_step"][1] >= round(slow, 2) > stragglers[0]["host_s_per_step"][0]
    assert f"straggler at step {STEPS}: process 1 spends" in done.stdout
    assert max(r["step"] for r in recs if "loss" in r) == STEPS
