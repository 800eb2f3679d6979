"""meshtrain's train step against EasyDeL's on the same model, alternately (issue 37).

Two persistent worker processes: meshtrain's step (public API: ``make_plan`` + ``make_train_step``,
the ``fsdp`` recipe on ``--devices`` simulated CPU devices, f32, ``optax.adamw(1e-3)``, batch
``--batch-size`` x ``--seq-len``) and the peer's. With ``--peer-python`` (a venv with ``easydel``) the peer
is EasyDeL's ``LlamaForCausalLM`` with meshtrain's dimensions, its own FSDP partition rules
(``sharding_axis_dims=(1, -1, 1, 1, 1)``), its own ``training_step`` jitted as its ``Trainer`` does
(state shardings, donated state) and the same optax AdamW. Without it, the peer is the hand-written
``jax.jit`` step of tools/bench_overhead.py (the same model, shardings, optimizer and donation; layers
unrolled, as meshtrain's default at 4 layers), in the main venv.

Each worker compiles once and runs ``--warmup`` steps; then ``--rounds`` rounds, each worker in turn
(the first one alternates) running ``--steps`` timed steps when the parent tells it to over stdin
(answers on stdout, every wait bounded by ``--timeout``). Prints per-round medians, the median of the
per-round ratios meshtrain / peer, CPU seconds per step, parameter counts, XLA's FLOPs of both
programs and the load average; exits 1 when the ratio is above ``--max-ratio``.

    python tools/bench_vs_easydel.py --peer-python /work/easydel-venv/bin/python --rounds 7
    python tools/bench_vs_easydel.py --model tiny --seq-len 32 --steps 3 --rounds 2   # hand-written peer
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: transformers submodules EasyDeL 0.3.0 patches on import; each needs torch, which the peer venv lacks
TORCH_ONLY_MODULES = ("dbrx", "llama4", "qwen3_next", "qwen3_5_moe", "phimoe", "glm4v_moe")


# ----------------------------------------------------------------------------------------------- workers

def _meshtrain_side(args):
    """meshtrain's step: ``(info, step_once)``; ``step_once()`` runs one step and waits for its loss."""
    import jax
    import optax

    import meshtrain as mt
    from meshtrain.data import BatchIterator, load_source

    cfg = mt.models.get_config(args.model)
    abstract = mt.abstract_state(mt.models.model_factory(cfg), optax.adamw(1e-3))
    plan = mt.make_plan(abstract, args.recipe, batch=mt.BatchSpec(args.batch_size, args.seq_len))
    data = BatchIterator(load_source(None), args.batch_size, args.seq_len, shardings=plan.batch_shardings)
    batches = [next(data) for _ in range(4)]
    state = {"s": mt.init_state(plan, seed=0), "i": 0}
    if args.side == "meshtrain":
        t0 = time.perf_counter()
        compiled = mt.make_train_step(plan).lower(state["s"], batches[0]).compile()
        compile_s = time.perf_counter() - t0

        def step_once():
            state["s"], metrics = compiled(state["s"], batches[state["i"] % len(batches)])
            state["i"] += 1
            return float(metrics["loss"])
    else:   # the hand-written step of tools/bench_overhead.py, on the same plan, state and batches
        sys.path.insert(0, HERE)
        from bench_overhead import hand_written_step
        t0 = time.perf_counter()
        compiled = hand_written_step(plan, abstract.tx, args.batch_size, args.seq_len, "unrolled").lower(
            state["s"].params, state["s"].opt_state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        state["s"] = (state["s"].params, state["s"].opt_state)

        def step_once():
            *state["s"], loss = compiled(*state["s"], batches[state["i"] % len(batches)])
            state["i"] += 1
            return float(loss)
    dims = {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                         "d_ff", "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings")}
    info = {"name": "meshtrain" if args.side == "meshtrain" else "hand-written", "params": abstract.num_params,
            "compile_s": compile_s, "dims": dims, "versions": _versions(["jax", "jaxlib", "flax", "optax"])}
    return info, compiled, step_once


