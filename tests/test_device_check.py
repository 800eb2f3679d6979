"""``tools/device_check.sh``: the accelerator check refuses on a CPU-only host, its ``--dry-run`` runs
the same pipeline on CPU with tiny shapes (bench_mfu variants, forecasts, the table, the fastest row), and
the table goes under one heading in BENCHMARKS.md, newest first."""

import importlib.util
import os
import re
import sys

import processes
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "device_check.sh")


def _tool_module():
    spec = importlib.util.spec_from_file_location("device_check", os.path.join(ROOT, "tools", "device_check.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_script(*args, timeout):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHON"] = sys.executable
    return processes.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_it_refuses_a_cpu_only_host_without_dry_run():
    out = run_script(timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "error: tools/device_check.sh needs a GPU or TPU, and JAX sees only CPUs on this host; run it on an "
        "accelerator machine, or pass --dry-run to run the same pipeline on CPU with tiny shapes")
    assert out.stdout == ""


def test_tables_go_under_one_heading_newest_first(tmp_path):
    dc = _tool_module()
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## Other\n\ntext\n")
    dc.write(str(path), "### first\n\n| a |\n")
    dc.write(str(path), "### second\n\n| b |\n")
    text = path.read_text()
    assert text.count(dc.HEADING) == 1 and text.startswith("# Benchmarks\n\n## Other\n\ntext\n\n" + dc.HEADING)
    assert text.index("### second") < text.index("### first")


@pytest.mark.slow
def test_the_dry_run_runs_the_pipeline_and_adds_a_dated_table(tmp_path):
    dc = _tool_module()
    out_md = tmp_path / "BENCHMARKS.md"
    # the first four variants (baseline with the hand-written step, unpacked, the 8B cut with its own
    # hand-written step, remat full), run together; the rest are listed as skipped. The budget's own
    # skipping is test_a_variant_past_the_budget_or_the_variant_count_is_skipped_with_its_row
    out = run_script("--dry-run", "--variants", "4", "--out", str(out_md), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    text = out_md.read_text()
    assert text.startswith(dc.HEADING)
    assert re.search(r"^### \d{4}-\d\d-\d\d \d\d:\d\d UTC: 8 x cpu \(cpu\) — dry run", text, re.M), text
    assert f"`tools/device_check.sh --dry-run --variants 4 --out {out_md}` in " in text  # the command
    for v in dc.VARIANTS:  # every variant has its row, measured or skipped
        assert f"| {v.section} | {v.label} |" in text, text
    num = r"[0-9.,]+"
    # the baseline: both steps timed, MFU, tokens/s per chip, 1.000 against itself, the forecast with its
    # range, forecast / measured, the bottleneck and the roofline
    base = re.search(rf"^\| baseline \| fsdp flash \| tiny \| xla \| ({num}) \| ({num}) \| ({num}) \| ({num})% \| "
                     rf"({num}) \| 1\.000 \| ({num}) \(({num})–({num})\) \| ({num}) \| (\w+) \| ({num}) \|$", text, re.M)
    assert base, text
    # the 8B-shaped model cut to 2 layers (dry run: small), with its own hand-written step and baseline
    cut = re.search(rf"^\| 8B cut \| 8B fsdp flash \| small-2l \| xla \| ({num}) \| ({num}) \| ({num}) \| .* \| "
                    rf"1\.000 \| ({num}) \(", text, re.M)
    assert cut, text
    assert re.search(r"^\| remat \| fsdp flash, remat full \| tiny \| xla \| [0-9.,]+ \| — \| — \|", text, re.M), text
    assert "| skipped: --variants 4 |" in text
    assert re.search(r"^- \*\*Fastest tiny: .+\*\*: [0-9.,]+ ms per step", text, re.M), text
    assert re.search(r"^- \*\*Fastest small-2l: 8B fsdp flash\*\*", text, re.M), text
    assert text[len(dc.HEADING):].strip() in out.stdout  # what it wrote is what it printed


def test_a_variant_past_the_budget_or_the_variant_count_is_skipped_with_its_row(monkeypatch):
    dc = _tool_module()
    ran = []
    monkeypatch.setattr(dc, "bench", lambda v, shapes, env, timeout: ran.append(v.label) or {"error": "not run"})
    monkeypatch.setattr(dc, "unsupported", lambda v: None)
    shapes = dc.Shapes("tiny", 8, 32, 1)
    rows = dc.run_all(shapes, {}, 0.0, 8, log=lambda *a, **k: None)   # no budget left: nothing starts
    assert ran == [] and [r["error"] for r in rows] == ["skipped: 0 s of the 0 s budget left"] * len(dc.VARIANTS)
    rows = dc.run_all(shapes, {}, 1e9, 8, log=lambda *a, **k: None, limit=2)
    assert ran == [v.label for v in dc.VARIANTS[:2]]
    assert [r["error"] for r in rows[2:]] == ["skipped: --variants 2"] * (len(dc.VARIANTS) - 2)
    ran.clear()  # run together (a dry run's --jobs): the same rows, in priority order
    rows = dc.run_all(shapes, {}, 1e9, 8, log=lambda *a, **k: None, limit=3, jobs=3)
    assert sorted(ran) == sorted(v.label for v in dc.VARIANTS[:3])
    assert [r["variant"].label for r in rows] == [v.label for v in dc.VARIANTS]
    assert [r["error"] for r in rows] == ["not run"] * 3 + ["skipped: --variants 3"] * (len(dc.VARIANTS) - 3)


def test_values_the_installed_meshtrain_does_not_know_are_skipped():
    dc = _tool_module()
    assert dc.unsupported(dc.Variant("remat", "x", (), needs=(("remat", "full"),))) is None
    assert dc.unsupported(dc.Variant("remat", "x", (), needs=(("remat", "no_such_policy"),))) == (
        "skipped: the installed meshtrain has no remat=no_such_policy")
    assert dc.unsupported(dc.Variant("precision", "x", (), needs=(("no_such_option", "on"),))) == (
        "skipped: the installed meshtrain has no no_such_option=on")
    # the variants that need one say so: fp8 and remat offload
    needs = {n for v in dc.VARIANTS for n in v.needs}
    assert {("fp8", "delayed"), ("remat", "offload")} <= needs


def test_variant_flags_fill_the_8b_cut_and_batch_placeholders():
    dc = _tool_module()
    gpu, dry = dc.Shapes("llama3.2-1b", 8, 2048, 3), dc.Shapes("tiny", 8, 32, 1, dry_run=True)
    cut = next(v for v in dc.VARIANTS if v.label == "8B fsdp flash")
    assert cut.hand and [gpu.fill(f) for f in cut.flags][-6:] == ["--model", "llama3-8b", "--layers", "8",
                                                                  "--batch-size", "4"]
    assert [dry.fill(f) for f in cut.flags][-6:] == ["--model", "small", "--layers", "2", "--batch-size", "8"]
    double = next(v for v in dc.VARIANTS if v.label == "fsdp flash, batch ×2")
    assert gpu.fill(double.flags[-1]) == "16"
    assert [v.label for v in dc.VARIANTS if v.hand] == [dc.BASELINE, "8B fsdp flash"]


def test_a_failed_run_is_reported_by_its_exception_and_out_of_memory_line():
    dc = _tool_module()
    # the shape of a real failure (fsdp dense on one H200, 2026-11-27): JAX's note on filtered frames comes
    # last, the exception before it, XLA's allocator line earlier
    stderr = ("EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 64.02GiB with allocator "
              "GPU_0_bfc on device 0. [tf-allocator-allocation-error='']\nTraceback (most recent call last):\n"
              "jax.errors.JaxRuntimeError: NOT_FOUND: All configs failed during profiling.\n"
              "--------------------\nFor simplicity, JAX has removed its internal frames from the traceback.\n")
    assert dc.failure_reason(stderr, 1) == (
        "jax.errors.JaxRuntimeError: NOT_FOUND: All configs failed during profiling. (RESOURCE_EXHAUSTED: Out of "
        "memory while trying to allocate 64.02GiB with allocator GPU_0_bfc on device 0.)")
    assert dc.failure_reason("Traceback\nValueError: bad shape\n", 1) == "ValueError: bad shape"
    assert dc.failure_reason("", 3) == "exit 3"


def test_one_device_leaves_out_the_recipe_rows_that_are_one_program_there():
    dc = _tool_module()
    labels = [v.label for v in dc.variants_for(1)]
    assert labels[0] == dc.BASELINE and len(labels) == len(dc.VARIANTS) - len(dc.MULTI_DEVICE)
    assert "dp flash" not in labels and "fsdp_tp flash" not in labels
    assert {"fsdp flash, remat full", "fsdp flash, bf16 parameters", "8B fsdp flash"} <= set(labels)
    assert [v.label for v in dc.variants_for(8)] == [v.label for v in dc.VARIANTS]
