"""`meshtrain import` / `meshtrain export` against broken HuggingFace folders, broken run folders and
hostile output folders (issue 35; the export's special token ids are issue 31).

The HuggingFace folders are written here with numpy + safetensors (a tiny Llama or Mixtral: vocabulary
260, width 32, 2 layers), so preparing a case costs no JAX. Cases that need a run folder copy one of
two made once per probe: an imported tiny Llama (``meshtrain import``) and a 1-step ``vit-tiny`` run.
Full-disk and read-only cases mount a tmpfs inside their folder and unmount it in the same snippet.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Callable, List, Optional

import numpy as np

from probe_bad_input import Case, child_env, made_once, vit_tiny_run

IMPORT = ["import", "{work}/src", "--out", "{work}/run"]
EXPORT = ["export", "{work}/run", "--out", "{work}/hf"]


def tiny_hf(path: str, kind: str = "llama", layers: int = 2, heads: int = 4, kv: int = 2, vocab: int = 260,
            width: int = 32, tied: bool = False, dtype=np.float32, extra_layers: int = 0, **changes) -> None:
    """A HuggingFace folder of random weights in PyTorch naming (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    hd, ff, experts = width // heads, 2 * width, 4
    config = {"model_type": kind, "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": width,
              "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
              "hidden_act": "silu", "tie_word_embeddings": tied, "torch_dtype": "float32", "bos_token_id": 1,
              "eos_token_id": 2}
    if kind == "mixtral":
        config.update(num_local_experts=experts, num_experts_per_tok=2, sliding_window=None)
    config.update(changes)
    shapes = {"model.embed_tokens.weight": (vocab, width), "model.norm.weight": (width,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, width)
    for layer in range(layers + extra_layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * hd, width),
                       p + "self_attn.k_proj.weight": (kv * hd, width), p + "self_attn.v_proj.weight": (kv * hd, width),
                       p + "self_attn.o_proj.weight": (width, heads * hd), p + "input_layernorm.weight": (width,),
                       p + "post_attention_layernorm.weight": (width,)})
        if kind == "mixtral":
            shapes[p + "block_sparse_moe.gate.weight"] = (experts, width)
            for e in range(experts):
                q = p + f"block_sparse_moe.experts.{e}."
                shapes.update({q + "w1.weight": (ff, width), q + "w3.weight": (ff, width),
                               q + "w2.weight": (width, ff)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ff, width), p + "mlp.up_proj.weight": (ff, width),
                           p + "mlp.down_proj.weight": (width, ff)})
    rng = np.random.default_rng(0)
    tensors = {k: (0.02 * rng.standard_normal(s)).astype(dtype) for k, s in shapes.items()}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _src(then: Optional[Callable[[str], None]] = None, **kw) -> Callable[[str], None]:
    def prepare(work: str) -> None:
        tiny_hf(os.path.join(work, "src"), **kw)
        if then is not None:
            then(os.path.join(work, "src"))
    return prepare


def _edit_json(name: str, **changes) -> Callable[[str], None]:
    def edit(folder: str) -> None:
        path = os.path.join(folder, name)
        data = json.load(open(path))
        for key, value in changes.items():
            if value is _DROP:
                data.pop(key, None)
            else:
                data[key] = value
        with open(path, "w") as f:
            json.dump(data, f)
    return edit


_DROP = object()


def _weights(damage: Callable[[bytes], bytes]) -> Callable[[str], None]:
    def edit(folder: str) -> None:
        path = os.path.join(folder, "model.safetensors")
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(damage(data))
    return edit


def _index_null(folder: str) -> None:
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": None}, f)


def _tied_head_equal(folder: str) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _tied_head_different(folder: str) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _bad_tokenizer(folder: str) -> None:
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": {"type": "Nonsense"}')


