"""The benchmark scripts in tools/ run and meet their bounds (scaled down to the tiny model)."""

import json
import os
import re
import sys

import processes
import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))


def tool(name, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    return processes.run([sys.executable, os.path.join(ROOT, "tools", name), *args], capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.mark.slow
def test_compile_time_is_flat_in_depth():
    # batch 8 x 32 (one row per device, the dry-run seq): the instruction and loop counts do not depend on the
    # shapes; at 32 layers `auto` scans too (next test), so the two can share that compile through the cache
    out = tool("bench_compile.py", "--model", "tiny", "--layers", "4", "32", "--repeats", "1",
               "--batch-size", "8", "--seq-len", "32", "--max-ratio", "inf", "--layer-loop", "scan")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    ops = re.findall(r"(\d+) HLO instructions, (\d+) while loops?", out.stdout)
    # The scanned program does not grow with depth (XLA may pick a different tiling or two): the
    # deterministic reason compile time is flat. The seconds themselves are figures, not assertions.
    assert len(ops) == 2, out.stdout
    (n4, w4), (n32, w32) = [(int(a), int(b)) for a, b in ops]
    assert abs(n32 - n4) <= 0.01 * n4, out.stdout
    assert w4 == w32 >= 1, out.stdout  # the layers stay one loop at any depth
    assert re.search(r"ratio .*: [0-9.]+", out.stdout)


@pytest.mark.slow
def test_default_layer_loop_unrolls_shallow_stacks_and_scans_deep_ones():
    out = tool("bench_compile.py", "--model", "tiny", "--layers", "4", "32", "--repeats", "1",
               "--batch-size", "8", "--seq-len", "32", "--max-ratio", "inf")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    loops = [int(w) for _, w in re.findall(r"(\d+) HLO instructions, (\d+) while loops?", out.stdout)]
    assert loops[0] == 0 and loops[1] >= 1, out.stdout   # 4 layers: straight-line; 32: one scan
    assert "layer loop auto" in out.stdout


@pytest.mark.slow
def test_overhead_benchmark_matches_hand_written_numbers():
    # one timed step at 8 x 32: the check is the first-step loss of each program, not the timings
    out = tool("bench_overhead.py", "--model", "tiny", "--steps", "1", "--batch-size", "8", "--seq-len", "32",
               "--max-ratio", "inf")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    first = re.search(r"meshtrain ([0-9.]+), hand-written ([0-9.]+)", out.stdout)
    assert first.group(1) == first.group(2)  # the same model, data and optimizer: the same loss


@pytest.mark.slow
def test_mfu_benchmark_runs_on_cpu_and_reports_its_formula():
    # 8 x 32, the shapes of device_check's dry-run baseline (tests/test_device_check.py): the same two programs,
    # compiled once per session through the shared compilation cache
    out = tool("bench_mfu.py", "--steps", "1", "--batch-size", "8", "--seq-len", "32", "--json")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["model"] == "tiny" and res["hardware"] == "cpu" and res["recipe"] == "fsdp"
    # The same model, shardings, data and optimizer: the same first loss from both steps.
    assert res["first_loss"]["meshtrain"] == res["first_loss"]["hand-written"]
    from meshtrain.models import get_config
    from meshtrain.models.flops import model_flops_per_token
    assert res["model_flops_per_step"] == model_flops_per_token(get_config("tiny"), 32) * 8 * 32
    for r in res["results"].values():   # MFU is the formula applied to the measured step time
        mfu = res["model_flops_per_step"] / r["step_s"] / 8 / (res["peak_tflops_per_device"] * 1e12)
        assert abs(r["mfu"] - mfu) <= 1e-9 * max(mfu, 1.0) and r["mfu"] > 0


def test_bad_input_probe_runs_and_judges_its_cases(tmp_path):
    out = tool("probe_bad_input.py", "--group", "cli", "--only", "plan --", "--json", str(tmp_path / "probe.json"))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    results = json.load(open(tmp_path / "probe.json"))
    assert len(results) == 4 and all(r["ok"] and r["code"] == 2 and not r["traceback"] for r in results), results
    assert "4 passed, 0 failed; 0 tracebacks" in out.stdout


def test_import_benchmark_reports_both_loaders():
    out = tool("bench_import.py", "--layers", "1", "--d-model", "128", "--vocab", "512")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    peaks = re.findall(r"(sharded|whole)\s+peak host memory above baseline:\s+[0-9,]+ MiB = ([0-9.]+) x", out.stdout)
    assert [h for h, _ in peaks] == ["sharded", "whole"], out.stdout


def test_import_plan_reads_exactly_each_devices_blocks():
    out = tool("bench_import.py", "--plan-only", "tiny", "--devices", "8", "--recipe", "fsdp_tp")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert "equal: True" in out.stdout, out.stdout


def test_compiler_check_lists_its_cases_and_needs_libtpu_only_to_compile():
    listed = tool("check_compilers.py", "--list")
    assert listed.returncode == 0 and "fsdp_cp ulysses splash: meshtrain plan --check tpu" in listed.stdout
    ran = tool("check_compilers.py", "--only", "dp")
    assert ran.returncode == 0, ran.stderr[-2000:]
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        assert "libtpu is not installed" in ran.stdout
    else:
        assert "MiB" in ran.stdout


def test_suite_profile_splits_cpu_from_waiting(tmp_path):
    """tools/suite_profile.py reads conftest's MESHTRAIN_TEST_CPU_LOG lines: per-file CPU and the most idle tests."""
    log = tmp_path / "cpu.jsonl"
    rows = [{"test": "tests/test_a.py::t1", "wall_s": 10.0, "cpu_s": 1.0, "children_cpu_s": 8.0, "slow": False},
            {"test": "tests/test_b.py::t2", "wall_s": 40.0, "cpu_s": 0.5, "children_cpu_s": 1.5, "slow": True}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "suite_profile.py"), str(log)],
                        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 tests: 50 s of test wall time, 11 CPU s" in out.stdout and "22 % busy" in out.stdout
    files = [line for line in out.stdout.split("most waiting")[0].splitlines() if line]
    assert [line.split()[-1] for line in files[2:]] == ["tests/test_a.py", "tests/test_b.py"]
    idle = out.stdout.split("most waiting")[1].splitlines()
    assert idle[2].split() == ["38.0", "40.0", "tests/test_b.py::t2"]


def test_xla_live_buffers_names_the_buffers_live_at_the_peak(tmp_path):
    """tools/xla_live_buffers.py joins XLA's dump files (lines as XLA 0.10 writes them: the optimized HLO, the
    live ranges with their "(peak)" section, the buffer assignment): each live buffer's shape, kind and op_name,
    and the temp allocation less the live bytes (the heap's fragmentation)."""
    prefix = tmp_path / "module_0007.jit_step.cpu_after_optimizations"
    (tmp_path / f"{prefix.name}.txt").write_text(
        '  %param.4 = f32[8,64]{1,0} parameter(4), metadata={op_name="state.params[\'head\']"}\n'
        '  %all-gather.3 = f32[64,64]{1,0} all-gather(%param.4), dimensions={0}, '
        'metadata={op_name="jit(step)/jvp(M)/head/dot_general"}\n'
        '  %ynn_fusion.1 = f32[64,64]{1,0} fusion(%a, %b), kind=kCustom, '
        'metadata={op_name="jit(step)/transpose(jvp(M))/head/dot_general"}\n'
        '  %wrapped_copy.2 = f32[64,64]{1,0} fusion(%all-gather.3), kind=kLoop\n'
        '  %max_fusion = f32[4,64]{1,0} fusion(%ynn_fusion.0), metadata={op_name="jit(step)/jvp(M)/jit(relu)/max"}\n')
    (tmp_path / f"{prefix.name}-live-range.txt").write_text(
        "HloLiveRange (max 9):\n  BufferLiveRange:\n    param.4{}:0-9\n  Live ranges at 5 (peak):\n"
        "    ynn_fusion.1{}: 16384 bytes (cumulative: 16384 bytes)\n"
        "    all-gather.3{}: 16384 bytes (cumulative: 32768 bytes)\n"
        "    wrapped_copy.2{}: 16384 bytes (cumulative: 49152 bytes)\n"
        "    max_fusion{}: 1024 bytes (cumulative: 50176 bytes)\n"
        "    param.4{}: 2048 bytes (cumulative: 52224 bytes)\n"
        "  Stack trace breakdown for peak usage: 52 224 bytes\n")
    (tmp_path / f"{prefix.name}-buffer-assignment.txt").write_text(
        "BufferAssignment:\nallocation 0: size 2048, parameter 4, shape |f32[8,64]| at ShapeIndex {}:\n"
        "allocation 1: size 51200, preallocated-temp:\n")
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "xla_live_buffers.py"), str(tmp_path)],
                        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "peak at instruction 5: 50,176 B live in temp buffers" in out.stdout
    assert "temp allocation 51,200 B (fragmentation 1,024 B)" in out.stdout
    kinds = {line.split()[1]: line for line in out.stdout.splitlines()[1:] if line.strip()[0].isdigit()}
    assert "backward" in kinds["ynn_fusion.1"] and "f32[64,64]" in kinds["ynn_fusion.1"]
    assert "gathered weight (copy)" in kinds["wrapped_copy.2"] and "gathered weight " in kinds["all-gather.3"]
    assert "forward" in kinds["max_fusion"] and "jit(relu)/max" in kinds["max_fusion"]
    assert "argument" in kinds["param.4"]