def _stub_torch_only_modules():
    """Empty stand-ins for the transformers modules EasyDeL patches at import (they need torch): here, in the
    benchmark's process, never in site-packages."""
    import importlib
    import types
    for name in TORCH_ONLY_MODULES:
        stub = types.ModuleType(f"transformers.models.{name}.modeling_{name}")
        sys.modules[stub.__name__] = stub
        setattr(importlib.import_module(f"transformers.models.{name}"), f"modeling_{name}", stub)


def _easydel_side(args):
    """EasyDeL's Llama and its own training step, with meshtrain's dimensions (``args.dims``, from the
    meshtrain worker)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    _stub_torch_only_modules()
    import easydel as ed
    from easydel.infra.loss_utils import LossConfig
    from easydel.trainers.trainer._fn import training_step

    d = json.loads(args.dims)
    cfg = ed.LlamaConfig(vocab_size=d["vocab_size"], hidden_size=d["d_model"], intermediate_size=d["d_ff"],
                         num_hidden_layers=d["n_layers"], num_attention_heads=d["n_heads"],
                         num_key_value_heads=d["n_kv_heads"], head_dim=d["head_dim"],
                         max_position_embeddings=d["max_seq_len"], rms_norm_eps=d["norm_eps"],
                         rope_theta=d["rope_theta"], tie_word_embeddings=d["tie_embeddings"],
                         sharding_axis_dims=(1, -1, 1, 1, 1))   # EasyDeL's (dp, fsdp, ep, tp, sp): all fsdp
    model = ed.LlamaForCausalLM(config=cfg, dtype=jnp.float32, param_dtype=jnp.float32, precision=None,
                                rngs=nnx.Rngs(0)).shard_model()
    state = model.to_state().init_tx(optax.adamw(1e-3))
    state = state.shard_state(partition_rules=model._get_partition_rules(None), mesh=model.mesh)
    replicated = NamedSharding(model.mesh, PartitionSpec())
    # as EasyDeL's Trainer.configure_functions: state shardings in and out, the state donated, batch replicated
    fn = jax.jit(training_step, static_argnums=(2, 3, 4, 5, 6), in_shardings=(state.shardings, replicated),
                 out_shardings=(state.shardings, replicated), donate_argnums=(0,))
    rng = np.random.default_rng(0)
    b, t = args.batch_size, args.seq_len
    batches = []
    for _ in range(4):   # labels are the next tokens already (shift_tokens=False): the loss covers all t
        ids = rng.integers(0, d["vocab_size"], (b, t + 1)).astype(np.int32)
        batches.append({"input_ids": jnp.asarray(ids[:, :-1]), "labels": jnp.asarray(ids[:, 1:]),
                        "attention_mask": jnp.ones((b, t), jnp.int32),
                        "position_ids": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))})
    static = (LossConfig(shift_tokens=False), None, PartitionSpec(("dp", "fsdp"), "sp"), 1, None)
    model.mesh.__enter__()   # EasyDeL's step reads the mesh from the context (its Trainer runs inside it)
    t0 = time.perf_counter()
    compiled = fn.lower(state, batches[0], *static).compile()
    compile_s = time.perf_counter() - t0
    box = {"s": state, "i": 0}

    def step_once():
        box["s"], metrics = compiled(box["s"], batches[box["i"] % len(batches)])
        box["i"] += 1
        return float(metrics.loss)

    params = sum(int(x.size) for x in jax.tree.leaves(state.graphstate))
    info = {"name": "EasyDeL", "params": params, "compile_s": compile_s,
            "versions": _versions(["easydel", "jax", "jaxlib", "flax", "optax"])}
    return info, compiled, step_once


def _versions(names):
    from importlib.metadata import version
    return {n: version(n) for n in names}


def _flops(compiled) -> float:
    """XLA's FLOPs of one device's program (cost analysis of the partitioned step)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", float("nan")))


