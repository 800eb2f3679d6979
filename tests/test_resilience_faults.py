"""``meshtrain launch --max-restarts``: a killed or hung process restarts the whole job from its last
checkpoint, the run ends like an uninterrupted one (bit for bit), every attempt is in events.jsonl and
no process outlives the launcher. Faults are injected deterministically (``MESHTRAIN_FAULT``).
This file: the Supervisor's policy and each fault (kill, hang, coordinator kill, full disk) against the
uninterrupted run (conftest.py)."""

import re

import pytest
from launch_jobs import STEPS, alive, bench, launch, losses, records

from meshtrain.supervisor import Supervisor


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


#: The faults of one launch, one per attempt at increasing steps (each restart resumes from the checkpoint the
#: attempt before it committed): SIGKILL of process 1; a full disk on process 1 (its save of step 3 fails with
#: ENOSPC: exit 74; process 0 waits in the save); SIGKILL of process 0 (the coordinator); SIGSTOP of process 1
#: (a hang; last, so that hang-0.txt is its report). Cut: one launch per fault (8 attempts, each fault restarting
#: from an uninterrupted first attempt) became this one launch of 5 attempts: every fault still kills or hangs
#: a real process, each restart is still checked (its cause, the step it resumed from) and the job still ends
#: bit-identical to the uninterrupted run, now after restarting from restarted attempts too.
FAULTS = [("kill", 2, 1), ("full", 3, 1), ("kill", 4, 0), ("stop", 5, 1)]


@pytest.mark.slow
def test_killed_or_hung_processes_restart_the_job_which_ends_bit_identical(uninterrupted, hang_s, tmp_path):
    out = tmp_path / "run"
    spec = ";".join(f"{kind}@step={step},process={process},attempt={k}" for k, (kind, step, process) in enumerate(FAULTS))
    done = launch(out, "--max-restarts", str(len(FAULTS)), "--restart-backoff", "0", fault=spec, hang=hang_s)
    assert done.returncode == 0, done.stderr[-3000:]
    events = records(out / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds == ["attempt", "first_step", *["fault", "failed", "restart", "attempt", "first_step"] * len(FAULTS),
                     "done"], events
    for k, (fault, step, process) in enumerate(FAULTS):
        injected, failed, resumed = events[2 + 5 * k], events[3 + 5 * k], events[6 + 5 * k]
        assert (injected["kind"], injected["step"], injected["process"]) == (fault, step, process), injected
        assert failed["attempt"] == k and resumed["attempt"] == k + 1, (failed, resumed)
        _assert_cause(fault, process, failed, out, done.stderr, hang_s)
        assert resumed["resumed_from"] <= step and resumed["step"] == resumed["resumed_from"] + 1, resumed
    # the same losses at every step and the same parameters and optimizer state, bit for bit
    assert losses(out) == losses(uninterrupted)
    tool = bench()
    assert tool.same_arrays(tool.final_arrays(str(out), STEPS), tool.final_arrays(str(uninterrupted), STEPS))
    pids = [int(p) for line in re.findall(r"\[launch\] 2 processes: pids ([\d ]+)", done.stderr)
            for p in line.split()]
    assert len(pids) == 2 * (len(FAULTS) + 1) and not [p for p in pids if alive(p)], done.stderr[-2000:]


def _assert_cause(fault, process, failed, out, stderr, hang_s):
    """What the launcher recorded for one failed attempt: the process, its status and the cause it names."""
    if fault == "kill":
        cause = "process 1 killed by SIGKILL" if process else "coordinator (process 0) lost: killed by SIGKILL"
        assert (failed["process"], failed["status"], failed["cause"]) == (process, 137, cause)
    elif fault == "full":   # process 1 exits 74, unless process 0, held in Orbax's save barrier, finds the hang first
        assert (failed["process"], failed["status"]) in ((1, 74), (0, 75)), failed
        # (whether that hang report already names process 1 depends on the load: its heartbeat may still be fresh)
        assert failed["status"] == 74 or "found a hang (watchdog, exit 75)" in failed["cause"], failed
        assert "[1] error: [process 1] saving step 3 to" in stderr and "failed: the disk is full" in stderr
    else:   # process 0 waits in the step's collective; its watchdog names process 1 and the frame
        assert (failed["process"], failed["status"]) == (0, 75), failed
        head = (out / "hang-0.txt").read_text()
        first = head.splitlines()[0]
        assert "slow: process 1 (not running" in first and "in train_steps" in first, first
        elapsed, bound = map(float, re.search(r"no step for (\d+) s \(bound (\S+) s\)", first).groups())
        assert bound == hang_s and elapsed >= bound, first   # fired past its bound (how far past: the load's doing)
        assert "all threads (faulthandler)" in head and "meshtrain-watchdog" not in first
        assert first in failed["cause"]
