"""Recipe files and MoE settings never give a traceback, and the pre-flight memory check refuses what
XLA would die on (issue 18): every case exits 2 with one line `error: ...` naming the key or file and
what to change. CLI cases call `meshtrain.cli.main` in this process (8 simulated devices, conftest)."""

import dataclasses
import math
import re

import pytest

import meshtrain as mt
from meshtrain.cli import main
from meshtrain.errors import ConfigError
from meshtrain.models import get_config
from meshtrain.parallel.moe import capacity_for
from meshtrain.train import preflight

FSDP = "name: mine\nstrategies: [fsdp]\nmesh: {ici: {fsdp: -1}}\n"
EP = "name: mine\nstrategies: [fsdp, ep]\nmesh: {ici: {fsdp: -1, expert: 4}}\n"


def _refused(capsys, argv) -> str:
    """Run the CLI; assert exit 2 with exactly one `error:` line on stderr and return it."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("text,expected", [
    (FSDP.replace("-1}", "-1}, axis_types: sideways"), r"mesh.axis_types='sideways'; use one of \['auto', 'explicit'\]"),
    (FSDP + "rules: {params: {embed: 3}}\n", r"rules.params.embed: 3 is not a mesh axis name; .*null to replicate"),
    (FSDP + "rules: {params: {embed: [fsdp, 3]}}\n", r"rules.params.embed: \['fsdp', 3\] is not a mesh axis name"),
    (FSDP + "rules: {params: {embed: fsdpp}}\n", r"rules.params.embed names mesh axis 'fsdpp' \(did you mean 'fsdp'\?\)"),
    (FSDP.encode() + b'description: "caf\xe9"\n', r"is not UTF-8 text \(byte 0xe9 at offset 71\); save it as UTF-8 YAML"),
    (FSDP + "remat: full\nremat: none\n", r"key 'remat' is given twice in one mapping \(lines 4 and 5\); keep one"),
    ("name: mine\nstrategies: [fsdp, tp]\nmesh:\n  ici:\n    fsdp: -1\n    tensor: 2\n    tensor: 4\n",
     r"key 'tensor' is given twice in one mapping \(lines 6 and 7\)"),
    (FSDP + "replicate_indivisible: [kv_head]\n",
     r"replicate_indivisible names logical axis 'kv_head', which no model axis uses \(did you mean 'kv_heads'\?\)"),
    (FSDP + "replicate_indivisible: [3]\n", r"replicate_indivisible names logical axis 3, which no model axis uses"),
    (FSDP.replace("mesh: {", "mesh: {icii: {}, "), r"unknown mesh keys \['icii'\]; use \['ici', 'dcn', 'axis_types'\]"),
    (FSDP.replace("{fsdp: -1}", "[fsdp]"), r"mesh.ici must map mesh axes to sizes"),
    (FSDP + "remat: [full\n", r"is not valid YAML: .* at line \d+, column \d+$"),
    (EP + "capacity_factor: 0\n", r"\['capacity_factor'\] are settings of the model .*get_config\('tiny-moe', capacity"),
    (EP + "moe: {top_k: 0, n_shared: -1}\n", r"\['moe'\] are settings of the model"),
], ids=["axis_types", "rule_int", "rule_int_in_list", "rule_axis_typo", "not_utf8", "duplicate_key",
        "duplicate_nested_key", "replicate_typo", "replicate_int", "mesh_key_typo", "ici_list", "bad_yaml",
        "moe_key", "moe_section"])
def test_bad_recipe_file_is_one_error_line(tmp_path, capsys, text, expected):
    path = tmp_path / "mine.yaml"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    line = _refused(capsys, ["plan", "--model", "tiny-moe", "--recipe", str(path)])
    assert str(path) in line
    assert re.search(expected, line), line


@pytest.mark.parametrize("overrides,expected", [
    (dict(capacity_factor=0), "capacity_factor=0: use a finite number > 0"),
    (dict(capacity_factor=-1.5), "capacity_factor=-1.5: use a finite number > 0"),
    (dict(capacity_factor=math.nan), "capacity_factor=nan: use a finite number > 0"),
    (dict(capacity_factor=math.inf), "capacity_factor=inf: use a finite number > 0"),
    (dict(capacity_factor="1.25"), "capacity_factor='1.25': use a finite number > 0"),
    (dict(capacity_factor=True), "capacity_factor=True: use a finite number > 0"),
    (dict(experts_per_token=0), "top_k=0 with 8 experts (DecoderConfig.experts_per_token): choose an integer 1 <="),
    (dict(experts_per_token=9), "top_k=9 with 8 experts (DecoderConfig.experts_per_token): choose an integer 1 <="),
    (dict(experts_per_token=1.5), "top_k=1.5 with 8 experts"),
    (dict(n_shared_experts=-1), "n_shared=-1 (DecoderConfig.n_shared_experts): use an integer >= 0"),
    (dict(n_shared_experts=0.5), "n_shared=0.5 (DecoderConfig.n_shared_experts): use an integer >= 0"),
])
def test_bad_moe_setting_refused_when_the_config_is_made(overrides, expected):
    # Read time, not inside the jitted step (where it surfaced as a tracing error or an out-of-memory compile).
    with pytest.raises(ConfigError) as info:
        get_config("tiny-moe", **overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("capacity_factor,seq_len,expected", [(1.25, 64, 20), (4.0, 64, 64), (1e6, 64, 64),
                                                              (1e6, 8, 8), (0.01, 64, 1)])
def test_capacity_stops_at_the_sequence_length(capacity_factor, seq_len, expected):
    # An expert never gets more than seq_len tokens of one sequence (top_k picks distinct experts), so a
    # larger factor only added empty slots: 1e6 asked the dispatch buffer for hundreds of GB.
    assert capacity_for(capacity_factor, seq_len, 2, 8) == expected


def test_memory_estimate_of_a_huge_capacity_factor_is_the_dropless_one():
    from meshtrain.analysis.memory import estimate_memory
    from helpers import mesh_for, tiny_abstract

    recipe, mesh = mesh_for("fsdp_ep")
    plan = mt.make_plan(tiny_abstract(model="tiny-moe"), recipe, mesh, batch=mt.BatchSpec(16, 64))
    cfg = get_config("tiny-moe")
    huge, no_drop = (estimate_memory(plan, dataclasses.replace(cfg, capacity_factor=cf)).total for cf in (1e6, 4.0))
    assert huge == no_drop


def test_huge_batch_of_short_sequences_refused_before_compiling(tmp_path, capsys, monkeypatch):
    # The pre-flight check consulted the full estimate (activations, logits) only when parameters +
    # optimizer + batch ids passed 30 % of a device: a huge batch of short sequences slipped through and
    # died in XLA (RESOURCE_EXHAUSTED). A fixed limit keeps the test independent of this host's memory
    # (and small enough that, were the check to miss it again, the run would still fit).
    monkeypatch.setattr(preflight, "device_memory_limit", lambda device, local: 64 * 2 ** 20)
    line = _refused(capsys, ["train", "--model", "tiny", "--batch-size", "8192", "--seq-len", "8", "--steps", "1",
                             "--eval-every", "0", "--progress", "none", "--out", str(tmp_path / "run")])
    assert "the plan needs ~" in line and "activations" in line and "but a device has 0.06 GiB" in line
    assert "a smaller --batch-size/--seq-len" in line
