"""Per-backend XLA scheduling flags: accepted by this jaxlib, never override the user, shown in plans."""

import json
import os
import processes
import sys

from meshtrain.hardware import SCHEDULING_FLAGS, apply_scheduling_flags, detect_backend, scheduling_flags


def _start_backend(xla_flags: str) -> processes.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    return processes.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"], capture_output=True,
                          text=True, env=env, timeout=120)


def test_every_gpu_flag_is_known_to_this_xla():
    # XLA parses XLA_FLAGS on every backend and aborts on a flag it does not know, so the CPU build
    # checks the GPU set (GPU flags live in the shared DebugOptions).
    ok = _start_backend(scheduling_flags("gpu")["XLA_FLAGS"])
    assert ok.returncode == 0, ok.stderr[-1500:]
    bad = _start_backend("--xla_gpu_no_such_flag_in_meshtrain=true")  # the check can fail
    assert bad.returncode != 0 and "Unknown flag" in bad.stderr


def test_user_flags_win_and_cpu_needs_none():
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x"}
    added = apply_scheduling_flags("gpu", env)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in env["XLA_FLAGS"]
    assert env["XLA_FLAGS"].count("xla_gpu_enable_latency_hiding_scheduler") == 1
    assert "latency_hiding" not in added["XLA_FLAGS"] and "--xla_dump_to=/tmp/x" in env["XLA_FLAGS"]
    assert len(added["XLA_FLAGS"].split()) == len(SCHEDULING_FLAGS["gpu"][1]) - 1
    tpu_env = {}
    apply_scheduling_flags("tpu", tpu_env)
    assert "--xla_tpu_enable_async_collective_fusion=true" in tpu_env["LIBTPU_INIT_ARGS"]
    assert apply_scheduling_flags("cpu", {}) == {} and scheduling_flags("cpu") == {}
    assert detect_backend({"JAX_PLATFORMS": "cuda"}) == "gpu" and detect_backend({"JAX_PLATFORMS": "cpu"}) == "cpu"


def test_plan_shows_the_flags_for_its_hardware():
    out = processes.run([sys.executable, "-m", "meshtrain.cli", "plan", "--model", "tiny", "--recipe", "fsdp",
                          "--hardware", "h100", "--batch-size", "8", "--seq-len", "64", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert plan["xla_flags"] == scheduling_flags("gpu")