def worker_main(args) -> int:
    """Build one side, warm up, then answer ``{"steps": n}`` lines with a round's step times (JSON lines on the
    original stdout; everything the libraries print goes to stderr)."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    build = _easydel_side if args.side == "easydel" else _meshtrain_side
    info, compiled, step_once = build(args)
    info["first_loss"] = step_once()
    for _ in range(args.warmup - 1):
        step_once()
    info.update(flops_per_device=_flops(compiled), devices=len(jax.devices()))
    proto.write(json.dumps({"ready": info}) + "\n")
    proto.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if "steps" not in request:
            break
        times, cpu0 = [], time.process_time()
        for _ in range(request["steps"]):
            t0 = time.perf_counter()
            loss = step_once()
            times.append(time.perf_counter() - t0)
        proto.write(json.dumps({"times": times, "cpu_s": time.process_time() - cpu0, "loss": loss}) + "\n")
        proto.flush()
    return 0


# ------------------------------------------------------------------------------------------------ parent

class Worker:
    """One side's process: JSON lines in and out, every read bounded by a timeout."""

    def __init__(self, python: str, side: str, args, extra=()):
        self.side = side
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench_vs_easydel_{side}_", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        env.pop("JAX_NUM_CPU_DEVICES", None)
        cmd = [python, os.path.abspath(__file__), "--worker", side, "--model", args.model, "--recipe", args.recipe,
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--devices", str(args.devices),
               "--warmup", str(args.warmup), *extra]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, start_new_session=True)
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def read(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise SystemExit(f"error: the {self.side} worker did not answer within {timeout:.0f} s "
                             f"(raise --timeout; its log: {self.log.name})") from None
        if not line:
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise SystemExit(f"error: the {self.side} worker exited ({self.proc.wait(timeout=30)}); "
                             f"its log {self.log.name} ends:\n{tail}")
        return json.loads(line)

    def ask(self, request: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("{}\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=60)
        self.log.close()
        if self.proc.returncode == 0:   # keep a failed worker's log for the error message's path
            os.unlink(self.log.name)


def _rounds(ours: Worker, peer: Worker, args):
    """``args.rounds`` rounds, the first worker alternating; each round's per-step times and CPU seconds."""
    rows = []
    for r in range(args.rounds):
        order = (ours, peer) if r % 2 == 0 else (peer, ours)
        row = {}
        for w in order:
            row[w.side] = w.ask({"steps": args.steps}, args.timeout)
        rows.append(row)
        m, p = (statistics.median(row[w.side]["times"]) for w in (ours, peer))
        print(f"round {r + 1}: meshtrain {m * 1e3:.1f} ms, {peer.name} {p * 1e3:.1f} ms, ratio {m / p:.3f} "
              f"({order[0].name} first)", flush=True)
    return rows


def _summary(rows, ours: Worker, peer: Worker, infos, load_before, args) -> dict:
    med = {w.side: [statistics.median(row[w.side]["times"]) for row in rows] for w in (ours, peer)}
    cpu = {w.side: sum(row[w.side]["cpu_s"] for row in rows) / (args.steps * len(rows)) for w in (ours, peer)}
    ratios = [a / b for a, b in zip(med[ours.side], med[peer.side])]
    flat = {w.side: [t for row in rows for t in row[w.side]["times"]] for w in (ours, peer)}
    return {
        "model": args.model, "recipe": args.recipe, "batch": [args.batch_size, args.seq_len],
        "devices": args.devices, "warmup": args.warmup, "steps_per_round": args.steps, "rounds": len(rows),
        "peer": peer.name, "ratio": statistics.median(ratios), "round_ratios": ratios,
        "median_ms": {w.name: statistics.median(med[w.side]) * 1e3 for w in (ours, peer)},
        "round_median_ms": {w.name: [x * 1e3 for x in med[w.side]] for w in (ours, peer)},
        "min_step_ratio": min(flat[ours.side]) / min(flat[peer.side]),
        "cpu_s_per_step": {w.name: cpu[w.side] for w in (ours, peer)},
        "params": {w.name: infos[w.side]["params"] for w in (ours, peer)},
        "flops_per_step": {w.name: infos[w.side]["flops_per_device"] * infos[w.side]["devices"] for w in (ours, peer)},
        "compile_s": {w.name: infos[w.side]["compile_s"] for w in (ours, peer)},
        "first_loss": {w.name: infos[w.side]["first_loss"] for w in (ours, peer)},
        "versions": {w.name: infos[w.side]["versions"] for w in (ours, peer)},
        "load_average": {"before": load_before, "after": list(os.getloadavg())},
    }


def _print_summary(s: dict, max_ratio: float):
    a, b = "meshtrain", s["peer"]
    print(f"{s['model']} / {s['recipe']} on {s['devices']} CPU devices, batch {s['batch'][0]}x{s['batch'][1]}, "
          f"{s['warmup']} warm-up steps, {s['rounds']} alternated rounds of {s['steps_per_round']} steps")
    print(f"parameters: {a} {s['params'][a]:,}, {b} {s['params'][b]:,}; XLA FLOPs per step: "
          f"{a} {s['flops_per_step'][a]:.4g}, {b} {s['flops_per_step'][b]:.4g} "
          f"({s['flops_per_step'][a] / s['flops_per_step'][b]:.3f}x)")
    print(f"median step: {a} {s['median_ms'][a]:.1f} ms, {b} {s['median_ms'][b]:.1f} ms; median of the per-round "
          f"ratios {s['ratio']:.3f} (rounds {min(s['round_ratios']):.3f}-{max(s['round_ratios']):.3f}; "
          f"limit {max_ratio}); fastest steps {s['min_step_ratio']:.3f}")
    cpu = s["cpu_s_per_step"]
    print(f"CPU seconds per step: {a} {cpu[a]:.3f}, {b} {cpu[b]:.3f} ({cpu[a] / cpu[b]:.3f}x); compile: "
          f"{a} {s['compile_s'][a]:.1f} s, {b} {s['compile_s'][b]:.1f} s; first loss {a} "
          f"{s['first_loss'][a]:.4f}, {b} {s['first_loss'][b]:.4f}")
    load = s["load_average"]
    print("load average (1/5/15 min): before " + "/".join(f"{x:.2f}" for x in load["before"]) +
          ", after " + "/".join(f"{x:.2f}" for x in load["after"]))
    print("versions: " + "; ".join(f"{k}: " + ", ".join(f"{n} {v}" for n, v in vs.items())
                                   for k, vs in s["versions"].items()))


def parent_main(args) -> int:
    load_before = list(os.getloadavg())
    ours = Worker(sys.executable, "meshtrain", args)
    ours.name = "meshtrain"
    peer = None
    try:
        infos = {"meshtrain": ours.read(args.timeout)["ready"]}
        if args.peer_python:
            peer = Worker(args.peer_python, "easydel", args, ["--dims", json.dumps(infos["meshtrain"]["dims"])])
        else:
            peer = Worker(sys.executable, "hand", args)
        infos[peer.side] = peer.read(args.timeout)["ready"]
        peer.name = infos[peer.side]["name"]
        rows = _rounds(ours, peer, args)
    finally:
        for w in (ours, peer):
            if w is not None:
                w.close()
    summary = _summary(rows, ours, peer, infos, load_before, args)
    _print_summary(summary, args.max_ratio)
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ratio"] <= args.max_ratio else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-python", default=None,
                   help="python of a venv with easydel 0.3.0 (default: the hand-written step in this venv)")
    p.add_argument("--model", default="small")
    p.add_argument("--recipe", default="fsdp")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the compile (>= 1)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per round and side")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900, help="seconds any one answer of a worker may take")
    p.add_argument("--max-ratio", type=float, default=0.95, help="exit 1 when meshtrain / peer is above this")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    p.add_argument("--worker", choices=("meshtrain", "hand", "easydel"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--dims", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    if args.worker:
        args.side = args.worker
        return worker_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
