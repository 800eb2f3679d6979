"""The tiny 2-process job under ``meshtrain launch`` that the resilience tests start, fault and compare
(tests/test_resilience_*.py; the uninterrupted reference run is a session fixture in conftest.py)."""

import importlib.util
import json
import os
import sys

import processes
from helpers import cache_every_process

ROOT = os.path.dirname(os.path.dirname(__file__))
#: HANG_S: the hang bound that holds on an idle machine; the runs get it scaled to the machine's speed
#: (:func:`hang_s`), so that a slow step on a busy host is not taken for a hang.
STEPS, HANG_S = 6, 6
TRAIN = ["train", "--model", "tiny", "--recipe", "fsdp", "--steps", str(STEPS), "--batch-size", "8", "--seq-len",
         "32", "--eval-every", "0", "--progress", "lines", "--log-every", "1", "--ckpt-every", "1"]


def bench():
    spec = importlib.util.spec_from_file_location("bench_resilience", os.path.join(ROOT, "tools", "bench_resilience.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env(fault=None):
    e = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "MESHTRAIN_FAULT")}
    e["JAX_PLATFORMS"] = "cpu"
    if fault:
        e["MESHTRAIN_FAULT"] = fault
    return cache_every_process(e)   # processes 1.. load their programs from the cache too


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
