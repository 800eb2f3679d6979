"""Group ``inputs`` (issue 35): bad input in the files and flags of train, generate, plan and rules
files. Damaged prepared token folders (``train --data``), generation on a run that is not a decoder's or
whose header is damaged, stop ids outside the vocabulary, rules files that are not UTF-8 or repeat a
section, a mixture-of-experts capacity factor of ``inf`` in a run header, ``plan --topology`` without a
compile check, ``--dcn`` where no process spans a slow link, a sequence length above the model's maximum
given through ``--batch``, and a sequence length the context axes do not divide.

Each case's name ends in its part, ``[data]``, ``[run]`` or ``[flags]`` (``--only`` picks one; the test
runs them as three). Most cases fail before anything compiles. The one real run (``vit-tiny``, one step,
a checkpoint) is trained once per probe session and copied into each case that needs it, some with a
doctored header.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable, List

import numpy as np

from probe_bad_input import Case, vit_tiny_run

QUICK = ["--steps", "1", "--progress", "none", "--eval-every", "0", "--ckpt-every", "0"]


def _prepared(folder: str, meta: dict = None, drop=(), starts=None, raw_starts: bytes = b"") -> None:
    """A prepared token folder as ``meshtrain data prepare`` writes it (4,000 uint16 ids below 300 in 40
    documents), then damaged: fields of ``tokens.json`` replaced or dropped, other ``doc_starts``."""
    os.makedirs(folder)
    np.random.default_rng(0).integers(0, 300, 4000).astype(np.uint16).tofile(os.path.join(folder, "tokens.bin"))
    starts_path = os.path.join(folder, "doc_starts.npy")
    if raw_starts:
        with open(starts_path, "wb") as f:
            f.write(raw_starts)
    elif starts is not False:
        np.save(starts_path, np.arange(0, 4000, 100, dtype=np.int64) if starts is None else starts,
                allow_pickle=True)
    fields = {"format": "meshtrain-tokens/1", "tokenizer": "bpe:probe", "vocab_size": 300, "eos_id": 0,
              "dtype": "uint16", "num_tokens": 4000, "num_docs": 40, "text_field": "text", "inputs": []}
    fields.update(meta or {})
    for key in drop:
        fields.pop(key)
    with open(os.path.join(folder, "tokens.json"), "w") as f:
        json.dump(fields, f)


def _data_case(label: str, says: str, **damage) -> Case:
    return Case(f"train --data: {label} [data]", ["train", "--model", "tiny", "--data", "{work}/tok", *QUICK,
                                           "--out", "{work}/run"], "2",
                prepare=lambda work: _prepared(os.path.join(work, "tok"), **damage), out="{work}/run", says=says)


class _Runs:
    """The session's one trained run (``vit-tiny``, one step, checkpointed), copied per case."""

    def __init__(self, tmp: str):
        self.tmp = tmp

    def trained(self) -> str:
        return vit_tiny_run(self.tmp)

    def copy(self, header: Callable[[dict], None] = None) -> Callable[[str], None]:
        """``prepare``: the run copied to ``{work}/run``, its header's ``model_config`` rewritten by ``header``."""
        def prepare(work: str) -> None:
            run = os.path.join(work, "run")
            shutil.copytree(self.trained(), run)
            if header is None:
                return
            path = os.path.join(run, "metrics.jsonl")
            lines = open(path).read().splitlines()
            start = json.loads(lines[0])
            start["model_config"] = header(start["model_config"])
            lines[0] = json.dumps(start)
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
        return prepare


def _decoder(name: str, **changes):
    """A header rewrite: the built-in decoder ``name``'s config with ``changes`` (as the header stores it)."""
    def rewrite(_old: dict) -> dict:
        import meshtrain.models as models  # (the probe's own process; only in a case's prepare)

        return {**dataclasses.asdict(models.get_config(name)), **changes}
    return rewrite


def _write(name: str, data: bytes) -> Callable[[str], None]:
    def prepare(work: str) -> None:
        with open(os.path.join(work, name), "wb") as f:
            f.write(data)
    return prepare