def _made_once(tmp: str, kind: str) -> str:
    """The imported tiny Llama run or the 1-step vit-tiny run (the same one group ``inputs`` copies),
    made once per probe (or test session: probe_bad_input.made_once)."""
    if kind == "vit":
        return vit_tiny_run(tmp)

    def make(target: str) -> None:
        tiny_hf(target + "-src")
        argv = ["import", target + "-src", "--out", target, "--devices", "1"]
        done = subprocess.run([sys.executable, "-m", "meshtrain", *argv], capture_output=True, text=True,
                              env=child_env(), timeout=600)
        if done.returncode:
            raise SystemExit(f"probe group hf: setup {argv} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return made_once("hf-imported-tiny-llama", tmp, make)


def _run(tmp: str, kind: str, then: Optional[Callable[[str], None]] = None) -> Callable[[str], None]:
    def prepare(work: str) -> None:
        shutil.copytree(_made_once(tmp, kind), os.path.join(work, "run"))
        if then is not None:
            then(os.path.join(work, "run"))
    return prepare


def _broken_header(run: str) -> None:
    path = os.path.join(run, "metrics.jsonl")
    lines = open(path).read().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["model_config"]["n_heads"] = "four"
    lines[0] = json.dumps(header) + "\n"
    with open(path, "w") as f:
        f.writelines(lines)


#: Runs meshtrain with a tmpfs mounted at {work}/mnt (options: sys.argv[1] of the case's text), then
#: checks that nothing is left in it, unmounts it and exits with meshtrain's status.
MOUNTED = """
import os, subprocess, sys
mnt = '{work}/mnt'
os.makedirs(mnt, exist_ok=True)
subprocess.run(['mount', '-t', 'tmpfs', '-o', '%s', 'tmpfs', mnt], check=True, timeout=60)
try:
    code = subprocess.run([sys.executable, '-m', 'meshtrain', %s], timeout=500).returncode
    left = os.listdir(mnt)
finally:
    subprocess.run(['umount', '-l', mnt], timeout=60)
if left:
    print('left behind in the mount:', left, file=sys.stderr)
    sys.exit(1)
sys.exit(code)
"""

#: Starts the import, sends SIGINT as soon as its temporary sibling folder appears, checks that
#: neither --out nor the temporary folder is left, exits with the import's status (130 expected).
CTRL_C = """
import glob, os, signal, subprocess, sys, time
proc = subprocess.Popen([sys.executable, '-m', 'meshtrain', 'import', '{work}/src', '--out', '{work}/run'])
deadline = time.monotonic() + 400
while proc.poll() is None and not glob.glob('{work}/run.partial-*') and time.monotonic() < deadline:
    time.sleep(0.005)
if proc.poll() is None:
    proc.send_signal(signal.SIGINT)
code = proc.wait(timeout=300)
left = glob.glob('{work}/run*')
if left:
    print('left behind:', left, file=sys.stderr)
    sys.exit(1)
sys.exit(code)
"""


def _mounted(options: str, argv: List[str]) -> str:
    return MOUNTED % (options, ", ".join(repr(a) for a in argv))


def cases(tmp: str) -> List[Case]:
    out = "{work}/run"
    cfg = lambda **kw: _edit_json("config.json", **kw)  # noqa: E731
    bad_config = [
        ("rope_scaling a string", dict(rope_scaling="llama3"), "rope_scaling='llama3'"),
        ("sliding_window a string", dict(sliding_window="big"), "sliding_window='big'"),
        ("rms_norm_eps a string", dict(rms_norm_eps="tiny"), "rms_norm_eps='tiny'"),
        ("rope_theta null", dict(rope_theta=None), "rope_theta=None"),
        ("vocab_size 0", dict(vocab_size=0), "vocab_size=0"),
        ("vocab_size -5", dict(vocab_size=-5), "vocab_size=-5"),
        ("num_hidden_layers 0", dict(num_hidden_layers=0), "num_hidden_layers=0"),
        ("num_attention_heads 0", dict(num_attention_heads=0), "num_attention_heads=0"),
        ("hidden_size null", dict(hidden_size=None), "hidden_size=None"),
        ("hidden_size a string", dict(hidden_size="32"), "hidden_size='32'"),
        ("max_position_embeddings 0", dict(max_position_embeddings=0), "max_position_embeddings=0"),
    ]
    found = [Case(f"import (config): config.json {label}", IMPORT, "2", prepare=_src(cfg(**change)), out=out, says=says)
             for label, change, says in bad_config]
    found += [
        Case("import (config): mixtral config without num_local_experts", IMPORT, "2", out=out,
             says="num_local_experts", prepare=_src(cfg(num_local_experts=_DROP), kind="mixtral")),
        Case("import (config): index with weight_map null", IMPORT, "2", out=out, says="weight_map=",
             prepare=_src(_index_null)),
        Case("import (config): 4 query heads over 3 kv heads", IMPORT, "2", out=out, says="num_key_value_heads=3",
             prepare=_src(kv=3, width=36)),
    ]
    for label, damage in [("zero bytes", lambda b: b""), ("garbage", lambda b: bytes(range(256)) * 8),
                          ("truncated", lambda b: b[:len(b) // 2]),
                          ("garbage header", lambda b: b[:8] + b"{not json" + b[17:])]:
        found.append(Case(f"import (weights): safetensors {label}", IMPORT, "2", out=out, says="model.safetensors",
                          prepare=_src(_weights(damage))))
    found += [
        Case("import (weights): int32 weights", IMPORT, "2", out=out, says="stored as I32",
             prepare=_src(dtype=np.int32)),
        Case("import (weights): bool weights", IMPORT, "2", out=out, says="stored as BOOL",
             prepare=_src(dtype=np.bool_)),
        Case("import (weights): corrupt tokenizer.json", IMPORT, "2", out=out, says="tokenizer.json",
             prepare=_src(_bad_tokenizer)),
        Case("import (weights): an extra layer's tensors (config says 2 layers)", IMPORT, "2", out=out,
             says="num_hidden_layers=2", prepare=_src(extra_layers=1)),
        Case("import (weights): lm_head.weight equal to the embedding in a tied config", IMPORT, "warn", out=out,
             says="lm_head.weight", prepare=_src(_tied_head_equal, tied=True)),
        Case("import (weights): lm_head.weight unlike the embedding in a tied config", IMPORT, "2", out=out,
             says="differs from model.embed_tokens.weight", prepare=_src(_tied_head_different, tied=True)),
        Case("import (output): read-only --out folder", [], "2", needs_root=True, says="Read-only file system",
             prepare=_src(), python=_mounted("ro,size=1m", ["import", "{work}/src", "--out", "{work}/mnt/run"])),
        Case("import (output): full disk (64 KiB tmpfs)", [], "74", needs_root=True, prepare=_src(),
             python=_mounted("size=64k", ["import", "{work}/src", "--out", "{work}/mnt/run"])),
        Case("import (output): Ctrl-C while writing the run", [], "130", python=CTRL_C,
             prepare=_src(vocab=8192, width=128)),
        Case("export: a vit-tiny run (not a decoder)", EXPORT, "2", out="{work}/hf", says="needs a decoder run",
             prepare=_run(tmp, "vit")),
        Case("export: run header with a broken model_config", EXPORT, "2", out="{work}/hf",
             says="model_config field 'n_heads' is 'four'", prepare=_run(tmp, "imported", _broken_header)),
        Case("export: read-only --out folder", [], "2", needs_root=True, says="Read-only file system",
             prepare=_run(tmp, "imported"), python=_mounted("ro,size=1m", ["export", "{work}/run", "--out",
                                                                             "{work}/mnt/hf"])),
        Case("export: full disk (64 KiB tmpfs)", [], "74", needs_root=True, prepare=_run(tmp, "imported"),
             python=_mounted("size=64k", ["export", "{work}/run", "--out", "{work}/mnt/hf"])),
    ]
    return found
