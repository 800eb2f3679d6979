"""tools/bench_checkpoint.py runs end to end (scaled down) and reports consistent figures."""

import json
import os
import processes
import sys

ROOT = os.path.dirname(os.path.dirname(__file__))

SETTING_KEYS = {"compression", "checkpoint_bytes_on_disk", "sync_save_s", "sync_save_MBps", "sync_vs_raw_fsync",
                "sync_save_peak_rss_extra_bytes", "sync_save_peak_rss_x_state", "async_save_peak_rss_extra_bytes",
                "async_save_peak_rss_x_state", "async_stall_s", "sync_stall_in_loop_s", "stall_ratio",
                "async_stall_idle_cpu_s", "stall_ratio_idle_cpu", "donated_after_async_save",
                "donated_after_sync_save", "mapped_hashing", "copy_before_sync_save"}


def test_bench_checkpoint_runs_small_with_compare(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    # a 4 MB state: every figure below is still measured (the async host copy, the donations, zstd's smaller
    # file on a fresh optimizer state); 16 MB cost 1.6x the CPU and checked nothing more
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "bench_checkpoint.py"), "--mb", "4",
                          "--repeats", "1", "--saves", "2", "--every", "2", "--dir", str(tmp_path), "--json",
                          "--compare"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 0 < r["state_bytes"] - 12 * r["params"] <= 16          # f32 params + Adam mu, nu; int32 counters
    assert r["raw_fsync_MBps"] > 0 and r["raw_buffered_MBps"] > 0 and r["load_avg_1min"] >= 0
    assert set(r["configs"]) == {"before", "after"}
    before, after = r["configs"]["before"], r["configs"]["after"]
    for c in (before, after):
        assert SETTING_KEYS <= set(c), SETTING_KEYS - set(c)
        assert len(c["async_stall_all_s"]) == 2 and c["sync_save_MBps"] > 0
        assert c["sync_vs_raw_fsync"] == r["raw_fsync_s"] / c["sync_save_s"]
        assert c["stall_ratio"] == c["async_stall_s"] / c["sync_stall_in_loop_s"]
        assert c["async_stall_first_s"] == c["async_stall_all_s"][0]
        assert c["async_stall_later_median_s"] == c["async_stall_all_s"][1]     # the median of one later save
        assert c["stall_ratio_idle_cpu"] == c["async_stall_idle_cpu_s"] / c["sync_stall_in_loop_s"]
        assert c["sync_save_peak_rss_x_state"] == c["sync_save_peak_rss_extra_bytes"] / r["state_bytes"]
        # an async save holds a host copy of the state until it is written (CPU: a copy of the shards)
        assert c["async_save_peak_rss_extra_bytes"] >= 0.5 * r["state_bytes"]
        # the step right after each save (one per save but the last) donates every state buffer
        assert c["donated_after_async_save"] == [r["state_buffers"]] * (len(c["async_stall_all_s"]) - 1)
        assert c["donated_after_sync_save"] == [r["state_buffers"]] * (len(c["sync_stall_in_loop_all_s"]) - 1)
    assert (before["compression"], before["mapped_hashing"], before["copy_before_sync_save"]) == ("zstd", False, True)
    assert (after["compression"], after["mapped_hashing"], after["copy_before_sync_save"]) == ("none", True, False)
    # the top-level figures are the current settings'; a fresh optimizer state compresses (zeros)
    assert r["sync_save_s"] == after["sync_save_s"] and r["stall_ratio"] == after["stall_ratio"]
    assert before["checkpoint_bytes_on_disk"] < after["checkpoint_bytes_on_disk"]
    assert r["compare"]["sync_save_speedup"] == before["sync_save_s"] / after["sync_save_s"]
    assert os.listdir(tmp_path) == []                              # the benchmark cleans up after itself
