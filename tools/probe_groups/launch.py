"""Probe group ``launch`` (issue 35): ``meshtrain launch`` leaves nothing behind and says what happened.

* the launcher killed by SIGKILL while its 2 processes train (with in-memory peer copies in
  ``/dev/shm``): within 10 s no process is left and no ``/dev/shm/meshtrain-*`` entry;
* the same while one process hangs (SIGSTOP) under ``--max-restarts``: a stopped process dies too;
* one process killed mid-run: the launcher exits 137, and the survivor says one line, no traceback.

The first two run a Python snippet that starts the launcher, waits until training is under way,
kills it with SIGKILL, then checks the processes it had announced; the probe itself then checks for
any process carrying the case's marker and for new ``/dev/shm/meshtrain-*`` entries.
"""

from __future__ import annotations

from typing import List

from probe_bad_input import Case

#: Starts `meshtrain launch` in the background, waits for READY (a glob), SIGKILLs the launcher and
#: checks that its processes and its run's /dev/shm folder are gone within 10 s. Exit 0 when they are.
KILL_LAUNCHER = r'''
import glob, os, re, signal, subprocess, sys, time
from pathlib import Path
from meshtrain.checkpoint.peers import store_folder
work = "{work}"
run = os.path.join(work, "run")
shm = str(store_folder(Path(run) / "checkpoints"))
extra, env = EXTRA, dict(os.environ, **ENV)
ready = lambda: READY
log_path = os.path.join(work, "launch.log")
with open(log_path, "w") as log:
    p = subprocess.Popen([sys.executable, "-m", "meshtrain", "launch", "--processes", "2", "--devices-per-process",
                          "1", *extra, "--", "train", "--model", "tiny", "--steps", "100000", "--batch-size", "2",
                          "--seq-len", "16", "--eval-every", "0", "--progress", "none", "--ckpt-every", "0",
                          "--peer-every", "1", "--out", run], stdout=log, stderr=subprocess.STDOUT, env=env)
deadline = time.monotonic() + 400
while not ready() and p.poll() is None and time.monotonic() < deadline:
    time.sleep(0.1)
if not ready():
    p.kill(); p.wait()
    sys.exit(f"error: training did not get under way (READY_TEXT); launcher log: "
             + open(log_path).read()[-1500:])
pids = [int(x) for x in re.search(r"processes: pids ([\d ]+)", open(log_path).read()).group(1).split()]
os.kill(p.pid, signal.SIGKILL)
p.wait()
t0 = time.monotonic()

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

while (any(map(alive, pids)) or os.path.exists(shm)) and time.monotonic() - t0 < 10:
    time.sleep(0.1)
left = [pid for pid in pids if alive(pid)]
if left or os.path.exists(shm):
    sys.exit(f"error: 10 s after SIGKILL of the launcher: processes {left} alive, {shm} "
             f"{'still there' if os.path.exists(shm) else 'removed'}")
print(f"launcher killed: its processes {pids} and {shm} were gone after {time.monotonic() - t0:.1f} s")
'''


def _kill_launcher(extra: List[str], ready: str, env: dict) -> str:
    return (KILL_LAUNCHER.replace("EXTRA", repr(extra)).replace("READY_TEXT", ready.replace('"', "'"))
            .replace("READY", ready).replace("ENV", repr(env)))


def cases(tmp: str) -> List[Case]:
    # a committed peer copy of process 1: both processes trained a step and wrote to /dev/shm
    step_copies = 'glob.glob(shm + "/process-1/[0-9]*")'
    # process 1 stopped itself (the fault is logged just before its SIGSTOP)
    stopped = 'os.path.exists(run + "/events.jsonl") and "fault" in open(run + "/events.jsonl").read()'
    return [
        Case("launch: SIGKILL of the launcher leaves no process and no /dev/shm folder", [], "0", group="launch",
             python=_kill_launcher([], step_copies, {}), says="were gone after"),
        Case("launch: SIGKILL of a supervising launcher while a process hangs (SIGSTOP)", [], "0", group="launch",
             python=_kill_launcher(["--max-restarts", "1"], stopped, {"MESHTRAIN_FAULT": "stop@step=2,process=1"}),
             says="were gone after"),
        Case("launch: a process killed mid-run: exit 137, the launcher names it, no traceback",
             ["launch", "--processes", "2", "--devices-per-process", "1", "--grace", "5", "--", "train", "--model",
              "tiny", "--steps", "6", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--progress",
              "none", "--ckpt-every", "0", "--out", "{work}/run"], "137", group="launch",
             env={"MESHTRAIN_FAULT": "kill@step=2,process=1"}, says="[launch] process 1 exited with status 137"),
    ]
