"""The SLURM template (issue 36): its CPU variant is the GPU template with only what CPU needs changed,
the exit status a SIGTERM stop ends with, and (opt-in, when Debian's ``slurmctld`` is installed)
``tools/slurm_check.sh``: a one-node SLURM that runs the CPU variant through requeues, a crash and a
node-count change.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from meshtrain import interrupts
from meshtrain.errors import ConfigError
import processes

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "recipes" / "launch"

#: The only lines the CPU variant changes (GPU line -> CPU line): no GPUs, 1 CPU per task, 4 simulated
#: devices per task, the tiny model and a short run. Everything else (requeue, retries, logs, mesh
#: derivation) is the GPU template's, so tools/slurm_check.sh checks the template itself.
CPU_CHANGES = {
    "# meshtrain on SLURM GPU nodes: 2 nodes × 8 GPUs, one task per node (each task drives its 8 GPUs).":
        "# CPU variant of slurm-gpu.sbatch (tools/slurm_check.sh): 2 nodes × 4 simulated CPU devices, tiny model.",
    "#SBATCH --gpus-per-node=8": None,
    "#SBATCH --cpus-per-task=32": "#SBATCH --cpus-per-task=1",
    "GPUS_PER_NODE=8                                    # = --gpus-per-node: the mesh's fsdp size":
        "GPUS_PER_NODE=4                                    # simulated CPU devices per task: the mesh's fsdp size\n"
        "export JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=${GPUS_PER_NODE}",
    "      --model small --recipe hsdp --mesh \"data=-1,fsdp=${GPUS_PER_NODE}\" \\":
        "      --model tiny --recipe hsdp --mesh \"data=-1,fsdp=${GPUS_PER_NODE}\" \\",
    "      --steps 10000 --batch-size 256 --seq-len 1024 \\":
        "      --steps \"${STEPS:-120}\" --batch-size 8 --seq-len 16 \\",
    "      --compute-dtype bfloat16 \\": "      --compute-dtype float32 \\",
    "      --out \"${RUN_DIR}\" --ckpt-every 500 --resume 2>&1 | quiet":
        "      --out \"${RUN_DIR}\" --ckpt-every 10 --resume 2>&1 | quiet",
    "  echo \"job ${SLURM_JOB_ID}: status ${status}; retry ${attempt}/${MAX_RETRIES} from the last checkpoint in 10 s\"":
        "  echo \"job ${SLURM_JOB_ID}: status ${status}; retry ${attempt}/${MAX_RETRIES} from the last checkpoint in 2 s\"",
    "  sleep 10": "  sleep 2",
}


def cpu_variant(gpu_text: str) -> str:
    """The GPU template with :data:`CPU_CHANGES` applied (each must match exactly one line)."""
    lines = gpu_text.split("\n")
    for old, new in CPU_CHANGES.items():
        assert lines.count(old) == 1, f"slurm-gpu.sbatch has {lines.count(old)} lines {old!r}; update CPU_CHANGES"
        i = lines.index(old)
        lines[i:i + 1] = [] if new is None else new.split("\n")
    return "\n".join(lines)


def test_cpu_variant_is_the_gpu_template_with_cpu_changes_only():
    gpu = (LAUNCH / "slurm-gpu.sbatch").read_text()
    cpu = (LAUNCH / "slurm-cpu.sbatch").read_text()
    assert cpu == cpu_variant(gpu), "recipes/launch/slurm-cpu.sbatch drifted from slurm-gpu.sbatch: regenerate " \
        "it with `python -m tests.test_slurm > recipes/launch/slurm-cpu.sbatch`"
    # the mesh follows the node count: no hard-coded data size
    assert '--mesh "data=-1,fsdp=${GPUS_PER_NODE}"' in gpu
    for needed in ("--open-mode=append", "--requeue", "scontrol requeue", "MESHTRAIN_PREEMPTED_EXIT=99",
                   "${SLURM_JOB_ID}", "MAX_RETRIES"):
        assert needed in gpu, needed


def test_preempted_exit_status_is_read_and_checked(monkeypatch):
    assert interrupts.preempted_exit_status({}) == 0
    assert interrupts.preempted_exit_status({interrupts.ENV_PREEMPTED_EXIT: "99"}) == 99
    for bad in ("-1", "256", "requeue"):
        with pytest.raises(ConfigError, match="MESHTRAIN_PREEMPTED_EXIT"):
            interrupts.preempted_exit_status({interrupts.ENV_PREEMPTED_EXIT: bad})
    env = {interrupts.ENV_PREEMPTED_EXIT: "99"}
    monkeypatch.setattr(interrupts, "_preempted", False)
    assert interrupts.exit_status(0, env) == 0          # finished: 0
    monkeypatch.setattr(interrupts, "_preempted", True)
    assert interrupts.exit_status(0, env) == 99         # stopped by SIGTERM after a save
    assert interrupts.exit_status(1, env) == 1          # a failure keeps its status
    assert interrupts.exit_status(0, {}) == 0           # unset: the documented 0


def test_sigterm_during_startup_exits_at_once_with_the_status(tmp_path):
    """A process blocked in C code (as in an XLA compilation) still leaves at once on SIGTERM."""
    ready = tmp_path / "ready"
    code = ("import os, time, pathlib; from meshtrain import interrupts\n"
            "interrupts.guard_startup(lambda t: os.write(2, (t + '\\n').encode()))\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(120)\n")   # one C call: Python's own handler would run only after it
    proc = processes.start([sys.executable, "-c", code], cwd=ROOT, stderr=processes.PIPE, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), MESHTRAIN_PREEMPTED_EXIT="99"))
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        status, _, err = processes.finish(proc, timeout=60)
    finally:
        processes.kill(proc)
    assert status == 99, err
    assert "SIGTERM during start-up" in err


@pytest.mark.slow
@pytest.mark.timeout(3000)   # above its own 2400 s bound: pyproject's 1200 s per test would stop it first
@pytest.mark.skipif(shutil.which("slurmctld") is None or shutil.which("munged") is None,
                    reason="Debian's slurmctld/slurmd/munge are not installed (apt-get install slurmctld slurmd munge)")
def test_slurm_check_script_passes_every_case(tmp_path):
    """tools/slurm_check.sh: time-limit and scancel SIGTERM requeue and resume bit-identically, a
    kill -9 is retried, --nodes changes the mesh, every attempt's log is kept (28 minutes on 2 busy cores)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHTRAIN_PYTHON=sys.executable, SLURM_CHECK_DIR=str(tmp_path))
    out = processes.run(["bash", str(ROOT / "tools" / "slurm_check.sh")], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=2400)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    assert "all cases passed" in out.stdout


if __name__ == "__main__":   # regenerate the CPU variant
    sys.stdout.write(cpu_variant((LAUNCH / "slurm-gpu.sbatch").read_text()))
