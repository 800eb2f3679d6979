"""`meshtrain recipes` and `meshtrain plan`: output, JSON shape, and bad input (exit 2, no traceback)."""

import json
import os
import processes
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(__file__))


def cli(*args, devices=None):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    return processes.run([sys.executable, "-m", "meshtrain", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_recipes_lists_every_builtin():
    out = cli("recipes")
    assert out.returncode == 0, out.stderr
    for name in ("dp", "fsdp", "zero1", "hsdp", "tp", "fsdp_tp", "fsdp_tp_sp"):
        assert any(line.startswith(name + " ") for line in out.stdout.splitlines()), name


def test_plan_json_has_the_documented_keys():
    out = cli("plan", "--model", "tiny", "--recipe", "fsdp_tp", "--mesh", "fsdp=2,tensor=4", "--devices", "8",
              "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}
    row = next(p for p in plan["params"] if p["path"] == "blocks/mlp/gate_df")
    assert set(row) >= {"path", "shape", "dtype", "logical_axes", "spec", "bytes_per_device"}
    assert row["spec"] == [None, "fsdp", "tensor"] and row["bytes_per_device"] == 2 * 64 * 128 * 4 // 8
    assert set(plan["per_device_bytes"]) >= {"params", "optimizer", "total"}


def test_plan_recipe_file_and_devices():
    out = cli("plan", "--model", "tiny", "--recipe", os.path.join("recipes", "fsdp.yaml"), "--devices", "4",
              "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mesh"] == {"fsdp": 4}


#: ``meshtrain plan`` with each of BAD_PLAN_INPUT's arguments in ONE child, one ``cli.main`` call each (the
#: function ``python -m meshtrain`` exits with): its return code, stdout and stderr, and any exception that
#: escaped ``main`` printed as a traceback into that case's stderr, as the interpreter would. Why one child:
#: eight interpreters and JAX starts cost ~13 CPU s; every case runs on the same 8 simulated devices, and
#: test_recipes_lists_every_builtin / test_plan_* still run the real ``python -m meshtrain`` process.
_PLAN_CASES_DRIVER = """
import contextlib, io, json, sys, traceback
from meshtrain.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""

BAD_PLAN_INPUT = [
    (("--recipe", "fsdp3"), "unknown recipe 'fsdp3'"),
    (("--model", "gpt9"), "unknown model 'gpt9'"),
    (("--recipe", "tp", "--mesh", "tensor=3"), "multiply to 3 but there are 8 devices"),
    (("--recipe", "dp", "--mesh", "tensor=2"), "not part of this mesh"),
    (("--recipe", "fsdp", "--mesh", "fsdp"), "write axis=size"),
    (("--recipe", "tp", "--devices", "8", "--mesh", "data=1,tensor=8", "--model", "tiny", "--batch-size", "3"),
     None),
    (("--recipe", "fsdp", "--batch-size", "12"), "batch size 12 is not divisible by data-parallel size 8"),
    (("--recipe", "missing.yaml"), "does not exist"),
]


@pytest.fixture(scope="module")
def bad_plan_results():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    cases = [["plan", *args] for args, _ in BAD_PLAN_INPUT]
    out = processes.run([sys.executable, "-c", _PLAN_CASES_DRIVER, json.dumps(cases)], capture_output=True,
                        text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(BAD_PLAN_INPUT)), ids=lambda i: " ".join(BAD_PLAN_INPUT[i][0]))
def test_plan_bad_input_exits_2_without_traceback(case, bad_plan_results):
    message = BAD_PLAN_INPUT[case][1]
    out = bad_plan_results[case]
    if message is None:  # tp with batch 3 is fine: tp does not split the batch
        assert out["returncode"] == 0, out["stderr"]
        return
    assert out["returncode"] == 2, (out["stdout"], out["stderr"])
    assert message in out["stderr"]
    assert "Traceback" not in out["stderr"]