def cases(tmp: str) -> List[Case]:
    runs = _Runs(tmp)
    gen = ["generate", "{work}/run", "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    plan = ["plan", "--model", "tiny"]
    rules = [*plan, "--rules", "{work}/r.yaml"]
    long = ",".join(f"{k}=8x4096:int32@batch/seq" for k in ("inputs", "targets", "positions", "segment_ids"))
    return [
        # prepared token folders (train --data DIR): refused up front, naming the file and field
        _data_case("tokens.json without dtype", "'dtype' is missing", drop=("dtype",)),
        _data_case("tokens.json without vocab_size", "'vocab_size' is missing", drop=("vocab_size",)),
        _data_case("tokens.json dtype garbage", "'dtype' is 'float99'", meta={"dtype": "float99"}),
        _data_case("tokens.json num_tokens a string", "'num_tokens' is '4000'", meta={"num_tokens": "4000"}),
        _data_case("doc_starts.npy missing", "doc_starts.npy' is missing", starts=False),
        _data_case("doc_starts.npy pickled (object array)", "doc_starts.npy' is not a .npy array of integers",
                   starts=np.array([0, "x", None], dtype=object)),
        _data_case("doc_starts.npy 2-D", "not a 1-D integer array", starts=np.zeros((4, 10), np.int64)),
        _data_case("doc_starts.npy unsorted", "not strictly increasing", starts=np.array([0, 500, 300, 1000])),
        _data_case("doc_starts.npy past the end", "past the end", starts=np.array([0, 1000, 9000])),
        # generate: not a decoder, a damaged header, stop ids the model cannot emit
        Case("generate: a vit-tiny run [run]", gen, "2", prepare=runs.copy(), says="needs a decoder run"),
        Case("generate: run header model_config vocab_size a string [run]", gen, "2",
             prepare=runs.copy(_decoder("tiny", vocab_size="256")), says="metrics.jsonl"),
        Case("generate: run header model_config with an unknown field [run]", gen, "2",
             prepare=runs.copy(_decoder("tiny", bogus=1)), says="'bogus'"),
        Case("generate --stop-ids -1 [run]", [*gen, "--stop-ids=-1"], "2", prepare=runs.copy(_decoder("tiny")),
             says="stop id -1"),
        Case("generate --stop-ids beyond the vocabulary [run]", [*gen, "--stop-ids", "0,256"], "2",
             prepare=runs.copy(_decoder("tiny")), says="stop id 256"),
        Case("generate API: stop_ids beyond the vocabulary raise ConfigError [run]", [], "2", python=(
            "import sys\nimport meshtrain as mt\nfrom flax import nnx\n"
            "with nnx.use_eager_sharding(False):\n"
            "    model = mt.models.Decoder(mt.models.get_config('tiny'), rngs=nnx.Rngs(0))\n"
            "try:\n    mt.generate(model, [[1, 2]], 2, stop_ids=[999])\n"
            "except mt.errors.ConfigError as e:\n    print('error:', e, file=sys.stderr); sys.exit(2)\n")),
        # mixture of experts: capacity_factor from a run header (the CLI paths that read one)
        Case("moe: capacity_factor inf in a run header (generate) [run]", gen, "2",
             prepare=runs.copy(_decoder("tiny-moe", capacity_factor=float("inf"))), says="capacity_factor=inf"),
        Case("moe: capacity_factor a string in a run header (train --model RUN) [run]",
             ["train", "--model", "{work}/run", *QUICK, "--out", "{work}/new"], "2",
             prepare=runs.copy(_decoder("tiny-moe", capacity_factor="1.25")), out="{work}/new",
             says="capacity_factor"),
        # rules files (--rules)
        Case("rules file not UTF-8 [flags]", rules, "2",
             prepare=_write("r.yaml", "logical:\n  kv: null\n# caf\xe9\n".encode("latin-1")), says="not UTF-8"),
        Case("rules file with two logical: sections [flags]", rules, "2",
             prepare=_write("r.yaml", b"logical:\n  kv: null\nlogical:\n  joined_kv: tensor\n"),
             says="given twice"),
        Case("rules file paths: a string [flags]", rules, "2", prepare=_write("r.yaml", b"paths: '.*kernel'\n"),
             says="not a mapping"),
        # plan flags that used to be ignored
        Case("plan --topology without --check [flags]", [*plan, "--topology", "8xH100"], "2",
             says="--check gpu or --check tpu"),
        Case("plan --recipe auto --batch [flags]", [*plan, "--recipe", "auto", "--batch", "x=8x16:int32@batch/seq"],
             "2", says="--batch"),
        Case("plan: --batch sequence above a decoder's maximum [flags]", [*plan, "--recipe", "fsdp", "--batch", long],
             "warn", says="max_seq_len 256"),
        # --dcn where no axis can cross a slow link (`train --dcn` in one process warns: group cli's
        # "train --dcn data=2 in one process", the same check for any axis)
        Case("plan --dcn fsdp=2 [flags]", [*plan, "--dcn", "fsdp=2"], "2", says="--slices"),
        Case("plan: a recipe's mesh dcn fsdp=2 on one host [flags]", [*plan, "--recipe", "{work}/d.yaml"], "warn",
             prepare=_write("d.yaml", b"name: mine\nstrategies: [fsdp]\nmesh:\n  ici: {fsdp: -1}\n  dcn: {fsdp: 2}\n"),
             says="--slices 2"),
        # a sequence length the context axes do not divide (fsdp_cp: context=4, zig-zag: multiples of 8)
        Case("plan fsdp_cp --seq-len 100 [flags]", [*plan, "--recipe", "fsdp_cp", "--seq-len", "100"], "2",
             says="96 or 104"),
        Case("train fsdp_cp --seq-len 100 [flags]", ["train", "--model", "tiny", "--recipe", "fsdp_cp", "--seq-len",
                                                     "100", *QUICK, "--out", "{work}/run"], "2", out="{work}/run",
             says="96 or 104"),
    ]