def test_serve_benchmark_alternates_batched_and_one_after_another_rows_and_divides_medians():
    """tools/bench_serve.py's bookkeeping, with a stand-in server (the real ones: BENCHMARKS.md, "Serving,
    third pass"): every N once; per round N = 16 (measured again after the first) and the same requests one
    after another on the big server and on 1 slot; the ratio is of the medians over the rounds."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve", os.path.join(ROOT, "tools", "bench_serve.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    class Stub:
        def __init__(self):
            self.bodies = []

        def complete(self, body):
            self.bodies.append(body)
            return {"usage": {"completion_tokens": body["max_tokens"]}}

    args = argparse.Namespace(clients=[1, 4, 16], requests_per_client=2, max_tokens=8, prompt_len=4,
                              max_batch=64, rounds=2)
    servers = {64: Stub(), 1: Stub()}
    rows = bench.run_rows(servers, args)
    assert [(r["round"], r["clients"], r["slots"], r["requests"]) for r in rows] == [
        (0, 1, 64, 2), (0, 4, 64, 8), (0, 16, 64, 32),
        (1, "16 one after another", 64, 32), (1, "16 one after another", 1, 32),
        (2, 16, 64, 32), (2, "16 one after another", 64, 32), (2, "16 one after another", 1, 32)]
    assert len(servers[64].bodies) == 2 + 8 + 32 * 4 and len(servers[1].bodies) == 32 * 2
    assert len({tuple(b["prompt"]) for b in servers[1].bodies}) == 32  # distinct prompts, as the batched rows'

    def row(clients, slots, tokens_per_s):
        return {"clients": clients, "slots": slots, "tokens_per_s": tokens_per_s}

    seq = "16 one after another"
    made = [row(16, 64, 400.0), row(seq, 64, 100.0), row(seq, 1, 80.0), row(16, 64, 440.0), row(seq, 64, 120.0),
            row(seq, 1, 90.0), row(16, 64, 300.0)]
    assert bench.ratios(made, args) == {"same_server": round(400 / 110, 2), "one_slot": round(400 / 85, 2)}


def test_bench_vs_easydel_falls_back_to_the_hand_written_step_and_alternates_rounds():
    # Without --peer-python the peer is tools/bench_overhead.py's hand-written step: the same model, plan, data and
    # optimizer, so both report the same first loss, parameters and (within XLA's own counting) FLOPs. No speed check.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=processes.TEST_XLA_FLAGS)
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "bench_vs_easydel.py"), "--model", "tiny",
                         "--batch-size", "8", "--seq-len", "32", "--warmup", "1", "--steps", "2", "--rounds", "2",
                         "--max-ratio", "inf", "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    rounds = re.findall(r"round (\d): meshtrain [0-9.]+ ms, hand-written [0-9.]+ ms, ratio [0-9.]+ \((\S+) first\)",
                        out.stdout)
    assert rounds == [("1", "meshtrain"), ("2", "hand-written")], out.stdout   # the first side alternates
    assert re.search(r"median of the per-round ratios [0-9.]+ .*limit inf", out.stdout)
    assert re.search(r"load average \(1/5/15 min\): before [0-9.]+/[0-9.]+/[0-9.]+, after ", out.stdout)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["peer"] == "hand-written" and res["rounds"] == 2 and len(res["round_ratios"]) == 2
    assert res["params"]["meshtrain"] == res["params"]["hand-written"] == 131_392
    assert res["first_loss"]["meshtrain"] == res["first_loss"]["hand-written"]
    flops = res["flops_per_step"]
    assert abs(flops["meshtrain"] / flops["hand-written"] - 1) < 0.01, flops
    assert all(len(v) == 2 for v in res["round_median_ms"].values())
    assert set(res["cpu_s_per_step"]) == {"meshtrain", "hand-written"}
