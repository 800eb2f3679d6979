"""``meshtrain generate``: JSON output that matches ``mt.generate``, scoring without generating, and
one-line errors (exit 2, no traceback) for bad input, checked before anything is restored."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import processes
import pytest

import meshtrain as mt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def generate_cli(*argv, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return processes.run([sys.executable, "-m", "meshtrain", "generate", *map(str, argv)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=timeout)


def generate_in_process(capsys, *argv):
    """``meshtrain generate ARGV`` through ``cli.main`` in this process: ``(exit status, stdout, stderr)``.
    For checks of the command's status and error line, not of a process (a real process's exit and
    stderr: test_missing_run_folder_is_one_line_exit_2 and the JSON test run ``generate_cli``)."""
    from meshtrain.cli import main

    capsys.readouterr()
    try:
        code = main(["generate", *map(str, argv)])
    except SystemExit as exc:   # argparse's own refusals
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def train(out, data=None):
    from meshtrain.train import TrainConfig, Trainer

    Trainer(TrainConfig(model="tiny", recipe="dp", steps=2, batch_size=8, seq_len=16, ckpt_every=2, eval_every=0,
                        progress="none", out=str(out), data=data)).run()
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A byte-level run (the embedded corpus) and one trained on a token file (no tokenizer)."""
    d = tmp_path_factory.mktemp("generate")
    tokens = d / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16))
    return {"text": train(d / "text"), "ids": train(d / "ids", str(tokens))}


@pytest.mark.slow
def test_json_lines_match_the_python_api_and_scoring_needs_no_generation(runs):
    out = generate_cli(runs["text"], "--prompt", "def main(", "--prompt", "import os", "--max-new-tokens", 6,
                       "--prompt-logprobs", "--json", "--recipe", "tp")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [sorted(r) for r in rows] == [["new_ids", "new_logprobs", "new_text", "prompt_logprobs", "speed"]] * 2
    assert rows[0]["speed"] == rows[1]["speed"] and rows[0]["speed"]["prompt_tokens"] == len("def main(import os")
    rows = [{k: v for k, v in r.items() if k != "speed"} for r in rows]  # the batch's timing: differs per run
    api = mt.generate(runs["text"], ["def main(", "import os"], max_new_tokens=6, prompt_logprobs=True)
    assert [r["new_ids"] for r in rows] == [list(g.new_ids) for g in api]
    np.testing.assert_allclose(rows[0]["new_logprobs"], api[0].new_logprobs, atol=1e-4)
    offloaded = generate_cli(runs["text"], "--prompt", "def main(", "--prompt", "import os", "--max-new-tokens", 6,
                             "--prompt-logprobs", "--json", "--recipe", "tp", "--offload-weights")
    assert offloaded.returncode == 0, offloaded.stderr[-3000:]
    assert [{k: v for k, v in json.loads(line).items() if k != "speed"}
            for line in offloaded.stdout.splitlines()] == rows  # layers streamed from host
    assert len(rows[1]["prompt_logprobs"]) == len("import os") - 1
    scored = generate_cli(runs["ids"], "--prompt-ids", "1,2,3,4", "--max-new-tokens", 0, "--prompt-logprobs", "--json")
    assert scored.returncode == 0, scored.stderr[-3000:]
    row = json.loads(scored.stdout)
    assert row["new_ids"] == [] and len(row["prompt_logprobs"]) == 3 and "new_text" not in row


@pytest.mark.slow
@pytest.mark.parametrize("run, argv, message", [
    ("text", ["--prompt", ""], "prompt 0 is empty"),
    ("text", ["--prompt", "x" * 257], "more than max_seq_len 256"),
    ("text", ["--prompt", "x" * 200, "--max-new-tokens", "57"], "exceeds max_seq_len 256"),
    ("ids", ["--prompt", "hello"], "has no tokenizer"),
    ("text", ["--step", "7"], "--step 7: no such checkpoint step"),
    ("text", ["--prompt-ids", "1,x"], "--prompt-ids '1,x'"),
    ("text", ["--recipe", "pp"], "generation runs without a pipeline"),
    ("text", ["--top-p", "0"], "--top-p 0.0"),
])
def test_bad_input_is_one_line_exit_2(runs, run, argv, message, capsys):
    # cli.main in this process: the status and the one line are main's (a real process's exit and
    # stderr: test_missing_run_folder_is_one_line_exit_2), and each check here costs no interpreter
    if not any(a.startswith("--prompt") for a in argv):
        argv = argv + ["--prompt", "def"]
    if "--max-new-tokens" not in argv:
        argv = argv + ["--max-new-tokens", "4"]
    code, out, err = generate_in_process(capsys, runs[run], *argv)
    assert code == 2, out + err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_missing_run_folder_is_one_line_exit_2(tmp_path):
    out = generate_cli(tmp_path / "nothing", "--prompt", "a", "--max-new-tokens", 1)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: {tmp_path / 'nothing'} does not exist; pass a run folder or "
                                               f"its checkpoints/ folder"]


