"""The manifest's block checksum: new saves write XXH3-128 and say so, SHA-256 manifests written before still
verify, a flipped byte is found under either, and a manifest naming an unknown algorithm is refused."""

import hashlib
import json
import os
import random
import re
import sys

import processes
import pytest
import xxhash
from helpers import mesh_for, tiny_abstract

import meshtrain as mt
from meshtrain.checkpoint import CheckpointError, Checkpointer, integrity
from meshtrain.checkpoint.saving import SaveTuning
from meshtrain.checkpoint.types import Checksum, StepStatus


def _step(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1000)   # several blocks per file
    step_dir = tmp_path / "7"
    (step_dir / "state").mkdir(parents=True)
    data = bytes(random.Random(0).randrange(256) for _ in range(4500))
    (step_dir / "state" / "big").write_bytes(data)
    (step_dir / "small").write_bytes(b"abc")
    return step_dir, data


def test_saves_write_xxh3_by_default():
    assert SaveTuning().checksum is Checksum.XXH3_128


@pytest.mark.parametrize("checksum, reference", [(Checksum.XXH3_128, lambda b: xxhash.xxh3_128(b).hexdigest()),
                                                 (Checksum.SHA256, lambda b: hashlib.sha256(b).hexdigest())])
@pytest.mark.parametrize("mapped", [True, False])
def test_manifest_records_its_algorithm_and_detects_a_flip(tmp_path, monkeypatch, checksum, reference, mapped):
    step_dir, data = _step(tmp_path, monkeypatch)
    manifest = integrity.write_manifest(step_dir, 7, mapped=mapped, checksum=checksum)
    assert manifest["algorithm"] == checksum.value
    blocks = manifest["files"]["state/big"][checksum.value]
    assert blocks == [reference(data[i:i + 1000]) for i in range(0, 4500, 1000)]
    assert integrity.check_step(step_dir, 7).status is StepStatus.OK
    flipped = bytearray(data)
    flipped[3210] ^= 0x01
    (step_dir / "state" / "big").write_bytes(bytes(flipped))
    check = integrity.check_step(step_dir, 7)
    assert check.status is StepStatus.CORRUPT
    assert f"state/big (bytes 3000-3999 differ from the manifest's {checksum.value})" in check.reason


def test_a_manifest_without_algorithm_verifies_as_sha256(tmp_path, monkeypatch):
    """The first manifests recorded ``algorithm: sha256``; one without the key is read the same way."""
    step_dir, _ = _step(tmp_path, monkeypatch)
    manifest = integrity.write_manifest(step_dir, 7, checksum=Checksum.SHA256)
    del manifest["algorithm"]
    (step_dir / integrity.MANIFEST).write_text(json.dumps(manifest))
    assert integrity.check_step(step_dir, 7).status is StepStatus.OK


def test_unknown_algorithm_is_reported_not_raised(tmp_path, monkeypatch):
    step_dir, _ = _step(tmp_path, monkeypatch)
    manifest = integrity.write_manifest(step_dir, 7, checksum=Checksum.XXH3_128)
    manifest["algorithm"] = "md5"
    (step_dir / integrity.MANIFEST).write_text(json.dumps(manifest))
    check = integrity.check_step(step_dir, 7)
    assert check.status is StepStatus.CORRUPT and "checksum 'md5'" in check.reason and "xxh3_128" in check.reason


def test_checkpointer_saves_xxh3_manifests_and_refuses_a_flipped_byte(tmp_path):
    recipe, mesh = mesh_for("fsdp")
    plan = mt.make_plan(tiny_abstract(), recipe, mesh, batch=mt.BatchSpec(16, 64))
    state = mt.init_state(plan, seed=0)
    with Checkpointer(tmp_path / "ck", save_every=1, async_save=False) as ckpt:
        ckpt.maybe_save(1, state, data_state={}, metadata={})
    step_dir = tmp_path / "ck" / "1"
    manifest = integrity.read_manifest(step_dir)
    assert manifest["algorithm"] == "xxh3_128"
    big = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0x04
    big.write_bytes(bytes(data))
    assert integrity.check_step(step_dir, 1).status is StepStatus.CORRUPT
    with Checkpointer(tmp_path / "ck", save_every=1, async_save=False) as ckpt:
        with pytest.raises(CheckpointError, match="step 1 .* corrupt: checksum mismatch: .* manifest's xxh3_128"):
            ckpt.restore(plan, step=1)


def test_checksum_benchmark_runs_and_prints_each_rate():
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "bench_checksums.py")
    out = processes.run([sys.executable, tool, "--mb", "1"], text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rates = dict(re.findall(r"^(\w+ \([\w.-]+\))\s+([\d,]+) MB/s$", out.stdout, re.M))
    assert {"sha256 (hashlib)", "xxh3_128 (xxhash)"} <= set(rates) and all(int(r.replace(",", "")) > 0
                                                                           for r in rates.values())
