"""``meshtrain launch``: supervision of a process group (with small Python children) and the CLI."""

from __future__ import annotations

import os
import signal
import processes
import sys
import time

import pytest

from meshtrain.cli import main
from meshtrain.commands.launch import ProcessGroup

#: Children sleep this long unless stopped, then exit 9 (NOT_STOPPED): a test sees from the status, not from
#: the clock, whether the group stopped them; the bound only keeps a broken test from hanging.
WAIT_S = 300
NOT_STOPPED = 9


def child(code: str):
    return [sys.executable, "-c", code]


def trap(marker):
    """Exits 0 on SIGTERM; touches ``marker`` once the handler is installed."""
    return child(f"import signal, sys, time, pathlib; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
                 f"pathlib.Path({str(marker)!r}).touch(); time.sleep({WAIT_S}); sys.exit({NOT_STOPPED})")


STUBBORN = child(f"import signal, time, pathlib, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 f"pathlib.Path(sys.argv[1]).touch(); time.sleep({WAIT_S})")


def group(argvs, grace=10.0):
    return ProcessGroup(argvs, [dict(os.environ)] * len(argvs), grace=grace, quiet=True)


def wait_for(paths, deadline_s=WAIT_S / 2):
    end = time.monotonic() + deadline_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < end, f"children did not start: {[p for p in paths if not p.exists()]}"
        time.sleep(0.02)


def test_first_failure_stops_the_others_and_sets_the_status(tmp_path):
    ready = tmp_path / "ready"
    fail = child(f"import pathlib, sys, time\nwhile not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.02)\n"
                 f"sys.exit(3)")
    g = group([trap(ready), fail, trap(tmp_path / "r2")])
    g.start()
    try:
        status = g.supervise()
    finally:
        g.close()
    assert status == 3
    # stopped by the group's SIGTERM (0), not at the end of their sleep (NOT_STOPPED); r2 may not have trapped yet
    assert [p.returncode for p in g.procs] in ([0, 3, 0], [0, 3, -signal.SIGTERM])


def test_a_process_ignoring_sigterm_is_killed_after_the_grace(tmp_path):
    ready = tmp_path / "ready"
    stubborn = STUBBORN + [str(ready)]
    fail = child(f"import pathlib, sys, time\nwhile not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.02)\n"
                 f"sys.exit(4)")
    g = group([stubborn, fail], grace=0.5)
    g.start()
    try:
        status = g.supervise()
    finally:
        g.close()
    assert status == 4
    assert g.procs[0].returncode == -signal.SIGKILL


def test_signals_are_forwarded_to_every_process(tmp_path):
    markers = [tmp_path / "a", tmp_path / "b"]
    g = group([trap(m) for m in markers])
    g.start()
    try:
        wait_for(markers)
        g.forward(signal.SIGTERM)
        status = g.supervise()
    finally:
        g.close()
    assert status == 0 and [p.returncode for p in g.procs] == [0, 0]


def test_status_of_a_killed_process_is_128_plus_signal():
    g = group([child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")])
    g.start()
    try:
        assert g.supervise() == 128 + signal.SIGKILL
    finally:
        g.close()


@pytest.mark.parametrize("argv, message", [
    (["launch", "--processes", "2"], "give the meshtrain command to launch after --"),
    (["launch", "--processes", "2", "--", "fly"], "got 'fly'"),
    (["launch", "--processes", "2", "--", "launch", "--processes", "2"], "give the meshtrain command"),
    (["launch", "--processes", "0", "--", "train"], "--processes 0"),
    (["launch", "--processes", "2", "--devices-per-process", "4", "--", "train", "--devices", "8"], "disagree"),
    (["launch", "--processes", "2", "--", "train", "--process-id", "1"], "--process-id is set by"),
])
def test_bad_launch_commands_say_what_to_change(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_every_process_reports_its_error_and_the_launcher_exits_with_it(tmp_path):
    """A real launch whose command fails in every process: each error line carries its process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHTRAIN_", "JAX_"))}
    missing = tmp_path / "no-such-data.txt"
    proc = processes.run([sys.executable, "-m", "meshtrain", "launch", "--processes", "2", "--devices-per-process",
                           "2", "--init-timeout", "120", "--", "train", "--model", "tiny", "--data", str(missing),
                           "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    for i in range(2):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"[{i}] error: [process {i}]")]
        assert lines and str(missing) in lines[0], proc.stderr[-3000:]
    assert "[launch] process" in proc.stderr


LAUNCHER = """
import os, sys, time
from meshtrain.commands.launch import Guard, ProcessGroup
folder, pids, use_guard = sys.argv[1], sys.argv[2], sys.argv[3] == "guard"
os.makedirs(folder)
guard = Guard() if use_guard else None
if guard:
    guard.note(f"dir {folder}")
g = ProcessGroup([[sys.executable, "-c", "import time; time.sleep(300)"]] * 2, [dict(os.environ)] * 2, quiet=True,
                 guard=guard)
g.start()
with open(pids + ".tmp", "w") as f:
    f.write(" ".join(str(p.pid) for p in g.procs))
os.replace(pids + ".tmp", pids)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("guard", ["guard", "no-guard"])
def test_a_sigkilled_launcher_leaves_no_process_and_the_guard_removes_the_run_folder(guard, tmp_path):
    """SIGKILL of the launcher: its processes die with it (parent-death signal, also without the guard);
    the guard removes the folder it was told about (the run's /dev/shm copies)."""
    folder, pid_file = tmp_path / "meshtrain-peers-x", tmp_path / "pids"
    launcher = processes.start([sys.executable, "-c", LAUNCHER, str(folder), str(pid_file), guard])
    try:
        wait_for([pid_file])
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        os.kill(launcher.pid, signal.SIGKILL)
        processes.wait(launcher, timeout=60)
        end = time.monotonic() + processes.scaled(10)
        while (any(map(_alive, pids)) or (guard == "guard" and folder.exists())) and time.monotonic() < end:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)], "a launched process outlived its SIGKILLed launcher"
        assert folder.exists() == (guard == "no-guard")
    finally:
        processes.kill(launcher)