@pytest.mark.slow
def test_bench_generate_runs_and_prints_its_figures():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = processes.run([sys.executable, os.path.join(ROOT, "tools", "bench_generate.py"), "--models", "tiny",
                         "--recipes", "dp", "tp", "--batch-sizes", "1", "8", "--prompt-len", "8", "--new-tokens", "4",
                         "--repeats", "1", "--weight-memory", "device", "host", "--json"], capture_output=True,
                        text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()[1:]]
    cells = rows[::2]  # layers on the device; each followed by the same cell with layers streamed from host
    assert [(c["recipe"], c["batch"], c["padded"]) for c in cells] == [("dp", 1, 8), ("dp", 8, 8), ("tp", 1, 1),
                                                                       ("tp", 8, 8)]
    for on_device, from_host in zip(rows[::2], rows[1::2]):
        assert (on_device["weight_memory"], from_host["weight_memory"]) == ("device", "host")
        assert from_host["decode_tokens_per_s"] > 0 and on_device["host_weight_bytes_per_device"] == 0
        # tiny: 2 layers, so one layer of the stack stays on the device and the other only in host memory
        assert (on_device["weight_bytes_per_device"] - from_host["weight_bytes_per_device"]
                == from_host["host_weight_bytes_per_device"] // 2)
    for c in cells:  # figures, not bounds: the speeds are printed, never compared
        assert c["prefill_tokens_per_s"] > 0 and c["decode_tokens_per_s"] > 0 and c["per_token_ms"] > 0
    # tp splits the weights and the cache's kv_heads over 8 devices; dp replicates them
    assert cells[2]["weight_bytes_per_device"] < cells[0]["weight_bytes_per_device"] / 4
    assert cells[3]["cache_bytes_per_device"] == cells[1]["cache_bytes_per_device"]  # 8 rows: batch or heads / 8


@pytest.mark.slow
def test_bench_generate_takes_a_run_and_alternates_with_transformers(tmp_path):
    """`bench_generate.py RUN` on an imported tiny Llama, then `--vs-transformers`: the same greedy tokens
    from both, 3 alternated rounds, the load average; figures are printed, never compared."""
    pytest.importorskip("transformers")
    from test_hf import hf_folder

    from meshtrain.train.interop import import_hf

    import_hf(hf_folder(tmp_path / "src", "llama")[0], str(tmp_path / "run"))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    common = [sys.executable, os.path.join(ROOT, "tools", "bench_generate.py"), str(tmp_path / "run"), "--devices",
              "1", "--recipes", "dp", "--batch-sizes", "2", "--prompt-len", "6", "--new-tokens", "5", "--repeats", "1",
              "--json"]
    cells = processes.run(common, capture_output=True, text=True, env=env, timeout=600)
    assert cells.returncode == 0, cells.stderr[-3000:]
    cell = json.loads(cells.stdout.splitlines()[1])
    assert cell["model"] == str(tmp_path / "run") and cell["batch"] == 2 and cell["decode_tokens_per_s"] > 0
    versus = processes.run(common + ["--vs-transformers"], capture_output=True, text=True, env=env, timeout=600)
    assert versus.returncode == 0, versus.stderr[-3000:]
    report = json.loads(versus.stdout.splitlines()[1])
    assert report["same_tokens"] and len(report["rounds"]) == 3 and len(report["load_average_after"]) == 3
    assert all(r["meshtrain_end_to_end_tokens_per_s"] > 0 and r["transformers_end_to_end_tokens_per_s"] > 0
               for r in report["rounds"])
    refused = processes.run(common[:2] + ["--vs-transformers", "--rounds", "2", str(tmp_path / "run")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2 and "--rounds 2: alternate at least 3 rounds" in refused.stderr


def test_plan_generate_shows_weights_and_kv_cache_per_device():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    plan = [sys.executable, "-m", "meshtrain", "plan", "--model", "small", "--batch-size", "8", "--seq-len", "512",
            "--generate"]
    out = processes.run(plan + ["--recipe", "fsdp_tp", "--json"], capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    g = json.loads(out.stdout)["generation"]
    # int8 + bf16 scales + the bf16 output projection (2 % of small's weights)
    assert g["weights_bf16"] * 2 == g["weights_none"] and 0.5 < g["weights_int8"] / g["weights_bf16"] < 0.53
    # --offload-weights: the 4-layer stack in host memory, one layer of it (and the rest) on the device
    for fmt in ("none", "bf16", "int8"):
        assert g[f"weights_{fmt}"] - g[f"weights_{fmt}_offloaded"] == g[f"host_weights_{fmt}"] * 3 // 4 > 0
    # 2 (k, v) × 4 layers × 8 rows × 512 slots × 8 kv heads × 16 × 4 bytes, over fsdp=4 (rows) × tensor=2 (heads)
    assert g["kv_cache"] == 2 * 4 * 8 * 512 * 8 * 16 * 4 // 8 and g["kv_cache_bf16"] * 2 == g["kv_cache"]
    refused = processes.run(plan + ["--recipe", "pp", "--batch-size", "16"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --generate with recipe 'pp'"), refused.stderr
