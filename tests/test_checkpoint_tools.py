"""tools/bench_checkpoint.py runs end to end (scaled down) and reports consistent figures."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_bench_checkpoint_runs_small(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_checkpoint.py"), "--mb", "16",
                          "--repeats", "1", "--saves", "2", "--every", "2", "--dir", str(tmp_path), "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < r["state_bytes"] - 12 * r["params"] <= 16          # f32 params + Adam mu, nu; int32 counters
    assert len(r["async_stall_all_s"]) == 2 and r["raw_fsync_MBps"] > 0 and r["sync_save_MBps"] > 0
    assert r["async_stall_idle_cpu_s"] < r["sync_stall_in_loop_s"]   # an async save blocks less than a sync one
    assert r["stall_ratio"] == r["async_stall_s"] / r["sync_stall_in_loop_s"]
    # the step right after each async save (one per save but the last) donates every state buffer
    assert r["donated_after_async_save"] == [r["state_buffers"]] * (len(r["async_stall_all_s"]) - 1)
    assert os.listdir(tmp_path) == []                              # the benchmark cleans up after itself
